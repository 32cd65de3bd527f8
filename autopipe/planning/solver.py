"""The planner: the exact minimum of the cost model over stage count, split points, micro-batch
count and checkpoint mode, subject to per-device memory limits.

Each ``(chunks, mode)`` pair is a :class:`~autopipe.planning.search.Candidate` with a cheap lower bound
on its time.  After a first plan (the greedy split of least largest forward lane), candidates
are taken in order of that bound until it reaches the best time found, and a coarse grid of lane
caps (:class:`~autopipe.planning.completion.Completions`) gives each a lower bound and a few plans.  Then,
those with the best plans first, each candidate whose bound is still under the best time gets a
finer grid around its best plan (a tighter bound, more plans) and, if that bound is still under,
the exact DP (:class:`~autopipe.planning.search.Search`) looks for a strictly better plan, pruned by that
grid.  A candidate is only ever skipped on a lower bound, so what is left at the end is optimal.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from . import interleaved
from .completion import Completions
from .cost import MODES, CostModel, Evaluation, SizeCosts, recomputations
from .plans import SCHEDULES, Plan, Prediction, StagePlan, placement
from ..profiling.profiles import Profile
from .search import Candidate, Choice, Search, greedy_split, least_largest
from .simulate import simulate

__all__ = ["plan", "solve", "Search", "Choice", "PlanningError", "build_plan", "candidate_chunks", "device_names",
           "memory_limits", "parse_bytes", "smallest_memory"]

# plans taken from each grid of caps, by each of two orders (Completions.plans)
_PLANS = 3


class PlanningError(ValueError):
    """No plan satisfies the options (memory limits, chunks, batch size)."""


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
    interleave: int | str = "auto",
) -> Plan:
    """The plan of least predicted iteration time for ``profile`` on ``devices``.

    Stages use ``devices`` in order (``k`` of them, ``k`` chosen); ``speeds`` are relative
    (times are divided by them); ``memory_limit`` is bytes (or ``"16GiB"``) for every device or
    one per device, defaulting to the capacity of CUDA devices and no limit on CPU;
    ``checkpoint="auto"`` chooses the mode; ``chunks=None`` chooses the micro-batch count;
    ``engine`` is what will run the plan: ``"local"`` (the in-process runtime) or
    ``"distributed"`` (torch.distributed.pipelining: skips relayed by the stages between, equal
    micro-batches only), costed as in :mod:`autopipe.planning.cost`.  ``interleave`` is the number of
    stages per device (:mod:`autopipe.planning.interleaved`): 1, 2, ..., or ``"auto"``, which also tries
    2 where the local engine runs the plan, more than one device is given and the enumeration
    is within :data:`~autopipe.planning.interleaved.BUDGET` (the plan's options record what was tried).
    """
    names = device_names(profile, devices)
    options = _Options.check(profile, names, batch_size, memory_limit, checkpoint,
                             optimizer_state_factor, schedule, speeds, chunks, engine, interleave)
    model = CostModel(profile, names, options.speeds,
                      options.batch_size, optimizer_state_factor, engine)
    choice = None
    for factor in options.interleaves:
        if factor == 1:
            choice = solve(model, options.candidates, options.modes, options.limits)
        else:
            choice = interleaved.search(model, options.candidates, options.modes, options.limits, factor,
                                        choice) or choice
    if choice is None:
        raise PlanningError(_infeasible(model, options))
    return build_plan(profile, model, choice.bounds, choice.chunks, choice.mode, options.record(),
                      choice.interleave)


def solve(model: CostModel, candidates: Sequence[int], modes: Sequence[str], limits: np.ndarray) -> Choice | None:
    """The best plan over the micro-batch counts ``candidates`` and ``modes``, or ``None`` if
    none fits in memory.

    Candidates are scouted in order of their cheap bound while it is under the best time: a
    coarse grid of caps gives each a lower bound and plans.  Then each is searched exactly
    for a strictly better plan (after a finer grid around its best plan), those with the best
    plans first, so that the others are cut off early.  Ties go to the plan found first.
    """
    pairs = sorted((Candidate.of(model, chunks, mode, len(limits)) for chunks in candidates for mode in modes),
                   key=lambda c: (c.bound, c.chunks, MODES.index(c.mode)))
    best = _seed(model, pairs[0], limits)
    leads = []
    for pair in pairs:
        if best is not None and pair.bound >= best.iteration_ms:
            break
        leads.append(_scout(model, pair, limits, best))
        best = _better(best, leads[-1].plan)
    for lead in sorted(leads, key=lambda lead: math.inf if lead.plan is None else lead.plan.iteration_ms):
        best = _search(model, lead, limits, best)
    return best


@dataclass(frozen=True)
class _Lead:
    """What a coarse grid of caps tells about a candidate: a lower bound on its time and on the
    lane sum of its plans (within the grid's caps), its best plan found and that plan's largest
    forward and backward lanes."""

    candidate: Candidate
    least: float
    floor: float
    plan: Choice | None
    lanes: tuple[float, float] | None


def _seed(model: CostModel, candidate: Candidate, limits: np.ndarray) -> Choice | None:
    """A first plan, so that the first grid has finite caps: the split of least largest
    forward lane (the greedy one), if it fits in memory."""
    speeds = model.speeds[: len(limits)]
    prefix = candidate.costs.forward
    bounds = tuple(sorted({0, *greedy_split(prefix, speeds, least_largest(prefix, speeds, 1e-3)[1])}))
    return _best_plan(model, candidate, limits, [bounds])[0]


def _scout(model: CostModel, candidate: Candidate, limits: np.ndarray, best: Choice | None) -> _Lead:
    """A coarse grid of caps for ``candidate``: cheap, and its bound and plans decide the order of
    the exact searches and cut most of them off."""
    completions = _grid(model, candidate, limits, best, None, candidate.work)
    return _Lead(candidate, completions.least(), completions.floor,
                 *_best_plan(model, candidate, limits, completions.plans(_PLANS)))


def _search(model: CostModel, lead: _Lead, limits: np.ndarray, best: Choice | None) -> Choice | None:
    """``best`` or a better plan of ``lead.candidate``: the plans of a grid of caps around its
    best plan, then the exact DP — each only while its lower bound is under the best time."""
    if best is not None and lead.least >= best.iteration_ms:
        return best
    completions = _grid(model, lead.candidate, limits, best, lead.lanes, lead.floor)
    best = _better(best, _best_plan(model, lead.candidate, limits, completions.plans(_PLANS))[0])
    if best is not None and completions.least() >= best.iteration_ms:
        return best
    cutoff = math.inf if best is None else best.iteration_ms
    return Search(model, lead.candidate, limits, cutoff, completions).run() or best


def _grid(model: CostModel, candidate: Candidate, limits: np.ndarray, best: Choice | None,
          lanes: tuple[float, float] | None, least_sum: float) -> Completions:
    """The grid of caps up to the largest lanes a plan better than ``best`` can have, given
    that its lane sum is at least ``least_sum``."""
    caps = candidate.caps(math.inf if best is None else best.iteration_ms, least_sum)
    return Completions.around(candidate, model.speeds[: len(limits)], caps, lanes)


def _best_plan(model: CostModel, candidate: Candidate, limits: np.ndarray,
               splits: Sequence[tuple[int, ...]]) -> tuple[Choice | None, tuple[float, float] | None]:
    """The best of ``splits`` that fits in memory, and its largest forward and backward lanes
    (``None`` if none fits)."""
    found = None
    for bounds in splits:
        evaluation = model.evaluate(bounds, candidate.chunks, candidate.mode)
        if all(stage.memory <= limit for stage, limit in zip(evaluation.stages, limits)):
            if found is None or evaluation.iteration_ms < found[1].iteration_ms:
                found = bounds, evaluation
    if found is None:
        return None, None
    bounds, evaluation = found
    lanes = (max(max(s.forward, s.copy_in) for s in evaluation.stages),
             max(max(s.backward + s.recompute, s.copy_grad) for s in evaluation.stages))
    return Choice(bounds, candidate.chunks, candidate.mode, evaluation.iteration_ms), lanes


def _better(best: Choice | None, other: Choice | None) -> Choice | None:
    """The faster of two plans, ``best`` on a tie."""
    if best is None or other is not None and other.iteration_ms < best.iteration_ms:
        return other
    return best


@dataclass(frozen=True)
class _Options:
    """Checked planning options."""

    batch_size: int
    speeds: list[float]
    limits: np.ndarray
    candidates: list[int]
    modes: list[str]
    interleaves: list[int]
    given: dict[str, Any]

    @staticmethod
    def check(profile: Profile, names: list[str], batch_size: int | None, memory_limit: Any,
              checkpoint: str, optimizer_state_factor: float, schedule: str,
              speeds: Sequence[float] | None, chunks: int | None, engine: str,
              interleave: int | str = "auto") -> "_Options":
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
        factors = _interleaves(interleave, profile.layers, len(names), engine)
        given = {"devices": names, "batch_size": batch, "memory_limit": memory_limit,
                 "checkpoint": checkpoint, "optimizer_state_factor": optimizer_state_factor,
                 "speeds": rates, "chunks": chunks, "engine": engine, "interleave": interleave,
                 "interleaves_searched": factors}
        return _Options(batch, rates, memory_limits(memory_limit, names),
                        candidate_chunks(batch, profile.batch_sizes, chunks, equal=engine == "distributed"),
                        modes, factors, given)

    def record(self) -> dict[str, Any]:
        """The options as JSON for the plan file."""
        limit = self.given["memory_limit"]
        shown = list(limit) if isinstance(limit, (list, tuple)) else limit
        return {**self.given, "memory_limit": shown,
                "memory_limit_bytes": [None if math.isinf(v) else int(v) for v in self.limits]}


def _interleaves(asked: int | str, layers: Sequence[Any], devices: int, engine: str) -> list[int]:
    """The stages-per-device factors to search: ``[asked]``, or for ``"auto"`` 1 and, where it
    can run and be searched exactly, 2."""
    if asked == "auto":
        fits = interleaved.split_count(len(layers), devices, 2) <= interleaved.BUDGET
        return [1, 2] if engine == "local" and devices > 1 and 2 * 2 <= len(layers) and fits else [1]
    if not isinstance(asked, int) or isinstance(asked, bool) or asked < 1:
        raise ValueError(f"interleave must be 'auto' or a positive integer (stages per device), got {asked!r}")
    if asked > 1:
        if engine != "local":
            raise ValueError(f"interleave={asked}: the distributed engine runs one stage per process; "
                             "use interleave=1 (or 'auto') with engine='distributed'")
        if devices < 2 or 2 * asked > len(layers):
            raise ValueError(f"interleave={asked} needs at least 2 devices and {2 * asked} layers; "
                             f"got {devices} devices and {len(layers)} layers")
        count = interleaved.split_count(len(layers), devices, asked)
        if count > interleaved.BUDGET:
            raise ValueError(f"interleave={asked} would enumerate {count} splits of {len(layers)} layers on "
                             f"up to {devices} devices, more than {interleaved.BUDGET}; plan fewer "
                             "devices or use interleave=1")
    return [asked]


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
    from ..device import DeviceError, ops_for

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
               options: dict[str, Any], interleave: int = 1) -> Plan:
    """The :class:`Plan` of one split, costed by ``model`` (simulated when interleaved)."""
    where = placement(len(bounds) - 1, interleave)
    if interleave == 1:
        evaluation = model.evaluate(bounds, chunks, mode)
    else:
        lanes = model.stage_lanes(bounds, chunks, mode, where)
        simulation = simulate(lanes, chunks, mode, where)
        evaluation = Evaluation(lanes, simulation.forward_ms, simulation.backward_ms)
    layers = profile.layers
    stages = [
        StagePlan(index=s, device=model.devices[where[s]], start=bounds[s], stop=bounds[s + 1],
                  first_layer=layers[bounds[s]].name, last_layer=layers[bounds[s + 1] - 1].name,
                  forward_ms=lanes.forward, backward_ms=lanes.backward, recompute_ms=lanes.recompute,
                  copy_in_ms=lanes.copy_in, copy_grad_ms=lanes.copy_grad,
                  memory_bytes=int(math.ceil(lanes.memory)))
        for s, lanes in enumerate(evaluation.stages)
    ]
    recomputed = recomputations(mode, chunks)
    busy = sum(chunks * (l.forward + l.backward) + recomputed * l.recompute for l in evaluation.stages)
    used = len(stages) // interleave
    bubble = 1 - busy / (used * evaluation.iteration_ms) if evaluation.iteration_ms > 0 else 0.0
    predicted = Prediction(evaluation.iteration_ms, evaluation.forward_ms, evaluation.backward_ms, bubble)
    return Plan(model=profile.model, profile_digest=profile.digest, devices=[stage.device for stage in stages],
                batch_size=model.batch_size, chunks=chunks, checkpoint=mode, schedule="gpipe",
                stages=stages, predicted=predicted, options=options, interleave=interleave)


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
