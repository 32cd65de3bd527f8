"""The planner's search over interleaved splits: ``v`` stages per device, placed round-robin.

With ``k`` devices and ``n = k·v`` stages, stage ``s`` runs on device ``s % k``.  Each device
then holds ``v`` chunks of the chain, so a split has ``n - 1`` cuts to balance forward and
backward work at once (one cut cannot, when forward and backward costs are spread differently
over the layers), and a device can work on a later chunk while an earlier micro-batch fills
the pipeline::

    device 0:  [ s0 ]      [ s2 ]          layers  s0 | s1 | s2 | s3
    device 1:        [ s1 ]      [ s3 ]

Stages sharing a device take turns, so there is no closed form: a split's time is the
simulator's (:func:`autopipe.planning.simulate.simulate`, the rule the runtime follows).  The search is
exact by enumeration with pruning: a lower bound on every split is computed at once with numpy,
per phase the larger of

* the busiest device: ``m · Σ`` of its stages' lanes (forward; backward with recomputation), and
* the chain: one micro-batch through every stage plus ``m - 1`` more on the slowest lane
  (``Σ q + (m-1)·max p``, where ``q`` leaves out a recomputation that might not happen),

and splits are simulated in order of bound until it reaches the best time found (the
``(chunks, mode, device count)`` groups themselves taken in order of their least possible
work per device, see :func:`search`); a split over a device's memory limit (the sum of its
stages') is passed over.  There are ``C(L-1, n-1)`` splits of ``L`` layers; beyond
:data:`BUDGET` of them the planner does not interleave (and says so in the plan's options).
"""
from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from .._vocab import CheckpointMode
from .cost import CostModel, recomputations
from .plans import placement
from .candidates import Choice
from .simulate import simulate

__all__ = ["BUDGET", "split_count", "search", "time_of"]

#: splits (over all device counts) that the planner enumerates for one interleave factor.
BUDGET = 200_000


def split_count(layers: int, devices: int, interleave: int) -> int:
    """Splits of ``layers`` into ``interleave`` stages on each of 2..``devices`` devices."""
    return sum(math.comb(layers - 1, k * interleave - 1) for k in range(2, devices + 1))


def time_of(model: CostModel, bounds: Sequence[int], chunks: int, mode: CheckpointMode, interleave: int,
            limits: np.ndarray) -> float:
    """The simulated iteration ms of one interleaved split, or ``inf`` if a device's stages
    overflow its memory."""
    where = placement(len(bounds) - 1, interleave)
    lanes = model.stage_lanes(bounds, chunks, mode, where)
    held = np.zeros(len(limits))
    for stage, device in zip(lanes, where):
        held[device] += stage.memory
    if np.any(held > limits[: len(held)]):
        return math.inf
    return simulate(lanes, chunks, mode, where).iteration_ms


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


def search(model: CostModel, candidates: Sequence[int], modes: Sequence[CheckpointMode], limits: np.ndarray,
           interleave: int, best: Choice | None) -> Choice | None:
    """The best interleaved split strictly faster than ``best`` (any split if ``best`` is
    ``None``), or ``None``.

    Each ``(chunks, mode, device count)`` is taken in order of its least possible time (all its
    work spread evenly over its devices), and within it each split in order of its bound; both
    loops stop at the best time found, so what they skip cannot be faster."""
    devices = min(len(limits), model.layers // interleave)
    groups = {k: _Splits.of(model.layers, k, interleave) for k in range(2, devices + 1)}
    tried = sorted((_work_bound(model, chunks, mode, k), chunks, mode, k)
                   for chunks in candidates for mode in modes for k in groups)
    found = best
    for least, chunks, mode, k in tried:
        if found is not None and least >= found.iteration_ms:
            break
        lower = _lower_bounds(model, groups[k], chunks, mode, interleave)
        for row in np.argsort(lower, kind="stable"):
            if found is not None and lower[row] >= found.iteration_ms:
                break
            bounds = tuple(int(b) for b in groups[k].bounds[row])
            ms = time_of(model, bounds, chunks, mode, interleave, limits)
            if found is None and math.isfinite(ms) or found is not None and ms < found.iteration_ms:
                found = Choice(bounds, chunks, mode, ms, interleave)
    return None if found is best else found


def _work_bound(model: CostModel, chunks: int, mode: CheckpointMode, devices: int) -> float:
    """All the work of one iteration over the total speed of ``devices`` devices."""
    costs = model.at(model.micro_batch_size(chunks))
    work = chunks * (costs.forward[-1] + costs.backward[-1]) + recomputations(mode, chunks) * costs.forward[-1]
    return float(work / np.sum(model.speeds[:devices]))


def _lower_bounds(model: CostModel, splits: _Splits, chunks: int, mode: CheckpointMode, interleave: int) -> np.ndarray:
    """A lower bound on the simulated time of every split (the module docstring's)."""
    costs = model.at(model.micro_batch_size(chunks))
    bounds = splits.bounds
    speeds = model.speeds[np.asarray(placement(bounds.shape[1] - 1, interleave))]
    forward = (costs.forward[bounds[:, 1:]] - costs.forward[bounds[:, :-1]]) / speeds
    backward = (costs.backward[bounds[:, 1:]] - costs.backward[bounds[:, :-1]]) / speeds
    recomputed = recomputations(mode, chunks)
    recompute = forward if recomputed else np.zeros_like(forward)
    least = backward + (recompute if mode == "always" else 0.0)  # a backward job at the least
    return (_phase_bound(chunks * forward, forward, forward, splits.devices, chunks)
            + _phase_bound(chunks * backward + recomputed * recompute, least, backward + recompute,
                           splits.devices, chunks, reverse=True))


def _phase_bound(work: np.ndarray, least: np.ndarray, lane: np.ndarray, devices: int, chunks: int,
                 reverse: bool = False) -> np.ndarray:
    """Per split: the larger of the chain bound and, for every device, what one micro-batch
    needs before its first stage can start, its stages' ``work``, and what the last
    micro-batch needs after its last stage (``least`` per stage, ``lane`` with recomputation)."""
    if reverse:
        work, least, lane = work[:, ::-1], least[:, ::-1], lane[:, ::-1]
    rows, stages = work.shape
    before = np.cumsum(least, axis=1) - least  # Σ least over earlier stages
    after = least.sum(axis=1, keepdims=True) - np.cumsum(least, axis=1)
    per_device = work.reshape(rows, stages // devices, devices).sum(axis=1)
    busiest = (before[:, :devices] + per_device + after[:, stages - devices:]).max(axis=1)
    chain = least.sum(axis=1) + (chunks - 1) * lane.max(axis=1)
    return np.maximum(busiest, chain)
