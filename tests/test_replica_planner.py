"""The replica planner: exact against brute force over (replicas, split, chunks, checkpoint),
refuses bad replica counts, prices the reduction tail, and its plans load and save."""
from __future__ import annotations

import itertools
import math
import random
from typing import Sequence

import numpy as np
import pytest
from helpers import all_splits
from synthetic import make_profile, random_profile

from autopipe.planning import interleaved
from autopipe.planning.cost import CostModel, replica_copies
from autopipe.planning.placement import permuted
from autopipe.planning.plans import Plan, placement
from autopipe.planning.replicas import _reductions, plan, reduction_time
from autopipe.planning.simulate import simulate
from autopipe.planning.solver import PlanningError, candidate_chunks
from autopipe.profiling.profiles import Profile, ReductionFit


def brute_force(profile: Profile, devices: int, limit: float, families: Sequence[tuple[str, int]] = (("gpipe", 1),),
                counts: Sequence[int] | None = None, batch: int | None = None,
                speeds: Sequence[float] | None = None, optimizer: str | float = 2.0) -> tuple[float, int, int]:
    """Least total time over every replica count (or ``counts``), plan of ``families`` (schedule
    and stages per device), split, micro-batch count and mode (``always`` too under 1F1B, as the
    planner's ``checkpoint="auto"``), and with ``speeds`` (of each replica's devices) every order
    of the devices, with the reduction tail computed here from the simulator's timeline (each
    replica's pipeline on the slowest of the replicas' links between the same positions), the
    memory of ``optimizer``'s state and step; and the replicas and stages of that optimum."""
    best = (math.inf, 0, 0)
    batch = profile.batch_size if batch is None else batch
    for replicas in counts or [r for r in range(1, devices + 1) if devices % r == 0]:
        per, share = devices // replicas, -(-batch // replicas)
        links = replica_copies(profile, [["cpu"] * per] * replicas)  # the slowest replica's, per pair
        model = CostModel(profile, ["cpu"] * per, speeds or [1.0] * per, share, optimizer, "local", links)
        orders = itertools.permutations(range(per)) if speeds else [tuple(range(per))]
        for order, (schedule, interleave) in itertools.product(orders, families):
            moved = permuted(model, order)
            modes = ("never", "except_last", "always") if schedule == "1f1b" else ("never", "except_last")
            for bounds in all_splits(model.layers, per * interleave):
                stages = len(bounds) - 1
                if stages % interleave or (interleave > 1 and stages < 2 * interleave):
                    continue
                for m in candidate_chunks(share, profile.batch_sizes):
                    for mode in modes:
                        end = _total(profile, moved, bounds, m, mode, schedule, interleave, limit, replicas)
                        if end < best[0] - 1e-9:
                            best = (end, replicas, stages)
    return best


def _total(profile: Profile, model: CostModel, bounds: tuple[int, ...], m: int, mode: str, schedule: str,
           interleave: int, limit: float, replicas: int) -> float:
    """A plan's pipeline time (under its faster turn rule) and reduction tail; ``inf`` if it
    does not fit."""
    ms, rule, _ = interleaved.timed(model, bounds, m, mode, interleave, np.full(len(model.devices), limit), schedule)
    if math.isinf(ms):
        return ms
    where = placement(len(bounds) - 1, interleave)
    timeline = simulate(model.stage_lanes(bounds, m, mode, where, schedule), m, mode, where, schedule, rule)
    end = timeline.iteration_ms
    for s in range(len(bounds) - 1):
        done = max(e.end_ms for e in timeline.events if e.stage == s and e.kind == "B")
        params = sum(layer.param_bytes for layer in profile.layers[bounds[s]:bounds[s + 1]])
        end = max(end, done + reduction_time(profile, "local", replicas, params)[0])
    return end


def _instance(rng: random.Random) -> tuple[Profile, int]:
    layers, devices = rng.randint(2, 7), rng.choice([2, 4])
    profile = random_profile(rng, layers, devices, skips=rng.randint(0, 2), per_pair=False)
    profile.reductions = [ReductionFit("local", 2, rng.uniform(0, 2.0), rng.choice([1e-5, 1e-4, 1e-3]), [])]
    return profile, devices


def _kind(replicas: int, stages: int, devices: int) -> str:
    if replicas == devices:
        return "data parallel"
    return "pipeline" if replicas == 1 else "hybrid"


def test_optimal_against_brute_force_with_each_kind_winning() -> None:
    rng = random.Random(14)
    won: dict[str, int] = {}
    for _ in range(50):
        profile, devices = _instance(rng)
        whole = CostModel(profile, ["cpu"], [1.0], profile.batch_size, 2.0, "local")
        peak = whole.evaluate((0, len(profile.layers)), 1, "never").peak_memory
        limit = math.inf if rng.random() < 0.3 else peak * rng.uniform(0.15, 1.1)
        expected, replicas, stages = brute_force(profile, devices, limit)
        if math.isinf(expected):
            with pytest.raises(PlanningError):
                plan(profile, devices, memory_limit=limit, interleave=1, optimizer_state=2.0, time_limit=None)
            continue
        chosen = plan(profile, devices, memory_limit=limit, interleave=1, optimizer_state=2.0, time_limit=None)
        assert chosen.predicted.iteration_ms == pytest.approx(expected, rel=1e-9)
        assert all(stage.memory_bytes <= limit + 1 for stage in chosen.stages)
        won[_kind(replicas, stages, devices)] = won.get(_kind(replicas, stages, devices), 0) + 1
    assert set(won) == {"data parallel", "pipeline", "hybrid"}, won


def test_optimal_against_brute_force_with_a_named_optimizer() -> None:
    """SGD with momentum (the default) keeps one buffer and its step allocates nothing; priced as
    its factor alone (1.0, which names no optimizer: the most any step allocates), replica splits
    that fit were refused and a slower plan was called optimal."""
    rng = random.Random(5)
    for _ in range(40):
        profile, devices = _instance(rng)
        whole = CostModel(profile, ["cpu"], [1.0], profile.batch_size, "momentum", "local")
        limit = whole.evaluate((0, len(profile.layers)), 1, "never").peak_memory * rng.uniform(0.3, 0.9)
        expected = brute_force(profile, devices, limit, optimizer="momentum")[0]
        if math.isinf(expected):
            continue
        chosen = plan(profile, devices, memory_limit=limit, interleave=1, time_limit=None)
        assert chosen.predicted.iteration_ms == pytest.approx(expected, rel=1e-9)
        assert all(stage.memory_terms["step"] == 0 for stage in chosen.stages)


def test_bounds_never_exceed_the_brute_force_optimum_when_stopped_early() -> None:
    """Stopped at once, the plan's lower bound (the least over replica counts, each at least
    its pipeline's bound and what its reduction tail needs) is still at most the optimum."""
    rng = random.Random(15)
    for _ in range(25):
        profile, devices = _instance(rng)
        expected = brute_force(profile, devices, math.inf)[0]
        for time_limit in (1e-6, 0.02, None):
            chosen = plan(profile, devices, interleave=1, optimizer_state=2.0, time_limit=time_limit)
            assert chosen.predicted.lower_bound_ms <= expected * (1 + 1e-9)
            assert chosen.predicted.iteration_ms >= expected * (1 - 1e-9)


def test_replicas_must_divide_the_devices_and_fit_the_batch() -> None:
    profile = make_profile([1.0] * 4, devices=4, param_bytes=1000)
    with pytest.raises(ValueError, match=r"replicas=3 does not divide the 4 devices .* use one of \[1, 2, 4\]"):
        plan(profile, 4, replicas=3)
    with pytest.raises(ValueError, match="replicas must be 'auto' or a positive integer"):
        plan(profile, 4, replicas=0)
    with pytest.raises(ValueError, match="more than the batch of 2 samples"):
        plan(profile, 4, replicas=4, batch_size=2)
    with pytest.raises(ValueError, match="replicas=2 does not divide the batch of 7, and the distributed engine"):
        plan(profile, 4, replicas=2, engine="distributed", batch_size=7)
    distributed = plan(profile, 4, replicas=2, engine="distributed")
    assert distributed.replicas == 2 and distributed.replica_batch_size * 2 == distributed.batch_size


def test_hybrid_plan_layout_prediction_and_file(tmp_path) -> None:
    profile = make_profile([1.0, 2.0, 3.0, 1.0], devices=4, param_bytes=10_000, output_bytes=10,
                           copies=(0.01, 0.0))
    profile.reductions = [ReductionFit("local", 2, 0.5, 1e-4, [])]
    chosen = plan(profile, ["cpu"] * 4, replicas=2, interleave=1)
    assert chosen.replicas == 2 and len(chosen.replica_devices) == 2
    assert chosen.batch_size == 8 and chosen.replica_batch_size == 4
    assert chosen.options["reduction"] == "measured" and chosen.options["replicas_searched"].keys() == {"2"}
    # the tail: stage 0 finishes last and reduces its own parameters after it
    params0 = 10_000 * (chosen.stages[0].stop - chosen.stages[0].start)
    assert chosen.predicted.reduction_ms >= 0.5 + params0 * 1e-4 - 1e-9
    saved = Plan.load(chosen.save(tmp_path / "plan.json"))
    assert saved.replicas == 2 and saved.replica_devices == chosen.replica_devices
    assert saved.predicted == chosen.predicted


def test_replicas_need_no_copy_fit_between_them() -> None:
    """Two machines profiled apart have no fits between them, and their replicas never copy
    between them: planned (pricing every replica's links asked for every pair of devices)."""
    names = ["cuda:0", "cuda:1", "cuda:2", "cuda:3"]
    profile = make_profile([4.0] * 4, devices=names, output_bytes=1000, param_bytes=100_000, copies=(0.05, 1e-6))
    profile.copies = [fit for fit in profile.copies if fit.src // 2 == fit.dst // 2]
    profile.reductions = [ReductionFit("local", 2, 0.0, 1e-6, [])]
    for count in (2, 4):
        chosen = plan(profile, names, replicas=count, memory_limit="16GiB", time_limit=None)
        assert chosen.replicas == count and math.isfinite(chosen.predicted.iteration_ms)


@pytest.mark.parametrize("limit", [math.inf, [math.inf, 1e9]])
def test_an_infinite_memory_limit_is_saved_as_none(tmp_path, limit) -> None:
    """No limit, as the pipeline planner records it: JSON holds no infinity (save() refused it)."""
    profile = make_profile([1.0] * 4, devices=2, output_bytes=100, param_bytes=1000)
    chosen = plan(profile, 2, memory_limit=limit, time_limit=None)
    saved = Plan.load(chosen.save(tmp_path / "plan.json"))
    assert saved.options["memory_limit"] == (None if limit == math.inf else [None, 1e9])
    assert saved.to_json() == chosen.to_json()


def test_old_files_load_as_one_replica_and_estimate_reduction(tmp_path) -> None:
    profile = make_profile([1.0, 2.0], devices=2, param_bytes=1000, copies=(0.2, 1e-3))
    path = profile.save(tmp_path / "profile.json")
    assert "reductions" not in path.read_text()  # an old profile's digest stays its own
    assert Profile.load(path).reductions == []
    chosen = plan(Profile.load(path), 2, replicas=2)
    assert chosen.options["reduction"] == "estimated from copy fits"
    # estimate: the copy fit's latency + bytes * ms/byte, once per other replica
    assert reduction_time(profile, "local", 2, 2000) == (pytest.approx(0.2 + 2000 * 1e-3), False)
    pipeline = plan(profile, 2, replicas=1)
    document = pipeline.to_json()
    for key in ("replicas", "replica_devices"):
        document.pop(key)
    document["predicted"].pop("reduction_ms")
    import json
    (tmp_path / "old.json").write_text(json.dumps(document))
    old = Plan.load(tmp_path / "old.json")
    assert old.replicas == 1 and old.replica_devices == [old.devices] and old.predicted.reduction_ms == 0.0


def test_memory_limit_just_under_a_replica_forces_a_pipeline() -> None:
    profile = make_profile([1.0] * 6, devices=2, param_bytes=100_000, saved_bytes=10)
    free = plan(profile, 2)
    assert free.replicas == 2  # sub-linear layer times: two half batches beat a pipeline
    need = max(stage.memory_bytes for stage in free.stages)
    limited = plan(profile, 2, memory_limit=need - 1)
    assert limited.replicas == 1 and limited.device_count == 2
    assert np.all([stage.memory_bytes < need for stage in limited.stages])


def test_cli_plan_replicas_compare_and_show(tmp_path, capsys) -> None:
    from autopipe.cli import main

    profile = make_profile([1.0] * 6, devices=2, param_bytes=100_000, saved_bytes=10)
    profile.reductions = [ReductionFit("local", 2, 0.5, 1e-6, [])]
    path = profile.save(tmp_path / "p.json")
    out = tmp_path / "plan.json"
    assert main(["plan", str(path), "--compare", "-o", str(out)]) == 0
    text = capsys.readouterr().out
    chosen = Plan.load(out)
    assert chosen.replicas == 2 and "replicas:      2 (data parallel), on cpu | cpu, each with 4 of" in text
    assert "(cost measured)" in text
    rows = {line.split("  ")[0]: line for line in text.splitlines()
            if line.startswith(("ours", "pure data parallel", "best pipeline only"))}
    assert set(rows) == {"ours (autopipe)", "pure data parallel", "best pipeline only"}
    assert " 1.00x" in rows["pure data parallel"] and rows["best pipeline only"].split()[6] == "1"
    assert main(["show", str(out), "--width", "30"]) == 0
    shown = capsys.readouterr().out
    assert "replica 1: stages on cpu" in shown and "stage 0  reduce" in shown
    assert main(["plan", str(path), "--replicas", "3"]) != 0
    assert "--replicas 3 does not divide the 2 devices" in capsys.readouterr().err
    assert main(["plan", str(path), "--replicas", "1", "-o", str(out)]) == 0
    assert Plan.load(out).replicas == 1


def test_no_replica_count_fitting_names_each_counts_smallest_limit_as_its_own() -> None:
    """Each replica count's error names the smallest limit for its own plans; the message says
    so and the least of them fits (each read alone claimed to be 'the smallest')."""
    import re

    profile = make_profile([1.0] * 4, sizes=(1, 2, 4, 8), devices=2, param_bytes=1000, saved_bytes=100)
    with pytest.raises(PlanningError, match=r"for any replica count \(1, 2\); .* the least of them fits") as error:
        plan(profile, memory_limit=10, time_limit=None)
    named = [int(n) for n in re.findall(r"is (\d+) bytes", str(error.value))]
    assert len(named) == 2
    assert plan(profile, memory_limit=min(named), time_limit=None).stages
    with pytest.raises(PlanningError):
        plan(profile, memory_limit=min(named) - 1, time_limit=None)


def test_distributed_replicas_get_micro_batches_that_divide_their_share() -> None:
    """The distributed engine needs equal micro-batches: re-priced with the reduction tail, a
    replica's split keeps to counts that divide its share (15 of a batch of 30)."""
    profile = make_profile([5.0] * 8, sizes=(1, 2, 3, 4, 6, 8, 12, 16), batch_size=32, devices=4,
                           param_bytes=[10] * 6 + [4_000_000, 4_000_000], output_bytes=100, saved_bytes=100,
                           copies=(0.01, 1e-6))
    chosen = plan(profile, 4, replicas=2, batch_size=30, engine="distributed")
    assert chosen.options["replica_split"] == "least total"
    assert chosen.replica_batch_size == 15 and 15 % chosen.chunks == 0


def test_searched_placement_carries_to_every_replica(tmp_path) -> None:
    """Each replica runs on its group's devices in the order the search placed the first
    replica's (fast devices first here), and the plan saves and loads."""
    names = ["cuda:0", "cuda:1", "cuda:2", "cuda:3"]  # planned only
    profile = make_profile([5.0] * 8, sizes=(1, 2, 4, 8, 16), batch_size=32, devices=names,
                           param_bytes=1000, output_bytes=100, saved_bytes=100, copies=(0.01, 1e-6))
    chosen = plan(profile, names, replicas=2, speeds=[1, 3, 1, 3], memory_limit="1GB", placement="search",
                  interleave=1)
    order = chosen.options["device_order"]
    groups = [names[:2], names[2:]]
    assert chosen.replica_devices == [[group[order[d]] for d in chosen.placement] for group in groups]
    assert chosen.replica_devices[0] == [chosen.devices[d] for d in chosen.placement]
    assert chosen.devices[0] == "cuda:1"  # the fast one
    chosen.save(tmp_path / "plan.json")
    assert Plan.load(tmp_path / "plan.json").replica_devices == chosen.replica_devices


@pytest.mark.parametrize("asked", [{"schedule": "1f1b", "interleave": 1}, {"interleave": 2}])
def test_a_schedule_or_interleave_asked_for_stays_with_replicas(asked) -> None:
    """The reduction tail's re-pricing covers one-stage-per-device fill-drain splits only: a 1F1B
    schedule or two stages per device asked for is what the plan runs."""
    rng = random.Random(1)
    for _ in range(12):
        profile = random_profile(rng, rng.randint(5, 9), 4, skips=rng.randint(0, 1), per_pair=False,
                                 sizes=(1, 2, 3, 4, 6, 8))
        chosen = plan(profile, 4, replicas=2, batch_size=16, checkpoint="never", **asked)
        assert chosen.schedule == asked.get("schedule", "gpipe")
        assert chosen.interleave == asked["interleave"]


@pytest.mark.parametrize("asked", [{"schedule": "auto", "interleave": 1}, {"schedule": "gpipe", "interleave": "auto"}])
def test_plans_not_priced_with_their_tails_keep_the_bound_below_them(asked) -> None:
    """Only fill-drain splits of one stage per device are re-priced with their reduction tails:
    the 1F1B and interleaved plans the pipeline search also tries are bounded by its bound, so
    the plan's bound stays at most the optimum over every plan searched, and a gap of 0 means
    the optimum (a fill-drain plan of 42.96 ms was called optimal where a 1F1B one of 42.05 ms
    fits, and one of 131.5 ms where an interleaved one of 118.3 ms does)."""
    schedules = ["gpipe", "1f1b"] if asked["schedule"] == "auto" else ["gpipe"]
    rng = random.Random(192)
    layers, devices = rng.randint(1, 7), rng.choice([2, 4, 4, 3])
    profile = random_profile(rng, layers, devices, skips=rng.randint(0, 2), per_pair=rng.random() < 0.5)
    profile.reductions = [ReductionFit("local", 2, rng.uniform(0, 2.0), rng.choice([1e-5, 1e-4, 1e-3]), [])]
    cases = [(profile, 4, {"replicas": 2, "batch_size": 7}), (*_instance(random.Random(0)), {"replicas": 2})]
    cases += [(*_instance(rng), {}) for _ in range(6)]
    for profile, devices, options in cases:
        interleaves = [1, 2] if asked["interleave"] == "auto" and len(profile.layers) >= 4 else [1]
        families = [(schedule, v) for schedule in schedules for v in interleaves]
        counts = [options["replicas"]] if "replicas" in options else None
        expected = brute_force(profile, devices, math.inf, families, counts, options.get("batch_size"))[0]
        chosen = plan(profile, devices, optimizer_state=2.0, time_limit=None, **asked, **options)
        assert chosen.predicted.lower_bound_ms <= expected * (1 + 1e-9)
        assert chosen.predicted.iteration_ms >= expected * (1 - 1e-9)
        if chosen.predicted.gap == 0:
            assert chosen.predicted.iteration_ms == pytest.approx(expected, rel=1e-9)


def test_splits_are_priced_with_their_tails_on_every_device_order_searched() -> None:
    """With ``placement="search"`` the pipeline search tries every device order, and so does
    the re-pricing with the reduction tail (it priced the given order only, and called a plan
    16% slower than the optimum exact)."""
    for seed in (12, 84):
        rng = random.Random(seed)
        profile, devices = _instance(rng)
        speeds = [rng.choice([1.0, 2.0]) for _ in range(2)]
        speeds = [1.0, 3.0] if speeds[0] == speeds[1] else speeds
        expected = brute_force(profile, devices, math.inf, counts=[2], speeds=speeds)[0]
        chosen = plan(profile, devices, replicas=2, speeds=speeds * 2, optimizer_state=2.0, interleave=1,
                      placement="search", time_limit=None)
        assert chosen.predicted.iteration_ms == pytest.approx(expected, rel=1e-9) and chosen.predicted.gap == 0


def test_frozen_parameters_are_not_reduced():
    profile = make_profile([1.0, 1.0], devices=2, param_bytes=40_000, copies=(0.1, 1e-6))
    trained = _reductions(profile, [0, 1, 2], 2, "local")
    profile.layers[0].grad_param_bytes = 0  # layer 0 frozen: its stage has no gradient to reduce
    frozen = _reductions(profile, [0, 1, 2], 2, "local")
    assert trained[0] > 0 and frozen == [0.0, trained[1]]


def test_every_replicas_links_are_priced_not_the_first_replicas_alone() -> None:
    """Replica 1's devices are joined by a slow link (another node): a plan of two replicas pays
    it, as the step waits for the slowest replica, so it is no faster than either replica's own
    pipeline, and the planner keeps the one pipeline on the fast link (it chose two replicas at a
    predicted 30 ms, gap 0, that would take 138)."""
    names = ["cuda:0", "cuda:1", "cuda:2", "cuda:3"]
    copies = {(i, j): (0.01, 1e-6) for i in range(4) for j in range(4) if i != j}
    copies[2, 3] = copies[3, 2] = (50.0, 1e-3)
    profile = make_profile([4.0] * 4, devices=names, output_bytes=1000, param_bytes=100_000, copies=copies)
    profile.reductions = [ReductionFit("local", 2, 0.0, 1e-6, [])]
    limit = 0.8 * CostModel(profile, names[:1], [1.0], 8).evaluate((0, 4), 8, "always").peak_memory
    two = plan(profile, names, memory_limit=limit, interleave=1, replicas=2, time_limit=None)
    bounds = [stage.start for stage in two.stages] + [two.stages[-1].stop]
    for group in two.replica_devices:
        own = CostModel(profile, group, [1.0] * len(group), two.batch_size // 2).evaluate(bounds, two.chunks,
                                                                                          two.checkpoint)
        assert two.predicted.iteration_ms >= own.iteration_ms - 1e-9, group
    chosen = plan(profile, names, memory_limit=limit, interleave=1, time_limit=None)
    assert chosen.replicas == 1 and chosen.predicted.iteration_ms < two.predicted.iteration_ms
