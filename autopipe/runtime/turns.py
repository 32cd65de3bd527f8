"""A device's compute, taken in turns by the stages placed on it.

An interleaved pipeline puts several stages on one device, each with its own worker thread
(each must drive its own backward).  Those threads must not compute at once: on a CPU
"device" that would be two threads on one core, on CUDA two streams sharing one GPU, and
either way the device would not be running the schedule that was planned.  So each compute
task takes the device's turn first; when the device falls free, the waiting task furthest
along its phase's chain goes next — the rule :mod:`autopipe.planning.simulate` predicts with::

    forward  (stage 0 → 3):  later stage first  (a micro-batch reaches the end sooner)
    backward (stage 3 → 0):  earlier stage first

A stage that fails still gives its turn back (``finally``), so no other stage waits forever.
"""
from __future__ import annotations

import contextlib
import heapq
import threading
from typing import Iterator

from .._vocab import TaskKind

__all__ = ["Turns", "priority"]


class Turns:
    """One device: one holder at a time, waiters served in order of priority (least first)."""

    def __init__(self) -> None:
        self._changed = threading.Condition()
        self._busy = False
        self._waiting: list[int] = []

    @contextlib.contextmanager
    def hold(self, rank: int) -> Iterator[None]:
        """Compute while holding the device; ``rank`` is unique among its stages (see :func:`priority`)."""
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


def priority(stage: int, kind: TaskKind) -> int:
    """Rank of a stage's task (``"F"`` or ``"B"``): the further along its phase, the less."""
    return -stage if kind == "F" else stage
