"""The planner: the exact minimum of the cost model over stage count, split points, micro-batch
count and checkpoint mode, subject to per-device memory limits.

Why a label-setting DP and not a min-max DP: the iteration time ``S + (m-1)·X + V`` (see
:mod:`autopipe.cost`) mixes a sum ``S`` that depends on the split (speeds differ, copies come
and go) with two bottlenecks (forward lane maximum ``X``, backward lanes through ``M`` and ``V``).
So the DP over (layers covered, stages used) keeps, per state, every label ``(X, M, V, S)`` not
dominated by another; every component only ever raises the final time, so a dominated label can
never finish better.  Labels and whole stages are also cut by a lower bound against the best plan
found so far (branch and bound): the layers left add at least their work at the fastest device
left, the cheapest possible copies of the cuts still to come, and lane maxima no less than their
work spread over the devices left (minimised over how many stages are left, :meth:`Search._least`).
Labels are numpy arrays, so each stage extends every label of a state over every stop at once,
and the Pareto filter compares blocks of labels at once.  Candidates ``(m, mode)`` are tried in
order of a lower bound, in rounds of growing targets (see :func:`solve`).

Skips whose copy cost depends on the device pair need state: a label's key records, for each skip
still open, its producer stage and the consumer stage it is committed to (the producer's gradient
lane is known only with the consumer); a stage that does not pop a skip committed to it is
invalid.  With one copy fit for every pair the cost depends only on the cut positions and the key
stays empty.  Relayed skips (``engine="distributed"``) never need it: each hop's copy is
charged to the neighbours it joins, known from the stage index and the cut positions.
"""
from __future__ import annotations

import bisect
import itertools
import math
from dataclasses import dataclass
from typing import Any, Iterator, Sequence

import numpy as np

from .cost import MODES, CostModel, SizeCosts
from .plans import SCHEDULES, Plan, Prediction, StagePlan
from .profiles import Profile

__all__ = ["plan", "solve", "Search", "Choice", "PlanningError", "build_plan", "candidate_chunks", "device_names",
           "memory_limits", "parse_bytes", "smallest_memory"]


class PlanningError(ValueError):
    """No plan satisfies the options (memory limits, chunks, batch size)."""


# Key: ((skip index, producer, consumer), ...).
_Key = tuple


@dataclass(frozen=True)
class Choice:
    """The best plan the search found: stage bounds, chunks, checkpoint mode and its time."""

    bounds: tuple[int, ...]
    chunks: int
    mode: str
    iteration_ms: float


@dataclass(frozen=True)
class _Labels:
    """The labels of one DP state as parallel arrays: forward lane maximum ``X``, backward lane
    maximum ``M``, ``V``, lane sum ``S`` and each label's index in its stage's trace (``-1``
    for the empty start); arrays, because every stage extends every label at once."""

    x: np.ndarray
    peak: np.ndarray
    v: np.ndarray
    total: np.ndarray
    ref: np.ndarray


# New labels of one stage before the Pareto filter: stop, X, M, V, S, lower bound, parent ref.
_Piece = tuple[np.ndarray, ...]


class Search:
    """One DP over splits for fixed ``chunks`` and ``mode``, cut by an upper bound ``best``."""

    def __init__(self, model: CostModel, chunks: int, mode: str, limits: np.ndarray, best: float,
                 floors: tuple[float, float] = (0.0, 0.0)) -> None:
        """``floors``: known lower bounds on the largest forward and backward compute lanes."""
        self.model = model
        self.m = chunks
        self.requested = mode
        self.mode = "never" if mode == "except_last" and chunks == 1 else mode
        self.costs: SizeCosts = model.at(model.micro_batch_size(chunks))
        self.limits = limits
        self.best = best
        self.bounds: tuple[int, ...] | None = None
        self.devices = len(limits)
        self.keyed = (bool(model.chain.skips) and not model.relayed
                      and not _uniform(model.latency, model.per_byte))
        speeds = model.speeds[: self.devices]
        recompute = 0.0 if self.mode == "never" else 1.0
        per_forward = np.diff(self.costs.forward)
        per_back = np.diff(self.costs.backward) + recompute * per_forward
        self.rest_forward = self.costs.forward[-1] - self.costs.forward
        self.rest_back = self.rest_forward * recompute + (self.costs.backward[-1] - self.costs.backward)
        self.all_work = float(self.rest_forward[0] + self.rest_back[0]) / float(np.max(speeds))
        # largest single layer at or after each position (0 past the end)
        self.layer_forward = np.concatenate((np.maximum.accumulate(per_forward[::-1])[::-1], [0.0]))
        self.layer_back = np.concatenate((np.maximum.accumulate(per_back[::-1])[::-1], [0.0]))
        self.speed_after = np.concatenate((np.cumsum(speeds[::-1])[::-1], [0.0]))
        self.top_after = np.concatenate((np.maximum.accumulate(speeds[::-1])[::-1], [0.0]))
        self.least_forward, self.least_back = floors
        self.cuts = _cheapest_cuts(model, self.costs, self.devices)
        self.trace: list[tuple[np.ndarray, np.ndarray]] = []

    def run(self) -> Choice | None:
        """The best split strictly better than ``best``, or ``None``."""
        root = _Labels(np.zeros(1), np.zeros(1), np.full(1, -math.inf), np.zeros(1), np.full(1, -1))
        frontier: dict[tuple[int, _Key], _Labels] = {(0, ()): root}
        for stage in range(self.devices):
            pieces: dict[_Key, list[_Piece]] = {}
            for (start, key), labels in frontier.items():
                self._extend(stage, start, key, labels, pieces)
            frontier = self._settle(pieces)
            if not frontier:
                break
        if self.bounds is None:
            return None
        return Choice(self.bounds, self.m, self.requested, self.best)

    def _caps(self) -> tuple[float, float]:
        """Largest forward and backward lane a plan better than ``best`` can have:
        ``best > S + (m-1)·X + w·M`` (``w = m-1``, or ``m-2`` with ``except_last``), with
        ``S ≥`` all work at top speed and each maximum at least its floor."""
        spare = self.best - self.all_work
        backward_weight = self.m - 1 if self.mode != "except_last" else self.m - 2
        forward_cap = (spare - backward_weight * self.least_back) / (self.m - 1) if self.m > 1 else math.inf
        backward_cap = ((spare - (self.m - 1) * self.least_forward) / backward_weight
                        if backward_weight > 0 else math.inf)
        return forward_cap, backward_cap

    def _extend(self, stage: int, start: int, key: _Key, labels: _Labels, pieces: dict[_Key, list[_Piece]]) -> None:
        """Grow ``labels`` by one stage ``[start, stop)`` on device ``stage``, for every ``stop``
        at once (numpy arrays over ``stop``)."""
        model, costs, layers = self.model, self.costs, self.model.layers
        stops = np.arange(start + 1, layers + 1) if stage + 1 < self.devices else np.array([layers])
        speed = model.speeds[stage]
        forward = costs.sum(costs.forward, start, stops) / speed
        back = costs.sum(costs.backward, start, stops) / speed
        if self.mode != "never":
            back = back + forward
        forward_cap, backward_cap = self._caps()
        within = (forward <= forward_cap) & (back <= backward_cap)
        count = len(stops) if within.all() else int(np.argmin(within))
        memory = model.memory(costs, start, stops[:count], self.m, self.mode,
                              model.held_bytes(costs, start, stops[:count]))
        fits = np.nonzero(memory <= self.limits[stage])[0]
        if not len(fits):
            return
        stops, forward, back = stops[fits], forward[fits], back[fits]
        skipped = forward if self.mode == "except_last" else np.zeros(len(stops))
        copy_in = np.full(len(stops), model.copy_ms(stage - 1, stage, costs.input_bytes[start]) if stage else 0.0)
        copy_grad = self._main_grad(stage, stops)
        if not self.keyed:
            self._add_skips(stage, start, stops, copy_in, copy_grad)
            self._push(stage, labels, stops, (copy_in, forward, back, skipped, copy_grad), key, pieces)
            return
        for j, stop in enumerate(stops.tolist()):
            for extra_in, extra_grad, new_key in self._commitments(stage, start, stop, key):
                lanes = (copy_in[j:j + 1] + extra_in, forward[j:j + 1], back[j:j + 1], skipped[j:j + 1],
                         copy_grad[j:j + 1] + extra_grad)
                self._push(stage, labels, stops[j:j + 1], lanes, new_key, pieces)

    def _main_grad(self, stage: int, stops: np.ndarray) -> np.ndarray:
        """The gradient of each stop's stage output, copied back from device ``stage + 1``."""
        layers = self.model.layers
        if stage + 1 >= self.devices:
            return np.zeros(len(stops))
        nbytes = self.costs.input_bytes[np.minimum(stops, layers - 1)] * (stops < layers)
        latency, per_byte = self.model.latency[stage + 1, stage], self.model.per_byte[stage + 1, stage]
        return np.where(nbytes > 0, latency + nbytes * per_byte, 0.0)

    def _add_skips(self, stage: int, start: int, stops: np.ndarray, copy_in: np.ndarray,
                   copy_grad: np.ndarray) -> None:
        """Skip copies that depend only on the cuts, in place.  Relayed: every skip crossing the
        cut before ``start`` comes in from ``stage - 1``, every one crossing ``stop`` sends its
        gradient back from ``stage + 1``.  Straight, with one copy fit for all pairs: skips
        received (stash before ``start``, pop before ``stop``) and sent on (stash in the stage,
        pop at or after ``stop``)."""
        model = self.model
        for skip, nbytes in zip(model.chain.skips, self.costs.skip_bytes):
            crosses_stop = (skip.stash < stops) & (stops <= skip.pop)
            if model.relayed:
                if stage and skip.stash < start <= skip.pop:
                    copy_in += model.copy_ms(stage - 1, stage, nbytes)
                if stage + 1 < self.devices:
                    copy_grad += model.copy_ms(stage + 1, stage, nbytes) * crosses_stop
                continue
            cost = model.copy_ms(0, 1, nbytes) if self.devices > 1 else 0.0
            if skip.stash < start <= skip.pop:
                copy_in += cost * (skip.pop < stops)
            elif start <= skip.stash:
                copy_grad += cost * crosses_stop

    def _commitments(self, stage: int, start: int, stop: int, key: _Key) -> Iterator[tuple[float, float, _Key]]:
        """Skip copies in and out of stage ``[start, stop)`` when they depend on the device pair:
        one ``(copy in, copy of gradients, key after)`` per choice of consumer stage for each
        skip the stage sends on; nothing if the stage breaks a commitment in ``key``."""
        model, skips, nbytes = self.model, self.model.chain.skips, self.costs.skip_bytes
        copy_in = 0.0
        kept = []
        for entry in key:
            index, producer, consumer = entry
            if skips[index].pop < stop:
                if consumer != stage:
                    return
                copy_in += model.copy_ms(producer, stage, nbytes[index])
            elif consumer == stage:
                return
            else:
                kept.append(entry)
        sent = [i for i, s in enumerate(skips) if start <= s.stash < stop <= s.pop]
        for consumers in itertools.product(range(stage + 1, self.devices), repeat=len(sent)):
            copy_grad = sum(model.copy_ms(u, stage, nbytes[i]) for i, u in zip(sent, consumers))
            yield copy_in, copy_grad, tuple(sorted(kept + [(i, stage, u) for i, u in zip(sent, consumers)]))

    def _push(self, stage: int, labels: _Labels, stops: np.ndarray, lanes: tuple[np.ndarray, ...],
              key: _Key, pieces: dict[_Key, list[_Piece]]) -> None:
        """Append the stage's lanes to every label at once (labels × stops arrays) — forward
        ``C, F``; backward (reversed, see :mod:`autopipe.cost`) ``W+R, G`` — record a finished
        plan that beats ``best`` and keep what can still beat it (:meth:`_least`)."""
        copy_in, forward, back, skipped, copy_grad = lanes
        m1, m2, layers = self.m - 1, self.m - 2, self.model.layers
        x = np.maximum(labels.x[:, None], np.maximum(copy_in, forward))
        peak = np.maximum(labels.peak[:, None], back)
        v = np.maximum(labels.v[:, None] - skipped, back - skipped + m2 * peak)
        peak = np.maximum(peak, copy_grad)
        v = np.maximum(v, copy_grad + m2 * peak)
        total = labels.total[:, None] + (copy_in + forward + back + copy_grad)
        if stops[-1] == layers:
            final = total[:, -1] + m1 * x[:, -1] + v[:, -1]
            best = int(np.argmin(final))
            if final[best] < self.best:
                self.best = float(final[best])
                self.bounds = self._bounds(stage, int(labels.ref[best]))
        if stage + 1 >= self.devices:
            return
        # a cheap bound over the (labels × stops) grid, then a tighter one on what survives
        relaxed = self._bound(stage, stops, x, peak, total, self.speed_after[stage + 1],
                              self.top_after[stage + 1], 0.0)
        relaxed[:, stops == layers] = math.inf
        i, j = np.nonzero(relaxed < self.best)
        least = self._least(stage, stops[j], x[i, j], peak[i, j], total[i, j])
        alive = least < self.best
        i, j = i[alive], j[alive]
        if len(i):
            pieces.setdefault(key, []).append((stops[j], x[i, j], peak[i, j], v[i, j], total[i, j], least[alive],
                                               labels.ref[i]))

    def _least(self, stage: int, stops: np.ndarray, x: np.ndarray, peak: np.ndarray,
               total: np.ndarray) -> np.ndarray:
        """The least of :meth:`_bound` over the number ``j ≥ 1`` of stages still to come, which
        run on devices ``stage+1 … stage+j`` and add ``j - 1`` cuts after the one at ``stop``."""
        speeds = self.model.speeds[stage + 1: self.devices]
        count = np.arange(1, len(speeds) + 1)
        grid = self._bound(stage, stops[:, None], x[:, None], peak[:, None], total[:, None], np.cumsum(speeds),
                           np.maximum.accumulate(speeds), self.cuts[stops][:, : len(speeds)])
        grid[count[None, :] > (self.model.layers - stops)[:, None]] = math.inf
        return grid.min(axis=1, initial=math.inf)

    def _bound(self, stage: int, stops: np.ndarray, x: np.ndarray, peak: np.ndarray, total: np.ndarray,
               spread: Any, top: Any, cuts: Any) -> np.ndarray:
        """A lower bound on the final time of a label at ``stop < L`` whose remaining layers run
        on devices of total speed ``spread`` and top speed ``top`` with ``cuts`` of extra copy
        time: their work at ``top`` adds to the sum; each lane maximum is at least its value so
        far, the work left spread over those devices, the largest layer left at ``top`` and the
        least for the whole chain; the next stage's copy of its main input adds to the sum and
        is a forward lane."""
        forward_floor = np.maximum(np.maximum(self.rest_forward[stops] / spread, self.layer_forward[stops] / top),
                                   self.least_forward)
        back_floor = np.maximum(np.maximum(self.rest_back[stops] / spread, self.layer_back[stops] / top),
                                self.least_back)
        nbytes = self.costs.input_bytes[np.minimum(stops, self.model.layers - 1)]
        latency, per_byte = self.model.latency[stage, stage + 1], self.model.per_byte[stage, stage + 1]
        next_copy = np.where(nbytes > 0, latency + nbytes * per_byte, 0.0)
        backward_weight = self.m - 1 if self.mode != "except_last" else self.m - 2
        rest = (self.rest_forward[stops] + self.rest_back[stops]) / top + next_copy + cuts
        return (total + rest + (self.m - 1) * np.maximum(x, np.maximum(forward_floor, next_copy))
                + backward_weight * np.maximum(peak, back_floor))

    def _settle(self, pieces: dict[_Key, list[_Piece]]) -> dict[tuple[int, _Key], _Labels]:
        """This stage's new labels that are still under ``best`` and not dominated within their
        state ``(stop, key)``: recorded as the stage's trace and returned as the next frontier.
        Without ``except_last``, ``V = (m-1)·M`` (see :mod:`autopipe.cost`), so ``V`` is not
        compared."""
        columns = 4 if self.mode == "except_last" else 3
        frontier: dict[tuple[int, _Key], _Labels] = {}
        trace_stops, trace_parents, offset = [], [], 0
        for key, parts in pieces.items():
            stops, x, peak, v, total, least, parent = (np.concatenate(column) for column in zip(*parts))
            order = np.lexsort((v, peak, x, total, stops))
            order = order[least[order] < self.best]
            stops, x, peak, v, total, parent = (a[order] for a in (stops, x, peak, v, total, parent))
            keep = _pareto_mask(np.stack((total, x, peak, v)[:columns], axis=1), stops)
            stops, x, peak, v, total, parent = (a[keep] for a in (stops, x, peak, v, total, parent))
            refs = offset + np.arange(len(stops))
            offset += len(stops)
            trace_stops.append(stops)
            trace_parents.append(parent)
            for lo, hi in _groups(stops):
                frontier[(int(stops[lo]), key)] = _Labels(x[lo:hi], peak[lo:hi], v[lo:hi], total[lo:hi], refs[lo:hi])
        empty = np.zeros(0, dtype=int)
        self.trace.append((np.concatenate(trace_stops or [empty]), np.concatenate(trace_parents or [empty])))
        return frontier

    def _bounds(self, stage: int, ref: int) -> tuple[int, ...]:
        """Stage bounds of the plan whose last stage ``stage`` follows the label ``ref`` of the
        stage before, read back through the trace."""
        stops = [self.model.layers]
        for past in range(stage - 1, -1, -1):
            stops.append(int(self.trace[past][0][ref]))
            ref = int(self.trace[past][1][ref])
        return (0, *reversed(stops))


def _cheapest_cuts(model: CostModel, costs: SizeCosts, devices: int) -> np.ndarray:
    """Row ``p``: the least total copy time of ``0, 1, …, devices - 1`` cuts at positions after
    ``p`` (``inf`` where there are fewer).  A cut before layer ``c`` copies at least the main
    input forward and its gradient back, at the cheapest latency and ms/byte of any neighbour
    pair (skips only add)."""
    layers = model.layers
    table = np.full((layers + 1, devices), math.inf)
    table[:, 0] = 0.0
    if devices < 2:
        return table
    pairs = np.arange(devices - 1)
    forward = model.latency[pairs, pairs + 1].min(), model.per_byte[pairs, pairs + 1].min()
    back = model.latency[pairs + 1, pairs].min(), model.per_byte[pairs + 1, pairs].min()
    nbytes = costs.input_bytes
    cost = np.where(nbytes > 0, forward[0] + back[0] + nbytes * (forward[1] + back[1]), 0.0)
    cheapest: list[float] = []
    for stop in range(layers - 2, -1, -1):  # positions after stop: stop + 1 … layers - 1
        bisect.insort(cheapest, float(cost[stop + 1]))
        del cheapest[devices - 1:]
        table[stop, 1: len(cheapest) + 1] = cheapest
    table[:, 1:] = np.cumsum(table[:, 1:], axis=1)
    return table


def _groups(sorted_keys: np.ndarray) -> list[tuple[int, int]]:
    """``[lo, hi)`` of each run of equal values in a sorted array."""
    if not len(sorted_keys):
        return []
    edges = [0, *(np.flatnonzero(np.diff(sorted_keys)) + 1).tolist(), len(sorted_keys)]
    return list(zip(edges, edges[1:]))


def _pareto_mask(points: np.ndarray, groups: np.ndarray, block: int = 128) -> np.ndarray:
    """Which points no other point of the same group dominates (≤ in every column); points are
    sorted by group, then lexicographically, so only an earlier point can dominate (an equal
    later one is a duplicate).  A cheap pass first drops points dominated by the earlier point
    of least value in some column; the survivors are compared block by block with numpy
    (a point dropped early is dominated by a survivor too, so this is exact)."""
    keep = np.zeros(len(points), dtype=bool)
    for lo, hi in _groups(groups):
        survivors = lo + np.flatnonzero(_not_beaten_by_leaders(points[lo:hi]))
        kept = points[:0]
        for first in range(0, len(survivors), block):
            rows = survivors[first:first + block]
            chunk = points[rows]
            earlier = np.tri(len(chunk), k=-1, dtype=bool)
            beaten = ((chunk[None] <= chunk[:, None]).all(axis=2) & earlier).any(axis=1)
            if len(kept):
                beaten |= (kept[None] <= chunk[:, None]).all(axis=2).any(axis=1)
            keep[rows[~beaten]] = True
            kept = np.concatenate((kept, chunk[~beaten]))
    return keep


def _not_beaten_by_leaders(points: np.ndarray) -> np.ndarray:
    """False for each point dominated by the earlier point of least value in some column."""
    alive = np.ones(len(points), dtype=bool)
    index = np.arange(len(points))
    for column in points.T[1:]:
        leader = np.maximum.accumulate(np.where(column == np.minimum.accumulate(column), index, 0))
        before = np.concatenate(([0], leader[:-1]))
        alive[1:] &= ~(points[before[1:]] <= points[1:]).all(axis=1)
    return alive


def _uniform(latency: np.ndarray, per_byte: np.ndarray) -> bool:
    off = ~np.eye(len(latency), dtype=bool)
    return len(latency) < 2 or (np.ptp(latency[off]) == 0 and np.ptp(per_byte[off]) == 0)


def plan(
    profile: Profile,
    devices: Sequence[Any] | int | None = None,
    *,
    batch_size: int | None = None,
    memory_limit: float | str | Sequence[float | str | None] | None = None,
    checkpoint: str = "auto",
    optimizer_state_factor: float = 2.0,
    schedule: str = "gpipe",
    speeds: Sequence[float] | None = None,
    chunks: int | None = None,
    engine: str = "local",
) -> Plan:
    """The plan of least predicted iteration time for ``profile`` on ``devices``.

    Stages use ``devices`` in order (``k`` of them, ``k`` chosen); ``speeds`` are relative
    (times are divided by them); ``memory_limit`` is bytes (or ``"16GiB"``) for every device or
    one per device, defaulting to the capacity of CUDA devices and no limit on CPU;
    ``checkpoint="auto"`` chooses the mode; ``chunks=None`` chooses the micro-batch count;
    ``engine`` is what will run the plan: ``"local"`` (the in-process runtime) or
    ``"distributed"`` (torch.distributed.pipelining: skips relayed by the stages between, equal
    micro-batches only), costed as in :mod:`autopipe.cost`.
    """
    names = device_names(profile, devices)
    options = _Options.check(profile, names, batch_size, memory_limit, checkpoint,
                             optimizer_state_factor, schedule, speeds, chunks, engine)
    model = CostModel(profile, names, options.speeds,
                      options.batch_size, optimizer_state_factor, engine)
    choice = solve(model, options.candidates, options.modes, options.limits)
    if choice is None:
        raise PlanningError(_infeasible(model, options))
    return build_plan(profile, model, choice.bounds, choice.chunks, choice.mode, options.record())


def solve(model: CostModel, candidates: Sequence[int], modes: Sequence[str], limits: np.ndarray) -> Choice | None:
    """Branch and bound over ``(chunks, mode)``, one exact :class:`Search` each.

    The DP's size grows steeply with the gap between its cut-off and the optimum, and a DP by
    stages completes no plan before its last stage, so rounds are cut at a target ``(1 + gap)``
    times the least lower bound, the gap doubling from 0.25%, and never above the best balanced
    split (the seed, see :class:`_Candidate`).  A round searches every candidate whose lower
    bound is under the target, each for a plan strictly better than the best so far, so the
    first round that finds a plan has found the optimum; a round at the seed that finds none
    proves the seed optimal.  Without a seed the last round has no target.
    """
    # ties go to the mode listed first in MODES (least recomputation)
    pairs = sorted((_Candidate.of(model, m, mode, limits) for m in candidates for mode in modes),
                   key=lambda c: (c.bound, c.chunks, MODES.index(c.mode)))
    seed = min((c.seed for c in pairs if c.seed is not None), key=lambda c: c.iteration_ms, default=None)
    ceiling = math.inf if seed is None else seed.iteration_ms
    gap = 0.0025
    while True:
        target = min(pairs[0].bound * (1 + gap) if gap < 16 else math.inf, ceiling)
        choice = _round(model, pairs, limits, target)
        if choice is not None or target == ceiling:
            return choice or seed
        gap *= 2


def _round(model: CostModel, pairs: Sequence["_Candidate"], limits: np.ndarray, best: float) -> Choice | None:
    """The best plan under ``best`` over every candidate whose lower bound is under it."""
    choice = None
    for pair in pairs:
        if pair.bound >= best:
            break
        found = Search(model, pair.chunks, pair.mode, limits, best, pair.floors).run()
        if found is not None:
            choice, best = found, found.iteration_ms
    return choice


@dataclass(frozen=True)
class _Candidate:
    """A ``(chunks, mode)`` pair: its lower bound, compute-lane floors and the best of a few
    balanced splits (``seed``, ``None`` if none fits in memory)."""

    bound: float
    chunks: int
    mode: str
    floors: tuple[float, float]
    seed: Choice | None

    @staticmethod
    def of(model: CostModel, chunks: int, mode: str, limits: np.ndarray) -> "_Candidate":
        """``S + (m-1)·X + V ≥`` the least over stage counts ``k`` of: work at the top speed of
        the first ``k`` devices, the ``k - 1`` cheapest cuts (:func:`_cheapest_cuts`), and
        ``(m-1)·X + w·M`` with ``X ≥ X*`` and the forward work over those devices' total
        speed (``M`` likewise), where ``X*`` and ``M*`` are the least possible largest forward
        and backward compute lanes on these devices (copies only add lanes) and ``w`` is
        ``m-1``, or ``m-2`` with ``except_last``.  The splits reaching ``X*``, ``M*`` and the
        least largest forward + backward are the seeds."""
        costs = model.at(model.micro_batch_size(chunks))
        recompute = 1.0 if mode == "always" or mode == "except_last" and chunks > 1 else 0.0
        back = costs.backward + recompute * costs.forward
        speeds = model.speeds[: len(limits)]
        (least_forward, by_forward), (least_back, by_back) = (_least_largest_lane(costs.forward, speeds),
                                                              _least_largest_lane(back, speeds))
        _, by_both = _least_largest_lane(costs.forward + back, speeds)
        backward_weight = chunks - 1 if mode != "except_last" else max(chunks - 2, 0)
        count = np.arange(1, min(len(speeds), model.layers) + 1)
        spread, top = np.cumsum(speeds)[count - 1], np.maximum.accumulate(speeds)[count - 1]
        cuts = _cheapest_cuts(model, costs, len(speeds))[0, count - 1]
        bound = float(np.min(float(costs.forward[-1] + back[-1]) / top + cuts
                             + (chunks - 1) * np.maximum(least_forward, costs.forward[-1] / spread)
                             + backward_weight * np.maximum(least_back, back[-1] / spread)))
        seeds = [Choice(tuple(bounds), chunks, mode, model.evaluate(bounds, chunks, mode).iteration_ms)
                 for bounds in (by_forward, by_back, by_both)
                 if bounds is not None and _fits(model.evaluate(bounds, chunks, mode), limits)]
        seed = min(seeds, key=lambda c: c.iteration_ms, default=None)
        return _Candidate(bound, chunks, mode, (least_forward, least_back), seed)


def _fits(evaluation: Any, limits: np.ndarray) -> bool:
    return all(stage.memory <= limit for stage, limit in zip(evaluation.stages, limits))


def _least_largest_lane(prefix: np.ndarray, speeds: np.ndarray) -> tuple[float, list[int] | None]:
    """The least ``max_s work_s / v_s`` over contiguous splits of the layers (prefix sums
    ``prefix``) onto the devices in order, skipping allowed (a lower bound): bisection on the
    cap, each device greedily taking all the layers that fit (optimal for a fixed order).
    Also the greedy split at the feasible end, if it uses the devices without gaps."""
    low, high = float(prefix[-1]) / float(np.sum(speeds)), float(prefix[-1]) / float(np.min(speeds))
    for _ in range(60):
        cap = (low + high) / 2
        if _greedy(prefix, speeds, cap)[-1] >= len(prefix) - 1:
            high = cap
        else:
            low = cap
    bounds = _greedy(prefix, speeds, high)
    stops = [0] + [b for b in bounds[1:] if b > 0]
    valid = bounds[-1] == len(prefix) - 1 and all(b > a for a, b in zip(stops, stops[1:]))
    return low, stops if valid else None


def _greedy(prefix: np.ndarray, speeds: np.ndarray, cap: float) -> list[int]:
    """Stage ends when each device in turn takes the most layers whose work fits ``cap · speed``
    (stops once all layers are placed)."""
    bounds = [0]
    for speed in speeds:
        if bounds[-1] == len(prefix) - 1:
            break
        bounds.append(int(np.searchsorted(prefix, prefix[bounds[-1]] + cap * speed, side="right")) - 1)
    return bounds


@dataclass(frozen=True)
class _Options:
    """Checked planning options."""

    batch_size: int
    speeds: list[float]
    limits: np.ndarray
    candidates: list[int]
    modes: list[str]
    given: dict[str, Any]

    @staticmethod
    def check(profile: Profile, names: list[str], batch_size: int | None, memory_limit: Any,
              checkpoint: str, optimizer_state_factor: float, schedule: str,
              speeds: Sequence[float] | None, chunks: int | None, engine: str) -> "_Options":
        # 1F1B is not planned: its time is not modelled, and fill-drain's is not a proven bound
        # for it.  A gpipe plan runs on the distributed engine with schedule='1f1b' when chunks ≥
        # stages, holding no more activations than planned (≤ stages - s micro-batches in flight).
        if schedule != "gpipe":
            known = f"; '{schedule}' is not a schedule" if schedule not in SCHEDULES else ""
            raise ValueError(f"the planner models only schedule='gpipe' (fill-drain){known}; use 'gpipe' "
                             "(the distributed engine can run a gpipe plan with schedule='1f1b' "
                             "when chunks >= stages)")
        if checkpoint != "auto" and checkpoint not in MODES:
            raise ValueError(f"checkpoint '{checkpoint}' is not one of {['auto', *MODES]}")
        if optimizer_state_factor < 0:
            raise ValueError(f"optimizer_state_factor must be ≥ 0 (2 for SGD with momentum, 3 for Adam), "
                             f"got {optimizer_state_factor}")
        batch = profile.batch_size if batch_size is None else int(batch_size)
        rates = [1.0] * len(names) if speeds is None else [float(v) for v in speeds]
        if len(rates) != len(names) or min(rates) <= 0:
            raise ValueError(f"speeds must be {len(names)} positive numbers (one per device), got {list(rates)}")
        # 'always' is never chosen automatically: 'except_last' recomputes less and needs the
        # same memory, so it is at least as fast and as small.
        modes = ["never", "except_last"] if checkpoint == "auto" else [checkpoint]
        given = {"devices": names, "batch_size": batch, "memory_limit": memory_limit,
                 "checkpoint": checkpoint, "optimizer_state_factor": optimizer_state_factor,
                 "speeds": rates, "chunks": chunks, "engine": engine}
        return _Options(batch, rates, memory_limits(memory_limit, names),
                        candidate_chunks(batch, profile.batch_sizes, chunks, equal=engine == "distributed"),
                        modes, given)

    def record(self) -> dict[str, Any]:
        """The options as JSON for the plan file."""
        limit = self.given["memory_limit"]
        shown = list(limit) if isinstance(limit, (list, tuple)) else limit
        return {**self.given, "memory_limit": shown,
                "memory_limit_bytes": [None if math.isinf(v) else int(v) for v in self.limits]}


def candidate_chunks(batch_size: int, sizes: Sequence[int], chunks: int | None = None,
                     equal: bool = False) -> list[int]:
    """Micro-batch counts worth trying: the least ``m`` for each distinct ``ceil(B/m)`` within
    the profiled sizes (for equal micro-batch size, fewer micro-batches is never slower); with
    ``equal`` (the distributed engine needs one micro-batch shape) only divisors of ``B`` —
    a divisor is always the least ``m`` of its size, so no better count is lost."""
    if batch_size < 1:
        raise ValueError(f"batch size must be at least 1, got {batch_size}")
    low, high = min(sizes), max(sizes)
    if chunks is not None:
        size = -(-batch_size // chunks) if 1 <= chunks <= batch_size else 0
        if not low <= size <= high:
            raise ValueError(f"chunks={chunks} with batch size {batch_size} gives micro-batches of {size} "
                             f"samples, outside 1..{batch_size} or the profiled sizes {low}..{high}; "
                             "choose another chunks or profile more batch sizes")
        if equal and batch_size % chunks:
            raise ValueError(f"chunks={chunks} does not divide batch size {batch_size}, and the distributed "
                             "engine needs equal micro-batches; choose a divisor of the batch size")
        return [chunks]
    found = {}
    for m in range(1, batch_size + 1):
        found.setdefault(-(-batch_size // m), m)
    usable = [m for size, m in found.items() if low <= size <= high and not (equal and batch_size % m)]
    if not usable:
        shape = "equal micro-batches" if equal else "micro-batches"
        raise ValueError(f"batch size {batch_size} cannot be split into {shape} of the profiled "
                         f"sizes {low}..{high}; profile batch sizes up to {batch_size} or use a batch "
                         f"size of at least {low}{' that a profiled size divides' if equal else ''}")
    return sorted(usable)


_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_bytes(text: str | float | int) -> float:
    """``16GiB``, ``500MB``, ``1e9`` or a number → bytes."""
    if isinstance(text, (int, float)):
        return float(text)
    stripped = text.strip().lower().replace(" ", "")
    number = stripped.rstrip("abcdefghijklmnopqrstuvwxyz")
    unit = stripped[len(number):]
    try:
        return float(number) * _UNITS[unit]
    except (ValueError, KeyError):
        raise ValueError(f"cannot read '{text}' as a memory size; write e.g. 16GiB, 500MB or 1e9") from None


def memory_limits(limit: Any, names: Sequence[str]) -> np.ndarray:
    """Bytes per device: one value for all, one per device, or the CUDA capacity / no limit."""
    if isinstance(limit, (list, tuple)):
        if len(limit) != len(names):
            raise ValueError(f"{len(limit)} memory limits for {len(names)} devices; give one, or one per device")
        values = [_default_limit(n) if v is None else parse_bytes(v) for v, n in zip(limit, names)]
    elif limit is None:
        values = [_default_limit(n) for n in names]
    else:
        values = [parse_bytes(limit)] * len(names)
    if min(values) <= 0:
        raise ValueError(f"memory limits must be positive, got {values}")
    return np.asarray(values, dtype=float)


def _default_limit(name: str) -> float:
    if not name.startswith("cuda"):
        return math.inf
    from .device import DeviceError, ops_for

    try:
        capacity = ops_for(name).capacity()
    except DeviceError as error:
        raise ValueError(f"cannot read the memory of {name} here ({error}); pass memory_limit "
                         "(e.g. '16GiB') to plan for it") from None
    return math.inf if capacity is None else float(capacity)


def device_names(profile: Profile, devices: Sequence[Any] | int | None) -> list[str]:
    """Plan devices as names: the profile's, its first ``n``, or those given."""
    if devices is None:
        return list(profile.devices)
    if isinstance(devices, int):
        if devices < 1:
            raise ValueError(f"device count must be at least 1, got {devices}")
        if devices <= len(profile.devices):
            return list(profile.devices[:devices])
        if all(d.startswith("cpu") for d in profile.devices):
            return ["cpu"] * devices
        raise ValueError(f"{devices} devices requested but the profile measured {len(profile.devices)} "
                         f"({', '.join(profile.devices)}); name the devices or profile on all of them")
    names = [f"cuda:{d}" if isinstance(d, int) else str(d) for d in devices]
    if not names:
        raise ValueError("no devices given; pass e.g. ['cpu', 'cpu'] or 2")
    return names


def build_plan(profile: Profile, model: CostModel, bounds: Sequence[int], chunks: int, mode: str,
               options: dict[str, Any]) -> Plan:
    """The :class:`Plan` of one split, costed by ``model``."""
    evaluation = model.evaluate(bounds, chunks, mode)
    layers = profile.layers
    stages = [
        StagePlan(index=s, device=model.devices[s], start=bounds[s], stop=bounds[s + 1],
                  first_layer=layers[bounds[s]].name, last_layer=layers[bounds[s + 1] - 1].name,
                  forward_ms=lanes.forward, backward_ms=lanes.backward, recompute_ms=lanes.recompute,
                  copy_in_ms=lanes.copy_in, copy_grad_ms=lanes.copy_grad,
                  memory_bytes=int(math.ceil(lanes.memory)))
        for s, lanes in enumerate(evaluation.stages)
    ]
    recomputed = {"never": 0, "except_last": chunks - 1, "always": chunks}[mode]
    busy = sum(chunks * (l.forward + l.backward) + recomputed * l.recompute for l in evaluation.stages)
    bubble = 1 - busy / (len(stages) * evaluation.iteration_ms) if evaluation.iteration_ms > 0 else 0.0
    predicted = Prediction(evaluation.iteration_ms, evaluation.forward_ms, evaluation.backward_ms, bubble)
    return Plan(model=profile.model, profile_digest=profile.digest, devices=model.devices[: len(stages)],
                batch_size=model.batch_size, chunks=chunks, checkpoint=mode, schedule="gpipe",
                stages=stages, predicted=predicted, options=options)


def _infeasible(model: CostModel, options: _Options) -> str:
    need, chunks, mode = smallest_memory(model, options.candidates, options.modes, len(options.limits))
    limits = ", ".join("none" if math.isinf(v) else f"{int(v)}" for v in options.limits)
    return (f"no plan fits the memory limits ({limits} bytes per device); the smallest per-device "
            f"memory limit that would fit is {int(math.ceil(need))} bytes ({need / 2**30:.3f} GiB, "
            f"with chunks={chunks}, checkpoint={mode}); raise memory_limit, add devices or allow "
            "checkpointing")


def smallest_memory(model: CostModel, candidates: Sequence[int], modes: Sequence[str],
                    devices: int) -> tuple[float, int, str]:
    """Min over plans of the largest stage memory (a min-max DP per ``(chunks, mode)``)."""
    best = (math.inf, 0, "")
    for chunks in candidates:
        costs = model.at(model.micro_batch_size(chunks))
        for mode in modes:
            effective = "never" if mode == "except_last" and chunks == 1 else mode
            answer = _min_max_memory(model, costs, chunks, effective, devices)
            if answer < best[0]:
                best = (answer, chunks, mode)
    return best


def _min_max_memory(model: CostModel, costs: SizeCosts, chunks: int, mode: str, devices: int) -> float:
    """``min over k ≤ devices and splits of max stage memory``: ``reach[c]`` is the best over
    the first ``c`` layers with one more stage each round."""
    layers = model.layers
    starts = np.arange(layers)
    reach = np.full(layers + 1, math.inf)
    reach[0] = 0.0
    answer = math.inf
    for _ in range(devices):
        grown = np.full(layers + 1, math.inf)
        for stop in range(1, layers + 1):
            head = starts[:stop]
            row = model.memory(costs, head, stop, chunks, mode, model.held_bytes(costs, head, stop))
            grown[stop] = np.min(np.maximum(reach[:stop], row))
        reach = grown
        answer = min(answer, float(reach[layers]))
    return answer
