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
Each ``(chunks, mode, device count)`` group has a cheap lower bound on all its splits
(:func:`_group_bounds`: per phase all work over the devices, or the chain — one micro-batch
through every stage and the cheapest cuts, plus ``m - 1`` on a lane no smaller than the
average stage's, the largest layer or the ``n - 1``-th cheapest cut; the cut after stage ``s``
joins devices ``s % k`` and ``(s + 1) % k``, so only those pairs' copies count).  The groups
that may beat the best time found get a tighter one, their least chain time
(:class:`~autopipe.planning._chain.Chains`: which cuts fall where copies are cheap and how
large a lane that makes), all device counts of a ``(chunks, mode)`` at once, in order of
their least cheap bound; the split that gives the least chain time of each ``(chunks,
mode)``'s best group is simulated, so that the groups after it are cut off by a better time.
Then the groups in order of bound, until it reaches the best time:

* with at most :data:`EXACT` splits, when listing them fits the time left, every split in
  order of its own bound (per phase the larger of the busiest device, ``m · Σ`` of its stages'
  lanes with what must run before and after, and the chain ``Σ q + (m-1)·max p`` over its
  stages and its copy lanes, priced as the cost model prices them — the main input and the
  skips between devices — where ``q`` leaves out a recomputation that might not happen) until
  that bound reaches the best time: exact;
* beyond, a polynomial search: its least chain split (or, where that does not fit in memory,
  the split of least largest lane within each device's memory, shared equally by its
  stages), then a descent that moves one cut at a time to the neighbouring layer while the
  simulated time falls — at most ``2 (n - 1)`` simulations a round.  The group's bound then
  stays open, and the plan's gap shows what that may cost.

A split over a device's memory limit (the sum of its stages') is passed over.  Every step
checks the time limit.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np

from .cost import CostModel, recomputations
from .plans import placement
from ._arrays import all_splits
from ._budget import Budget, Outcome
from ._chain import Chains, cheapest_ring_cuts
from ._minmax import foreseen, min_max_split
from .candidates import Choice, better, greedy_split, least_largest
from .._vocab import Schedule
from .schedules import TURN_RULES
from .simulate import simulate

__all__ = ["EXACT", "SIMULATED", "Group", "search", "time_of", "timed"]

#: most splits of one group that the search enumerates (exactly); larger groups are descended.
EXACT = 200_000
#: seconds per split and stage that bounding a group's splits takes, and per split and stage or
#: skip that listing them with their copy lanes takes, once per device count (measured: ~0.25 s
#: for the 170,544 splits of ResNet-50 into 8 stages; 0.15-0.3 s to list the 92,378 splits of 20
#: layers into 10 stages with 15 skips), to descend a group whose enumeration would overrun
_ENUMERATE_S = 2e-7


def time_of(model: CostModel, bounds: Sequence[int], chunks: int, mode: str, interleave: int,
            limits: np.ndarray) -> float:
    """The simulated iteration ms of one interleaved split under its faster turn rule, or
    ``inf`` if a device's stages overflow its memory."""
    return timed(model, bounds, chunks, mode, interleave, limits)[0]


#: Seconds per micro-batch and stage a simulation (:func:`timed`) is foreseen to take before one
#: was timed: measured 2e-5 per turn rule, and two rules are tried where stages share a device
#: (at 16,384 micro-batches of 4 stages: 2.4 s, where a time limit of 0.3 s was given).
SIMULATED = 5e-5


def timed(model: CostModel, bounds: Sequence[int], chunks: int, mode: str, interleave: int, limits: np.ndarray,
          schedule: Schedule = "gpipe") -> tuple[float, str, tuple[float, float] | None]:
    """:func:`time_of` (under ``schedule``), the turn rule that gives it (depth-first on a tie)
    and its forward and backward phases (``None`` where it does not fit)."""
    where = placement(len(bounds) - 1, interleave)
    lanes = model.stage_lanes(bounds, chunks, mode, where, schedule)
    held = np.zeros(len(limits))
    for stage, device in zip(lanes, where):
        held[device] += stage.memory
    if np.any(held > limits[: len(held)]):
        return math.inf, TURN_RULES[0], None
    # the rule only orders stages that share a device: with one stage per device one run tells
    rules = TURN_RULES if len(set(where)) < len(where) else TURN_RULES[:1]
    runs = [(simulate(lanes, chunks, mode, where, schedule, rule, timeline=False), rule) for rule in rules]
    run, rule = min(runs, key=lambda pair: (pair[0].iteration_ms, TURN_RULES.index(pair[1])))
    return run.iteration_ms, rule, (run.forward_ms, run.backward_ms)


@dataclass(frozen=True)
class _Splits:
    """Every split into ``n`` stages: ``bounds`` is (splits × n+1) layer indices; their copy
    lanes (:func:`_copy_lanes`) at micro-batch size ``b`` are ``fixed + b · per_sample``, as
    bytes grow with ``b`` (each a pair ``C``, ``G``): one listing serves every group of a device
    count."""

    devices: int
    bounds: np.ndarray
    fixed: tuple[np.ndarray, np.ndarray]
    per_sample: tuple[np.ndarray, np.ndarray]

    @staticmethod
    def of(model: CostModel, devices: int, interleave: int) -> _Splits:
        bounds = all_splits(model.layers, devices * interleave)
        fixed, per_sample = _copy_lanes(model, bounds, devices)
        return _Splits(devices, bounds, fixed, per_sample)

    def copy_lanes(self, size: int) -> tuple[np.ndarray, np.ndarray]:
        """Each split's ``C`` and ``G`` lanes per stage at micro-batch size ``size``."""
        return self.fixed[0] + size * self.per_sample[0], self.fixed[1] + size * self.per_sample[1]


class _Listings(dict):
    """The :class:`_Splits` of the device counts enumerated so far, the oldest dropped beyond
    :data:`KEPT` stage entries (each held in five arrays)."""

    KEPT = 3_000_000

    def of(self, model: CostModel, devices: int, interleave: int) -> _Splits:
        if devices not in self:
            self[devices] = _Splits.of(model, devices, interleave)
            while sum(splits.bounds.size for splits in self.values()) > self.KEPT and len(self) > 1:
                del self[next(iter(self))]
        return self[devices]


def search(model: CostModel, candidates: Sequence[int], modes: Sequence[str], limits: np.ndarray,
           interleave: int, best: Choice | None, budget: Budget | None = None) -> Outcome:
    """The best interleaved split strictly faster than ``best`` (any split if ``best`` is
    ``None``; the outcome's choice is ``None`` if none is), and a lower bound on the time of
    ``best`` and of every interleaved split (see the module docstring).  When ``budget`` runs
    out, the bound of what is left (the next split's, or the next group's) is the outcome's."""
    budget = Budget(None) if budget is None else budget
    devices = min(len(limits), model.layers // interleave)
    cuts = {chunks: cheapest_ring_cuts(model, model.at(model.micro_batch_size(chunks)), devices, interleave)
            for chunks in candidates}
    cheap = {(chunks, mode, k): float(bound) for chunks in candidates for mode in modes
             for k, bound in enumerate(_group_bounds(model, chunks, mode, devices, interleave, cuts[chunks]), start=2)}
    groups, found, left = _bounded(model, cheap, interleave, limits, best, budget)
    listings = _Listings()
    for group in sorted(groups, key=lambda group: group.bound):
        if found is not None and group.bound >= found.iteration_ms:
            break
        if budget.out():
            left = min(left, group.bound)
            break
        splits, stages = math.comb(model.layers - 1, group.devices * interleave - 1), group.devices * interleave
        listing = 0 if group.devices in listings else stages + len(model.chain.skips)
        if splits <= EXACT and budget.fits(_ENUMERATE_S * splits * (stages + listing)):
            found, unsearched = group.enumerate(found, listings.of(model, group.devices, interleave))
        else:
            found, unsearched = group.descend(found), group.bound
        left = min(left, unsearched)
    upper = math.inf if found is None else found.iteration_ms
    return Outcome(None if found is best else found, min(upper, left))


def _bounded(model: CostModel, cheap: dict[tuple[int, str, int], float], interleave: int, limits: np.ndarray,
             found: Choice | None, budget: Budget) -> tuple[list[Group], Choice | None, float]:
    """The groups that may beat ``found``, each bounded by the larger of its cheap bound and its
    chain bound (:class:`~autopipe.planning._chain.Chains`, for all groups of a ``(chunks,
    mode)`` at once, taken in order of their least cheap bound); the best plan then, as the
    split of least chain time of each ``(chunks, mode)``'s best group is simulated so that the
    groups after it are cut off by a better time; and the least cheap bound of the groups not
    reached when ``budget`` ran out."""
    pairs = sorted({key[:2] for key in cheap}, key=lambda pair: min(b for key, b in cheap.items() if key[:2] == pair))
    groups: list[Group] = []
    for chunks, mode in pairs:
        above = math.inf if found is None else found.iteration_ms
        ks = [k for (c, m, k), bound in cheap.items() if (c, m) == (chunks, mode) and bound < above]
        if ks and budget.out():
            return groups, found, min(cheap[chunks, mode, k] for k in ks)
        if not ks:
            continue
        chains = Chains(model, chunks, mode, interleave, model.speeds)  # refined only while the time lasts
        least = chains.bound([k * interleave for k in ks], above, budget)
        bounded = [Group(model, chunks, mode, k, interleave, limits, budget,
                         max(cheap[chunks, mode, k], least[k * interleave]), chains) for k in ks]
        first = min(bounded, key=lambda group: group.bound)
        if found is None or first.bound < found.iteration_ms:
            found = first.start(found)
        groups += [group for group in bounded if found is None or group.bound < found.iteration_ms]
    return groups, found, math.inf


class Group:
    """The interleaved splits of one ``(chunks, mode, device count)`` under ``schedule``,
    searched within ``budget`` (:mod:`autopipe.planning.one_f_one_b` descends its 1F1B ones)."""

    def __init__(self, model: CostModel, chunks: int, mode: str, devices: int, interleave: int,
                 limits: np.ndarray, budget: Budget | None, bound: float = 0.0, chains: Chains | None = None,
                 schedule: Schedule = "gpipe") -> None:
        self.model, self.chunks, self.mode, self.devices = model, chunks, mode, devices
        self.interleave, self.limits, self.schedule = interleave, limits, schedule
        self.budget = Budget(None) if budget is None else budget
        self.bound, self.chains = bound, chains  # a lower bound on its splits; their chain bounds
        self.first: Choice | None = None  # its first plan simulated (:meth:`start`)

    def out(self) -> bool:
        """Whether the time is up, or would be after one more simulation (the plan chosen is
        not simulated again: its :class:`Choice` keeps the phases)."""
        return self.budget.before("simulation", size=self._tasks(), prior=SIMULATED)

    def _tasks(self) -> int:
        """A simulation's size: micro-batches times stages."""
        return self.chunks * self.devices * self.interleave

    def better(self, bounds: tuple[int, ...], found: Choice | None) -> Choice | None:
        """``found``, or the plan of ``bounds`` if it is faster (and fits)."""
        with self.budget.step("simulation", self._tasks()):
            ms, rule, phases = timed(self.model, bounds, self.chunks, self.mode, self.interleave, self.limits,
                                     self.schedule)
        if math.isfinite(ms) and (found is None or ms < found.iteration_ms):
            return Choice(bounds, self.chunks, self.mode, ms, self.interleave, self.schedule, rule, phases)
        return found

    def enumerate(self, found: Choice | None, splits: _Splits) -> tuple[Choice | None, float]:
        """Every split (``splits``, of this group's device count) in order of its bound, until
        that reaches the best time: the best plan and the bound of the splits left unsearched
        when the time ran out (``inf``: none)."""
        lower = _lower_bounds(self.model, splits, self.chunks, self.mode, self.interleave)
        for row in np.argsort(lower, kind="stable"):
            if found is not None and lower[row] >= found.iteration_ms:
                break
            if self.out():
                return found, float(lower[row])
            found = self.better(tuple(int(b) for b in splits.bounds[row]), found)
        return found, math.inf

    def start(self, found: Choice | None) -> Choice | None:
        """``found``, or the group's first plan if faster: its least chain split, or where that
        does not fit (or no chain bounds were given) the min-max split; none is simulated when
        the time is up, unless nothing was found yet."""
        if self.first is None and (found is None or not self.out()):
            count = self.devices * self.interleave
            split = None if self.chains is None else self.chains.split(count)
            self.first = None if split is None else self.better(split, None)
            if self.first is None:
                split = _min_max(self.model, self.chunks, self.mode, self.devices, self.interleave, self.limits,
                                 self.budget, self.schedule)
                self.first = None if split is None else self.better(split, None)
        return better(found, self.first)

    def descend(self, found: Choice | None) -> Choice | None:
        """The first plan (:meth:`start`), then single-cut moves while they lower the simulated time."""
        current = self.start(None)
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
    """The split of least largest stage lane into ``devices · interleave`` stages of a layer at
    least: by bisection on the lane without memory limits, else by the ``O(n · L²)`` DP, each
    stage within an equal share of its device's limit (so that their sum fits) or, where no
    split does, within the whole limit (the sum is then checked where the split is priced,
    :func:`timed`); ``None`` if the DP would overrun ``budget``, or no split fits."""
    costs = model.at(model.micro_batch_size(chunks))
    where = placement(devices * interleave, interleave)
    speeds = model.speeds[where]
    if np.all(np.isinf(limits[:devices])):
        lane = costs.forward * (2.0 if recomputations(mode, chunks) else 1.0) + costs.backward
        return _held_apart(greedy_split(lane, speeds, least_largest(lane, speeds, 1e-3)[1]), model.layers)
    if budget is not None and budget.out(foreseen(model.layers, len(where))):
        return None

    def within(share: float) -> Callable[[int, np.ndarray, np.ndarray], np.ndarray]:
        def fits(s: int, start: np.ndarray, stop: np.ndarray) -> np.ndarray:
            memory = model.schedule_memory(costs, start, stop, chunks, mode, schedule, s, len(where))
            return memory <= limits[where[s]] * share
        return fits

    for share in (1 / interleave, 1.0):
        bounds = min_max_split(model, chunks, mode, speeds, within(share))
        if bounds is not None:
            return tuple(bounds)
    return None


def _held_apart(ends: Sequence[int], layers: int) -> tuple[int, ...]:
    """Stage bounds from the greedy split's stage ``ends``, each moved the least so that every
    stage holds a layer: the greedy leaves a stage none where the one before took up to the
    cap, and round-robin placement needs every stage (``layers`` is at least their count)."""
    bounds, count = [0], len(ends)
    for stage, end in enumerate(ends[:-1], start=1):
        bounds.append(min(max(int(end), bounds[-1] + 1), layers - (count - stage)))
    return tuple(bounds + [layers])


def _group_bounds(model: CostModel, chunks: int, mode: str, devices: int, interleave: int,
                  cuts: np.ndarray) -> np.ndarray:
    """A lower bound on every split of ``k`` devices × ``interleave`` stages, for each ``k =
    2 … devices``: per phase the larger of all its work over the devices' total speed and the
    chain: one micro-batch through every stage (``Σ F_s/v_s ≥ F/v_max``) and the ``n - 1``
    cheapest cuts (``cuts``: :func:`~autopipe.planning._chain.cheapest_ring_cuts` at this
    micro-batch size), plus ``m - 1`` on the slowest lane: a stage's, at least the average of
    the ``n`` stages' and the largest layer at the top speed, or a cut's copy."""
    costs = model.at(model.micro_batch_size(chunks))
    forward, backward = float(costs.forward[-1]), float(costs.backward[-1])
    recomputed = recomputations(mode, chunks)
    spread = np.cumsum(model.speeds[:devices])[1:]
    top = np.maximum.accumulate(model.speeds[:devices])[1:]
    lanes = np.diff(costs.forward), np.diff(costs.backward) + (np.diff(costs.forward) if recomputed else 0.0)
    slowest = [np.maximum(float(np.sum(lane)) / (interleave * spread), float(np.max(lane)) / top) for lane in lanes]
    first = backward + (forward if mode == "always" else 0.0)  # the first job may skip it
    return (np.maximum(chunks * forward / spread,
                       forward / top + cuts[0, :, 0] + (chunks - 1) * np.maximum(slowest[0], cuts[0, :, 1]))
            + np.maximum((chunks * backward + recomputed * forward) / spread,
                         first / top + cuts[1, :, 0] + (chunks - 1) * np.maximum(slowest[1], cuts[1, :, 1])))


def _lower_bounds(model: CostModel, splits: _Splits, chunks: int, mode: str, interleave: int) -> np.ndarray:
    """A lower bound on the simulated time of every split (the module docstring's)."""
    costs = model.at(model.micro_batch_size(chunks))
    bounds = splits.bounds
    stages = bounds.shape[1] - 1
    speeds = model.speeds[np.asarray(placement(stages, interleave))]
    forward = (costs.forward[bounds[:, 1:]] - costs.forward[bounds[:, :-1]]) / speeds
    backward = (costs.backward[bounds[:, 1:]] - costs.backward[bounds[:, :-1]]) / speeds
    recomputed = recomputations(mode, chunks)
    recompute = forward if recomputed else np.zeros_like(forward)
    least = backward + (recompute if mode == "always" else 0.0)  # a backward job at the least
    copy_in, copy_grad = splits.copy_lanes(costs.b)
    return (_phase_bound(chunks * forward, forward, forward, splits.devices, chunks, copy_in)
            + _phase_bound(chunks * backward + recomputed * recompute, least, backward + recompute,
                           splits.devices, chunks, copy_grad))


def _copy_lanes(model: CostModel, bounds: np.ndarray,
                devices: int) -> tuple[tuple[np.ndarray, np.ndarray], tuple[np.ndarray, np.ndarray]]:
    """Per split (a row of ``bounds``) and stage, its copy lanes ``C`` and ``G`` as the cost
    model prices them (:meth:`~autopipe.planning.cost.CostModel.stage_lanes`) — the main input
    and every skip popped there from a stage on another device, the gradients of both back —
    as a part fixed by the copies' latencies and a part per sample of the micro-batch.  Skips
    go straight from stash to pop: interleaved plans run on the local engine only."""
    rows, stages = bounds.shape[0], bounds.shape[1] - 1
    where = np.arange(stages) % devices
    here, after = where[:-1], (where[:-1] + 1) % devices
    chain = model.chain
    inputs = np.asarray([model.profile.input_bytes, *chain.output_bytes[:-1]], dtype=float)[bounds[:, 1:-1]]
    fixed = np.asarray([0, *chain.output_fixed_bytes[:-1]], dtype=float)[bounds[:, 1:-1]]  # per micro-batch
    lanes = np.zeros((4, rows, stages))  # C fixed, C per sample, G fixed, G per sample
    for lane, (src, dst), cut in ((0, (here, after), np.s_[1:]), (2, (after, here), np.s_[:-1])):
        lanes[lane][:, cut] = (inputs + fixed > 0) * model.latency[src, dst] + fixed * model.per_byte[src, dst]
        lanes[lane + 1][:, cut] = inputs * model.per_byte[src, dst]
    flat = lanes.reshape(4, -1)
    first = np.arange(rows) * stages  # each row's first entry in flat
    apart = ~np.eye(devices, dtype=bool)  # one device copies nothing
    latency, per_byte = (np.ravel(apart * table[:devices, :devices]) for table in (model.latency, model.per_byte))
    skips = [skip for skip in model.chain.skips if skip.bytes_per_sample > 0 or skip.fixed_bytes > 0]
    if skips:  # each layer's stage: the cuts up to it
        owner = np.zeros((rows, model.layers + 1), dtype=np.int16)
        owner[np.arange(rows)[:, None], bounds[:, 1:-1]] = 1  # a split's cuts are distinct
        np.cumsum(owner, axis=1, out=owner)
    for skip in skips:
        src, dst = owner[:, skip.stash], owner[:, skip.pop]
        pair, back = where[src] * devices + where[dst], where[dst] * devices + where[src]
        into, out = first + dst, first + src
        flat[0, into] += latency[pair] + skip.fixed_bytes * per_byte[pair]
        flat[1, into] += skip.bytes_per_sample * per_byte[pair]
        flat[2, out] += latency[back] + skip.fixed_bytes * per_byte[back]
        flat[3, out] += skip.bytes_per_sample * per_byte[back]
    return (lanes[0], lanes[2]), (lanes[1], lanes[3])


def _phase_bound(work: np.ndarray, least: np.ndarray, lane: np.ndarray, devices: int, chunks: int,
                 copies: np.ndarray) -> np.ndarray:
    """Per split: the larger of the chain bound (one micro-batch through every stage and its
    ``copies`` at the cuts, then ``m - 1`` on the slowest lane: a stage's or a copy's, each a
    resource that serves the micro-batches in order) and, for every device, what one
    micro-batch needs before its first stage can start, its stages' ``work``, and what the last
    micro-batch needs after its last stage (``least`` per stage, ``lane`` with recomputation).
    The backward phase runs the stages in reverse, which swaps what runs before and after each
    device's stages but not their sum, so one bound serves both phases."""
    rows, stages = work.shape
    head, tail = least[:, :devices], least[:, stages - devices:]  # each device's first and last stage
    before = np.cumsum(head, axis=1) - head
    after = tail.sum(axis=1, keepdims=True) - np.cumsum(tail, axis=1)
    per_device = work.reshape(rows, stages // devices, devices).sum(axis=1)
    busiest = (before + per_device + after).max(axis=1)
    slowest = np.maximum(lane.max(axis=1), copies.max(axis=1, initial=0.0))
    chain = least.sum(axis=1) + copies.sum(axis=1) + (chunks - 1) * slowest
    return np.maximum(busiest, chain)
