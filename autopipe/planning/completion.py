"""What the layers after a cut can still cost, for a grid of caps on the lanes: the lower bound
of the planner's search, and plans that bound the optimum from above.

For caps ``(x, y)`` on every stage's forward and backward lane, the least lane sum of covering
layers ``[p, L)`` with stages on devices ``d, d+1, …`` is a min-sum DP, one range minimum per
device: compute at each device's speed, and at every cut the copies of the main input to the
next device and of its gradient back — a relaxation of the cost model (memory limits are
ignored, skips only add copies).  A partial plan with lanes ``X, M`` and lane sum ``S`` whose
next stage starts at ``p`` on device ``d`` then finishes no faster than

    S + (copy of p's input) + min over cells [rest(cell, d, p) + (m-1)·max(X, x⁻) + w·max(M, y⁻)]

where ``x⁻, y⁻`` are the caps one level below the cell's (a completion whose largest lanes are
``x' ≤ x`` and ``y' ≤ y`` either has ``x' > x⁻`` and ``y' > y⁻``, or lies in a lower cell) and
``w = m-1`` (``m-2`` with ``except_last``, as ``V ≥ (m-2)·M``).  Unlike a bound from averages
this sees that moving cuts to cheap copies unbalances the lanes, and that a plan lagging behind
needs larger lanes to finish on the devices left.  The bound is as tight as the grid is fine
where the best plans' lanes are, so :func:`grid_levels` places the levels densely
around a known plan.  Walking the DP's minima from the first layer gives a plan per cell.

With per-pair copies a skip's cost depends on the devices of both its stash and its pop, and
the DP, which does not know where the stash went when it prices the pop, charges the least
copy from any device that could hold it (:class:`_Sources`): far below what plans pay, which
cannot put every stash on its cheapest source at once.  Potentials ``λ[t, s]`` (Lagrangian
multipliers) move part of that cost to the stash: a stage on device ``s`` that stashes skip
``t`` and sends it on pays ``λ[t, s]``, the pop on ``d`` pays ``min_s' (copy(t, s', d) −
λ[t, s'])``; the two add up to at most the copy whatever the potentials, so every bound
holds, and the right potentials make the cheap source dear.  :meth:`Completions.directions`
gives the subgradient along each cell's plan; :mod:`autopipe.planning.refinement` steps the
potentials as it refines.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from ._arrays import RangeMin, power_spans, ragged_arange
from .candidates import Candidate, reach

__all__ = ["Completions", "grid_levels"]

# Relative levels, the most wanted first: before a plan is known, above the least possible lane;
# then around a plan's lanes, densest just around them (where a completion trades a little lane
# for other copies), and up to the cap (a wide top cell would bound all the plans it holds by
# its lower edge).
_FIRST = np.array([0.0, 0.1, 0.03, 0.3])
_AROUND = np.array([0.0, -1 / 32, 1 / 32, 1 / 4, -1 / 16, 1 / 16, -1 / 64, 1 / 64, 1 / 8, -1 / 8])
# Most floats a grid may hold (8 bytes each): its table and a few arrays of the same size per device.
_BUDGET = 8_000_000
# Levels a lane of the coarse grid, before a plan is known: _COARSE, one more on chains of at
# most _SHORT layers.  A DP costs a part per device whatever the cells and a part per cell that
# grows with the layers: with per-pair copies and skips, at 400 layers x 32 devices 5 x 5 cells
# cost 5-30% more than 4 x 4 and left a gap of 1.8-2.1% after 1 s where 4 x 4 left 2.6-4.3% (8
# runs each, alternating); at 1,000 x 64, where a cell costs a larger share of the DP, 5 x 5
# cost 5-60% more and did no better (5.6-6.3% against 5.3-9.2%).
_COARSE = 4
_SHORT = 500
# Levels a lane of a first grid around lanes guessed from another micro-batch count's plan (mixed
# speeds, no skips to pay for; autopipe.planning.solver._guess): at
# 1,000 layers x 64 devices of speeds 1, 1.5 and 2 the bound came within 2% of the plan after 14-17
# refinement steps where the coarse grid took 45 (4 levels: 37; 5 levels fell short of 6).
_GUESSED = 6
# Most cells × skip entries × devices whose skips' sources are ranged per cell (else for all cells at once).
_SOURCES = 300_000
# Ratio of the levels beyond the last relative one, up to the cap: fine enough for unequal speeds,
# where moving work to faster devices trades lane sum for larger lanes over a wide range.
_FAR = 1.2


class Completions:
    """The DP of the module docstring for one :class:`~autopipe.planning.candidates.Candidate`
    over cells of caps: cell ``i`` holds the plans whose largest lanes lie in
    ``(low_x[i], cap_x[i]] × (low_y[i], cap_y[i]]``.  A grid ``xs × ys`` (:meth:`grid`) also
    bounds partial plans (:meth:`lower_bound`); any cells bound whole plans (:meth:`cell_bounds`),
    their skips charged with ``potentials`` ``[t, s]`` (the module docstring; default 0)."""

    def __init__(self, candidate: Candidate, speeds: np.ndarray, cells: tuple[np.ndarray, ...],
                 levels: tuple[np.ndarray, np.ndarray] | None = None, skips: bool = False,
                 potentials: np.ndarray | None = None) -> None:
        self.candidate = candidate
        self.skips = skips and candidate.pays_skips  # charge the skips a stage receives
        self.speeds = speeds
        self.cap_x, self.cap_y, self.low_x, self.low_y = cells
        self.lows = levels  # a grid's lower caps per lane, for lower_bound
        self.work = candidate.costs.forward + candidate.back
        self.windows: dict[float, _Windows] = {}
        self.entries = _entries(candidate) if self.skips else None
        self.potentials = np.zeros(candidate.receive.shape[:2]) if potentials is None else potentials
        self.sources = None if self.entries is None else _Sources.of(candidate, self.entries, speeds, self.cap_x,
                                                                     self.cap_y, self.potentials)
        self.held = self._held() if self.skips else None
        self.stage: tuple[tuple[np.ndarray, np.ndarray], np.ndarray] | None = None
        self.walks: dict[int, tuple[tuple[int, ...], np.ndarray]] = {}  # by cell, :meth:`_walk`'s
        self.rest = self._rest()
        self.floor = float(np.min(self.rest[0, :, 0]))  # the least lane sum of any plan within the largest caps

    @staticmethod
    def grid(candidate: Candidate, speeds: np.ndarray, xs: np.ndarray, ys: np.ndarray,
             skips: bool = False, potentials: np.ndarray | None = None) -> Completions:
        """The cells of the grid of caps ``xs × ys`` (increasing, the last possibly ``inf``),
        each reaching down to the level below (the floors below the first); ``skips``: charge
        the skips each stage receives (bounds of whole plans only, see :class:`_Windows`)."""
        floor_x, floor_y = candidate.floors
        lows = np.concatenate(([floor_x], xs[:-1])), np.concatenate(([floor_y], ys[:-1]))
        cells = np.repeat(xs, len(ys)), np.tile(ys, len(xs)), np.repeat(lows[0], len(ys)), np.tile(lows[1], len(xs))
        return Completions(candidate, speeds, cells, lows, skips, potentials)

    def cell_bounds(self) -> np.ndarray:
        """Per cell, a lower bound on the time of every plan in it: ``rest + (m-1)·x⁻ + w·y⁻``
        (``inf`` where no plan fits its caps)."""
        weight_x, weight_m = self.candidate.weights
        return self.rest[0, :, 0] + weight_x * self.low_x + weight_m * self.low_y

    def _rest(self) -> np.ndarray:
        """``rest[d, cell, p]``: the least lane sum of stages on devices ``d, d+1, …`` covering
        ``[p, L)`` within the cell's caps (``inf`` if they cannot), device by device from the last.
        Where skips are charged (bounds of whole plans only) also ``inf`` where devices ``0 … d-1``
        cannot cover ``[0, p)`` within the caps (:meth:`_band`): no plan of the cell gets there."""
        devices, layers = len(self.speeds), len(self.work) - 1
        rest = np.empty((devices + 1, len(self.cap_x), layers + 1))
        rest[devices] = math.inf
        rest[:, :, layers] = 0.0
        for device in range(devices - 1, -1, -1):
            speed = float(self.speeds[device])
            window = self._window(speed)
            band = self._band(device) if self.skips else None
            extent = window.extent(band)
            if extent is None:  # no plan of any cell starts a stage on this device
                rest[device, :, :layers] = math.inf
                continue
            charge = None if self.sources is None else self.sources.charges(device, extent.entries)
            stage, start = self._stage(device), self.work[:layers] / speed
            if self.held is not None:
                stage, start = stage + self.held[device], start + self.held[device, :layers]
            np.subtract(window.least(stage, rest[device + 1], charge, band, extent), start,
                        out=rest[device, :, :layers])
        return rest

    def _band(self, device: int) -> tuple[np.ndarray, np.ndarray]:
        """Per cell, the first and last start ``p`` of a stage on ``device`` in a plan within
        the cell's caps: devices ``0 … d-1`` hold ``[0, p)``, a layer at least each and at most
        a cap's work at their speed; devices ``d …`` hold ``[p, L)`` likewise.  Only this band
        needs the DP: at 400 layers × 32 devices, 8-16% of the starts in the cells of least
        bound (rounding widens it)."""
        before, after = float(np.sum(self.speeds[:device])), float(np.sum(self.speeds[device:]))
        slack = 1 + 1e-6
        lanes = ((self.candidate.costs.forward, self.cap_x), (self.candidate.back, self.cap_y))
        last = np.min([np.searchsorted(prefix, cap * before * slack, side="right") - 1 if before else
                       np.zeros(len(cap), dtype=np.intp) for prefix, cap in lanes], axis=0)
        first = np.max([np.searchsorted(prefix, prefix[-1] - cap * after * slack, side="left")
                        for prefix, cap in lanes], axis=0)
        return np.maximum(first, device), last

    def _held(self) -> np.ndarray:
        """Per device and position ``q``: the potentials there of the skips stashed before
        ``q`` less those of the skips popped before ``q``, so that a stage ``[p, q)`` pays the
        difference: the potential of each skip it stashes and sends on (one it also pops costs
        nothing; :class:`_Sources` gives the potential of what it pops back)."""
        candidate = self.candidate
        steps = np.zeros((len(self.work) + 1, len(self.speeds)))
        np.add.at(steps, candidate.skip_stash + 1, self.potentials)
        np.subtract.at(steps, candidate.skip_pop + 1, self.potentials)
        return np.cumsum(steps[:-1], axis=0).T

    def _stage(self, device: int) -> np.ndarray:
        """Per cell, what a stage on ``device`` ending at each position costs beyond its start:
        its work to there at the device's speed plus the copies of the cut there to the next
        device and back, ``inf`` where either copy exceeds the cell's cap (the copies reused
        while the devices' copy costs are alike)."""
        copies = self.candidate.copy_forward[device], self.candidate.copy_back[device]
        if self.stage is None or not all(np.array_equal(a, b) for a, b in zip(copies, self.stage[0])):
            self.stage = copies, _cut(*copies, self.cap_x[:, None], self.cap_y[:, None])
        return self.stage[1] + self.work / float(self.speeds[device])

    def _window(self, speed: float) -> _Windows:
        """The stops ``(p, reach]`` a stage from each ``p`` may end at on a device of ``speed``."""
        if speed not in self.windows:
            candidate = self.candidate
            starts = np.arange(len(self.work) - 1)
            last = np.minimum(reach(candidate.costs.forward, starts, self.cap_x[:, None] * speed),
                              reach(candidate.back, starts, self.cap_y[:, None] * speed))
            self.windows[speed] = _Windows(last, candidate, self.entries)
        return self.windows[speed]

    def least(self) -> float:
        """A lower bound on the time of every plan within the largest caps."""
        return float(np.min(self.cell_bounds()))

    def lower_bound(self, device: int, starts: np.ndarray, x: np.ndarray, peak: np.ndarray) -> np.ndarray:
        """The least over cells of the module docstring's completion time (without ``S`` and
        the copy into ``starts``), for partial plans whose next stage runs on ``device``.  With
        ``a`` the x-levels whose lower cap is at most ``X`` (so ``max(X, x⁻) = X`` in their
        cells) and ``b`` likewise for ``M``, the cells split into four blocks, each the least
        of a table over the grid that running minima make once per start, not per plan."""
        assert self.lows is not None and not self.skips, "lower_bound needs a grid that charges no skips"
        (weight_x, weight_m), (low_x, low_y) = self.candidate.weights, self.lows
        positions, at = np.unique(starts, return_inverse=True)
        rest = self.rest[device][:, positions].reshape(len(low_x), len(low_y), -1)
        by_x, by_y = low_x[:, None, None] * weight_x, low_y[None, :, None] * weight_m
        below_x, below_y = np.minimum.accumulate(rest, axis=0), np.minimum.accumulate(rest, axis=1)
        both_below = _padded(np.minimum.accumulate(below_x, axis=1))
        above_y, above_x = _padded(_suffix_min(below_x + by_y, 1)), _padded(_suffix_min(below_y + by_x, 0))
        both_above = _padded(_suffix_min(_suffix_min(rest + by_x + by_y, 0), 1))
        a, b = np.searchsorted(low_x, x, side="right"), np.searchsorted(low_y, peak, side="right")
        return np.minimum(np.minimum(both_below[a - 1, b - 1, at] + weight_x * x + weight_m * peak,
                                     above_y[a - 1, b, at] + weight_x * x),
                          np.minimum(above_x[a, b - 1, at] + weight_m * peak, both_above[a, b, at]))

    def plans(self, count: int) -> list[tuple[int, ...]]:
        """The stage bounds of the DP's plan in the ``count`` cells whose caps promise the least
        time at most (``rest + (m-1)·x + w·y``) and the ``count`` of least lower bound."""
        weight_x, weight_m = self.candidate.weights
        rest = self.rest[0, :, 0]
        promise = rest + (weight_x * self.cap_x if weight_x else 0.0) + (weight_m * self.cap_y if weight_m else 0.0)
        least = self.cell_bounds()
        cells = dict.fromkeys(int(c) for order in (np.argsort(promise), np.argsort(least)) for c in order[:count]
                              if math.isfinite(rest[c]))
        return [self._walk(cell)[0] for cell in cells]

    def directions(self, cells: np.ndarray) -> np.ndarray:
        """Per cell of ``cells``, ``[t, s]``: how the potentials would raise its bound fastest
        (a subgradient ``g``, as ``g / |g|²``: a Polyak step then scales it by the gap).  Along
        the DP's plan each skip ``t`` popped by a later stage is charged from one source ``s'``
        while its stash lies on device ``s``: raising the potential of ``(t, s)`` and lowering
        that of ``(t, s')`` charges more for that plan."""
        directions = np.zeros((len(cells), *self.candidate.receive.shape[:2]))
        stash = self.candidate.skip_stash
        for row, cell in enumerate(cells):
            bounds, sources = self._walk(int(cell))
            popped = np.flatnonzero(sources >= 0)
            holder = np.searchsorted(np.asarray(bounds), stash[popped], side="right") - 1
            np.add.at(directions[row], (popped, holder), 1.0)
            np.subtract.at(directions[row], (popped, sources[popped]), 1.0)
        norms = np.sum(directions ** 2, axis=(1, 2))
        return directions / np.maximum(norms, 1.0)[:, None, None]

    def _walk(self, cell: int) -> tuple[tuple[int, ...], np.ndarray]:
        """Follow the DP's minima of ``cell`` from the first layer on device 0, skips charged
        as the DP charged them: the stage bounds, and per skip the source its pop was charged
        from (-1: none was).  Kept per cell: the cell of least bound gives both a direction
        and a plan (:meth:`directions`, :meth:`plans`)."""
        if cell not in self.walks:
            self.walks[cell] = self._follow(cell)
        return self.walks[cell]

    def _follow(self, cell: int) -> tuple[tuple[int, ...], np.ndarray]:
        """:meth:`_walk`, worked out."""
        layers = len(self.work) - 1
        bounds = [0]
        sources = np.full(len(self.candidate.skip_pop), -1)
        for device, speed in enumerate(self.speeds):
            start = bounds[-1]
            if start == layers:
                break
            stops = np.arange(start + 1, self._window(float(speed)).hi[cell, start] + 1)
            cut = _cut(self.candidate.copy_forward[device, stops], self.candidate.copy_back[device, stops],
                       self.cap_x[cell], self.cap_y[cell])
            values = self.work[stops] / speed + cut + self.rest[device + 1, cell, stops]
            popped, source = self._popped(device, cell, start, stops, values)
            stop = int(stops[np.argmin(values)])
            done = popped[1] < stop
            sources[popped[0][done]] = source[done]
            bounds.append(stop)
        return tuple(bounds), sources

    def _popped(self, device: int, cell: int, start: int, stops: np.ndarray,
                values: np.ndarray) -> tuple[tuple[np.ndarray, np.ndarray], np.ndarray]:
        """Add to ``values`` what a stage of ``cell`` on ``device`` from ``start`` to each of
        ``stops`` pays for its skips beyond the compute and cut (:meth:`_rest`); return the
        skips open at ``start``, their pops and the source each is charged from."""
        if self.held is None or self.sources is None or self.entries is None:
            return (np.zeros(0, dtype=int), np.zeros(0, dtype=int)), np.zeros(0, dtype=int)
        values += self.held[device, stops]
        skip, at = self.entries
        entries = np.arange(*np.searchsorted(at, [start, start + 1]))
        charge, source = self.sources.pick(device, cell, entries)
        pops = self.candidate.skip_pop[skip[entries]]
        paid = np.concatenate(([0.0], np.cumsum(charge)))
        values += paid[np.searchsorted(pops, stops, side="left")]
        return (skip[entries], pops), source


def grid_levels(candidate: Candidate, devices: int, caps: tuple[float, float],
                lanes: tuple[float, float] | None, guessed: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """The levels per lane of a grid (:meth:`Completions.grid`) from the least possible lanes
    (``candidate.floors``) to ``caps``: a coarse one (:data:`_COARSE` levels a lane, one more up
    to :data:`_SHORT` layers) from :data:`_FIRST` above the floors, or one from :data:`_AROUND`
    the lanes ``(X, M)`` of a plan, with as many levels as :data:`_BUDGET` allows
    (:data:`_GUESSED` if the lanes are ``guessed``); a lane whose weight is 0 gets only its cap."""
    count = max(int(math.sqrt(_BUDGET / ((devices + 6) * len(candidate.back)))), 1)
    if lanes is None:
        count = min(count, _COARSE + (len(candidate.back) <= _SHORT + 1))
    elif guessed:
        count = min(count, _GUESSED)
    x, y = (_levels(floor, cap, lane, weight, count)
            for floor, cap, lane, weight in zip(candidate.floors, caps, lanes or (None, None), candidate.weights))
    return x, y


def _suffix_min(values: np.ndarray, axis: int) -> np.ndarray:
    """The least of each entry and those after it along ``axis``."""
    return np.flip(np.minimum.accumulate(np.flip(values, axis), axis=axis), axis)


def _padded(table: np.ndarray) -> np.ndarray:
    """``table`` with a last row and column of ``inf``: what index ``-1`` and one past the end read."""
    padded = np.full((table.shape[0] + 1, table.shape[1] + 1, table.shape[2]), math.inf)
    padded[:-1, :-1] = table
    return padded


def _cut(forward: np.ndarray, back: np.ndarray, cap_x: np.ndarray | float, cap_y: np.ndarray | float) -> np.ndarray:
    """The copies of a cut both ways, ``inf`` where either exceeds its lane's cap."""
    return np.where((forward <= cap_x) & (back <= cap_y), forward + back, math.inf)


def _levels(floor: float, cap: float, lane: float | None, weight: float, count: int) -> np.ndarray:
    """At most ``count`` increasing caps ending at ``cap``: the first that lie in ``(floor, cap)``
    of :data:`_FIRST` above ``floor`` or :data:`_AROUND` ``lane``, its first four followed by
    levels :data:`_FAR` times the one before up to ``cap``; only ``cap`` for a lane that does
    not count (``weight`` 0)."""
    base, relative = (floor, _FIRST) if lane is None else (lane, _AROUND)
    top = base * (1 + relative.max())
    far = top * _FAR ** np.arange(1, max(math.ceil(math.log(cap / top, _FAR)), 1) if 0 < top < cap < math.inf else 1)
    wanted = np.concatenate((base * (1 + relative[:4]), far, base * (1 + relative[4:])))
    wanted = wanted[(floor < wanted) & (wanted < cap)] if weight > 0 else wanted[:0]
    first = np.sort(np.unique(wanted, return_index=True)[1])[: count - 1]
    return np.append(np.sort(wanted[first]), cap)


def _entries(candidate: Candidate) -> tuple[np.ndarray, np.ndarray]:
    """The skips open at each start ``p`` (stashed before ``p``, popped at or after it) as
    entries ``(skip, p)``, sorted by ``p`` and then pop."""
    stash, pop = candidate.skip_stash, candidate.skip_pop
    lengths = pop - stash
    skip = np.repeat(np.arange(len(pop)), lengths)
    at = np.repeat(stash + 1, lengths) + ragged_arange(lengths)
    order = np.lexsort((pop[skip], at))
    return skip[order], at[order]


class _Sources:
    """Per cell and entry ``(skip t, start p)`` (:func:`_entries`), the least that the stage on
    device ``d`` starting at ``p`` pays to receive ``t`` in a plan of the cell: the least copy
    from a device that can hold ``t``'s stash ``a`` there.  Within the cell's caps ``(x, y)``,
    devices ``0 … s`` must cover layers ``[0, a]`` and devices ``s … d-1`` layers ``[a, p)``,
    each device ``j`` at most ``x·v_j`` of forward and ``y·v_j`` of backward work and at least
    one layer; so ``s`` lies in a range, narrow where the caps are tight and the work between
    the two ends fills the devices between."""

    @staticmethod
    def of(candidate: Candidate, entries: tuple[np.ndarray, np.ndarray], speeds: np.ndarray, cap_x: np.ndarray,
           cap_y: np.ndarray, potentials: np.ndarray) -> _Sources:
        """The ranges of each cell, or where there are more than :data:`_SOURCES` cells ×
        entries × devices, of the largest caps for all cells (wider: as valid, cheaper)."""
        if len(cap_x) * len(entries[0]) * len(speeds) > _SOURCES:
            cap_x, cap_y = np.array([np.max(cap_x)]), np.array([np.max(cap_y)])
        return _Sources(candidate, entries, speeds, cap_x, cap_y, potentials)

    def __init__(self, candidate: Candidate, entries: tuple[np.ndarray, np.ndarray], speeds: np.ndarray,
                 cap_x: np.ndarray, cap_y: np.ndarray, potentials: np.ndarray) -> None:
        skip, at = entries
        stash = candidate.skip_stash[skip]
        loose = 1 + 1e-9  # never narrower than exact: rounding widens the range
        lanes = ((candidate.costs.forward, cap_x), (candidate.back, cap_y))
        self.prefix = np.concatenate(([0.0], np.cumsum(speeds)))  # speed of devices 0 … i-1
        # the least source: devices 0 … s hold at least the work of [0, a]
        need = np.max([prefix[stash + 1][None, :] / (cap[:, None] * loose) for prefix, cap in lanes], axis=0)
        self.low = np.maximum(np.searchsorted(self.prefix, need, side="left") - 1, 0)
        # devices s … d-1 hold at least the work of [a, p)
        self.span = np.max([(prefix[at] - prefix[stash])[None, :] / (cap[:, None] * loose) for prefix, cap in lanes],
                           axis=0)
        self.stash, self.at, self.skip = stash, at, skip
        self.potentials = potentials
        # [d, t, s]: a copy less its source's potential, each device's rows together (read a device at a time)
        self.less = np.subtract(candidate.receive.transpose(2, 0, 1), potentials, order="C")
        self.table = power_spans(self.less, np.minimum, math.inf, axis=2)  # [level, d, t, s]
        self.log2 = np.floor(np.log2(np.arange(1, len(speeds) + 2))).astype(np.intp)  # of each range length
        # at one speed, s … d-1 hold that work when there are at least this many of them
        self.count = np.ceil(self.span / speeds[0] - 1e-9).astype(np.intp) if np.ptp(speeds) == 0 else None

    def charges(self, device: int, entries: slice) -> np.ndarray:
        """Per cell (or one row for all) and entry of ``entries``: the least copy of the entry's
        skip to ``device`` from a source in its range less the source's potential, plus
        ``device``'s own (``inf`` where no source is).  Any potentials keep the bound: the stage
        holding the stash pays its device's (:meth:`Completions._held`), and that plus what the
        pop is charged is at most the copy (the module docstring)."""
        low, high = self._range(device, slice(None), entries)
        empty = high < low
        level = self.log2[np.maximum(high - low + 1, 1) - 1]
        _, devices, skips, sources = self.table.shape
        skip = self.skip[entries]
        rows = ((level * devices + device) * skips + skip) * sources
        flat = self.table.ravel()
        least = np.minimum(flat.take(rows + np.where(empty, 0, low)),
                           flat.take(rows + np.where(empty, 0, high - (1 << level) + 1)))
        return np.where(empty, math.inf, least + self.potentials[skip, device])

    def pick(self, device: int, cell: int, entries: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """:meth:`charges` of some ``entries`` in one ``cell``, and the source each is charged from."""
        low, high = self._range(device, cell if len(self.low) > 1 else 0, entries)
        skip, sources = self.skip[entries], np.arange(self.less.shape[2])
        values = np.where((sources >= low[:, None]) & (sources <= high[:, None]), self.less[device, skip], math.inf)
        source = np.argmin(values, axis=1)
        return values[np.arange(len(entries)), source] + self.potentials[skip, device], source

    def _range(self, device: int, row: int | slice, entries: np.ndarray | slice) -> tuple[np.ndarray, np.ndarray]:
        """The first and last device that may hold each entry's stash when ``device`` pops it
        (none where the last is before the first)."""
        span, stash = self.span[row, entries], self.stash[entries]
        if self.count is not None:
            high = device - self.count[row, entries]
        else:
            reach = self.prefix[device] * (1 + 1e-12) - span  # rounding widens the range
            high = np.searchsorted(self.prefix, reach, side="right") - 1
        high = np.minimum(np.minimum(high, device - 1), stash)  # a device holds a layer at least
        return np.maximum(self.low[row, entries], device - (self.at[entries] - stash)), high


@dataclass(frozen=True)
class _Extent:
    """What the DP of one device reads (:meth:`_Windows.extent`): the first and last stop of its
    stages' windows, and the entries (:func:`_entries`) of skips open at their starts."""

    columns: tuple[int, int]
    entries: slice


class _Windows:
    """For every cell and start ``p``, the least over stops ``q`` in ``(p, hi[cell, p]]`` of a
    table's ``[cell, q]`` — plus, given the ``entries`` of skips to charge (:func:`_entries`),
    what the stage ``[p, q)`` at least pays to receive the skips it pops (:class:`_Sources`)
    for each skip ``t`` stashed before ``p`` and popped in ``[p, q)`` (each skip that crosses a
    cut is received once, by the stage that pops it).  That charge only steps up with ``q``,
    where a skip open at ``p`` is popped, so each window splits into a few ranges of one charge
    each."""

    def __init__(self, hi: np.ndarray, candidate: Candidate, entries: tuple[np.ndarray, np.ndarray] | None) -> None:
        self.hi = hi
        cells, starts = hi.shape
        cell, start = np.divmod(np.arange(hi.size), starts)
        self.skips = None
        self.at: np.ndarray | None = None  # the start of each entry, where skips are charged
        if entries is None or not len(entries[0]):
            self.ranges = RangeMin(cell, start + 1, hi.ravel(), (cells, starts + 1))
            return
        skip, at = entries
        self.at = at
        steps = candidate.skip_pop[skip] + 1  # where the charge of each steps up: the first stop past its pop
        first = np.searchsorted(at, np.arange(starts + 1))
        # per (cell, p): the steps inside its window, and one range more than steps
        inside = np.searchsorted(at * (starts + 2) + steps, start * (starts + 2) + hi.ravel(), side="right")
        count = inside - first[start] + 1
        part = ragged_arange(count)
        which = np.repeat(first[start], count) + part  # the step that ends each range (one past for the last)
        last = part == np.repeat(count - 1, count)
        q_start = np.repeat(start, count)
        lo = np.where(part == 0, q_start + 1, steps[np.maximum(which - 1, 0)])
        top = np.where(last, np.repeat(hi.ravel(), count), steps[np.minimum(which, len(steps) - 1)] - 1)
        self.ranges = RangeMin(np.repeat(cell, count), lo, top, (cells, starts + 1))
        ends = np.concatenate(([0], np.cumsum(count)))  # each (cell, p)'s first range, and one past the last
        self.skips = (np.repeat(cell, count), np.repeat(first[start], count), which, ends[:-1], ends)

    def extent(self, band: tuple[np.ndarray, np.ndarray] | None) -> _Extent | None:
        """What the starts in ``band`` (per cell: first, last; every start without) read: the
        stops of their windows and the entries open at them; ``None`` if no cell has a start."""
        cells, starts = self.hi.shape
        if band is None:
            return _Extent((0, starts), slice(None))
        first, last = np.maximum(band[0], 0), np.minimum(band[1], starts - 1)
        some = first <= last
        if not np.any(some):
            return None
        lo, hi = int(np.min(first[some])), int(np.max(last[some]))
        top = int(np.max(self.hi[:, lo:hi + 1]))
        if self.at is None:
            return _Extent((lo + 1, max(top, lo + 1)), slice(0, 0))
        begin, end = np.searchsorted(self.at, [lo, hi + 1])
        return _Extent((lo + 1, max(top, lo + 1)), slice(int(begin), int(end)))

    def least(self, values: np.ndarray, plus: np.ndarray, charge: np.ndarray | None,
              band: tuple[np.ndarray, np.ndarray] | None, extent: _Extent) -> np.ndarray:
        """Per ``(cell, p)``: the least over its window of ``values + plus`` and, given the
        ``charge`` of each cell and entry of ``extent`` (:class:`_Sources`, :meth:`extent` of
        ``band``), what its skips cost; only for the starts ``p`` in each cell's ``band``
        (first, last; all without), ``inf`` elsewhere."""
        groups, queries, ends = self._within(band)
        least = self.ranges.of(values, plus, queries, extent.columns)
        if self.skips is not None and charge is not None:
            cell, begin, which = (part if queries is None else part[queries] for part in self.skips[:3])
            offset = extent.entries.start or 0  # the charges are of these entries only
            begin, which = begin - offset, which - offset
            zeros = np.zeros((len(charge), 1))
            paid = np.concatenate((zeros, np.cumsum(np.where(np.isinf(charge), 0.0, charge), axis=1)), axis=1)
            blocked = np.concatenate((zeros, np.cumsum(np.isinf(charge), axis=1)), axis=1)  # no source can send it
            row = cell if len(charge) > 1 else 0
            cost = paid[row, which] - paid[row, begin]
            cost = np.where(blocked[row, which] > blocked[row, begin], math.inf, cost)
            least = np.minimum.reduceat(least + cost, ends) if len(least) else least
        if groups is None:
            return least.reshape(self.hi.shape)
        out = np.full(self.hi.size, math.inf)
        out[groups] = least
        return out.reshape(self.hi.shape)

    def _within(self, band: tuple[np.ndarray, np.ndarray] | None) -> tuple[np.ndarray | None, ...]:
        """The ``(cell, p)`` (flat) in ``band``, their queries (ranges, :class:`RangeMin`) and
        where each one's first lies among those; all ``None`` for every ``(cell, p)``."""
        if band is None:
            return None, None, None if self.skips is None else self.skips[3]
        cells, starts = self.hi.shape
        first = np.arange(cells) * starts + np.clip(band[0], 0, starts)
        count = np.maximum(np.arange(cells) * starts + np.clip(band[1] + 1, 0, starts) - first, 0)
        groups = np.repeat(first, count) + ragged_arange(count)
        if self.skips is None:
            return groups, groups, None
        offsets = self.skips[4]
        per_group = offsets[groups + 1] - offsets[groups]
        queries = np.repeat(offsets[groups], per_group) + ragged_arange(per_group)
        return groups, queries, np.concatenate(([0], np.cumsum(per_group)[:-1])).astype(np.intp)
