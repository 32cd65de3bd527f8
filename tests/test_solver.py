"""The solver is exact (brute force on random instances) and obeys memory limits and speeds."""
from __future__ import annotations

import itertools
import math
import random
from pathlib import Path

import numpy as np
import pytest
from synthetic import make_profile, random_profile

from autopipe.cost import CostModel
from autopipe.profiles import Profile
from autopipe.solver import PlanningError, candidate_chunks, plan, solve

ROOT = Path(__file__).resolve().parents[1]


def model_of(profile, speeds, engine="local"):
    return CostModel(profile, profile.devices, speeds, profile.batch_size, 2.0,
                     engine)


def all_splits(layers, devices):
    for k in range(1, devices + 1):
        for cuts in itertools.combinations(range(1, layers), k - 1):
            yield (0, *cuts, layers)


def brute_force(model, chunks, modes, limits):
    """Every stage count, split, micro-batch count and mode: the least feasible time."""
    best = math.inf
    for bounds in all_splits(model.layers, len(limits)):
        for m in chunks:
            for mode in modes:
                evaluation = model.evaluate(bounds, m, mode)
                if all(s.memory <= limit for s, limit in zip(evaluation.stages, limits)):
                    best = min(best, evaluation.iteration_ms)
    return best


@pytest.mark.parametrize("seed", range(6))
def test_optimal_against_brute_force(seed):
    rng = random.Random(seed)
    for _ in range(50):
        layers, devices = rng.randint(1, 12), rng.randint(1, 4)
        profile = random_profile(rng, layers, devices, skips=rng.randint(0, 3), per_pair=rng.random() < 0.6)
        speeds = [rng.choice([0.5, 1.0, 1.5, 2.0]) for _ in range(devices)]
        model = model_of(profile, speeds)
        chunks = candidate_chunks(profile.batch_size, profile.batch_sizes)
        # "auto" tries never and except_last: 'always' is dominated; check that claim too
        modes = rng.choice([["never", "except_last"], ["always"], ["except_last"]])
        limits = np.full(devices, math.inf)
        if rng.random() < 0.5:
            limits[:] = model.evaluate((0, layers), 1, "never").peak_memory * rng.uniform(0.2, 1.0)
        expected = brute_force(model, chunks, modes, limits)
        if modes == ["never", "except_last"]:
            assert brute_force(model, chunks, ["never", "except_last", "always"], limits) == expected
        choice = solve(model, chunks, modes, limits)
        if math.isinf(expected):
            assert choice is None
            continue
        assert choice.iteration_ms == pytest.approx(expected, rel=1e-9)
        evaluation = model.evaluate(choice.bounds, choice.chunks, choice.mode)
        assert evaluation.iteration_ms == pytest.approx(expected, rel=1e-9)
        assert all(s.memory <= limit for s, limit in zip(evaluation.stages, limits))


@pytest.mark.parametrize("seed", range(2))
def test_optimal_against_brute_force_for_the_distributed_engine(seed):
    """Relayed skips (more of them, so they cross several cuts), equal micro-batches only."""
    rng = random.Random(100 + seed)
    for _ in range(20):
        layers, devices = rng.randint(2, 10), rng.randint(2, 4)
        profile = random_profile(rng, layers, devices, skips=rng.randint(1, 4), per_pair=rng.random() < 0.6)
        profile.batch_size = rng.choice([6, 8])
        speeds = [rng.choice([0.5, 1.0, 2.0]) for _ in range(devices)]
        model = model_of(profile, speeds, "distributed")
        chunks = candidate_chunks(profile.batch_size, profile.batch_sizes, equal=True)
        assert all(profile.batch_size % m == 0 for m in chunks)
        modes = rng.choice([["never", "except_last"], ["always"]])
        limits = np.full(devices, math.inf)
        if rng.random() < 0.5:
            limits[:] = model.evaluate((0, layers), 1, "never").peak_memory * rng.uniform(0.2, 1.0)
        expected = brute_force(model, chunks, modes, limits)
        choice = solve(model, chunks, modes, limits)
        if math.isinf(expected):
            assert choice is None
            continue
        assert choice.iteration_ms == pytest.approx(expected, rel=1e-9)
        assert model.evaluate(choice.bounds, choice.chunks, choice.mode).iteration_ms == pytest.approx(expected,
                                                                                                    rel=1e-9)


def test_distributed_engine_is_recorded_and_needs_equal_micro_batches():
    profile = make_profile([1.0] * 6, sizes=(1, 2, 4, 8), batch_size=6, devices=2, output_bytes=100,
                           copies=(0.1, 1e-4), skips=[("s", 0, 5, 50)])
    chosen = plan(profile, engine="distributed")
    assert chosen.options["engine"] == "distributed" and 6 % chosen.chunks == 0
    assert plan(profile).options["engine"] == "local"
    assert candidate_chunks(10, [1, 8]) == [2, 3, 4, 5, 10]
    assert candidate_chunks(10, [1, 8], equal=True) == [2, 5, 10]
    with pytest.raises(ValueError, match="chunks=4 does not divide batch size 6"):
        plan(profile, chunks=4, engine="distributed")
    with pytest.raises(ValueError, match="engine 'mpi' is not one of"):
        plan(profile, engine="mpi")


def test_constant_costs_1001_to_1012_over_three_stages():
    profile = make_profile([1001.0 + i for i in range(12)], sizes=(1, 2, 4, 8), linear=True, devices=3)
    chosen = plan(profile, chunks=8)
    assert chosen.balance == [4, 4, 4]
    assert max(s.forward_ms for s in chosen.stages) * 8 == pytest.approx(1009 + 1010 + 1011 + 1012)


def test_memory_limit_respected_and_infeasible_error_states_the_exact_minimum():
    profile = make_profile([1.0] * 6, sizes=(1, 2, 4), devices=3, output_bytes=500, param_bytes=10_000,
                           saved_bytes=[4000, 100, 3000, 100, 100, 2000])
    model = model_of(profile, [1.0] * 3)
    chunks = candidate_chunks(profile.batch_size, profile.batch_sizes)
    smallest = min(
        max(s.memory for s in model.evaluate(bounds, m, mode).stages)
        for bounds in all_splits(6, 3) for m in chunks for mode in ("never", "except_last")
    )
    fitted = plan(profile, memory_limit=smallest)
    assert max(s.memory_bytes for s in fitted.stages) <= smallest
    with pytest.raises(PlanningError, match=f"would fit is {int(smallest)} bytes"):
        plan(profile, memory_limit=smallest - 1)
    # one limit per device: a small first device pushes layers to the others
    per_device = plan(profile, memory_limit=[smallest, 10**9, 10**9])
    assert per_device.stages[0].memory_bytes <= smallest


def test_faster_device_gets_more_layers():
    profile = make_profile([1.0] * 12, sizes=(1, 2, 4, 8), linear=True, devices=2)
    assert plan(profile, chunks=8).balance == [6, 6]
    slow_first = plan(profile, chunks=8, speeds=[1.0, 3.0]).balance
    fast_first = plan(profile, chunks=8, speeds=[3.0, 1.0]).balance
    assert slow_first[1] > slow_first[0] and fast_first[0] > fast_first[1]
    assert slow_first == [3, 9] and fast_first == [9, 3]


def test_expensive_copies_use_fewer_devices():
    profile = make_profile([1.0] * 8, sizes=(1, 2, 4, 8), linear=True, devices=4, output_bytes=1000,
                           copies=(1000.0, 0.0))
    assert len(plan(profile).stages) == 1


def test_options_are_checked_with_a_fix():
    profile = make_profile([1.0] * 4, sizes=(2, 4), devices=2)
    with pytest.raises(ValueError, match="use 'gpipe'.*schedule='1f1b' when chunks >= stages"):
        plan(profile, schedule="1f1b", engine="distributed")
    with pytest.raises(ValueError, match="outside 1..4 or the profiled sizes 2..4"):
        plan(profile, chunks=4)
    with pytest.raises(ValueError, match="cannot be split into micro-batches of the profiled sizes"):
        plan(profile, batch_size=1)
    with pytest.raises(ValueError, match="speeds must be 2 positive numbers"):
        plan(profile, speeds=[1.0])
    assert candidate_chunks(10, [1, 10]) == [1, 2, 3, 4, 5, 10]


def test_plan_records_what_it_predicts():
    profile = make_profile([1.0, 2.0, 3.0, 4.0], sizes=(1, 2, 4), devices=2, output_bytes=100,
                           copies=(0.1, 1e-4), skips=[("s", 0, 3, 50)])
    chosen = plan(profile, checkpoint="always", memory_limit="1GiB")
    assert chosen.checkpoint == "always" and chosen.profile_digest == profile.digest
    assert chosen.model == profile.model
    assert chosen.split_points == [(s.start, s.first_layer) for s in chosen.stages[1:]]
    assert chosen.options["memory_limit_bytes"] == [2**30, 2**30]
    assert 0.0 <= chosen.predicted.bubble_fraction < 1.0
    assert chosen.predicted.iteration_ms == pytest.approx(chosen.predicted.forward_ms + chosen.predicted.backward_ms)


@pytest.mark.parametrize("devices", [2, 4, 8])
@pytest.mark.parametrize("name", ["resnet50-128.json", "resnet18-128.json"])
def test_committed_profiles_plan_for_2_4_8_devices(name, devices):
    path = ROOT / "profiles" / name
    if not path.exists():
        pytest.skip(f"{path} is not committed yet")
    profile = Profile.load(path)
    chosen = plan(profile, devices)
    assert sum(chosen.balance) == len(profile.layers)
    assert len(chosen.stages) <= devices


def test_pareto_mask_keeps_exactly_the_undominated_points_per_group():
    from autopipe.solver import _pareto_mask

    rng = np.random.default_rng(0)
    for columns in (3, 4):
        groups = np.sort(rng.integers(0, 5, 600))
        points = rng.integers(0, 6, (600, columns)).astype(float)  # small range: ties and duplicates
        order = np.lexsort(tuple(points.T[::-1]) + (groups,))
        groups, points = groups[order], points[order]
        keep = _pareto_mask(points, groups, block=16)
        for g in range(5):
            rows = np.flatnonzero(groups == g)
            unique = {tuple(p) for p in points[rows]}
            front = {p for p in unique if not any(q != p and all(a <= b for a, b in zip(q, p)) for q in unique)}
            assert sorted(tuple(p) for p in points[rows[keep[rows]]]) == sorted(front)


def test_cheapest_cuts_against_sorting_by_hand():
    from autopipe.solver import _cheapest_cuts

    profile = make_profile([1.0] * 6, sizes=(1, 2), devices=3, output_bytes=[5, 0, 3, 9, 1, 0],
                           copies={(0, 1): (1.0, 0.1), (1, 0): (2.0, 0.2), (1, 2): (0.5, 0.3), (2, 1): (3.0, 0.1),
                                   (0, 2): (0.0, 0.0), (2, 0): (0.0, 0.0)})
    model = model_of(profile, [1.0] * 3)
    table = _cheapest_cuts(model, model.at(2), 3)
    # the cut before layer c copies layer c-1's output (2 samples) at latency 0.5 + 2.0, 0.1 + 0.1 ms/byte
    cost = {c: 0.0 if n == 0 else 2.5 + 2 * n * 0.2 for c, n in zip(range(1, 6), [5, 0, 3, 9, 1])}
    for stop in range(7):
        after = sorted(cost[c] for c in range(stop + 1, 6))
        expected = [0.0] + [sum(after[:j]) if j <= len(after) else math.inf for j in (1, 2)]
        assert table[stop].tolist() == pytest.approx(expected)
