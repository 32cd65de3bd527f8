"""The least chain time of interleaved splits: a DP over stages, cut positions and lane caps.

In a fill-drain phase every micro-batch passes the stages in order and every stage takes the
micro-batches in order, whichever device each stage shares.  So one path through the
(lane × micro-batch) grid bounds a split's time: the first micro-batch through every stage
and every copy between them, then the other ``m - 1`` on the slowest stage.  Over both phases::

    time ≥ Σ_s Q_s + Σ_cuts 2·c(a) + (m - 1)·max_s P_s

with ``P_s = F_s + B_s`` a stage's forward and backward with recomputation, ``Q_s`` the same
as the first micro-batch runs them, ``2·c(a)`` the least copy of the main input at cut ``a``
forward and back (for the cut into stage ``s``, over the device pairs ``((s-1) % k, s % k)`` it
joins in a split over any ``k`` devices, :func:`stage_cuts`) and ``max F + max B ≥ max (F + B)``.
Where copies are dear a balanced split is not the fastest: the cuts must also fall where the
activations are small, and this bound sees both.

For a cap ``z`` on every ``P_s``, the least ``Σ Q + Σ 2c`` over splits into ``n`` stages is a DP
``D_n(z)`` over stages and cut positions, each stage's window of starts answered by a
sparse-table query per end: one pass over ``N`` stages gives ``D_n`` for every ``n ≤ N`` (when
every stage runs at one speed) and every cap of a grid at once, ``O(N · caps · L log L)``.
``D_n`` only falls as ``z`` grows, so splits whose largest ``P`` lies between two caps
``z_i < z_{i+1}`` take at least ``(m - 1)·z_i + D_n(z_{i+1})``; the least over the grid's
intervals bounds them all.  The grid (:class:`_Grid`) is geometric between the least cap a
split can have and the largest that can still beat the time to beat, then refined where the
least bounds are.  The DP at the best interval's cap also gives a split whose chain time is
near the least: a good first plan to simulate.

Where the DP is small (:data:`APART_CELLS`), a count's bound also keeps the two largest lanes
apart, ``(m - 1)·(max F + max B)``, over a grid of caps on each (:meth:`Chains._apart`): the
stage of largest forward need not be the one of largest backward, and one split cannot make
both small when forward and backward costs are spread differently over the layers.
"""
from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import Iterator, Sequence

import numpy as np

from ._arrays import RangeMin, uniform
from ._budget import Budget
from .candidates import least_largest
from .cost import CostModel, SizeCosts, recomputations
from .plans import placement

__all__ = ["Chains", "cheapest_ring_cuts", "copies_between", "stage_cuts"]

#: caps of the first grid (each a row of every DP step: they cost in proportion)
CAPS = 12
#: parts each pass cuts an interval into
SPLIT = 8
#: passes at most
PASSES = 3
#: an interval is narrow enough when the caps it spans cost at most this share of its bound
TOLERANCE = 2.5e-3
#: DP cells (stages × positions) up to which a count also gets the bound with its lanes apart
APART_CELLS = 4_000
#: caps a lane of that bound's first grid
LEVELS = 8


@dataclass(frozen=True)
class _Bound:
    """A lower bound on the chain time of every split into ``n`` stages and its interval of caps."""

    least: float
    cap: float
    low: float
    priced: bool = True  # whether a DP gave it (else it is the least chain time at its floor, no split)


class Chains:
    """The chain bounds of ``chunks`` micro-batches in ``mode`` over splits into any number of
    stages (``interleave`` per device, round-robin, at ``speeds[device]``)."""

    def __init__(self, model: CostModel, chunks: int, mode: str, interleave: int, speeds: np.ndarray) -> None:
        costs = model.at(model.micro_batch_size(chunks))
        recompute = costs.forward if recomputations(mode, chunks) else np.zeros_like(costs.forward)
        self.first = costs.forward + costs.backward + (recompute if mode == "always" else 0.0)
        self.lane = costs.forward + costs.backward + recompute  # prefix sums of P
        self.forward, self.back = costs.forward, costs.backward + recompute  # of F and B, apart
        self.cuts = stage_cuts(model, costs, interleave, len(speeds))  # [stage, position]: into it, both ways
        least = np.sort(np.min(self.cuts[1:, 1:-1], axis=0, initial=math.inf))  # at each cut position, any stage
        self.cheapest = np.concatenate(([0.0], np.cumsum(least)))  # of k cuts
        self.weight, self.interleave, self.speeds = chunks - 1, interleave, speeds
        self.bounds: dict[int, _Bound] = {}

    def stage_speeds(self, count: int) -> np.ndarray:
        """Each stage's speed in a split into ``count`` stages."""
        return self.speeds[np.asarray(placement(count, self.interleave))]

    def split(self, count: int) -> tuple[int, ...] | None:
        """A split into ``count`` stages (bounded first) of least ``Σ Q + Σ 2c`` within its
        bound's cap (``None`` if none keeps every lane within it, or no DP priced the count)."""
        if not self.bounds[count].priced:
            return None
        speeds = self.stage_speeds(count)
        cap = np.array([self.bounds[count].cap])
        tables = list(_sums(self.first, [(self.lane, cap)], self.cuts, speeds))
        if not math.isfinite(tables[-1][0, -1]):
            return None
        bounds = [len(self.lane) - 1]
        for s in range(count - 1, -1, -1):
            j, speed, before = bounds[-1], speeds[s], tables[s][0]
            starts = np.arange(j)
            fits = self.lane[j] - self.lane[starts] <= cap[0] * speed * (1 + 1e-12)
            values = np.where(fits, before[:j] + self.cuts[s, :j] + (self.first[j] - self.first[:j]) / speed,
                              math.inf)
            bounds.append(int(np.argmin(np.abs(values - tables[s + 1][0, j]))))
        return tuple(bounds[::-1])

    def bound(self, counts: Sequence[int], above: float, budget: Budget | None = None) -> dict[int, float]:
        """Each count's chain bound (at least ``above`` where none of its splits can beat it),
        from grids of caps shared by all counts when every stage runs at one speed (else a grid
        per count), refined while ``budget`` lasts."""
        self.bounds.update(self._bounds(sorted(counts), above, budget))
        least = {n: self.bounds[n].least for n in counts}
        for n in counts:  # where the DP is small, the largest forward and backward lanes apart
            if least[n] < above and n * len(self.lane) <= APART_CELLS and (budget is None or not budget.out()):
                least[n] = max(least[n], self._apart(n, above, budget))
        return least

    def _apart(self, count: int, above: float, budget: Budget | None) -> float:
        """The chain bound with ``(m - 1)·(max F + max B)`` for ``(m - 1)·max (F + B)``: from
        a grid of caps on each lane (:data:`LEVELS` a lane between its floor and the cap that
        can still beat ``above``, and no limit), refined around its least cell."""
        weight, speeds = self.weight, self.stage_speeds(count)
        top = float(np.max(speeds))
        lanes = (self.forward, self.back)
        floors = [max(float(lane[-1]) / (count * top), float(np.max(np.diff(lane))) / top) for lane in lanes]
        lowest = self._lowest(count, top)
        if weight == 0:
            return lowest
        highs = [(above - lowest - weight * floors[1 - k]) / weight if math.isfinite(above) else 2 * floors[k]
                 for k in range(2)]
        if any(high <= floor for high, floor in zip(highs, floors)):
            return above  # every split has lanes past a cap that can beat it
        levels = [np.append(np.geomspace(floor, high, LEVELS + 1)[1:], math.inf) for floor, high in zip(floors, highs)]
        known: dict[tuple[float, float], float] = {}
        least = -math.inf
        for _ in range(PASSES + 1):
            xs, ys = levels
            missing = [(x, y) for x in xs for y in ys if (x, y) not in known]
            if missing:
                caps = np.array(missing)
                *_, table = itertools.islice(_sums(self.first, [(self.forward, caps[:, 0]), (self.back, caps[:, 1])],
                                                   self.cuts, speeds), count + 1)
                known.update(zip(missing, table[:, -1].tolist()))
            lows = [np.concatenate(([floor], level[:-1])) for floor, level in zip(floors, levels)]
            values = weight * (lows[0][:, None] + lows[1][None, :]) + np.array([[known[x, y] for y in ys] for x in xs])
            i, j = np.unravel_index(int(np.argmin(values)), values.shape)
            least = float(values[i, j])
            spans = [(lows[0][i], xs[i]), (lows[1][j], ys[j])]
            wide = sum(weight * (high - low) for low, high in spans) > TOLERANCE * least
            if least >= above or not wide or budget is not None and budget.out():
                break
            levels = [np.union1d(level, np.geomspace(low, 4 * low, SPLIT + 1)[1:] if math.isinf(high)
                                 else np.linspace(low, high, SPLIT + 1)[1:-1])
                      for level, (low, high) in zip(levels, spans)]
        return least

    def _bounds(self, counts: list[int], above: float, budget: Budget | None) -> dict[int, _Bound]:
        shared = np.ptp(self.speeds[: max(counts) // self.interleave]) == 0
        floors = {n: self._floor(n, shared) for n in counts}
        top_speed = float(np.max(self.speeds))
        lowest = {n: self._lowest(n, top_speed) for n in counts}
        if self.weight == 0:  # the largest lane does not count: one cap, no limit
            highs = {n: math.inf for n in counts}
        else:  # over its high cap, a split is no faster than ``above``
            highs = {n: max(floors[n], (above - lowest[n]) / self.weight if math.isfinite(above) else 2 * floors[n])
                     for n in counts}
        if shared:
            return _Grid(self, counts, floors, lowest, highs, above, budget).bounds
        # a grid per count, the most stages first (their bounds are the least, the ones that
        # matter); a count reached after the time is up keeps what holds without a DP
        bounds = {}
        for n in sorted(counts, reverse=True):
            if bounds and budget is not None and budget.out():
                bounds[n] = _Bound(self.weight * floors[n] + lowest[n], math.inf, floors[n], priced=False)
            else:
                bounds[n] = _Grid(self, [n], floors, lowest, highs, above, budget).bounds[n]
        return bounds

    def _lowest(self, count: int, top: float) -> float:
        """``D_count(∞)`` at least: every layer's ``Q`` at the ``top`` speed and the
        ``count - 1`` cheapest cuts."""
        return float(self.first[-1]) / top + float(self.cheapest[count - 1])

    def _floor(self, count: int, shared: bool) -> float:
        """A cap under which no split into ``count`` stages exists: the average stage's or the
        largest layer's at one speed, else by bisection (:func:`least_largest`)."""
        speeds = self.stage_speeds(count)
        if shared:
            return max(float(self.lane[-1]) / count, float(np.max(np.diff(self.lane)))) / float(speeds[0])
        return least_largest(self.lane, speeds, TOLERANCE)[0]


class _Grid:
    """The bounds of ``counts`` stages (all at the speeds of the largest count's first stages)
    over caps refined where each count's least interval is: each pass adds :data:`SPLIT` - 1
    caps inside the least interval of every count whose bound is under ``above`` and under
    what another count's split is known to reach (else refining it could not raise the least
    bound of all), and which is still wider than :data:`TOLERANCE` of its bound, or past the
    last cap where that interval is the least; one DP prices the new caps for all counts at once."""

    def __init__(self, chains: Chains, counts: list[int], floors: dict[int, float], lowest: dict[int, float],
                 highs: dict[int, float], above: float, budget: Budget | None) -> None:
        self.chains, self.counts, self.floors, self.lowest = chains, counts, floors, lowest
        self.speeds = chains.stage_speeds(max(counts))
        low, high = min(floors[n] for n in counts), max(highs[n] for n in counts)
        if 0 < low < high < math.inf:
            caps = low * (high / low) ** (np.arange(CAPS) / (CAPS - 1))
        else:
            caps = np.array([high])
        self.caps = np.empty(0)
        self.sums = np.empty((max(counts) + 1, 0))
        self._add(caps)
        for _ in range(PASSES):
            if budget is not None and budget.out():
                break
            least = {n: self._least(n) for n in counts}
            # no count's least can be over the least chain time of a split in its interval
            reach = min(bound.least + self.chains.weight * (bound.cap - bound.low) for bound in least.values())
            wanted = [cap for n in counts if least[n].least < reach for cap in self._open(n, above)]
            if not wanted:
                break
            self._add(np.unique(wanted))
        self.bounds = {n: self._least(n) for n in counts}

    def _add(self, caps: np.ndarray) -> None:
        """Price ``caps`` for every count and merge them in."""
        chains = self.chains
        sums = np.array([table[:, -1] for table in _sums(chains.first, [(chains.lane, caps)], chains.cuts,
                                                         self.speeds)])
        order = np.argsort(np.concatenate((self.caps, caps)), kind="stable")
        self.caps = np.concatenate((self.caps, caps))[order]
        self.sums = np.concatenate((self.sums, sums), axis=1)[:, order]

    def _intervals(self, n: int) -> tuple[np.ndarray, np.ndarray]:
        """Per interval under each cap (and past the last, unless it is no limit): the least
        time of a split whose largest ``P`` lies in it, and the interval's least cap."""
        below = np.concatenate(([self.floors[n]], self.caps))
        ends = np.append(self.sums[n], self.lowest[n])  # D_n at each cap, and at least past the last
        if math.isinf(self.caps[-1]):
            below, ends = below[:-1], ends[:-1]
        return (self.chains.weight * below if self.chains.weight else 0.0) + ends, below  # no 0 · inf

    def _least(self, n: int) -> _Bound:
        values, below = self._intervals(n)
        best = int(np.argmin(values))
        return _Bound(float(values[best]), float(np.append(self.caps, math.inf)[best]), float(below[best]))

    def _open(self, n: int, above: float) -> np.ndarray:
        """Caps inside ``n``'s least interval if it is still too wide to bound ``n`` and under
        ``above``; past the last cap, up to the cap over which a split is slower than one known."""
        values, below = self._intervals(n)
        best = int(np.argmin(values))
        if values[best] >= above or not self.chains.weight:
            return np.empty(0)
        if best == len(self.caps):
            weight = self.chains.weight
            known = np.min(weight * self.caps + self.sums[n])  # a split within a cap reaches it
            top = (min(above, known) - self.lowest[n]) / weight if math.isfinite(known) else 4 * self.caps[-1]
            return np.geomspace(self.caps[-1], top, SPLIT + 1)[1:] if top > self.caps[-1] else np.empty(0)
        low, high = below[best], self.caps[best]
        if self.chains.weight * (high - low) <= TOLERANCE * values[best]:
            return np.empty(0)
        return np.linspace(low, high, SPLIT + 1)[1:-1]


def _sums(first: np.ndarray, lanes: Sequence[tuple[np.ndarray, np.ndarray]], cuts: np.ndarray,
          speeds: np.ndarray) -> Iterator[np.ndarray]:
    """Per stage count ``n = 0 … len(speeds)`` in turn: per row and layer ``j``, the least
    ``Σ Q + Σ 2c`` of the first ``n`` stages ending at ``j`` with every stage's work on each of
    ``lanes`` (prefix sums, and a cap per row) within its cap (``cuts[s]``: the cut into stage
    ``s`` at each position)."""
    width, rows = len(first), len(lanes[0][1])
    ends = np.arange(width)
    windows = {}
    for speed in np.unique(speeds):  # stage [i, j) fits when lane[j] - lane[i] ≤ cap · speed on every lane
        lo = np.max([np.searchsorted(lane, (lane[None, :] - caps[:, None] * speed * (1 + 1e-12)).ravel(),
                                     side="left") for lane, caps in lanes], axis=0)
        windows[speed] = RangeMin(np.repeat(np.arange(rows), width), lo, np.tile(ends - 1, rows), (rows, width))
    best = np.full((rows, width), math.inf)
    best[:, 0] = 0.0
    yield best
    for stage, speed in enumerate(speeds):
        offset = first / speed
        best = windows[speed].of(best + cuts[stage] - offset, 0.0).reshape(rows, width) + offset
        yield best


def stage_cuts(model: CostModel, costs: SizeCosts, interleave: int, devices: int) -> np.ndarray:
    """``[s, a]``: at least what the cut into stage ``s`` at position ``a`` (0 … L) copies,
    forward and back, in any round-robin split over ``k ≤ devices`` devices with more than ``s``
    stages (it joins devices ``(s-1) % k`` and ``s % k``): the least latency of those pairs, both
    ways, plus the bytes at their least ms per byte; 0 into stage 0 and at the ends."""
    stages = devices * interleave
    cuts = np.zeros((max(stages, 1), len(costs.input_bytes) + 1))
    if devices < 2:
        return cuts
    into = np.arange(1, stages)[:, None]
    counts = np.arange(2, devices + 1)[None, :]
    before, after = (into - 1) % counts, into % counts
    apart = counts * interleave > into  # splits over that many devices have such a stage
    latency, per_byte = (np.min(np.where(apart, table[before, after] + table[after, before], math.inf), axis=1)
                         for table in (model.latency, model.per_byte))
    cuts[1:] = _input_copies(costs, latency, per_byte)
    cuts[:, 0] = 0.0  # the batch's input is not a cut
    return cuts


def copies_between(model: CostModel, costs: SizeCosts, src: np.ndarray, dst: np.ndarray) -> np.ndarray:
    """``[i, a]``: the copy of the main input at position ``a`` (0 … L) from device ``src[i]``
    to ``dst[i]`` (nothing where no bytes cross)."""
    return _input_copies(costs, model.latency[src, dst], model.per_byte[src, dst])


def _input_copies(costs: SizeCosts, latency: np.ndarray, per_byte: np.ndarray) -> np.ndarray:
    """``[i, a]``: the main input at position ``a`` (0 … L) copied at ``latency[i]`` plus its
    bytes at ``per_byte[i]`` (nothing where no bytes cross)."""
    nbytes = np.append(costs.input_bytes, 0.0)
    return np.where(nbytes > 0, latency[:, None] + nbytes * per_byte[:, None], 0.0)


def cheapest_ring_cuts(model: CostModel, costs: SizeCosts, devices: int, interleave: int) -> np.ndarray:
    """``[phase, k - 2, ·]`` for the forward and backward phase and ``k = 2 … devices``: the
    least sum of the copies at the ``k · interleave - 1`` cuts of a round-robin split over ``k``
    devices, and the least largest of them.  Cuts lie at distinct positions, each paying at
    least the least copy there of its ring's pairs ``(i, i+1)`` and ``(k-1, 0)`` (with one copy
    fit for every pair, that copy)."""
    first, later = np.zeros(devices - 1, dtype=np.intp), np.arange(1, devices)
    rings = (((later - 1, later), (later, first)), ((later, later - 1), (first, later)))  # copies, then gradients
    if uniform(model.latency, model.per_byte):
        rings = tuple(((first[:1], later[:1]), (first[:1], later[:1])) for _ in range(2))
    out = np.zeros((2, devices - 1, 2))
    counts = np.arange(2, devices + 1) * interleave - 1
    for phase, (chain, closing) in enumerate(rings):
        # row k - 2: the least copy at each cut position over the ring of k devices (one row for all)
        least = np.minimum(np.minimum.accumulate(copies_between(model, costs, *chain)[:, 1:-1], axis=0),
                           copies_between(model, costs, *closing)[:, 1:-1])
        width = min(int(counts[-1]), least.shape[1])
        if not width:
            continue
        smallest = np.sort(np.partition(least, width - 1, axis=1)[:, :width], axis=1)
        smallest = np.broadcast_to(smallest, (devices - 1, width))
        taken, rows = np.minimum(counts, width) - 1, np.arange(devices - 1)
        out[phase, :, 0] = np.cumsum(smallest, axis=1)[rows, taken]
        out[phase, :, 1] = smallest[rows, taken]  # with fewer positions than cuts no split exists
    return out
