"""The planner's search for 1F1B plans: stages on devices ``0..k-1``, one per device or
``interleave`` per device round-robin (interleaved 1F1B).

1F1B (:mod:`autopipe.planning.schedules`) holds at most ``k - s`` micro-batches on stage ``s``
instead of all ``m``, so under a memory limit it may need no checkpointing where fill-drain
does.  Its phases interleave and its time has no closed form: a split's time is the
simulator's.  The search is a heuristic, not exact like fill-drain's
(:mod:`autopipe.planning.solver`).  It first prices under 1F1B the best fill-drain split, at
every micro-batch count and mode (the fill-drain search weighs every copy, which the min-max
split below leaves out: on 17 of the 95 1F1B instances of ``examples/bench_planner_random.py``
the plan took less time for it, up to 39% less).  Under a memory limit, with no plan yet, the
group likeliest to fit goes next: most devices, micro-batches and recomputation.  Then, for
each ``(chunks, mode, k)``, taken in order of a lower bound on any such plan and only while
that bound is under the best time found, a min-max DP gives the split of least largest compute
lane ``(F + W + R) / v`` whose every stage fits its device's memory with 1F1B's in-flight
count, and the simulator prices it.  The lower bound is the larger of all work spread over the
``k`` devices' total speed and one micro-batch's forward and backward through the chain at the
top speed, and with one stage per device (when the group is reached: it costs a bisection) the
least over splits of the largest stage's work after and before that chain, and what it runs
from its first backward on after micro-batch 0's round trip through the stages after it, copies
of the cuts included (:func:`_staged`, within 4% of the best split on equal layers without
checkpointing, 15% with, where the others lie up to 42% below it); a ``(chunks, mode, k)``
whose bound reaches the best time is never better, so the search skips it.  An interleaved
group gets the min-max split of its ``k · interleave`` stages and a descent on the simulated
time (:class:`autopipe.planning.interleaved.Group`), each device's stages sharing its memory.

The DP over stages ``s`` and cut positions is ``O(k · L²)`` per ``(chunks, mode, k)``; at most
:data:`CELLS` cells are spent in all (a group whose DP would pass it is left unsearched, its
bound kept, and smaller groups are still taken), and none after the planner's time limit.
Since the split of a group is not proven the fastest of its group, the lower bound this search
proves is the least group bound, not its plan's time: a 1F1B plan's gap is rarely 0.
"""
from __future__ import annotations

import heapq
import math
import time
from typing import Sequence

import numpy as np

from ._budget import Budget, Outcome
from .candidates import Choice, better, least_feasible
from .cost import CostModel, SizeCosts, recomputations
from ._minmax import foreseen, min_max_split
from ._chain import cheapest_ring_cuts, copies_between
from .interleaved import SIMULATED, Group, timed
from .simulate import evaluate

__all__ = ["CELLS", "search"]

#: DP cells (stages × cut pairs) the search spends at most, over all groups.
CELLS = 60_000_000


def search(model: CostModel, candidates: Sequence[int], modes: Sequence[str], limits: np.ndarray,
           best: Choice | None, budget: Budget | None = None, interleaves: Sequence[int] = (1,),
           seeds: Sequence[tuple[int, ...]] = ()) -> Outcome:
    """A 1F1B plan faster than ``best`` (any schedule; ``None`` in the outcome if none is
    found), over ``candidates`` micro-batch counts, checkpoint ``modes``, stage counts up to
    the devices given and stages per device ``interleaves``, and a lower bound on the time of
    ``best`` and of every 1F1B plan: the least bound of the groups (searched or not, as the
    split the DP picks need not be the fastest of its group).  ``seeds``, splits found by the
    fill-drain search, are priced under 1F1B first (:func:`_seeded`)."""
    budget = Budget(None) if budget is None else budget
    # (bound, chunks, mode, k, factor, whether the bound is tightened by _staged yet), least first
    groups = [(float(bound), chunks, mode, int(k), factor, factor > 1)
              for chunks in candidates for factor in interleaves
              for ks in [_device_counts(model, len(limits), factor)]
              for cuts in [_cuts(model, chunks, int(ks[-1]), factor)] for mode in modes
              for k, bound in zip(ks, _bound(model, chunks, mode, ks, cuts))]
    heapq.heapify(groups)
    found = _seeded(model, seeds, candidates, modes, limits, budget, best)
    factor = min(interleaves)
    widest = _device_counts(model, len(limits), factor)[-1:]
    if (found is None and np.any(np.isfinite(limits)) and len(widest)
            and budget.fits(foreseen(model.layers, int(widest[0]) * factor))):
        # first, the group likeliest to fit: most devices, micro-batches and recomputation
        lightest = min(modes, key=("always", "except_last", "never").index)
        found = _group(model, max(candidates), lightest, int(widest[0]), factor, limits, budget, None)
    spent, searched = 0, math.inf  # searched: the least bound of the groups taken out
    per_cell, skipped = 0.0, False  # the most seconds per stage and squared layer a group took so far
    while groups and not (found is not None and groups[0][0] >= found.iteration_ms):
        least, chunks, mode, k, factor, tight = groups[0]
        cells = k * factor * model.layers * (model.layers + 1) // 2
        if budget.out():
            break
        if spent + cells > CELLS:  # more than is left of the cap: smaller groups may still fit it
            heapq.heappop(groups)
            searched = min(searched, least)
            continue
        if not tight:  # worked out for the groups reached only: each costs a bisection
            heapq.heapreplace(groups, (max(least, _staged(model, chunks, mode, k)), chunks, mode, k, factor, True))
            continue
        heapq.heappop(groups)
        searched = min(searched, least)
        squares = k * factor * model.layers ** 2
        if not budget.fits(max(foreseen(model.layers, k * factor), per_cell * squares)):
            skipped = True  # for time: its bound stays in searched, and the plan says the limit was reached
            continue
        spent += cells
        start = time.perf_counter()
        found = _group(model, chunks, mode, k, factor, limits, budget, found)
        per_cell = max(per_cell, (time.perf_counter() - start) / squares)
    if skipped:
        budget.spent = True
    upper = math.inf if found is None else found.iteration_ms
    return Outcome(None if found is best else found, min(upper, searched, groups[0][0] if groups else math.inf))


def _device_counts(model: CostModel, devices: int, factor: int) -> np.ndarray:
    """The device counts of the groups of ``factor`` stages per device: from one (two where
    stages share devices) to the devices given, each stage holding a layer at least."""
    return np.arange(1 if factor == 1 else 2, min(devices, model.layers // factor) + 1)


def _seeded(model: CostModel, seeds: Sequence[tuple[int, ...]], candidates: Sequence[int], modes: Sequence[str],
            limits: np.ndarray, budget: Budget, found: Choice | None) -> Choice | None:
    """``found`` or a faster 1F1B plan of a split in ``seeds`` (the fill-drain search's), at
    any of ``candidates`` and ``modes`` that fits in memory."""
    for bounds in dict.fromkeys(seeds):
        for chunks in candidates:
            for mode in modes:
                size = chunks * (len(bounds) - 1)
                if budget.before("simulation", size=size, prior=SIMULATED):
                    return found
                with budget.step("simulation", size):
                    ms, _, phases = timed(model, bounds, chunks, mode, 1, limits, "1f1b")
                if found is None or ms < found.iteration_ms:
                    found = Choice(tuple(bounds), chunks, mode, ms, schedule="1f1b", phases=phases)
    return found


def _group(model: CostModel, chunks: int, mode: str, k: int, factor: int, limits: np.ndarray,
           budget: Budget | None, found: Choice | None) -> Choice | None:
    """``found`` or a faster plan of the group: its min-max split priced by the simulator, or
    (interleaved 1F1B) that split descended on the simulated time."""
    if factor > 1:
        return Group(model, chunks, mode, k, factor, limits, budget, schedule="1f1b").descend(found)
    bounds = _split(model, chunks, mode, k, limits)
    if bounds is None:
        return found
    evaluation = evaluate(model, bounds, chunks, mode, "1f1b")
    phases = evaluation.forward_ms, evaluation.backward_ms
    return better(found, Choice(tuple(bounds), chunks, mode, evaluation.iteration_ms, schedule="1f1b", phases=phases))


def _bound(model: CostModel, chunks: int, mode: str, k: np.ndarray | int, cuts: np.ndarray) -> np.ndarray:
    """A lower bound on the 1F1B time of any split of ``chunks`` micro-batches over devices
    ``0..k-1`` (an array, or one count): all work over their total speed, or one micro-batch's
    forward and backward through the chain at the top speed with the copies of the cuts both
    ways (``cuts[k]``, :func:`_cuts`)."""
    costs = model.at(model.micro_batch_size(chunks))
    forward, backward = float(costs.forward[-1]), float(costs.backward[-1])
    work = chunks * (forward + backward) + recomputations(mode, chunks) * forward
    index = np.asarray(k) - 1
    spread, top = np.cumsum(model.speeds)[index], np.maximum.accumulate(model.speeds)[index]
    return np.maximum(work / spread, (forward + backward) / top + cuts[np.asarray(k)])


def _cuts(model: CostModel, chunks: int, devices: int, factor: int) -> np.ndarray:
    """``[k]``: the least copies, forward and back, of the ``k · factor - 1`` cuts of a split over
    ``k = 0 … devices`` devices, ``factor`` stages each round-robin (the cut after stage ``s``
    joins devices ``s % k`` and ``(s + 1) % k``, :func:`~autopipe.planning._chain.cheapest_ring_cuts`;
    0 with one device)."""
    cuts = np.zeros(devices + 1)
    if devices >= 2:
        ring = cheapest_ring_cuts(model, model.at(model.micro_batch_size(chunks)), devices, factor)
        cuts[2:] = ring[0, :, 0] + ring[1, :, 0]
    return cuts


def _staged(model: CostModel, chunks: int, mode: str, k: int) -> float:
    """A lower bound on the 1F1B time of any split into ``k`` stages, one per device in order
    (the order of :func:`~autopipe.planning.schedules.order`)::

        stage s:  F0 .. F(w) | B0 F(w+1) B1 ... F(m-1) B(m-w-1) | B(m-w) ... B(m-1)
                  ^ micro-batch 0 arrives                         micro-batch m-1 leaves ^
                             ^ B0 waits for micro-batch 0 through stages s+1 … k-1 and back

    A stage's worker runs all its tasks at its device's speed.  Its first task waits for
    micro-batch 0's forward through every stage before it, and after its last (micro-batch
    ``m-1``'s backward) that backward still goes back through them: so the time is at least
    ``before + own work`` (1).  Its first backward also waits for micro-batch 0 through every
    stage after it and back, and what the stage runs from then on, all its backwards and the
    forwards after its ``w = min(k-s-1, m)`` of warm-up, comes after that (2).  Both chains
    cross the cuts on their way, stage ``j`` to ``j+1`` and back: at least the least pair of
    copies there at any position (:func:`_cheapest_cuts`); compute along them is at the top
    speed.  The least over splits is found by bisection on the time: for each constraint the
    furthest stop a device reaches only moves later with its start (a layer adds more to
    the stage than to the chains), so the greedy split (each device in turn the most layers
    that fit) decides whether a time is feasible.  Skips are left out."""
    costs = model.at(model.micro_batch_size(chunks))
    redo = recomputations(mode, chunks)
    forward, backward = costs.forward, costs.backward  # prefix sums over layers
    own = chunks * (forward + backward) + redo * forward
    last = 1.0 if redo == chunks else 0.0  # micro-batch m-1 recomputes on its way back
    speeds = model.speeds[:k]
    top = float(np.max(speeds))
    before = (forward + backward + last * forward) / top
    crossed = np.concatenate(([0.0], np.cumsum(_cheapest_cuts(model, costs, k))))  # [s]: cuts 0 … s-1
    # (2) per stage, less the chain after it: micro-batch 0's forward, the forwards after the
    # warm-up and the recomputations other than micro-batch 0's (which may run before its
    # gradient arrives), and every backward
    warm = np.minimum(k - 1 - np.arange(k), chunks)
    forwards = 1 + np.maximum(chunks - warm - 1, 0) + max(redo - 1, 0)
    after = np.maximum.accumulate((forwards[:, None] * forward + chunks * backward) / speeds[:, None]
                                  - (forward + backward) / top, axis=1)  # [stage, position]
    chain = float(forward[-1] + backward[-1]) / top + crossed[-1]  # micro-batch 0 there and back, all cuts

    def feasible(caps: np.ndarray) -> np.ndarray:
        start = np.zeros(len(caps), dtype=int)
        for speed, copies, rest in zip(speeds, crossed, after):
            limit = (own[start] + (caps - copies - before[start]) * speed) * (1 + 1e-12)
            stop = np.searchsorted(own, limit, side="right") - 1
            limit = rest[start] + caps - chain + 1e-12 * caps  # the chain before the stage is in rest's difference
            start = np.maximum(np.minimum(stop, np.searchsorted(rest, limit, side="right") - 1), start)
        return start == len(own) - 1

    # to within 1e-4 (two rounds of 255): half the rounds of 1e-9, so twice the groups are worked out in the time
    return least_feasible(0.0, (float(own[-1] / speeds[0]) + crossed[-1]) * (1 + 1e-9), 1e-4, feasible)[0]


def _cheapest_cuts(model: CostModel, costs: SizeCosts, k: int) -> np.ndarray:
    """``[j]`` for ``j < k - 1``: the least copy of the main input from device ``j`` to ``j+1``
    plus that of its gradient back, over the cut positions."""
    if k < 2:
        return np.zeros(0)
    src, dst = np.arange(k - 1), np.arange(1, k)
    both = copies_between(model, costs, src, dst) + copies_between(model, costs, dst, src)
    return np.min(both[:, 1:-1], axis=1) if both.shape[1] > 2 else np.zeros(k - 1)


def _split(model: CostModel, chunks: int, mode: str, k: int, limits: np.ndarray) -> list[int] | None:
    """Bounds of the ``k``-stage split of least largest compute lane whose stages fit their
    devices' memory under 1F1B, or ``None`` if none fits."""
    costs = model.at(model.micro_batch_size(chunks))

    def fits(s: int, start: np.ndarray, stop: np.ndarray) -> np.ndarray:
        return model.schedule_memory(costs, start, stop, chunks, mode, "1f1b", s, k) <= limits[s]

    return min_max_split(model, chunks, mode, model.speeds[:k], fits)
