"""What the planner's searches share: a :class:`Candidate` ``(chunks, mode)`` with what does not
depend on the split, the :class:`Choice` a search returns, and split helpers (:func:`reach`, the
greedy split and the min-max bisection, also used by :mod:`autopipe.planning.compare`)."""
from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property
from typing import Callable, Sequence

import numpy as np

from .._vocab import CheckpointMode
from .cost import CostModel, SizeCosts, effective_mode

__all__ = ["Candidate", "Choice", "better", "filled", "greedy_split", "least_feasible", "least_largest", "reach"]


@dataclass(frozen=True)
class Choice:
    """The best plan the search found: stage bounds, chunks, checkpoint mode, its time, its
    stages per device (:mod:`autopipe.planning.interleaved`), its schedule, the turn rule of
    its shared devices and, where a simulation priced it, the forward and backward phases that
    simulation gave (so that assembling the plan does not run it again: at 1,000 layers it
    takes a tenth of a second)."""

    bounds: tuple[int, ...]
    chunks: int
    mode: CheckpointMode
    iteration_ms: float
    interleave: int = 1
    schedule: str = "gpipe"
    turns: str = "depth_first"
    phases: tuple[float, float] | None = None


def better(best: Choice | None, other: Choice | None) -> Choice | None:
    """The faster of two plans, ``best`` on a tie."""
    if best is None or other is not None and other.iteration_ms < best.iteration_ms:
        return other
    return best


@dataclass(frozen=True)
class Candidate:
    """A ``(chunks, mode)`` pair and what does not depend on the split: the prefix sums of its
    forward lane (``costs.forward``) and backward lane with recomputation (``back``); row ``d``
    of ``copy_forward`` and ``copy_back``: the copy of a cut at each position from device ``d``
    to ``d + 1`` (its main input) and back (that input's gradient), 0 at both ends; the least
    possible largest forward and backward compute lanes (``floors``); their weights ``(m-1, w)``
    in the time; all work at the top speed; a lower bound on its time (``lower_bound``); the
    skips' stash and pop layers and what each device pays to receive each from each earlier
    device (:attr:`receive`)."""

    lower_bound: float
    chunks: int
    mode: CheckpointMode
    effective: CheckpointMode
    costs: SizeCosts
    back: np.ndarray
    copy_forward: np.ndarray
    copy_back: np.ndarray
    floors: tuple[float, float]
    weights: tuple[int, int]
    work: float
    skip_stash: np.ndarray
    skip_pop: np.ndarray
    sized: _Sized

    @staticmethod
    def all(model: CostModel, counts: Sequence[int], modes: Sequence[CheckpointMode], devices: int) -> list[Candidate]:
        """:meth:`of` every count with every mode; what does not depend on the mode is worked out
        once per count (at 1000 layers × 64 devices, 30 candidates: 0.04 s of CPU where building
        each alone took 0.07 s, beyond the costs at each size)."""
        return [Candidate.of(model, chunks, mode, devices, sized)
                for chunks in counts for sized in [_Sized.of(model, chunks, devices)] for mode in modes]

    @staticmethod
    def of(model: CostModel, chunks: int, mode: CheckpointMode, devices: int,
           sized: _Sized | None = None) -> Candidate:
        """``lower_bound``: ``S + (m-1)·X + V ≥`` the least over stage counts ``k`` of the
        ``k - 1`` cheapest cuts plus, per lane, :func:`filled` on the first ``k`` devices: the
        least compute sum when no stage's lane exceeds ``X`` plus ``(m-1)·X`` (``w·M`` for
        the backward lane, ``w`` being ``m-1``, or ``m-2`` with ``except_last``, as
        ``V ≥ (m-2)·M``), with ``X`` at least its floor."""
        sized = _Sized.of(model, chunks, devices) if sized is None else sized
        costs, copy_forward, copy_back = sized.costs, sized.copy_forward, sized.copy_back
        effective = effective_mode(mode, chunks)
        back, back_floor = sized.back(effective != "never")
        speeds = model.speeds[:devices]
        floors = sized.floor, back_floor
        weights = chunks - 1, chunks - 1 if effective != "except_last" else chunks - 2
        count = min(devices, model.layers)  # no more stages than layers: filled on the first count devices
        lower_bound = np.min(filled(float(costs.forward[-1]), speeds[:count], floors[0], weights[0])
                             + filled(float(back[-1]), speeds[:count], floors[1], weights[1])
                             + sized.cheapest[:count])
        total = float(costs.forward[-1] + back[-1])
        skips = model.chain.skips
        return Candidate(float(lower_bound), chunks, mode, effective, costs, back, copy_forward, copy_back, floors,
                         weights, total / float(np.max(speeds)), np.array([t.stash for t in skips], dtype=int),
                         np.array([t.pop for t in skips], dtype=int), sized)

    @property
    def receive(self) -> np.ndarray:
        """``[t, s, d]``: what device ``d`` pays to receive skip ``t`` from device ``s`` and send
        its gradient back (:func:`_receive`)."""
        return self.sized.receive

    @property
    def pays_skips(self) -> bool:
        """Whether some skip costs a copy from some device to another."""
        return self.sized.pays_skips

    def caps(self, best: float, least_sum: float) -> tuple[float, float]:
        """Largest forward and backward lane a plan better than ``best`` can have when its lane
        sum is at least ``least_sum``: ``best > S + (m-1)·X + w·M`` with each maximum at least
        its floor."""
        spare = best - least_sum
        (weight_x, weight_m), (floor_x, floor_m) = self.weights, self.floors
        return ((spare - weight_m * floor_m) / weight_x if weight_x > 0 else math.inf,
                (spare - weight_x * floor_x) / weight_m if weight_m > 0 else math.inf)


class _Sized:
    """What the candidates of one micro-batch count share whatever their mode: the costs at its
    size, the copies of the cuts (:func:`_cut_costs`), the least possible largest forward lane,
    the sums of the cheapest cuts (``cheapest[k]``: of ``k`` of them) and, only once a search
    asks (most candidates are never scouted), what receiving each skip costs."""

    def __init__(self, model: CostModel, costs: SizeCosts, devices: int) -> None:
        self.model, self.costs, self.devices = model, costs, devices
        self.copy_forward, self.copy_back = _cut_costs(model, costs, devices)
        self.floor = least_largest(costs.forward, model.speeds[:devices], 1e-3)[0]
        cut = np.min(self.copy_forward[:-1] + self.copy_back[:-1], axis=0, initial=math.inf)
        self.cheapest = np.concatenate(([0.0], np.cumsum(np.sort(cut[1:-1]))))
        self._backs: dict[bool, tuple[np.ndarray, float]] = {}

    def back(self, recomputed: bool) -> tuple[np.ndarray, float]:
        """The prefix sums of the backward lane, with or without recomputation, and its least
        possible largest value (two per size: ``except_last`` and ``always`` share one)."""
        if recomputed not in self._backs:
            back = self.costs.backward + (1.0 if recomputed else 0.0) * self.costs.forward
            self._backs[recomputed] = back, least_largest(back, self.model.speeds[:self.devices], 1e-3)[0]
        return self._backs[recomputed]

    @staticmethod
    def of(model: CostModel, chunks: int, devices: int) -> _Sized:
        """The shared parts of ``chunks`` micro-batches on the first ``devices``."""
        return _Sized(model, model.at(model.micro_batch_size(chunks)), devices)

    @cached_property
    def receive(self) -> np.ndarray:
        """:func:`_receive` at this size."""
        return _receive(self.model, self.costs, self.devices)

    @cached_property
    def pays_skips(self) -> bool:
        """Whether receiving some skip costs anything at this size."""
        return bool(np.any(np.isfinite(self.receive) & (self.receive > 0)))


def filled(work: float, speeds: np.ndarray, floor: float, weight: float) -> np.ndarray:
    """For each ``k``, the least over caps ``X`` (at least ``floor``) of ``S(X) + weight·X``,
    where ``S(X)`` is the least time sum of ``work`` spread over the first ``k`` devices
    (``speeds[:k]``) with none busier than ``X``: the fastest filled first (a relaxation of
    contiguous stages in order).  ``S`` is convex and piecewise linear, so the least is at
    ``X``'s lowest value or where one more device fills up."""
    count = len(speeds)
    prefix = np.where(np.tri(count, dtype=bool), np.asarray(speeds, dtype=float)[None, :], 0.0)  # row k-1: k devices
    fastest = -np.sort(-prefix, axis=1)
    capacity = np.cumsum(fastest, axis=1)  # work the j + 1 fastest do in unit time
    lowest = np.maximum(floor, work / capacity[:, -1])
    with np.errstate(divide="ignore"):
        caps = np.concatenate((lowest[:, None], work / capacity), axis=1)  # (k, candidate caps)
    caps = np.where(caps >= lowest[:, None], caps, lowest[:, None])
    # devices full at each cap: per row, how many capacities are below work / cap (rows shifted
    # apart so that one search over the flattened rows answers them all)
    shift = (np.arange(count) * (capacity[-1, -1] + 1.0))[:, None]
    with np.errstate(divide="ignore", invalid="ignore"):
        need = np.minimum(np.nan_to_num(work / caps, nan=0.0, posinf=np.inf), capacity[-1, -1] + 0.5)
    full = np.searchsorted((capacity + shift).ravel(), (need + shift).ravel()).reshape(caps.shape)
    full = np.minimum(full - np.arange(count)[:, None] * count, np.arange(count)[:, None])
    done = np.where(full > 0, caps * np.take_along_axis(capacity, np.maximum(full - 1, 0), axis=1), 0.0)
    spent = full * caps + np.maximum(work - done, 0.0) / np.take_along_axis(fastest, full, axis=1)
    return np.min(spent + weight * caps, axis=1)


def least_largest(prefix: np.ndarray, speeds: np.ndarray, tolerance: float) -> tuple[float, float]:
    """The least ``max_s work_s / v_s`` over contiguous splits of the layers (prefix sums
    ``prefix``) onto the devices in order, a device taking no layer allowed, as ``(low, high)``
    with ``low`` at most the optimum, the cap ``high`` feasible for :func:`greedy_split` and
    ``high - low`` within ``tolerance · high``.  Bisection on the cap, 255 caps at a time, from
    the average to the average plus a largest layer per device (every device then takes at
    least its share less one layer)."""
    total, spread = float(prefix[-1]), float(np.sum(speeds))
    largest = float(np.max(np.diff(prefix), initial=0.0))
    low = max(total / spread, largest / float(np.max(speeds)))
    high = (total + len(speeds) * largest) / spread * (1 + 1e-9)
    return least_feasible(low, high, tolerance, lambda caps: _greedy(prefix, speeds, caps)[-1] == len(prefix) - 1)


def least_feasible(low: float, high: float, tolerance: float,
                   feasible: Callable[[np.ndarray], np.ndarray]) -> tuple[float, float]:
    """Bisection on a value whose feasibility only grows with it, 255 values a round
    (``feasible`` answers for an array of them): ``(low, high)`` narrowed to within
    ``tolerance · high``, ``low`` never feasible (unless it was given so) and ``high`` feasible
    (if it was given so)."""
    while high - low > tolerance * high:
        caps = np.linspace(low, high, 257)[1:-1]
        found = feasible(caps)
        first = int(np.argmax(found)) if found.any() else len(caps)
        low, high = (caps[first - 1] if first else low), (caps[first] if first < len(caps) else high)
    return low, high


def greedy_split(prefix: np.ndarray, speeds: np.ndarray, cap: float) -> list[int]:
    """The stage end on each device when each in turn takes the most layers whose work fits
    ``cap · speed``."""
    return _greedy(prefix, speeds, np.array([cap]))[1:, 0].tolist()


def _greedy(prefix: np.ndarray, speeds: np.ndarray, caps: np.ndarray) -> np.ndarray:
    """Stage ends (a row per device after a row of zeros, a column per cap) when each device in
    turn takes the most layers whose work fits ``cap · speed``."""
    ends = [np.zeros(len(caps), dtype=int)]
    for speed in speeds:
        ends.append(np.searchsorted(prefix, prefix[ends[-1]] + caps * speed, side="right") - 1)
    return np.array(ends)


def _cut_costs(model: CostModel, costs: SizeCosts, devices: int) -> tuple[np.ndarray, np.ndarray]:
    """Row ``d``: the copy of the main input at each position ``c`` (0 … L) from device ``d``
    to ``d + 1``, and of its gradient back; 0 at both ends, which are no cuts, and on the last
    device, after which there is none."""
    nbytes = np.append(costs.input_bytes, 0.0)
    nbytes[0] = 0.0
    rows = np.arange(devices - 1)[:, None]
    forward, back = (np.where(nbytes > 0, model.latency[src, dst] + nbytes * model.per_byte[src, dst], 0.0)
                     for src, dst in ((rows, rows + 1), (rows + 1, rows)))
    last = np.zeros((1, len(nbytes)))
    return np.concatenate((forward, last)), np.concatenate((back, last))


def _receive(model: CostModel, costs: SizeCosts, devices: int) -> np.ndarray:
    """``[t, s, d]``: what device ``d`` pays to receive skip ``t`` from device ``s < d`` and
    send its gradient back (``inf`` from ``s ≥ d``; 0 when relayed: hop by hop, a skip's copies
    are the neighbours')."""
    latency, per_byte = model.latency[:devices, :devices], model.per_byte[:devices, :devices]
    nbytes = costs.skip_bytes[:, None, None]
    both = nbytes * (per_byte + per_byte.T)  # [t, from, to], in place from here: it is large
    both += latency + latency.T
    both[costs.skip_bytes <= 0] = 0.0
    if model.relayed:
        both[:] = 0.0
    np.copyto(both, np.inf, where=~np.tri(devices, k=-1, dtype=bool).T[None])  # only from s < d
    return both


def reach(prefix: np.ndarray, starts: np.ndarray, budget: np.ndarray | float) -> np.ndarray:
    """The last stop after each start whose work ``prefix[stop] - prefix[start]`` is within
    ``budget`` (broadcast against ``starts``), with slack for rounding: never short of it."""
    limit = (prefix[starts] + np.maximum(budget, 0.0)) * (1 + 1e-9)
    return np.where(np.asarray(budget) < 0, starts, np.searchsorted(prefix, limit, side="right") - 1)
