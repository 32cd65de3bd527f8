"""Whether to split, not only where: ``R`` replicas of one pipeline, each on ``D / R`` devices.

A plan with ``R`` replicas runs ``R`` copies of one pipeline side by side (data parallel over
pipelines): replica ``r`` holds devices ``r·k .. r·k + k - 1`` (``k = D / R``) and trains on
its ``ceil(B / R)`` samples of the batch.  ``R = 1`` is a pipeline (interleaved or not) and
``R = D`` with one stage is pure data parallelism.

Cost of a plan (ms), per replica — they are identical and run at once:

* the pipeline's own fill-drain time ``T`` at batch ``ceil(B / R)``, exactly as
  :mod:`autopipe.planning.cost` prices it, with the replica's memory (its stages' parameters,
  gradients, optimizer state, and activations of its share of the batch), on the strictest of the
  replicas' memory limits, the slowest of their speeds and the slowest of their links between
  the same positions (:func:`~autopipe.planning.cost.replica_copies`: a replica whose devices
  are joined by a slower link holds the others back);
* plus the gradient reduction: stage ``s`` starts reducing its parameter bytes ``P_s`` across
  the replicas when its last backward micro-batch ends (``e_s``, from the simulator), on a
  lane of its own (as DDP overlaps buckets with the backward), so the iteration ends at
  ``max(T, max_s e_s + red(P_s))`` and ``reduction_ms`` is what that adds to ``T``.

``red(n) = α + n · β · v(R)`` (:func:`reduction_time`) with ``α, β`` the profile's
reduction fit for the engine, measured at ``fit.replicas`` replicas, and ``v`` the bytes each
replica moves relative to that measurement: ``R - 1`` additions for the in-process runtime,
``2 (R - 1) / R`` for a ring all-reduce.  A profile without a fit (made before they were
measured) estimates ``α, β`` from its copy fit between devices 0 and 1 (zero when it has none),
and the plan's options say ``"reduction": "estimated from copy fits"``.

The planner (:func:`plan`) runs the exact pipeline search (:func:`autopipe.planning.solver.plan`)
for every ``R`` that divides ``D`` and takes the least total time, ties to fewer replicas.
With ``R = 1`` there is no reduction, and with one device per replica one split, so the
pipeline of least ``T`` is the answer.  With several replicas of several stages a split of
larger ``T`` but shorter tail can win: since the total is at least ``T``, every fill-drain
``(split, chunks, mode)`` with one stage per device, on every device order the pipeline search
tried, of ``T`` under the best total found is then priced (:func:`_least_total`), as long as
there are at most :data:`SPLITS` of them; beyond that the plan's options say
``"replica_split": "pipeline-optimal"`` (the total is then not proven least).  The 1F1B and
interleaved plans the pipeline search also tries (``schedule="auto"``, ``interleave="auto"``)
are not priced with their tails (the simulator would have to run every split): what bounds
them is the pipeline search's bound, so with them the plan's lower bound is the least of the
fill-drain total and that bound (or what the tail needs at least, if larger), and its gap is
rarely 0.
"""
from __future__ import annotations

import itertools
import math
import os
from dataclasses import replace
from typing import Any, Iterator, Sequence

import numpy as np

from .._vocab import CheckpointChoice, EngineName, Schedule
from .._checks import is_positive_int, loaded
from ..errors import OptionError
from ..profiling.profiles import Profile
from ..timeline import Event
from . import placement as placements
from ._budget import Budget
from .cost import CostModel, replica_copies
from .plans import Plan
from .simulate import Simulation, simulate, simulate_plan
from ._options import check_replica_share, device_speeds, plan_batch_size, recorded_limit
from .solver import PlanningError, build_plan, candidate_chunks, device_names, memory_limits, search_pipeline

__all__ = ["plan", "replica_counts", "reduction_time", "with_reduction", "pure_data_parallel",
           "best_pipeline", "parallelism", "plan_events", "reduction_events", "SPLITS"]

#: most splits (over all stage counts) whose totals with the reduction tail are priced one by one.
SPLITS = 200_000


def replica_counts(devices: int, batch_size: int, replicas: int | str, equal: bool = False) -> list[int]:
    """The replica counts to search: every divisor of ``devices`` up to the batch size (that
    also divides the batch, with ``equal``) for ``"auto"``, else ``[replicas]`` after checking it."""
    if replicas == "auto":
        return [r for r in range(1, devices + 1)
                if devices % r == 0 and r <= batch_size and not (equal and batch_size % r)]
    if not is_positive_int(replicas):
        raise OptionError(f"replicas must be 'auto' or a positive integer, got {replicas!r}")
    if devices % replicas:
        divisors = [r for r in range(1, devices + 1) if devices % r == 0]
        raise OptionError(f"replicas={replicas} does not divide the {devices} devices (each replica needs the "
                          f"same number of devices); use one of {divisors} or 'auto'")
    if replicas > batch_size:
        raise OptionError(f"replicas={replicas} is more than the batch of {batch_size} samples; use fewer replicas")
    if equal and batch_size % replicas:
        raise OptionError(f"replicas={replicas} does not divide the batch of {batch_size}, and the distributed engine "
                          "needs equal shares; choose a batch size divisible by the replicas")
    return [replicas]


def reduction_time(profile: Profile, engine: str, replicas: int, nbytes: float) -> tuple[float, bool]:
    """Time (ms) to reduce ``nbytes`` of gradients over ``replicas`` replicas with ``engine``,
    and whether it comes from a measured reduction fit (else from the copy fits)."""
    if replicas <= 1 or nbytes <= 0:
        return 0.0, profile.reduction_fit(engine) is not None
    fit = profile.reduction_fit(engine)
    if fit is not None:
        scale = _volume(engine, replicas) / _volume(engine, max(fit.replicas, 2))
        return fit.latency_ms + nbytes * fit.ms_per_byte * scale, True
    copy = profile.copy_fit(0, 1)
    latency, per_byte = (0.0, 0.0) if copy is None else (copy.latency_ms, copy.ms_per_byte)
    return latency + nbytes * per_byte * _volume(engine, replicas), False


def _volume(engine: str, replicas: int) -> float:
    """Bytes moved per replica per gradient byte: ``R - 1`` additions in one process, a ring
    all-reduce's ``2 (R - 1) / R`` between processes."""
    return replicas - 1.0 if engine == "local" else 2.0 * (replicas - 1) / replicas


def _reductions(profile: Profile, bounds: Sequence[int], replicas: int, engine: str) -> list[float]:
    """Each stage's gradient reduction time (ms): of the parameters that get gradients (frozen
    ones are not reduced)."""
    return [reduction_time(profile, engine, replicas,
                           sum(layer.trainable_bytes for layer in profile.layers[bounds[s]:bounds[s + 1]]))[0]
            for s in range(len(bounds) - 1)]


def reduction_events(timeline: Simulation, reductions: Sequence[float]) -> list[Event]:
    """Stage ``s``'s reduction on its own lane, from the end of its last backward."""
    events = []
    for s, ms in enumerate(reductions):
        if ms > 0:
            start = max(e.end_ms for e in timeline.events if e.stage == s and e.kind == "B")
            events.append(Event(s, "reduce", "A", 0, start, start + ms))
    return events


def plan_events(plan: Plan, timeline: Simulation | None = None) -> list[Event]:
    """The plan's predicted timeline, as ``show`` and ``bench`` draw it: the simulator's events
    (``timeline``, else simulated here) and each stage's gradient reduction on its own lane."""
    timeline = simulate_plan(plan) if timeline is None else timeline
    return timeline.events + reduction_events(timeline, [stage.reduce_ms for stage in plan.stages])


def _tail(timeline: Simulation, reductions: Sequence[float]) -> float:
    """What the reductions add after the pipeline's end."""
    ends = [e.end_ms for e in reduction_events(timeline, reductions)]
    return max([timeline.iteration_ms, *ends]) - timeline.iteration_ms


def with_reduction(profile: Profile, pipeline: Plan, replica_devices: list[list[str]], batch: int,
                   engine: str) -> Plan:
    """``pipeline`` (one replica's plan) as a plan of ``len(replica_devices)`` replicas on a
    whole batch of ``batch``, its prediction including the reduction tail (module docstring)."""
    replicas = len(replica_devices)
    if replicas == 1:
        return replace(pipeline, batch_size=batch)
    bounds = [stage.start for stage in pipeline.stages] + [pipeline.stages[-1].stop]
    reductions = _reductions(profile, bounds, replicas, engine)
    tail = _tail(simulate_plan(pipeline), reductions)
    stages = [replace(stage, reduce_ms=ms) for stage, ms in zip(pipeline.stages, reductions)]
    predicted = replace(pipeline.predicted, iteration_ms=pipeline.predicted.iteration_ms + tail,
                        reduction_ms=tail)
    return replace(pipeline, batch_size=batch, predicted=predicted, stages=stages,
                   replicas=replicas, replica_devices=replica_devices)


def plan(profile: Profile | str | os.PathLike[str], devices: Sequence[Any] | int | None = None, *,
         replicas: int | str = "auto", batch_size: int | None = None, memory_limit: Any = None,
         speeds: Sequence[float] | float | None = None, engine: EngineName = "local",
         time_limit: float | None = 1.0, checkpoint: CheckpointChoice = "auto", chunks: int | None = None,
         interleave: int | str = "auto", optimizer_state: str | float = "momentum", schedule: Schedule = "gpipe",
         placement: str = "given") -> Plan:
    """The plan of least predicted iteration time over replica counts and pipelines.

    Args:
        profile: what the profiler measured: a :class:`~autopipe.Profile` or its JSON path.
        devices: a count or device names (default: the profile's); replica ``r`` takes the
            ``r``-th run of ``len(devices) / replicas`` of them.
        replicas: ``"auto"`` (every divisor of the device count is tried) or a count that
            divides it; 1 plans a pipeline only, ``len(devices)`` pure data parallelism.
        batch_size: the whole batch, split over the replicas (default: the profile's).
        memory_limit, speeds: per device or one for all, as for :func:`autopipe.planning.solver.plan`;
            a replica's stage ``s`` must fit on (and runs at the speed of) every replica's device ``s``.
        engine: ``"local"`` or ``"distributed"`` (whose replicas need equal shares of the batch).
        time_limit: seconds for the whole search (``None``: no limit), shared by the replica
            counts in turn; the plan's lower bound is the least over the counts searched.
        checkpoint, chunks, interleave, optimizer_state, schedule, placement: for the pipeline
            search of each replica, as for :func:`autopipe.planning.solver.plan`.

    Returns:
        The :class:`Plan`; ``plan.options`` records the replica counts searched, the best time
        of each and whether the reduction cost was measured or estimated.

    Raises:
        OptionError: an option is invalid, or ``replicas`` does not divide the devices or exceeds
            the batch (a ``ValueError`` and ``TypeError``).
        DeviceError: a device name that is not one, or a device count the profile cannot give.
        FormatError: the ``profile`` file is corrupt or of another schema.
        PlanningError: no plan was found within the memory limits for any replica count.
    """
    budget = Budget(time_limit)  # from the start: checking the profile counts too
    profile = loaded(profile, Profile, "profile")
    # checked once here: the pipeline searches below take it as checked, and its digest
    options = {"checkpoint": checkpoint, "chunks": chunks, "interleave": interleave,
               "optimizer_state": optimizer_state, "schedule": schedule, "placement": placement,
               "digest": profile.checked_digest()}
    names = device_names(profile, devices)
    batch = plan_batch_size(profile, batch_size)
    counts = replica_counts(len(names), batch, replicas, equal=engine == "distributed")
    limits = memory_limits(memory_limit, names)
    rates = device_speeds(speeds, names)
    best: Plan | None = None
    lowest: float | None = math.inf  # the least lower bound over the replica counts planned
    tried: dict[str, float | None] = {}
    failures: list[str] = []
    for index, count in enumerate(counts):
        # one deadline for the whole call: each count gets an equal share of what is left
        share = budget.share(len(counts) - index)
        try:
            candidate = _replicated(profile, names, count, batch, limits, rates, engine,
                                    {**options, "time_limit": time_limit}, share)
        except ValueError as error:  # PlanningError, or options that a share of the batch cannot take
            if not isinstance(error, PlanningError) and (count == 1 or replicas != "auto"):
                raise
            tried[str(count)] = None
            failures.append(f"{count} replica{'s' if count > 1 else ''}: {error}")
            continue
        tried[str(count)] = candidate.predicted.iteration_ms
        bound = candidate.predicted.lower_bound_ms
        lowest = None if bound is None or lowest is None else min(lowest, bound)
        if best is None or candidate.predicted.iteration_ms < best.predicted.iteration_ms:
            best = candidate
    if best is None:
        # each count's error says whether none of its plans fits or none was found
        raise PlanningError(f"no plan was found within the memory limits for any replica count "
                            f"({', '.join(map(str, counts))}); the limit named for a count is for that count's plans, "
                            "the least of them fits: " + " | ".join(failures))
    if lowest is not None:  # each count's bound (its pipeline's; the reduction adds to it) holds
        best.predicted = replace(best.predicted, lower_bound_ms=min(lowest, best.predicted.iteration_ms))
    measured = reduction_time(profile, engine, 2, 1.0)[1]
    best.options.update({
        "devices": names, "batch_size": batch, "replicas": replicas, "replicas_searched": tried,
        "time_limit": time_limit,
        "memory_limit": recorded_limit(memory_limit),
        "memory_limit_bytes": [None if math.isinf(v) else int(v) for v in limits], "speeds": rates,
        "reduction": "measured" if measured else "estimated from copy fits",
    })
    return best


def _replicated(profile: Profile, names: list[str], count: int, batch: int, limits: np.ndarray,
                rates: list[float], engine: str, options: dict[str, Any], budget: Budget) -> Plan:
    """The best plan of ``count`` replicas: one replica's pipeline on the strictest of the
    replicas' device limits, the slowest of their speeds and of their links between the same
    positions (:func:`~autopipe.planning.cost.replica_copies`), with its reduction tail."""
    per = len(names) // count
    groups = [names[r * per:(r + 1) * per] for r in range(count)]
    limit = limits.reshape(count, per).min(axis=0)
    speed = np.asarray(rates).reshape(count, per).min(axis=0)
    share = -(-batch // count)
    check_replica_share(batch, count, profile.batch_sizes, equal=engine == "distributed")
    copies = replica_copies(profile, groups)
    pipeline = search_pipeline(profile, groups[0], batch_size=share,
                             memory_limit=[None if math.isinf(v) else float(v) for v in limit],
                             speeds=[float(v) for v in speed], engine=engine, budget=budget, copies=copies,
                             **options)
    bound = pipeline.predicted.lower_bound_ms
    # exact: the total found is the least of the plans priced with their tails, or whose totals
    # follow from their pipeline times (without several replicas of several stages the least
    # pipeline time is the least total: no tail, or one stage's, after the pipeline's end)
    exact, others = pipeline.predicted.gap == 0, False
    if count > 1 and per > 1:
        pipeline = _least_total(profile, pipeline, count, engine, budget, copies)
        exact, others = pipeline.options["replica_split"] == "least total", not _fill_drain_only(pipeline.options)
    order = pipeline.options.get("device_order", list(range(per)))  # the pipeline's devices, as placed
    replica_devices = [[group[order[d]] for d in pipeline.placement] for group in groups]
    chosen = with_reduction(profile, pipeline, replica_devices, batch, engine)
    # No plan's total is below the larger of its pipeline's bound (which the tail only adds to)
    # and what the tail needs at least; one priced with its tail reaches the total found.
    total = chosen.predicted.iteration_ms
    unpriced = max(bound, _floor(profile, pipeline, count, engine) if count > 1 else 0.0)
    least = (min(total, unpriced) if others else total) if exact else unpriced
    chosen.predicted = replace(chosen.predicted, lower_bound_ms=least)
    return chosen


def _fill_drain_only(options: dict[str, Any]) -> bool:
    """Whether the pipeline search tried fill-drain plans of one stage per device only (no 1F1B
    or interleaved ones, which :func:`_least_total` does not price with their tails)."""
    fill_drain = options["schedule"] == "gpipe" or options["engine"] == "distributed"  # its 'auto' is gpipe
    return fill_drain and list(options["interleaves_searched"]) == [1]


def _floor(profile: Profile, pipeline: Plan, replicas: int, engine: str) -> float:
    """A lower bound on any of this replica count's plans, pipeline and reduction tail: every
    stage's last backward comes after one micro-batch's forward through every layer (each at its
    least profiled time, on the fastest device), and some stage holds at least ``1/n`` of the
    parameters that get gradients, ``n`` the most stages searched, whose reduction starts only then."""
    options = pipeline.options
    forward = sum(min(stat.median_ms for stat in layer.forward.values()) for layer in profile.layers)
    stages = len(options["devices"]) * max(options["interleaves_searched"])
    params = sum(layer.trainable_bytes for layer in profile.layers)
    return forward / max(options["speeds"]) + reduction_time(profile, engine, replicas, params / stages)[0]


def _least_total(profile: Profile, pipeline: Plan, replicas: int, engine: str, budget: Budget,
                 copies: tuple[np.ndarray, np.ndarray]) -> Plan:
    """The replica pipeline of least total time (pipeline + reduction tail), starting from
    ``pipeline``, the one of least pipeline time: every one-stage-per-device fill-drain
    ``(split, chunks, mode)``, on the devices in each order the pipeline search tried
    (:func:`_placements`), whose pipeline time is under the best total is priced, until
    ``budget`` runs out (the plan's options then say the search was cut).  Only where the
    options allow such plans: a schedule or stages per device asked for stay as asked.
    ``copies``: the replicas' links, as the pipeline search priced them."""
    options = pipeline.options
    devices, share = options["devices"], pipeline.batch_size
    # the optimizer as asked: a name prices the step's temporaries it has, its factor alone the most any has
    model = CostModel(profile, devices, options["speeds"], share, options["optimizer_state"], engine, copies)
    layers = model.layers
    limits = np.asarray([math.inf if v is None else v for v in options["memory_limit_bytes"]], dtype=float)
    allowed = options["schedule"] in ("gpipe", "auto") and 1 in options["interleaves_searched"]
    placed = _placements(model, options["placement"], limits)
    if not allowed or sum(math.comb(layers - 1, len(prefix) - 1) for prefix in placed) > SPLITS:
        options["replica_split"] = "pipeline-optimal"
        return pipeline
    chunks = candidate_chunks(share, profile.batch_sizes, options["chunks"], equal=engine == "distributed")
    asked = options["checkpoint"]
    modes = ["never", "except_last"] if asked == "auto" else [asked]
    first = [stage.start for stage in pipeline.stages] + [layers]
    best = pipeline.predicted.iteration_ms + _tail(simulate_plan(pipeline),
                                                   _reductions(profile, first, replicas, engine))
    moved = {order: placements.permuted(model, order) for order in placed.values()}
    found, split = None, "least total"
    splits = ((order, bounds) for prefix, order in placed.items() for bounds in _splits(layers, len(prefix)))
    for order, bounds in splits:
        if budget.out():
            split = "least total of the splits priced before the time limit"
            break
        for m in chunks:
            for mode in modes:
                evaluation = moved[order].evaluate(bounds, m, mode)
                if evaluation.iteration_ms >= best or any(
                        stage.memory > limit for stage, limit in zip(evaluation.stages, limits[list(order)])):
                    continue
                timeline = simulate(evaluation.stages, m, mode)
                total = evaluation.iteration_ms + _tail(timeline, _reductions(profile, bounds, replicas, engine))
                if total < best:
                    best, found = total, (bounds, m, mode, order)
    options["replica_split"] = split
    if found is None:
        return pipeline
    bounds, m, mode, order = found
    return build_plan(profile, placements.permuted(model, order), bounds, m, mode,
                      {**options, "device_order": list(order)})


def _placements(model: CostModel, placement: str, limits: np.ndarray) -> dict[tuple[int, ...], tuple[int, ...]]:
    """The devices the stages of a split can take, in order: every prefix of the device orders
    the pipeline search tries (:func:`autopipe.planning.placement.orders`), each with an order
    it starts (stages use a prefix of an order, so distinct prefixes are distinct plans)."""
    placed: dict[tuple[int, ...], tuple[int, ...]] = {}
    for order in placements.orders(model, placement, limits)[0]:
        for stages in range(1, min(len(order), model.layers) + 1):
            placed.setdefault(order[:stages], order)
    return placed


def _splits(layers: int, stages: int) -> Iterator[tuple[int, ...]]:
    """Every split of ``layers`` into ``stages`` stages, as bounds."""
    for cuts in itertools.combinations(range(1, layers), stages - 1):
        yield (0, *cuts, layers)


def pure_data_parallel(profile: Profile, devices: Sequence[Any] | int | None = None, **options: Any) -> Plan:
    """The best plan with one stage per replica and a replica per device."""
    count = len(device_names(profile, devices))
    return plan(profile, devices, replicas=count, **{**options, "interleave": 1})


def best_pipeline(profile: Profile, devices: Sequence[Any] | int | None = None, **options: Any) -> Plan:
    """The best plan of one replica (a pipeline over the devices, or one device)."""
    return plan(profile, devices, replicas=1, **options)


def parallelism(profile: Profile, chosen: Plan, devices: Sequence[Any] | int | None, **options: Any) -> str:
    """A table: the chosen plan, pure data parallelism and the best pipeline-only plan on the
    same devices and options, each with its predicted time and ratio to the choice."""
    rows: list[tuple[str, Plan | str]] = [("ours (autopipe)", chosen)]
    for name, make in (("pure data parallel", pure_data_parallel), ("best pipeline only", best_pipeline)):
        try:
            rows.append((name, make(profile, devices, **options)))
        except ValueError as error:  # PlanningError included: say why the row is missing
            rows.append((name, str(error).split(";")[0]))
    lines = [f"{'parallelism':<20} {'iteration':>12} {'vs ours':>8}  {'R':>2}  {'m':>3}  balance",
             f"{'-' * 20} {'-' * 12} {'-' * 8}  {'-' * 2}  {'-' * 3}  {'-' * 7}"]
    for name, row in rows:
        if isinstance(row, str):
            lines.append(f"{name:<20} {'-':>12} {'-':>8}  ({row})")
            continue
        ms = row.predicted.iteration_ms
        lines.append(f"{name:<20} {ms:>9.2f} ms {ms / chosen.predicted.iteration_ms:>7.2f}x  {row.replicas:>2}  "
                     f"{row.chunks:>3}  [{','.join(map(str, row.balance))}]"
                     + (f" x{row.interleave}/device" if row.interleave > 1 else ""))
    return "\n".join(lines)
