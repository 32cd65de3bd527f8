"""Timelines of a pipeline iteration: what each stage's lanes did when, predicted or measured.

The simulator (predicted) and the runtime's trace (measured) both produce :class:`Event`
lists, so one renderer shows either and ``bench`` can put them side by side.
"""
from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Event"]


@dataclass(frozen=True)
class Event:
    """One interval on one lane of one stage.

    ``lane`` is ``"compute"`` or ``"copy"``; ``kind`` is ``"F"`` (forward), ``"B"`` (backward,
    including any recomputation), ``"R"`` (recomputation alone, where it is traced apart),
    ``"C"`` (forward copy into the stage) or ``"G"`` (gradient copy into the stage).  Times are
    in ms from the start of the iteration.
    """

    stage: int
    lane: str
    kind: str
    micro_batch: int
    start_ms: float
    end_ms: float

    @property
    def duration_ms(self) -> float:
        return self.end_ms - self.start_ms
