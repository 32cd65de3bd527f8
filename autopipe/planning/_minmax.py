"""The split of least largest compute lane under per-stage memory limits: a min-max DP over
stages and cut positions, ``O(stages · L²)``.

Used where no exact search exists and a split is then priced by the simulator: 1F1B plans
(:mod:`autopipe.planning.one_f_one_b`) and interleaved plans too large to enumerate
(:mod:`autopipe.planning.interleaved`).  Stage ``s``'s lane is ``(F + W + R) / v`` of its
layers on its device; ``fits(s, start, stop)`` says, for arrays of candidate stages, which fit
in memory.
"""
from __future__ import annotations

import math
from typing import Callable, Sequence

import numpy as np

from .cost import CostModel, recomputations

__all__ = ["min_max_split", "Fits", "foreseen"]

#: ``fits(stage, starts, stops)`` → a boolean array: which candidate stages fit in memory.
Fits = Callable[[int, np.ndarray, np.ndarray], np.ndarray]
#: seconds per stage and squared layer that the DP takes (measured: ~6 s for 128 stages of
#: 1,000 layers on the 2-core machine of the README)
_SECONDS = 5e-8


def foreseen(layers: int, stages: int) -> float:
    """Seconds :func:`min_max_split` is foreseen to take: to skip one that would overrun a time limit."""
    return _SECONDS * stages * layers ** 2


def min_max_split(model: CostModel, chunks: int, mode: str, speeds: Sequence[float] | np.ndarray,
                  fits: Fits) -> list[int] | None:
    """Bounds of the ``len(speeds)``-stage split (stage ``s`` at speed ``speeds[s]``) of least
    largest compute lane whose stages fit, or ``None`` if none does."""
    layers = model.layers
    costs = model.at(model.micro_batch_size(chunks))
    lane = costs.forward * (2.0 if recomputations(mode, chunks) else 1.0) + costs.backward
    start, stop = np.triu_indices(layers + 1, 1)  # every stage [start, stop), start < stop
    work = lane[stop] - lane[start]
    largest = np.full(layers + 1, math.inf)
    largest[0] = 0.0
    choices = []
    for s, speed in enumerate(speeds):
        value = np.where(fits(s, start, stop), np.maximum(largest[start], work / speed), math.inf)
        order = np.lexsort((value, stop))  # per stop, its least value first
        picked = order[np.concatenate(([True], np.diff(stop[order]) > 0))]
        largest = np.full(layers + 1, math.inf)
        largest[stop[picked]] = value[picked]
        choice = np.full(layers + 1, -1)
        choice[stop[picked]] = start[picked]
        choices.append(choice)
    if not math.isfinite(largest[layers]):
        return None
    bounds = [layers]
    for choice in reversed(choices):
        bounds.append(int(choice[bounds[-1]]))
    return bounds[::-1]
