"""The planner: the exact minimum of the cost model over stage count, split points, micro-batch
count and checkpoint mode, subject to per-device memory limits.

Each ``(chunks, mode)`` pair is a :class:`~autopipe.planning.candidates.Candidate` with a cheap lower bound
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

from .._vocab import CHECKPOINT_MODES, CheckpointChoice, CheckpointMode, EngineName, Schedule
from ..errors import PlanningError
from ..profiling.profiles import Profile
from . import interleaved
from ._assembly import build_plan
from ._infeasible import infeasible, smallest_memory
from ._options import Options, candidate_chunks, device_names, memory_limits, parse_bytes
from .completion import Completions
from .cost import CostModel
from .plans import Plan
from .candidates import Candidate, Choice, greedy_split, least_largest
from .search import Search

__all__ = ["plan", "solve", "Search", "Choice", "PlanningError", "build_plan", "candidate_chunks", "device_names",
           "memory_limits", "parse_bytes", "smallest_memory"]

# plans taken from each grid of caps, by each of two orders (Completions.plans)
_PLANS = 3


def plan(
    profile: Profile,
    devices: Sequence[Any] | int | None = None,
    *,
    batch_size: int | None = None,
    memory_limit: float | str | Sequence[float | str | None] | None = None,
    checkpoint: CheckpointChoice = "auto",
    optimizer_state: str | float = "momentum",
    schedule: Schedule = "gpipe",
    speeds: Sequence[float] | None = None,
    chunks: int | None = None,
    engine: EngineName = "local",
    interleave: int | str = "auto",
) -> Plan:
    """The plan of least predicted iteration time for ``profile`` on ``devices``.

    Stages use ``devices`` in order (``k`` of them, ``k`` chosen), costed as in
    :mod:`autopipe.planning.cost`.

    Args:
        profile: what the profiler measured.
        devices: device names, a count (the profile's first ``n``), or ``None`` for the profile's.
        batch_size: the training batch (default: the profile's).
        memory_limit: bytes, or a size such as ``"16GiB"``, for every device or one per device;
            default: the capacity of CUDA devices, no limit on CPU.
        checkpoint: a checkpoint mode, or ``"auto"`` to choose one.
        optimizer_state: what the optimizer keeps per parameter: ``"sgd"`` (nothing),
            ``"momentum"`` (SGD with momentum: one buffer, 1x the parameters), ``"adam"`` (2x),
            or a factor (state bytes per parameter byte; :mod:`autopipe.planning.memory`).
        schedule: only ``"gpipe"`` (fill-drain) is planned.
        speeds: relative device speeds (times are divided by them).
        chunks: the micro-batch count, or ``None`` to choose it.
        engine: what will run the plan: ``"local"`` (the in-process runtime) or ``"distributed"``
            (torch.distributed.pipelining: skips relayed by the stages between, equal
            micro-batches only).
        interleave: stages per device (:mod:`autopipe.planning.interleaved`): 1, 2, ..., or
            ``"auto"``, which also tries 2 where the local engine runs the plan, more than one
            device is given and the enumeration is within
            :data:`~autopipe.planning.interleaved.BUDGET` (the plan's options record what was tried).

    Returns:
        The :class:`Plan`, with its predicted times and the options it was made with.

    Raises:
        PlanningError: no plan fits the memory limits (the message gives the smallest limit that
            would fit).
        ValueError: an option is invalid (unknown mode, schedule or optimizer, chunks outside the
            profiled sizes, a memory size that cannot be read, ...).
    """
    names = device_names(profile, devices)
    options = Options.check(profile, names, batch_size, memory_limit, checkpoint,
                             optimizer_state, schedule, speeds, chunks, engine, interleave)
    model = CostModel(profile, names, options.speeds,
                      options.batch_size, optimizer_state, engine)
    choice = None
    for factor in options.interleaves:
        if factor == 1:
            choice = solve(model, options.candidates, options.modes, options.limits)
        else:
            choice = interleaved.search(model, options.candidates, options.modes, options.limits, factor,
                                        choice) or choice
    if choice is None:
        raise PlanningError(infeasible(model, options))
    return build_plan(profile, model, choice.bounds, choice.chunks, choice.mode, options.record(),
                      choice.interleave)


def solve(model: CostModel, candidates: Sequence[int], modes: Sequence[CheckpointMode],
          limits: np.ndarray) -> Choice | None:
    """The best plan over the micro-batch counts ``candidates`` and ``modes``, or ``None`` if
    none fits in memory.

    Candidates are scouted in order of their cheap bound while it is under the best time: a
    coarse grid of caps gives each a lower bound and plans.  Then each is searched exactly
    for a strictly better plan (after a finer grid around its best plan), those with the best
    plans first, so that the others are cut off early.  Ties go to the plan found first.
    """
    pairs = sorted((Candidate.of(model, chunks, mode, len(limits)) for chunks in candidates for mode in modes),
                   key=lambda c: (c.lower_bound, c.chunks, CHECKPOINT_MODES.index(c.mode)))
    best = _seed(model, pairs[0], limits)
    leads = []
    for pair in pairs:
        if best is not None and pair.lower_bound >= best.iteration_ms:
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
