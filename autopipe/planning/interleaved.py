"""The planner's search over interleaved splits: ``v`` stages per device, placed round-robin.

With ``k`` devices and ``n = k·v`` stages, stage ``s`` runs on device ``s % k``.  Each device
then holds ``v`` chunks of the chain, so a split has ``n - 1`` cuts to balance forward and
backward work at once (one cut cannot, when forward and backward costs are spread differently
over the layers), and a device can work on a later chunk while an earlier micro-batch fills
the pipeline::

    device 0:  [ s0 ]      [ s2 ]          layers  s0 | s1 | s2 | s3
    device 1:        [ s1 ]      [ s3 ]

Stages sharing a device take turns, so there is no closed form: a split's time is the
simulator's (:func:`autopipe.planning.simulate.simulate`, the runtime's rules) under the faster
of the two turn rules (:data:`~autopipe.planning.schedules.TURN_RULES`), which the plan records.
The ``(chunks, mode, device count)`` groups are taken in order of a lower bound on all their
splits (:func:`_group_bound`: per phase all work over the devices, or the chain — one
micro-batch through every stage and the cheapest cuts, plus ``m - 1`` on a lane no smaller
than the average stage's or the largest layer), until it reaches the best time found.  Within a group:

* with at most :data:`EXACT` splits, every split in order of its own bound (per phase the
  larger of the busiest device, ``m · Σ`` of its stages' lanes with what must run before and
  after, and the chain ``Σ q + (m-1)·max p``, where ``q`` leaves out a recomputation that might
  not happen) until that bound reaches the best time: exact;
* beyond, a polynomial search: the split of least largest lane (within each device's memory,
  shared equally by its stages), then a descent that moves one cut at a time to the
  neighbouring layer while the simulated time falls — at most ``2 (n - 1)`` simulations a
  round.  The group's bound then stays open, and the plan's gap shows what that may cost.

A split over a device's memory limit (the sum of its stages') is passed over.  Every step
checks the time limit.
"""
from __future__ import annotations

import itertools
import math
import time
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from .cost import CostModel, SizeCosts, recomputations
from .plans import placement
from ._budget import Budget, Outcome
from ._minmax import min_max_split
from .candidates import Choice, better, greedy_split, least_largest
from .._vocab import Schedule
from .schedules import TURN_RULES
from .simulate import simulate

__all__ = ["EXACT", "Group", "cheapest_cuts", "search", "time_of", "timed"]

#: most splits of one group that the search enumerates (exactly); larger groups are descended.
EXACT = 20_000
#: seconds per stage and squared layer that a min-max DP takes (measured: ~6 s for 128 stages
#: of 1,000 layers on the 2-core machine of the README), to skip one that would overrun the budget
_MIN_MAX_S = 5e-8


def time_of(model: CostModel, bounds: Sequence[int], chunks: int, mode: str, interleave: int,
            limits: np.ndarray) -> float:
    """The simulated iteration ms of one interleaved split under its faster turn rule, or
    ``inf`` if a device's stages overflow its memory."""
    return timed(model, bounds, chunks, mode, interleave, limits)[0]


def timed(model: CostModel, bounds: Sequence[int], chunks: int, mode: str, interleave: int,
          limits: np.ndarray, schedule: Schedule = "gpipe") -> tuple[float, str]:
    """:func:`time_of` (under ``schedule``) and the turn rule that gives it (depth-first on a tie)."""
    where = placement(len(bounds) - 1, interleave)
    lanes = model.stage_lanes(bounds, chunks, mode, where, schedule)
    held = np.zeros(len(limits))
    for stage, device in zip(lanes, where):
        held[device] += stage.memory
    if np.any(held > limits[: len(held)]):
        return math.inf, TURN_RULES[0]
    times = [(simulate(lanes, chunks, mode, where, schedule, rule).iteration_ms, rule) for rule in TURN_RULES]
    return min(times, key=lambda timed: (timed[0], TURN_RULES.index(timed[1])))


@dataclass(frozen=True)
class _Splits:
    """Every split into ``n`` stages: ``bounds`` is (splits × n+1) layer indices."""

    devices: int
    bounds: np.ndarray

    @staticmethod
    def of(layers: int, devices: int, interleave: int) -> _Splits:
        stages = devices * interleave
        cuts = np.fromiter(itertools.chain.from_iterable(itertools.combinations(range(1, layers), stages - 1)),
                           dtype=np.int64).reshape(-1, stages - 1)
        return _Splits(devices, np.pad(cuts, ((0, 0), (1, 1)), constant_values=((0, 0), (0, layers))))


def search(model: CostModel, candidates: Sequence[int], modes: Sequence[str], limits: np.ndarray,
           interleave: int, best: Choice | None, budget: Budget | None = None) -> Outcome:
    """The best interleaved split strictly faster than ``best`` (any split if ``best`` is
    ``None``; the outcome's choice is ``None`` if none is), and a lower bound on the time of
    ``best`` and of every interleaved split (see the module docstring).  When ``budget`` runs
    out, the bound of what is left (the next split's, or the next group's) is the outcome's."""
    devices = min(len(limits), model.layers // interleave)
    tried = sorted((_group_bound(model, chunks, mode, k, interleave), chunks, mode, k)
                   for chunks in candidates for mode in modes for k in range(2, devices + 1))
    found, left = best, math.inf
    for least, chunks, mode, k in tried:
        # the groups left are bounded by ``least`` too: they come in its order
        if found is not None and least >= found.iteration_ms or budget is not None and budget.out():
            left = min(left, least)
            break
        group = Group(model, chunks, mode, k, interleave, limits, budget)
        if math.comb(model.layers - 1, k * interleave - 1) <= EXACT:
            found, unsearched = group.enumerate(found)
        else:
            found, unsearched = group.descend(found), least
        left = min(left, unsearched)
    upper = math.inf if found is None else found.iteration_ms
    return Outcome(None if found is best else found, min(upper, left))


class Group:
    """The interleaved splits of one ``(chunks, mode, device count)`` under ``schedule``,
    searched within ``budget`` (:mod:`autopipe.planning.one_f_one_b` descends its 1F1B ones)."""

    def __init__(self, model: CostModel, chunks: int, mode: str, devices: int, interleave: int,
                 limits: np.ndarray, budget: Budget | None, schedule: Schedule = "gpipe") -> None:
        self.model, self.chunks, self.mode, self.devices = model, chunks, mode, devices
        self.interleave, self.limits, self.budget, self.schedule = interleave, limits, budget, schedule
        self.slowest = 0.0  # the longest a split's simulation took

    def out(self) -> bool:
        """Whether the time is up, or would be after one more simulation."""
        return self.budget is not None and self.budget.out(self.slowest)

    def better(self, bounds: tuple[int, ...], found: Choice | None) -> Choice | None:
        """``found``, or the plan of ``bounds`` if it is faster (and fits)."""
        start = time.perf_counter()
        ms, rule = timed(self.model, bounds, self.chunks, self.mode, self.interleave, self.limits, self.schedule)
        self.slowest = max(self.slowest, time.perf_counter() - start)
        if math.isfinite(ms) and (found is None or ms < found.iteration_ms):
            return Choice(bounds, self.chunks, self.mode, ms, self.interleave, self.schedule, rule)
        return found

    def enumerate(self, found: Choice | None) -> tuple[Choice | None, float]:
        """Every split in order of its bound, until that reaches the best time: the best plan
        and the bound of the splits left unsearched when the time ran out (``inf``: none)."""
        splits = _Splits.of(self.model.layers, self.devices, self.interleave)
        lower = _lower_bounds(self.model, splits, self.chunks, self.mode, self.interleave)
        for row in np.argsort(lower, kind="stable"):
            if found is not None and lower[row] >= found.iteration_ms:
                break
            if self.out():
                return found, float(lower[row])
            found = self.better(tuple(int(b) for b in splits.bounds[row]), found)
        return found, math.inf

    def descend(self, found: Choice | None) -> Choice | None:
        """The min-max split, then single-cut moves while they lower the simulated time."""
        start = _min_max(self.model, self.chunks, self.mode, self.devices, self.interleave, self.limits, self.budget,
                         self.schedule)
        if start is None:
            return found
        current = self.better(start, None)
        improved = current is not None
        while improved and current is not None and not self.out():
            improved = False
            for cut in range(1, len(current.bounds) - 1):
                for step in (-1, 1):
                    bounds = list(current.bounds)
                    bounds[cut] += step
                    if bounds[cut - 1] < bounds[cut] < bounds[cut + 1] and not self.out():
                        moved = self.better(tuple(bounds), current)
                        improved, current = improved or moved is not current, moved
        return better(found, current)


def _min_max(model: CostModel, chunks: int, mode: str, devices: int, interleave: int, limits: np.ndarray,
             budget: Budget | None, schedule: Schedule) -> tuple[int, ...] | None:
    """The split of least largest stage lane, each stage within its device's limit shared
    equally by the device's ``interleave`` stages (so that their sum fits): by bisection on the
    lane without memory limits, else by the ``O(n · L²)`` DP (``None`` if it would overrun
    ``budget``, or no split fits)."""
    costs = model.at(model.micro_batch_size(chunks))
    where = placement(devices * interleave, interleave)
    speeds = model.speeds[where]
    if np.all(np.isinf(limits[:devices])):
        lane = costs.forward * (2.0 if recomputations(mode, chunks) else 1.0) + costs.backward
        return tuple(sorted({0, *greedy_split(lane, speeds, least_largest(lane, speeds, 1e-3)[1])}))
    if budget is not None and budget.out(_MIN_MAX_S * len(where) * model.layers ** 2):
        return None

    def fits(s: int, start: np.ndarray, stop: np.ndarray) -> np.ndarray:
        memory = model.schedule_memory(costs, start, stop, chunks, mode, schedule, s, len(where))
        return memory <= limits[where[s]] / interleave

    bounds = min_max_split(model, chunks, mode, speeds, fits)
    return None if bounds is None else tuple(bounds)


def _group_bound(model: CostModel, chunks: int, mode: str, devices: int, interleave: int) -> float:
    """A lower bound on every split of ``devices`` devices × ``interleave`` stages, per phase
    the larger of all its work over the devices' total speed and the chain: one micro-batch
    through every stage (``Σ F_s/v_s ≥ F/v_max``) and the ``n - 1`` cheapest cuts
    (:func:`cheapest_cuts`; stages next to each other run on different devices), plus ``m - 1``
    on the slowest lane, at least the average of the ``n`` stages' and the largest layer at
    the top speed."""
    costs = model.at(model.micro_batch_size(chunks))
    forward, backward = float(costs.forward[-1]), float(costs.backward[-1])
    recomputed = recomputations(mode, chunks)
    speeds = model.speeds[:devices]
    spread, top = float(np.sum(speeds)), float(np.max(speeds))
    lanes = np.diff(costs.forward), np.diff(costs.backward) + (np.diff(costs.forward) if recomputed else 0.0)
    slowest = [max(float(np.sum(lane)) / (interleave * spread), float(np.max(lane)) / top) for lane in lanes]
    first = backward + (forward if mode == "always" else 0.0)  # the first job may skip it
    cuts = cheapest_cuts(model, costs, devices * interleave - 1)
    return (max(chunks * forward / spread, forward / top + cuts + (chunks - 1) * slowest[0])
            + max((chunks * backward + recomputed * forward) / spread,
                  first / top + cuts + (chunks - 1) * slowest[1]))


def cheapest_cuts(model: CostModel, costs: SizeCosts, count: int) -> float:
    """The ``count`` least copies of :func:`_cut_least` over the cut positions ``1 … L-1``: what
    one micro-batch's main input at least costs to cross ``count + 1`` stages."""
    return float(np.sum(np.sort(_cut_least(model, costs)[1:-1])[:count]))


def _cut_least(model: CostModel, costs: SizeCosts) -> np.ndarray:
    """At each position ``0 … L``, the least copy of the main input there between any two
    devices (and of its gradient back: the same pairs): the least latency plus the bytes at
    the least ms per byte."""
    count = len(model.devices)
    if count < 2:
        return np.zeros(len(costs.input_bytes) + 1)
    off = ~np.eye(count, dtype=bool)
    nbytes = np.append(costs.input_bytes, 0.0)
    return np.where(nbytes > 0, float(np.min(model.latency[off])) + nbytes * float(np.min(model.per_byte[off])), 0.0)


def _lower_bounds(model: CostModel, splits: _Splits, chunks: int, mode: str, interleave: int) -> np.ndarray:
    """A lower bound on the simulated time of every split (the module docstring's)."""
    costs = model.at(model.micro_batch_size(chunks))
    bounds = splits.bounds
    speeds = model.speeds[np.asarray(placement(bounds.shape[1] - 1, interleave))]
    forward = (costs.forward[bounds[:, 1:]] - costs.forward[bounds[:, :-1]]) / speeds
    backward = (costs.backward[bounds[:, 1:]] - costs.backward[bounds[:, :-1]]) / speeds
    recomputed = recomputations(mode, chunks)
    recompute = forward if recomputed else np.zeros_like(forward)
    least = backward + (recompute if mode == "always" else 0.0)  # a backward job at the least
    cuts = _cut_least(model, costs)[bounds[:, 1:-1]].sum(axis=1)  # the first micro-batch crosses each
    return (_phase_bound(chunks * forward, forward, forward, splits.devices, chunks, cuts)
            + _phase_bound(chunks * backward + recomputed * recompute, least, backward + recompute,
                           splits.devices, chunks, cuts, reverse=True))


def _phase_bound(work: np.ndarray, least: np.ndarray, lane: np.ndarray, devices: int, chunks: int,
                 cuts: np.ndarray, reverse: bool = False) -> np.ndarray:
    """Per split: the larger of the chain bound (with the copies ``cuts`` that one micro-batch
    makes on its way) and, for every device, what one micro-batch needs before its first stage
    can start, its stages' ``work``, and what the last micro-batch needs after its last stage
    (``least`` per stage, ``lane`` with recomputation)."""
    if reverse:
        work, least, lane = work[:, ::-1], least[:, ::-1], lane[:, ::-1]
    rows, stages = work.shape
    before = np.cumsum(least, axis=1) - least  # Σ least over earlier stages
    after = least.sum(axis=1, keepdims=True) - np.cumsum(least, axis=1)
    per_device = work.reshape(rows, stages // devices, devices).sum(axis=1)
    busiest = (before[:, :devices] + per_device + after[:, stages - devices:]).max(axis=1)
    chain = least.sum(axis=1) + cuts + (chunks - 1) * lane.max(axis=1)
    return np.maximum(busiest, chain)
