"""Timelines of a pipeline iteration: what each stage's lanes did when, predicted or measured.

The simulator (predicted) and the runtime's trace (measured) both produce :class:`Event`
lists, so one renderer shows either and ``bench`` can put them side by side.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from ._vocab import EventKind, Lane

__all__ = ["Event", "render", "MIN_WIDTH"]

#: The narrowest timeline: one column (each column spans ``total / width`` ms).
MIN_WIDTH = 1


@dataclass(frozen=True)
class Event:
    """One interval on one lane of one stage.

    ``lane`` is ``"compute"``, ``"copy"`` or ``"reduce"``; ``kind`` is ``"F"`` (forward), ``"B"`` (backward,
    including any recomputation), ``"R"`` (recomputation alone, where it is traced apart),
    ``"C"`` (forward copy into the stage), ``"G"`` (gradient copy into the stage) or ``"A"``
    (the stage's gradient reduction across replicas).  Times are
    in ms from the start of the iteration.
    """

    stage: int
    lane: Lane
    kind: EventKind
    micro_batch: int
    start_ms: float
    end_ms: float

    @property
    def duration_ms(self) -> float:
        return self.end_ms - self.start_ms


def render(events: Sequence[Event], width: int = 72) -> str:
    """A text timeline: one row per stage lane, one column per ``total / width`` ms.

    A cell shows the event covering most of it — ``F`` forward, ``B`` backward (with any
    recomputation), ``R`` recomputation, ``C`` forward copy, ``G`` gradient copy, ``A`` gradient
    reduction across replicas, in upper case
    for even micro-batches and lower case for odd ones so micro-batches stay apart — or ``.``
    when the lane is idle for most of it, so bubbles show as runs of dots.
    """
    if width < MIN_WIDTH:
        raise ValueError(f"a timeline needs a width of at least {MIN_WIDTH} characters, got {width}")
    if not events:
        return "(no events)"
    end = max(event.end_ms for event in events)
    step = end / width if end > 0 else 1.0
    rows = []
    for stage in sorted({event.stage for event in events}):
        for lane in ("compute", "copy", "reduce"):
            mine = [e for e in events if e.stage == stage and e.lane == lane]
            if mine or lane == "compute":
                rows.append(f"stage {stage:<2} {lane:<7} |{_row(mine, width, step)}|")
    label = f"{end:.1f} ms"
    return "\n".join(rows + [f"{'':17}0{label:>{width + 1}}"])


def _row(events: Sequence[Event], width: int, step: float) -> str:
    cells = []
    for column in range(width):
        lo, hi = column * step, (column + 1) * step
        best, cover = None, 0.0
        for event in events:
            overlap = min(hi, event.end_ms) - max(lo, event.start_ms)
            if overlap > cover:
                best, cover = event, overlap
        if best is None or cover * 2 < step:
            cells.append(".")
        else:
            cells.append(best.kind if best.micro_batch % 2 == 0 else best.kind.lower())
    return "".join(cells)
