"""A device's compute, taken in turns by the stages placed on it.

An interleaved pipeline puts several stages on one device, each with its own worker thread
(each must drive its own backward).  Those threads must not compute at once: on a CPU
"device" that would be two threads on one core, on CUDA two streams sharing one GPU, and
either way the device would not be running the schedule that was planned.  So each compute
task takes the device's turn first; when the device falls free, the waiting task of least
:func:`~autopipe.planning.schedules.priority` goes next — the rule :mod:`autopipe.planning.simulate`
predicts with, depth-first by default (the plan may choose breadth-first)::

    forward  (stage 0 → 3):  later stage first  (a micro-batch reaches the end sooner)
    backward (stage 3 → 0):  earlier stage first
    forwards before backwards (1F1B puts both on a device at once)

A stage that fails still gives its turn back (``finally``), so no other stage waits forever.
"""
from __future__ import annotations

import contextlib
import heapq
import threading
from typing import Iterator

from ..planning.schedules import priority

__all__ = ["Turns", "priority"]


class Turns:
    """One device: one holder at a time, waiters served in order of priority (least first) under
    ``rule`` (:data:`~autopipe.planning.schedules.TURN_RULES`)."""

    def __init__(self, rule: str = "depth_first") -> None:
        self.rule = rule
        self._changed = threading.Condition()
        self._busy = False
        self._waiting: list[tuple[int, int]] = []

    def rank(self, stage: int, kind: str) -> tuple[int, int]:
        """The rank of stage ``stage``'s ``kind`` task on this device."""
        return priority(stage, kind, self.rule)

    @contextlib.contextmanager
    def hold(self, rank: tuple[int, int]) -> Iterator[None]:
        """Compute while holding the device; ``rank`` is unique among its stages (see :meth:`rank`)."""
        with self._changed:
            heapq.heappush(self._waiting, rank)
            while self._busy or self._waiting[0] != rank:
                self._changed.wait()
            heapq.heappop(self._waiting)
            self._busy = True
        try:
            yield
        finally:
            with self._changed:
                self._busy = False
                self._changed.notify_all()
