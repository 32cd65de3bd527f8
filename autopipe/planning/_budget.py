"""The planner's time limit and what a search proves within it.

Every search of the planner returns an :class:`Outcome`: the best plan it found and a lower
bound on every plan of its search space (proven: from bounds that hold for what it did not
look at).  A search that finishes proves its best plan optimal, so its bound equals that
plan's time (gap 0); one stopped by the :class:`Budget` keeps the least bound of what it left.
"""
from __future__ import annotations

import math
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator

from .._checks import positive_number
from .candidates import Choice

__all__ = ["MARGIN", "Budget", "Outcome"]

#: the share of a time limit left for the last step's overrun and the plan's assembly
MARGIN = 0.02


class Budget:
    """A deadline shared by the searches of one ``plan()`` call (``None``: no limit)."""

    def __init__(self, seconds: float | None) -> None:
        if seconds is not None:
            positive_number(seconds, "time_limit", " of seconds (finite; None for no limit)")
        # the searches stop a little early: they check the time between steps, and the plan
        # is assembled after them
        self.end = math.inf if seconds is None else time.perf_counter() + seconds * (1 - MARGIN)
        self.spent = False
        self.crowded = False  # whether a search stopped because it would have outgrown memory
        self.slowest: dict[str, float] = {}  # per kind of step, the longest one took
        self.rates: dict[str, float] = {}  # per kind of the exact DP's steps, the most seconds per row

    def share(self, parts: int) -> Budget:
        """A budget of ``1 / parts`` of the time left (all of it when unlimited), ending no
        later than this one."""
        part = Budget(None)
        part.rates, part.slowest = self.rates, self.slowest  # the same machine's
        if math.isfinite(self.end):
            part.end = time.perf_counter() + max(self.end - time.perf_counter(), 0.0) / parts
        return part

    def absorb(self, part: Budget) -> None:
        """Take over what a :meth:`share` of this budget found: whether its time ran out and
        whether a search in it stopped for memory."""
        self.spent = self.spent or part.spent
        self.crowded = self.crowded or part.crowded

    def out(self, expected: float = 0.0) -> bool:
        """Whether the time is up, or would be after a step ``expected`` to take that many
        seconds (and stays up once it was)."""
        self.spent = self.spent or time.perf_counter() + expected >= self.end
        return self.spent

    def fits(self, expected: float) -> bool:
        """Whether a step ``expected`` to take that many seconds would end in time; unlike
        :meth:`out`, a step that would not leaves the time to shorter ones."""
        return not self.out() and time.perf_counter() + expected < self.end

    def before(self, kind: str, steps: int = 1, size: float = 1.0, prior: float = 0.0) -> bool:
        """Whether the time is up, or would be after ``steps`` more steps of ``kind`` and
        ``size`` as long, per unit of size, as the slowest so far (:meth:`step`; ``prior``
        before one was timed)."""
        return self.out(steps * size * self.slowest.get(kind, prior))

    @contextmanager
    def step(self, kind: str, size: float = 1.0) -> Iterator[None]:
        """Time a step of ``kind`` and ``size`` (its seconds per unit of size), for :meth:`before`."""
        start = time.perf_counter()
        yield
        self.slowest[kind] = max(self.slowest.get(kind, 0.0), (time.perf_counter() - start) / size)


@dataclass(frozen=True)
class Outcome:
    """A search's best plan (``None``: none found that fits and beats what it was given) and a
    lower bound on the time of every plan in its space (``inf`` if none fits)."""

    choice: Choice | None
    lower_bound: float
