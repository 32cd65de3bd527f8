"""The cost model: stage times, copy times, memory and fill-drain iteration time from a Profile.

Notation: layers ``0..L-1``; stage ``s`` holds layers ``[a_s, a_{s+1})`` on plan device ``s``
with relative speed ``v_s``; ``m`` micro-batches of ``b = ceil(B / m)`` samples each (exact when
``m`` divides ``B``, an upper bound otherwise, since times and bytes grow with ``b``).

Per layer ``l`` at size ``b`` (:func:`interpolate`): forward ``f_l(b)`` and backward ``g_l(b)``
are the profiled medians, piecewise-linear between profiled sizes; a size outside
``[min, max]`` of the profiled sizes is an error, never an extrapolation.  Saved bytes are
interpolated the same way; output and stash bytes are per sample, times ``b``.

Per stage ``s`` (times per micro-batch, in ms)::

    F_s = Σ f_l(b) / v_s                         forward compute
    W_s = Σ g_l(b) / v_s                         backward compute without recomputation
    R_s = F_s if the micro-batch is checkpointed  recomputation, run before its backward
    C_s = Σ_{tensors t received by s} α(p_t, s) + bytes_t · β(p_t, s)        forward copy lane
    G_s = Σ_{tensors t produced by s, consumed in c_t > s} α(c_t, s) + bytes_t · β(c_t, s)

where the tensors are the main input (from ``s-1``) and every skip whose stash is in an earlier
stage ``p_t`` and pop in ``s``; ``α, β`` are the device pair's fitted latency and ms/byte (0 on
the same device index).  The input copy of the batch onto device 0 happens before the pipeline
starts and is not counted.  How a skip from stage ``p`` to stage ``c > p`` travels depends on the
engine that will run the plan:

* ``local`` (the in-process runtime): straight from ``p``'s device to ``c``'s, once — as above;
* ``distributed`` (``torch.distributed.pipelining``, which only talks to neighbours): relayed by
  every stage between, so it is copied on every hop ``s-1 → s`` for ``p < s ≤ c``, adding
  ``α(s-1, s) + bytes · β(s-1, s)`` to ``C_s`` and its gradient's copy ``s → s-1`` to ``G_{s-1}``.

Iteration (:func:`phase_makespan`) = forward phase + backward phase (the loss needs the whole
output, so no backward starts before the last forward ends).  Each phase is a permutation flow
shop whose machines are the lanes in order — forward ``F_0, C_1, F_1, …, C_{k-1}, F_{k-1}``,
backward ``W_{k-1}+R, G_{k-2}, W_{k-2}+R, …, G_0, W_0+R`` — and whose jobs are the micro-batches
in order (backward in reverse order).  Its makespan is the longest path through the
(lane × micro-batch) grid.  With identical micro-batches that is ``Σ p + (m-1)·max p``.
With ``except_last`` the first backward job is not recomputed (``p⁰ = p − R``); reversing both
orders (which keeps every path) and walking the lanes ``i = 1..n`` as ``B_0, G_0, B_1, …``::

    makespan = Σ p + V_n,   V_i = max(V_{i-1} − R_i, p⁰_i + (m−2)·max_{j≤i} p_j),   V_0 = −∞

(the path runs jobs ``1..m-1`` over lanes ``1..i`` and the unrecomputed job over ``i..n``).  For
identical jobs ``R = 0`` and ``V_n = (m-1)·max p``, so one recurrence serves every mode.

With several stages on one device (an interleaved plan, :mod:`autopipe.planning.interleaved`) the
stages share that device's compute and there is no closed form: :meth:`CostModel.stage_lanes`
prices the stages (no copy between stages on one device) and the simulator
(:mod:`autopipe.planning.simulate`) gives the time.

1F1B (:mod:`autopipe.planning.schedules`) interleaves the phases: no closed form, its time is
the simulator's (:func:`autopipe.planning.simulate.evaluate`).  A gpipe plan may also run
on the distributed engine with ``1f1b`` (which needs ``m ≥`` stages); it then holds at most
``stages - s`` micro-batches on stage ``s``, no more memory than planned.

Memory of stage ``s`` (bytes) is :func:`autopipe.planning.memory.stage_memory`: parameters,
gradients, optimizer state, buffers, the saved activations and outputs of the micro-batches
in flight (all ``m`` in fill-drain; one micro-batch's saved tensors when checkpointed), inputs
and skips held, the gradient of its input and its largest layer's workspace — or, when larger,
what the optimizer's step holds after the backward: parameters, gradients, state and the step's
temporaries — term by term in that module.  The ``distributed`` engine's receive buffer adds
one more copy of the input per micro-batch to every stage but the first.  Other schedules hold
fewer micro-batches: ``m`` is the stage's :func:`~autopipe.planning.schedules.in_flight` count
(``min(stages - s, m)`` in 1F1B), and the saved tensors count
:func:`~autopipe.planning.schedules.saved_sets` times (1F1B with ``except_last`` may hold two
sets where fill-drain holds one).
"""
from __future__ import annotations

import bisect
import math
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np

from .._vocab import ENGINES, CheckpointMode, EngineName, Schedule
from .._checks import check_choice
from ..errors import DeviceError
from .graph import build_graph, chain_of
from .memory import (BackwardTables, MemoryTerms, estimated_workspace, optimizer_factor, output_saved_flags,
                     producers, stage_memory, step_factor)
from .schedules import in_flight, saved_sets
from ..profiling.profiles import Profile

__all__ = ["interpolate", "copy_matrix", "replica_copies", "CostModel", "SizeCosts", "StageLanes", "Evaluation",
           "phase_makespan", "backward_makespan", "recomputations", "effective_mode"]


def recomputations(mode: CheckpointMode, chunks: int) -> int:
    """How many of ``chunks`` micro-batches rerun their forward before their backward in
    checkpoint ``mode``: none, all but the last, or all."""
    return {"never": 0, "except_last": chunks - 1, "always": chunks}[mode]


def effective_mode(mode: CheckpointMode, chunks: int) -> CheckpointMode:
    """The mode that ``mode`` amounts to with ``chunks`` micro-batches: ``except_last`` of a
    single micro-batch keeps its activations, as ``never`` does."""
    return "never" if mode == "except_last" and chunks == 1 else mode


def interpolate(table: dict[int, float], b: int, what: str = "value") -> float:
    """Piecewise-linear value of ``table`` (micro-batch size → value) at ``b``."""
    sizes = sorted(table)
    if not sizes[0] <= b <= sizes[-1]:
        raise ValueError(f"micro-batch size {b} is outside the profiled sizes {sizes[0]}..{sizes[-1]} "
                         f"({what}); profile more batch sizes or choose another batch size / chunks")
    index = bisect.bisect_left(sizes, b)
    if sizes[index] == b:
        return float(table[b])
    lo, hi = sizes[index - 1], sizes[index]
    weight = (b - lo) / (hi - lo)
    return float(table[lo]) * (1 - weight) + float(table[hi]) * weight


def copy_matrix(profile: Profile, devices: Sequence[str],
                needed: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Latency and ms/byte for every ordered pair of plan devices.

    A pair uses the profile's fit for the same device indices when the profile's devices there
    have the same names, else any fit between devices of those names; two CPU devices without a
    fit cost 0 (a CPU-to-CPU move is a reference).  Anything else is a :class:`DeviceError`, for
    the pairs ``needed`` marks (every pair by default; the others without a fit are ``nan``).
    Built per pair of names, then spread over the devices (a table of every pair is ``n²``).
    """
    known = profile.devices
    names = sorted(set(devices))
    ids = np.searchsorted(names, devices)  # each device's name, as an index into names
    by_name = np.full((2, len(names), len(names)), np.nan)  # latency, ms/byte of each pair of names
    for a, src in enumerate(names):
        for b, dst in enumerate(names):
            if src.startswith("cpu") and dst.startswith("cpu"):
                by_name[:, a, b] = 0.0
    for fit in reversed(profile.copies):  # the first fit of each pair wins, as a scan would find
        src, dst = known[fit.src], known[fit.dst]
        if src in names and dst in names:
            by_name[:, names.index(src), names.index(dst)] = fit.latency_ms, fit.ms_per_byte
    latency, per_byte = by_name[:, ids[:, None], ids[None, :]]
    for fit in reversed(profile.copies):  # a fit between the same indices and names comes first
        i, j = fit.src, fit.dst
        if max(i, j) < len(devices) and known[i] == devices[i] and known[j] == devices[j]:
            latency[i, j], per_byte[i, j] = fit.latency_ms, fit.ms_per_byte
    np.fill_diagonal(latency, 0.0)
    np.fill_diagonal(per_byte, 0.0)
    if np.isnan(by_name).any():  # else every pair has a cost: no search of the n² table
        missing = np.argwhere(np.isnan(latency) & (True if needed is None else needed))
        if len(missing):
            src, dst = missing[0]
            raise _unmeasured(profile, devices[src], devices[dst])
    return latency, per_byte


def replica_copies(profile: Profile, groups: Sequence[Sequence[str]]) -> tuple[np.ndarray, np.ndarray]:
    """Latency and ms/byte between every ordered pair of positions in a replica's pipeline, where
    replica ``r`` runs on devices ``groups[r]``: the largest of the replicas' latencies and of their
    times per byte (:func:`copy_matrix` of all devices, position ``i`` of replica ``r`` at
    ``r·k + i``).  The replicas run side by side and the step waits for the slowest, so a link
    slower in one replica (another node, another interconnect) is what the plan pays; where the
    slowest link in latency is not the slowest per byte, this prices above every replica.  Only
    the links within a replica need a fit (replicas on two machines profiled apart have none
    between them)."""
    per = len(groups[0])
    replica = np.repeat(np.arange(len(groups)), per)
    latency, per_byte = copy_matrix(profile, [device for group in groups for device in group],
                                    needed=replica[:, None] == replica[None, :])
    at = np.arange(len(groups))[:, None] * per + np.arange(per)  # [replica, position]: index in all devices
    return (latency[at[:, :, None], at[:, None, :]].max(axis=0), per_byte[at[:, :, None], at[:, None, :]].max(axis=0))


def _unmeasured(profile: Profile, src: str, dst: str) -> DeviceError:
    """The error for a pair of plan devices ``src`` → ``dst`` that the profile has no copy fit for
    (a meta device holds no data, so nothing is measured on it: no advice to profile there)."""
    measured = (f"the profile has no copy measurement from {src} to {dst}: it was measured on "
                f"{', '.join(profile.devices)}")
    if "meta" in (src.split(":")[0], dst.split(":")[0]):
        return DeviceError(f"{measured}; plan on those devices (a meta device holds no data to time)")
    return DeviceError(f"{measured}; plan on those devices, or profile on these "
                       f"(python -m autopipe profile ... --devices {src},{dst})")


@dataclass(frozen=True)
class SizeCosts:
    """Prefix sums of the per-layer costs at one micro-batch size ``b`` (index ``c`` = layers ``< c``)."""

    b: int
    forward: np.ndarray
    backward: np.ndarray
    saved: np.ndarray
    params: np.ndarray
    grads: np.ndarray  # the parameters that get gradients (and optimizer state)
    buffers: np.ndarray
    input_bytes: np.ndarray  # per layer: its main input at b
    output_bytes: np.ndarray  # per layer: its output at b
    skip_bytes: np.ndarray
    backward_peaks: BackwardTables

    def sum(self, table: np.ndarray, start: Any, stop: Any) -> Any:
        """``Σ`` of a per-layer table over ``[start, stop)``; either bound may be an index array."""
        return table[stop] - table[start]


@dataclass(frozen=True)
class StageLanes:
    """One stage's per-micro-batch lane times (ms) and memory (bytes); see the module formulas."""

    forward: float
    backward: float
    recompute: float
    copy_in: float
    copy_grad: float
    memory: float
    memory_terms: dict[str, int] = field(default_factory=dict)  # memory by term (planning.memory)


@dataclass(frozen=True)
class Evaluation:
    """A fully costed split: its stages and predicted phase and iteration times."""

    stages: list[StageLanes]
    forward_ms: float
    backward_ms: float

    @property
    def iteration_ms(self) -> float:
        return self.forward_ms + self.backward_ms

    @property
    def peak_memory(self) -> float:
        return max(stage.memory for stage in self.stages)


class CostModel:
    """Costs of a profiled chain on given plan devices; see the module docstring for formulas."""

    def __init__(self, profile: Profile, devices: Sequence[str], speeds: Sequence[float],
                 batch_size: int, optimizer_state: str | float = "momentum", engine: EngineName = "local",
                 copies: tuple[np.ndarray, np.ndarray] | None = None) -> None:
        check_choice(engine, "engine", ENGINES)
        self.profile = profile
        self.relayed = engine == "distributed"
        self.chain = chain_of(build_graph(profile))  # skip edges and the tensors crossing each cut
        self.devices = list(devices)
        self.speeds = np.asarray(speeds, dtype=float)
        self.batch_size = batch_size
        self.optimizer_state_factor = optimizer_factor(optimizer_state)
        self.optimizer_step_factor = step_factor(optimizer_state)
        self.own_copies = not all(d.startswith("cpu") for d in self.devices)  # see planning.memory
        # latency and ms/byte per pair of devices: the devices' own, or those a replica plan
        # prices every replica's pipeline with (replica_copies)
        self.latency, self.per_byte = copy_matrix(profile, devices) if copies is None else copies
        self._sizes: dict[int, SizeCosts] = {}
        self._per_size = _per_size(profile)
        self._per_layer = _PerLayer.of(profile, self.chain.skips)

    @property
    def layers(self) -> int:
        return self.chain.layers

    def micro_batch_size(self, chunks: int) -> int:
        return -(-self.batch_size // chunks)

    def at(self, b: int) -> SizeCosts:
        """The prefix sums at micro-batch size ``b`` (cached)."""
        if b not in self._sizes:
            self._sizes[b] = self._build(b)
        return self._sizes[b]

    def _build(self, b: int) -> SizeCosts:
        # interpolation is linear in the table's values: one weight per profiled size for all layers
        sizes = self.profile.batch_sizes
        weights = np.asarray([interpolate({s: float(s == size) for s in sizes}, b, "every layer's tables")
                              for size in sizes])
        forward, backward, saved, workspace = (table @ weights for table in self._per_size)
        fixed = self._per_layer
        outputs = fixed.output_bytes * b + fixed.output_fixed_bytes
        inputs = np.concatenate(([self.profile.input_bytes * b], outputs[:-1]))
        workspace = np.where(fixed.measured_workspace, workspace, estimated_workspace(fixed.trainable_bytes, inputs))
        tables = BackwardTables.build(_prefix(saved), fixed.grads, workspace, outputs, fixed.output_saved,
                                      fixed.producer, self.own_copies)
        return SizeCosts(b, _prefix(forward), _prefix(backward), _prefix(saved), fixed.params, fixed.grads,
                         fixed.buffers, inputs, outputs, fixed.skip_bytes * b + fixed.skip_fixed_bytes, tables)

    def copy_ms(self, src: int, dst: int, nbytes: float) -> float:
        """One tensor's copy from plan device ``src`` to ``dst`` (0 on the same index or 0 bytes)."""
        if src == dst or nbytes <= 0:
            return 0.0
        return float(self.latency[src, dst] + nbytes * self.per_byte[src, dst])

    def route(self, src: int, dst: int) -> list[tuple[int, int]]:
        """The copies ``(from stage, to stage)`` of a skip stashed in stage ``src`` and popped in
        ``dst``: straight, or hop by hop when relayed; none within one stage."""
        if src == dst:
            return []
        return [(s - 1, s) for s in range(src + 1, dst + 1)] if self.relayed else [(src, dst)]

    def held_bytes(self, costs: SizeCosts, start: Any, stop: Any) -> Any:
        """Bytes per micro-batch of the skips stage ``[start, stop)`` sends on or receives, and
        when relayed also passes along (either bound may be an index array).

        A skip that is the stashing layer's own parameter (a tied head's weight) is that
        parameter where it is made, counted with the parameters.  A receiver with memory of its
        own holds a copy per micro-batch until that micro-batch's backward (the runtime's saved
        skips); on CPU it is the same tensor, no new bytes.  Its gradients,
        made by the receiver, wait for the sender's backward in the sender's inbox: the
        receiver's memory on CPU, a copy on the sender's device otherwise.  No backpressure
        bounds how many (only neighbours' input gradients are; a consumer stages away runs
        further ahead): one per micro-batch in flight, a bound (one to two of four measured
        on CPU, varying run to run)."""
        held = np.zeros(np.broadcast(start, stop).shape)
        for skip, nbytes in zip(self.chain.skips, costs.skip_bytes):
            sends = (start <= skip.stash) & (skip.stash < stop) & (stop <= skip.pop)
            receives = (skip.stash < start) & (start <= skip.pop) & (skip.pop < stop)
            passes = (skip.stash < start) & (stop <= skip.pop) & self.relayed
            copied = receives | passes
            held = held + nbytes * (copied | (sends & self.own_copies) if skip.param else sends | copied)
        return held

    def inner_bytes(self, costs: SizeCosts, start: Any, stop: Any) -> Any:
        """Bytes per micro-batch of the skips stashed and popped inside stage ``[start, stop)``
        (either bound may be an index array): no layer's saved bytes count them (a pop layer's
        leave popped tensors out), though the pop layer may save one for its backward.  A
        parameter stashed is the parameter itself: nothing."""
        inner = np.zeros(np.broadcast(start, stop).shape)
        for skip, nbytes in zip(self.chain.skips, costs.skip_bytes):
            if not skip.param:
                inner = inner + nbytes * ((start <= skip.stash) & (skip.pop < stop))
        return inner

    def memory(self, costs: SizeCosts, start: Any, stop: Any, chunks: int, mode: CheckpointMode,
               skip_bytes: Any) -> Any:
        """Peak bytes of stage ``[start, stop)``; ``skip_bytes`` per micro-batch of skips it holds
        (any argument but ``chunks`` and ``mode`` may be an array)."""
        return self.memory_terms(costs, start, stop, chunks, mode, skip_bytes).total

    def memory_terms(self, costs: SizeCosts, start: Any, stop: Any, chunks: int, mode: CheckpointMode,
                     skip_bytes: Any, held: int | None = None, refilled: Any = False,
                     extra_sets: Any = 0) -> MemoryTerms:
        """:meth:`memory` term by term (:mod:`autopipe.planning.memory`) with ``held``
        micro-batches in flight (default all ``chunks``, as in fill-drain), ``refilled`` by a
        forward between two backwards (1F1B), and ``extra_sets`` of saved tensors beyond theirs."""
        first = np.asarray(start) == 0
        inputs = costs.input_bytes[start]
        return stage_memory(
            params=costs.sum(costs.params, start, stop), grads=costs.sum(costs.grads, start, stop),
            buffers=costs.sum(costs.buffers, start, stop), inner_skips=self.inner_bytes(costs, start, stop),
            saved=costs.sum(costs.saved, start, stop), output=costs.output_bytes[np.asarray(stop) - 1],
            output_saved=1.0 * (costs.backward_peaks.extra[stop] == 0), input_bytes=inputs, first=first,
            skips=skip_bytes, in_flight=chunks if held is None else held,
            backward=costs.backward_peaks.peaks(start, stop),
            checkpointed=recomputations(mode, chunks) > 0, optimizer=self.optimizer_state_factor,
            step=self.optimizer_step_factor, own_copies=self.own_copies,
            received=inputs * ~first if self.relayed else 0.0, refilled=refilled, extra_sets=extra_sets)

    def schedule_memory_terms(self, costs: SizeCosts, start: Any, stop: Any, chunks: int, mode: CheckpointMode,
                              schedule: Schedule, stage: int, stages: int) -> MemoryTerms:
        """The terms of stage ``stage`` (of ``stages``) holding layers ``[start, stop)`` under
        ``schedule``: those of its micro-batches in flight, plus the saved tensors it holds beyond
        what that counts (bounds may be index arrays)."""
        held = in_flight(schedule, stage, stages, chunks)
        refilled = (np.asarray(held) < chunks) & (schedule == "1f1b")  # a steady state: forwards between backwards
        extra = saved_sets(schedule, mode, stage, stages, chunks) - (held if mode == "never" else 1)
        return self.memory_terms(costs, start, stop, chunks, mode, self.held_bytes(costs, start, stop), held,
                                 refilled, extra)

    def schedule_memory(self, costs: SizeCosts, start: Any, stop: Any, chunks: int, mode: CheckpointMode,
                        schedule: Schedule, stage: int, stages: int) -> Any:
        """Peak bytes of :meth:`schedule_memory_terms`."""
        return self.schedule_memory_terms(costs, start, stop, chunks, mode, schedule, stage, stages).total

    def evaluate(self, bounds: Sequence[int], chunks: int, mode: CheckpointMode) -> Evaluation:
        """Cost the fill-drain split whose stage ``s`` holds layers ``[bounds[s], bounds[s+1])``
        on device ``s`` (other schedules and placements: :func:`autopipe.planning.simulate.evaluate`)."""
        stages = self.stage_lanes(bounds, chunks, mode)
        forward_ms, backward_ms = phase_makespan(stages, chunks, mode)
        return Evaluation(stages, forward_ms, backward_ms)

    def stage_lanes(self, bounds: Sequence[int], chunks: int, mode: CheckpointMode,
                    placement: Sequence[int] | None = None, schedule: Schedule = "gpipe") -> list[StageLanes]:
        """Every stage's lanes and memory under ``schedule``, stage ``s`` on device
        ``placement[s]`` (default ``s``); a tensor between stages on one device is not copied."""
        costs = self.at(self.micro_batch_size(chunks))
        count = len(bounds) - 1
        where = list(range(count)) if placement is None else list(placement)
        owner = _owners(bounds, self.layers)
        copy_in = [0.0] * count
        copy_grad = [0.0] * count
        for s in range(1, count):
            copy_in[s] += self.copy_ms(where[s - 1], where[s], costs.input_bytes[bounds[s]])
            copy_grad[s - 1] += self.copy_ms(where[s], where[s - 1], costs.input_bytes[bounds[s]])
        for skip, nbytes in zip(self.chain.skips, costs.skip_bytes):
            src, dst = owner[skip.stash], owner[skip.pop]
            for hop_src, hop_dst in self.route(src, dst):
                copy_in[hop_dst] += self.copy_ms(where[hop_src], where[hop_dst], nbytes)
                copy_grad[hop_src] += self.copy_ms(where[hop_dst], where[hop_src], nbytes)
        starts, stops, index = np.asarray(bounds[:-1]), np.asarray(bounds[1:]), np.asarray(where)
        speed = self.speeds[index]
        forward = costs.sum(costs.forward, starts, stops) / speed
        backward = costs.sum(costs.backward, starts, stops) / speed
        recompute = forward * (1.0 if recomputations(mode, chunks) else 0.0)
        terms = self.schedule_memory_terms(costs, starts, stops, chunks, mode, schedule, np.arange(count), count)
        memory = np.broadcast_to(terms.total, (count,))
        return [StageLanes(float(forward[s]), float(backward[s]), float(recompute[s]), copy_in[s], copy_grad[s],
                           float(memory[s]), row) for s, row in enumerate(terms.rows(count))]


def _per_size(profile: Profile) -> tuple[np.ndarray, ...]:
    """Forward and backward medians, saved and workspace bytes as (layers × profiled sizes)
    matrices (a profile without workspace has 0s there, replaced by an estimate per size)."""
    sizes, layers = profile.batch_sizes, profile.layers
    forward = [[layer.forward[s].median_ms for s in sizes] for layer in layers]
    backward = [[layer.backward[s].median_ms for s in sizes] for layer in layers]
    saved = [[layer.saved_bytes[s] for s in sizes] for layer in layers]
    workspace = [[layer.workspace_bytes.get(s, 0) for s in sizes] for layer in layers]
    return tuple(np.asarray(table, dtype=float) for table in (forward, backward, saved, workspace))


@dataclass(frozen=True)
class _PerLayer:
    """What the costs at every micro-batch size read of each layer and skip, as arrays, read
    off the profile once (a chain of 1,000 layers is costed at 15 sizes)."""

    output_bytes: np.ndarray  # per sample
    output_fixed_bytes: np.ndarray
    measured_workspace: np.ndarray  # whether the profile has the layer's workspace
    trainable_bytes: np.ndarray
    output_saved: np.ndarray  # output_saved_flags
    producer: np.ndarray  # producers
    params: np.ndarray  # prefix sums of parameter, gradient and buffer bytes
    grads: np.ndarray
    buffers: np.ndarray
    skip_bytes: np.ndarray  # per sample, per skip
    skip_fixed_bytes: np.ndarray

    @staticmethod
    def of(profile: Profile, skips: Sequence[Any]) -> _PerLayer:
        layers = profile.layers
        column = lambda read: np.asarray([read(layer) for layer in layers], dtype=float)  # noqa: E731
        trainable = column(lambda layer: layer.trainable_bytes)
        return _PerLayer(column(lambda layer: layer.output_bytes), column(lambda layer: layer.output_fixed_bytes),
                         np.asarray([bool(layer.workspace_bytes) for layer in layers]), trainable,
                         output_saved_flags(layers), producers([bool(layer.aliases_input) for layer in layers]),
                         _prefix(column(lambda layer: layer.param_bytes)), _prefix(trainable),
                         _prefix(column(lambda layer: layer.buffer_bytes)),
                         np.asarray([s.bytes_per_sample for s in skips], dtype=float),
                         np.asarray([s.fixed_bytes for s in skips], dtype=float))


def _prefix(values: Sequence[float]) -> np.ndarray:
    return np.concatenate(([0.0], np.cumsum(np.asarray(values, dtype=float))))


def _owners(bounds: Sequence[int], layers: int) -> list[int]:
    owner = [0] * layers
    for s in range(len(bounds) - 1):
        for layer in range(bounds[s], bounds[s + 1]):
            owner[layer] = s
    return owner


def phase_makespan(stages: Sequence[StageLanes], chunks: int, mode: CheckpointMode) -> tuple[float, float]:
    """Forward and backward phase makespans of fill-drain (the closed forms above)."""
    forward_lanes = [stages[0].forward]
    for stage in stages[1:]:
        forward_lanes += [stage.copy_in, stage.forward]
    forward = sum(forward_lanes) + (chunks - 1) * max(forward_lanes)
    backward_lanes: list[tuple[float, float]] = []
    for index, stage in enumerate(stages):
        skipped = stage.recompute if mode == "except_last" else 0.0  # R of the first backward job
        backward_lanes.append((stage.backward + stage.recompute, skipped))
        if index < len(stages) - 1:
            backward_lanes.append((stage.copy_grad, 0.0))
    return forward, backward_makespan(backward_lanes, chunks)


def backward_makespan(lanes: Sequence[tuple[float, float]], chunks: int) -> float:
    """``Σ p + V_n`` over lanes ``(p, R)`` given in the order ``B_0, G_0, B_1, …`` (see above)."""
    total, peak, v = 0.0, 0.0, -math.inf
    for p, skipped in lanes:
        total += p
        peak = max(peak, p)
        v = max(v - skipped, p - skipped + (chunks - 2) * peak)
    return total + v

