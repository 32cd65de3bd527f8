"""The planner's search for 1F1B plans: stages on devices ``0..k-1``, one per device or
``interleave`` per device round-robin (interleaved 1F1B).

1F1B (:mod:`autopipe.planning.schedules`) holds at most ``k - s`` micro-batches on stage
``s`` instead of all ``m``, so under a memory limit it may need no checkpointing where
fill-drain does.  Its phases interleave and its time has no closed form: a split's time is the
simulator's.  The search is a heuristic, not exact like fill-drain's
(:mod:`autopipe.planning.solver`): for each ``(chunks, mode, k)``, taken in order of a lower
bound on any such plan and only while that bound is under the best time found, a min-max DP
gives the split of least largest compute lane ``(F + W + R) / v`` whose every stage fits its
device's memory with 1F1B's in-flight count, and the simulator prices it.  The lower bound is
the larger of all work spread over the ``k`` devices' total speed and one micro-batch's
forward and backward through the chain at the top speed; a ``(chunks, mode, k)`` whose bound
reaches the best time is never better, so the search skips it.  An interleaved group gets the
min-max split of its ``k · interleave`` stages and a descent on the simulated time
(:class:`autopipe.planning.interleaved.Group`), each device's stages sharing its memory.

The DP over stages ``s`` and cut positions is ``O(k · L²)`` per ``(chunks, mode, k)``; at most
:data:`CELLS` cells are spent in all, and none after the planner's time limit.  Since the split
of a group is not proven the fastest of its group, the lower bound this search proves is the
least group bound, not its plan's time: a 1F1B plan's gap is rarely 0.
"""
from __future__ import annotations

import math
from typing import Sequence

import numpy as np

from ._budget import Budget, Outcome
from .candidates import Choice
from .cost import CostModel, recomputations
from ._minmax import min_max_split
from ._chain import cheapest_cuts
from .interleaved import Group
from .simulate import evaluate

__all__ = ["CELLS", "search"]

#: DP cells (stages × cut pairs) the search spends at most, over all groups.
CELLS = 60_000_000


def search(model: CostModel, candidates: Sequence[int], modes: Sequence[str], limits: np.ndarray,
           best: Choice | None, budget: Budget | None = None, interleaves: Sequence[int] = (1,)) -> Outcome:
    """A 1F1B plan faster than ``best`` (any schedule; ``None`` in the outcome if none is
    found), over ``candidates`` micro-batch counts, checkpoint ``modes``, stage counts up to
    the devices given and stages per device ``interleaves``, and a lower bound on the time of
    ``best`` and of every 1F1B plan: the least bound of the groups (searched or not, as the
    split the DP picks need not be the fastest of its group)."""
    groups = sorted((_bound(model, chunks, mode, k, k * factor), chunks, mode, k, factor)
                    for chunks in candidates for mode in modes for factor in interleaves
                    for k in range(1 if factor == 1 else 2, min(len(limits), model.layers // factor) + 1))
    spent, found = 0, best
    for least, chunks, mode, k, factor in groups:
        cells = k * factor * model.layers * (model.layers + 1) // 2
        over = found is not None and least >= found.iteration_ms
        if over or spent + cells > CELLS or budget is not None and budget.out():
            break
        spent += cells
        if factor > 1:  # interleaved 1F1B: its min-max split, descended on the simulated time
            found = Group(model, chunks, mode, k, factor, limits, budget, schedule="1f1b").descend(found)
            continue
        bounds = _split(model, chunks, mode, k, limits)
        if bounds is None:
            continue
        time = evaluate(model, bounds, chunks, mode, "1f1b").iteration_ms
        if found is None or time < found.iteration_ms:
            found = Choice(tuple(bounds), chunks, mode, time, schedule="1f1b")
    upper = math.inf if found is None else found.iteration_ms
    return Outcome(None if found is best else found, min(upper, groups[0][0]) if groups else upper)


def _bound(model: CostModel, chunks: int, mode: str, k: int, stages: int) -> float:
    """A lower bound on the 1F1B time of any split of ``chunks`` micro-batches into ``stages``
    stages over devices ``0..k-1``: all work over their total speed, or one micro-batch's
    forward and backward through the chain at the top speed with the ``stages - 1`` cheapest
    cuts copied both ways (stages next to each other run on different devices)."""
    costs = model.at(model.micro_batch_size(chunks))
    forward, backward = float(costs.forward[-1]), float(costs.backward[-1])
    work = chunks * (forward + backward) + recomputations(mode, chunks) * forward
    speeds = model.speeds[:k]
    cuts = 2 * cheapest_cuts(model, costs)[stages - 1]
    return max(work / float(np.sum(speeds)), (forward + backward) / float(np.max(speeds)) + cuts)


def _split(model: CostModel, chunks: int, mode: str, k: int, limits: np.ndarray) -> list[int] | None:
    """Bounds of the ``k``-stage split of least largest compute lane whose stages fit their
    devices' memory under 1F1B, or ``None`` if none fits."""
    costs = model.at(model.micro_batch_size(chunks))

    def fits(s: int, start: np.ndarray, stop: np.ndarray) -> np.ndarray:
        return model.schedule_memory(costs, start, stop, chunks, mode, "1f1b", s, k) <= limits[s]

    return min_max_split(model, chunks, mode, model.speeds[:k], fits)
