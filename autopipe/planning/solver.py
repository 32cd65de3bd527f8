"""The planner: the exact minimum of the cost model over stage count, split points, micro-batch
count and checkpoint mode, subject to per-device memory limits.

Each ``(chunks, mode)`` pair is a :class:`~autopipe.planning.candidates.Candidate` with a cheap lower bound
on its time.  After a first plan (the greedy split of least largest forward lane), the
candidates are refined best first (:mod:`autopipe.planning.refinement`): the one of least cheap
bound gets a coarse grid of lane caps (:class:`~autopipe.planning.completion.Completions`), whose
cells bound its plans and give plans, and the cells of least bound over all candidates are
halved, until every cell's bound reaches the best time found or is settled.  A candidate with
cells left gets a finer grid around its best plan and then the exact DP
(:class:`~autopipe.planning.search.Search`) looks for a strictly better plan, pruned by that grid.
A candidate is only ever skipped on a lower bound, so what is left at the end is optimal;
stopped by the time limit, the least bound of what is left is a proven lower bound.
"""
from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from .._vocab import CHECKPOINT_MODES, CheckpointChoice, CheckpointMode, EngineName, Schedule
from .._checks import check_choice, loaded
from ..errors import PlanningError
from ..profiling.profiles import Profile
from . import interleaved, one_f_one_b
from . import placement as placements
from ._assembly import build_plan
from ._budget import Budget, Outcome
from ._infeasible import infeasible, smallest_memory, unfound
from ._options import Options, candidate_chunks, device_names, memory_limits, parse_bytes
from .completion import Completions, grid_levels
from .refinement import Cells, refine
from .cost import CostModel, Evaluation
from .plans import Plan
from .candidates import Candidate, Choice, better, greedy_split, least_largest
from .search import Search

__all__ = ["plan", "search_pipeline", "solve", "Search", "Choice", "PlanningError", "build_plan", "candidate_chunks",
           "device_names", "memory_limits", "parse_bytes", "smallest_memory"]

# plans taken from each grid of caps, by each of two orders (Completions.plans)
_PLANS = 1


def plan(
    profile: Profile | str | os.PathLike[str],
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
    time_limit: float | None = 1.0,
    placement: str = "given",
) -> Plan:
    """The plan of least predicted iteration time for ``profile`` on ``devices``.

    Stages use ``devices`` in order (``k`` of them, ``k`` chosen), costed as in
    :mod:`autopipe.planning.cost`.

    Args:
        profile: what the profiler measured: a :class:`~autopipe.Profile` or its JSON path.
        devices: device names, a count (the profile's first ``n``), or ``None`` for the profile's.
        batch_size: the training batch (default: the profile's).
        memory_limit: bytes, or a size such as ``"16GiB"``, for every device or one per device;
            default: the capacity of CUDA devices, no limit on CPU.
        checkpoint: a checkpoint mode, or ``"auto"`` to choose one.
        optimizer_state: what the optimizer keeps per parameter: ``"sgd"`` (nothing),
            ``"momentum"`` (SGD with momentum: one buffer, 1x the parameters), ``"adam"`` (2x),
            or a factor (state bytes per parameter byte; :mod:`autopipe.planning.memory`).
        schedule: ``"gpipe"`` (fill-drain: ``pipe(x)`` then ``loss.backward()``), ``"1f1b"``
            (fewer micro-batches in flight, trained with :meth:`~autopipe.Pipeline.train_step`;
            searched by :mod:`autopipe.planning.one_f_one_b`, a heuristic priced by simulation)
            or ``"auto"`` (the faster prediction of the two; local engine only).
        speeds: relative device speeds (times are divided by them).
        chunks: the micro-batch count, or ``None`` to choose it.
        engine: what will run the plan: ``"local"`` (the in-process runtime) or ``"distributed"``
            (torch.distributed.pipelining: skips relayed by the stages between, equal
            micro-batches only).
        interleave: stages per device (:mod:`autopipe.planning.interleaved`): 1, 2, ..., or
            ``"auto"``, which also tries 2 where the local engine runs the plan, more than one
            device is given (the plan's options record what was tried).
        time_limit: seconds to search (``None``: no limit); the search then returns the best plan
            found, ``plan.predicted.lower_bound_ms`` a proven lower bound on every plan searched
            and ``plan.predicted.gap`` how far above it the plan may be (0 when the search
            finished: the plan is then optimal for the cost model).  The exact search also
            stops, with the same proven bound, where its partial plans would outgrow memory
            (a few GB; ``plan.options["memory_limit_reached"]``).
        placement: ``"given"`` places stage ``s`` on the ``s``-th device; ``"search"`` also
            searches which device each stage runs on where the order matters
            (:mod:`autopipe.planning.placement`).

    Returns:
        The :class:`Plan`, with its predicted times and the options it was made with.

    Raises:
        PlanningError: no plan fits the memory limits, or none was found within them (the message
            says which, and names the smallest per-device limit that would fit:
            :mod:`autopipe.planning._infeasible`).
        OptionError: an option is invalid (unknown mode, schedule or optimizer, chunks outside the
            profiled sizes, a memory size that cannot be read, ...); a ``ValueError`` and ``TypeError``.
        DeviceError: a device name that is not one, or a device count the profile cannot give.
        FormatError: the ``profile`` file is corrupt or of another schema.
    """
    budget = Budget(time_limit)  # from the start: checking the profile counts too
    profile = loaded(profile, Profile, "profile")
    digest = profile.checked_digest()  # a profile built or edited in memory is checked as a loaded one
    return search_pipeline(profile, devices, batch_size=batch_size, memory_limit=memory_limit,
                           checkpoint=checkpoint, optimizer_state=optimizer_state, schedule=schedule,
                           speeds=speeds, chunks=chunks, engine=engine, interleave=interleave,
                           time_limit=time_limit, placement=placement, budget=budget, digest=digest)


def search_pipeline(profile: Profile, devices: Sequence[Any] | int | None = None, *, batch_size: int | None = None,
                    memory_limit: float | str | Sequence[float | str | None] | None = None,
                    checkpoint: CheckpointChoice = "auto", optimizer_state: str | float = "momentum",
                    schedule: Schedule | str = "gpipe", speeds: Sequence[float] | None = None,
                    chunks: int | None = None, engine: EngineName = "local", interleave: int | str = "auto",
                    time_limit: float | None = 1.0, placement: str = "given", budget: Budget,
                    digest: str, copies: tuple[np.ndarray, np.ndarray] | None = None) -> Plan:
    """:func:`plan` of a profile already validated, whose ``digest`` the caller has (the replica
    search validates it once for all its pipeline searches), within ``budget`` (``time_limit``
    is what the plan records); ``copies``: latency and ms/byte per pair of ``devices`` in place of
    theirs (a replica plan's, :func:`~autopipe.planning.cost.replica_copies`)."""
    check_choice(placement, "placement", placements.PLACEMENTS)
    names = device_names(profile, devices)
    options = Options.check(profile, names, batch_size, memory_limit, checkpoint,
                             optimizer_state, schedule, speeds, chunks, engine, interleave)
    model = CostModel(profile, names, options.speeds,
                      options.batch_size, optimizer_state, engine, copies)
    searched, complete = placements.orders(model, placement, options.limits)
    choice, lower, order, tried = None, math.inf, searched[0], 0
    for candidate_order in searched:  # each order only looks for plans faster than the best so far
        if tried and budget.out():  # an order's setup alone takes 10-20 ms
            break
        found, bound = _search_all(placements.permuted(model, candidate_order), options,
                                   options.limits[list(candidate_order)], budget, choice)
        lower, tried = min(lower, bound), tried + 1
        if found is not None and (choice is None or found.iteration_ms < choice.iteration_ms):
            choice, order = found, candidate_order
    everywhere = complete and tried == len(searched)  # every order that could differ was searched
    if choice is None:
        limited = budget.spent or np.all(np.isinf(options.limits))  # without limits some plan fits: the search stopped
        raise PlanningError(unfound(options, time_limit) if limited else
                            infeasible(model, options, budget, None if everywhere else tried))
    record = {**options.record(), "time_limit": time_limit, "time_limit_reached": budget.spent,
              "memory_limit_reached": budget.crowded,
              "placement": placement, "placements_searched": "all" if everywhere else tried,
              "device_order": list(order)}
    return build_plan(profile, placements.permuted(model, order), choice.bounds, choice.chunks, choice.mode, record,
                      choice.interleave, choice.schedule, min(lower, choice.iteration_ms), choice.turns, digest,
                      choice.phases)


def _search_all(model: CostModel, options: Options, limits: np.ndarray, budget: Budget,
                incumbent: Choice | None = None) -> tuple[Choice | None, float]:
    """Every search the options ask for (fill-drain, interleaved, 1F1B) on devices in
    ``model``'s order: the best plan found faster than ``incumbent`` (``None`` if none is) and
    a lower bound on every plan searched."""
    choice, lower, seeds = incumbent, math.inf, []
    families = [factor for factor in options.interleaves if "gpipe" in options.schedules]
    families += ["1f1b"] if "1f1b" in options.schedules else []
    for index, family in enumerate(families):
        # each family gets an equal share of the time left: one that finishes early leaves the
        # rest to the next (at 1,000 layers x 64 devices with per-pair copies the fill-drain search
        # used the whole second, and the interleaved one, with no time, missed a 2.7% faster plan)
        part = budget.share(len(families) - index)
        if family == 1:
            outcome = solve_within(model, options.candidates, options.modes, limits, part, choice)
            seeds += [] if outcome.choice is None else [outcome.choice.bounds]
        elif family != "1f1b":
            outcome = interleaved.search(model, options.candidates, options.modes, limits, family, choice, part)
        else:
            if "gpipe" not in options.schedules and 1 in options.interleaves:
                # the best fill-drain split seeds the 1F1B search, found in half the time left
                seed = solve_within(model, options.candidates, options.modes, limits, part.share(2)).choice
                seeds += [] if seed is None else [seed.bounds]
            outcome = one_f_one_b.search(model, options.candidates, options.modes_1f1b, limits, choice, part,
                                         options.interleaves, seeds)
        budget.absorb(part)
        choice, lower = outcome.choice or choice, min(lower, outcome.lower_bound)
    return None if choice is incumbent else choice, lower


def _fill_drain_modes(modes: Sequence[CheckpointMode], limits: np.ndarray) -> list[CheckpointMode]:
    """The checkpoint modes the fill-drain search needs: without memory limits only ``never``
    where it is one of ``modes``, as recomputing is then only time: for the same split and
    micro-batch count the forward phase is the same and the backward one no shorter (its lanes
    grow by the recomputation, and the recurrence of :mod:`autopipe.planning.cost` gives ``V ≥``
    the largest lane's ``(m-1)·p`` less the recomputation after it, which the lane sum pays)."""
    if "never" in modes and np.all(np.isinf(limits)):
        return ["never"]
    return list(modes)


def solve(model: CostModel, candidates: Sequence[int], modes: Sequence[CheckpointMode],
          limits: np.ndarray) -> Choice | None:
    """The best plan over the micro-batch counts ``candidates`` and ``modes``, or ``None`` if
    none fits in memory (:func:`solve_within` without a time limit)."""
    return solve_within(model, candidates, modes, limits, Budget(None)).choice


def solve_within(model: CostModel, candidates: Sequence[int], modes: Sequence[str], limits: np.ndarray,
                 budget: Budget, incumbent: Choice | None = None) -> Outcome:
    """The best plan found over the micro-batch counts ``candidates`` and ``modes`` within
    ``budget`` (faster than ``incumbent``, a plan found elsewhere that prunes this search; else
    ``None``), and a lower bound on the optimum (equal to the plan's time when the search
    finished: it is then exact).  Without memory limits only ``never`` of ``modes`` is searched
    (:func:`_fill_drain_modes`): the others are never faster.

    Best first over all candidates (:mod:`autopipe.planning.refinement`): a candidate whose
    cheap bound is the least open one is scouted (a coarse grid of caps gives it cells with
    lower bounds, and plans), else the cells of least bound are refined; until every cell is
    dropped (the best plan is then optimal) or too narrow to refine.  A candidate with
    cells left gets a finer grid around its best plan and the exact search, those with the best
    plans first, so that the others are cut off early.  Ties go to the plan found first.  When
    the time is up, what is left contributes its bound: a candidate not scouted its cheap
    bound, one not searched to the end its cells'.
    """
    pairs = sorted(Candidate.all(model, candidates, _fill_drain_modes(modes, limits), len(limits)),
                   key=lambda c: (c.lower_bound, c.chunks, CHECKPOINT_MODES.index(c.mode)))
    leads: list[_Lead] = []

    def scout(candidate: Candidate, best: Choice | None, potentials: np.ndarray) -> tuple[Cells, Choice | None]:
        guess = _guess(model, model.speeds[: len(limits)], pairs, candidate, best)
        leads.append(_scout(model, candidate, limits, best, potentials, guess))
        return leads[-1].cells, leads[-1].plan

    def price(candidate: Candidate, splits: Sequence[tuple[int, ...]]) -> Choice | None:
        return _best_plan(model, candidate, limits, splits)[0]

    best, waiting, per_cell = refine(pairs, scout, price, model.speeds[: len(limits)],
                                     better(incumbent, _seed(model, pairs[0], limits)), budget)
    unsettled = [lead for lead in leads if lead.cells.least() < (math.inf if best is None else best.iteration_ms)]
    refined, left, best = _refine_all(model, unsettled, limits, best, per_cell, budget)
    stopped = False  # a search stopped for time (not for memory)
    for grid in sorted(refined, key=lambda grid: math.inf if grid.plan is None else grid.plan.iteration_ms):
        best, unresolved = _search(model, grid, limits, best, budget)
        left.append(unresolved)
        stopped = stopped or math.isfinite(unresolved) and not budget.crowded
    budget.spent = budget.spent or stopped or len(left) > len(refined)  # a grid or a search left out for time
    left.append(waiting)
    upper = math.inf if best is None else best.iteration_ms
    return Outcome(None if best is incumbent else best, min(upper, *left))


@dataclass(frozen=True)
class _Lead:
    """What a coarse grid of caps tells about a candidate: its cells with their lower bounds
    (refined later), a lower bound on the lane sum of its plans (within the grid's caps), its
    best plan found and that plan's largest forward and backward lanes."""

    candidate: Candidate
    cells: Cells
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


def _scout(model: CostModel, candidate: Candidate, limits: np.ndarray, best: Choice | None,
           potentials: np.ndarray, guess: tuple[float, float] | None = None) -> _Lead:
    """A first grid of caps for ``candidate`` (skips charged with ``potentials``), coarse or
    around the ``guess`` of its lanes (:func:`_guess`): cheap, and its bound and plans decide
    the order of the exact searches and cut most of them off."""
    levels = _levels(model, candidate, limits, best, guess, candidate.work, guessed=guess is not None)
    completions = Completions.grid(candidate, model.speeds[: len(limits)], *levels, skips=True,
                                   potentials=potentials)
    loose = bool(model.chain.skips) or candidate.effective == "except_last" or bool(np.any(np.isfinite(limits)))
    return _Lead(candidate, Cells.of(completions, loose), completions.floor,
                 *_best_plan(model, candidate, limits, completions.plans(_PLANS)))


def _guess(model: CostModel, speeds: np.ndarray, candidates: Sequence[Candidate], candidate: Candidate,
           best: Choice | None) -> tuple[float, float] | None:
    """Where ``candidate``'s best lanes likely lie: the largest forward and backward lanes of
    ``best``, scaled by the ratio of the two micro-batch counts' least possible lanes (their
    floors).  Where ``speeds`` differ its first grid has levels around them, as the coarse grid's
    start at the floors, which lie below the lanes of the best plans there: moving work to
    faster devices shortens the lane sum and lengthens the largest lanes (with equal speeds
    the coarse grid is as good, and cheaper).  ``None`` where ``best`` is not a fill-drain plan
    of ``candidates`` (or one with a lane of no work) or ``candidate`` pays for skips (there a
    cell costs several times as much, and the coarse grid did better)."""
    if best is None or best.interleave != 1 or best.schedule != "gpipe" or candidate.pays_skips or np.ptp(speeds) == 0:
        return None
    source = next((c for c in candidates if (c.chunks, c.mode) == (best.chunks, best.mode)), None)
    if source is None or min(source.floors) <= 0:
        return None
    lanes = _largest_lanes(model.evaluate(best.bounds, best.chunks, best.mode))
    return (lanes[0] * candidate.floors[0] / source.floors[0], lanes[1] * candidate.floors[1] / source.floors[1])


@dataclass(frozen=True)
class _Refined:
    """A candidate's finer grid of caps around its best lanes: the grid, a lower bound on the
    candidate's plans better than the best time when it was built, and its best plan."""

    candidate: Candidate
    completions: Completions
    least: float
    plan: Choice | None


def _refine(model: CostModel, lead: _Lead, limits: np.ndarray, best: Choice | None, xs: np.ndarray,
            ys: np.ndarray) -> _Refined:
    """The finer grid of caps ``xs × ys`` around ``lead``'s best plan, for the exact search to
    prune by."""
    completions = Completions.grid(lead.candidate, model.speeds[: len(limits)], xs, ys)
    found = better(lead.plan, _best_plan(model, lead.candidate, limits, completions.plans(_PLANS))[0])
    return _Refined(lead.candidate, completions, max(lead.cells.least(), completions.least()), found)


def _refine_all(model: CostModel, leads: list[_Lead], limits: np.ndarray, best: Choice | None, per_cell: float,
                budget: Budget) -> tuple[list[_Refined], list[float], Choice | None]:
    """The finer grid of each of ``leads`` (:func:`_refine`), the smallest first, while the next
    is foreseen to fit in ``budget`` (twice the slowest grid so far per cell, as steps vary;
    before the first, ``per_cell``: a refined cell's, which charges skips and so costs 2-4 times
    a grid's); the bounds of the leads left out, and the best plan.  A grid that does not fit
    leaves the time to the others and to the exact searches of those built."""
    refined, left = [], []
    grid_cell = per_cell
    levels = [(lead, _levels(model, lead.candidate, limits, best, lead.lanes, lead.floor)) for lead in leads]
    for lead, (xs, ys) in sorted(levels, key=lambda pair: len(pair[1][0]) * len(pair[1][1])):
        cells = len(xs) * len(ys)
        if not budget.fits(2 * grid_cell * cells):
            left.append(lead.cells.least())
            continue
        start = time.perf_counter()
        refined.append(_refine(model, lead, limits, best, xs, ys))
        took = (time.perf_counter() - start) / cells
        grid_cell = took if len(refined) == 1 else max(grid_cell, took)
        best = better(best, refined[-1].plan)
    return refined, left, best


def _search(model: CostModel, grid: _Refined, limits: np.ndarray, best: Choice | None,
            budget: Budget) -> tuple[Choice | None, float]:
    """``best`` or a better plan of ``grid.candidate`` by the exact DP (only while the grid's
    bound is under the best time), and a lower bound on the candidate's plans left unsearched
    when ``budget`` ran out (``inf`` when none was)."""
    if best is not None and grid.least >= best.iteration_ms:
        return best, math.inf
    if budget.out():
        return best, grid.least
    cutoff = math.inf if best is None else best.iteration_ms
    search = Search(model, grid.candidate, limits, cutoff, grid.completions, budget)
    found = search.run() or best
    return found, math.inf if search.finished else grid.least


def _levels(model: CostModel, candidate: Candidate, limits: np.ndarray, best: Choice | None,
            lanes: tuple[float, float] | None, least_sum: float,
            guessed: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """The levels of a grid of caps up to the largest lanes a plan better than ``best`` can
    have, given that its lane sum is at least ``least_sum`` (coarse, or around ``lanes``, a few
    if they are ``guessed``)."""
    caps = candidate.caps(math.inf if best is None else best.iteration_ms, least_sum)
    return grid_levels(candidate, len(limits), caps, lanes, guessed)


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
    return Choice(bounds, candidate.chunks, candidate.mode, evaluation.iteration_ms), _largest_lanes(evaluation)


def _largest_lanes(evaluation: Evaluation) -> tuple[float, float]:
    """A plan's largest forward lane (compute or copy) and largest backward lane."""
    return (max(max(s.forward, s.copy_in) for s in evaluation.stages),
            max(max(s.backward + s.recompute, s.copy_grad) for s in evaluation.stages))
