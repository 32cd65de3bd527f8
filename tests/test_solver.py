"""The solver is exact (brute force on random instances) and obeys memory limits and speeds."""
from __future__ import annotations

import itertools
import math
import random
from pathlib import Path
from typing import Sequence

import numpy as np
import pytest
from helpers import StopAfter, all_splits, brute_force, model_of
from synthetic import make_profile, random_profile

from autopipe.errors import OptionError
from autopipe.profiling.profiles import Profile
from autopipe.planning._infeasible import infeasible
from autopipe.planning._options import Options
from autopipe.planning.cost import CostModel
from autopipe.planning.plans import placement
from autopipe.planning.solver import PlanningError, candidate_chunks, plan, smallest_memory, solve

ROOT = Path(__file__).resolve().parents[1]


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
            if np.all(np.isinf(limits)):  # solve then searches only "never" (solver._fill_drain_modes)
                assert brute_force(model, chunks, ["never"], limits) == expected
        choice = solve(model, chunks, modes, limits)
        if math.isinf(expected):
            assert choice is None
            continue
        assert choice.iteration_ms == pytest.approx(expected, rel=1e-9)
        evaluation = model.evaluate(choice.bounds, choice.chunks, choice.mode)
        assert evaluation.iteration_ms == pytest.approx(expected, rel=1e-9)
        assert all(s.memory <= limit for s, limit in zip(evaluation.stages, limits))


@pytest.mark.parametrize("seed", range(3))
def test_recomputing_never_shortens_a_fill_drain_split(seed):
    """Split by split, checkpointing only adds time (memory aside): why a fill-drain search
    without memory limits tries "never" alone."""
    rng = random.Random(seed)
    for _ in range(30):
        layers, devices = rng.randint(1, 9), rng.randint(1, 4)
        profile = random_profile(rng, layers, devices, skips=rng.randint(0, 3), per_pair=rng.random() < 0.6)
        model = model_of(profile, [rng.choice([0.5, 1.0, 2.0]) for _ in range(devices)])
        for bounds in all_splits(layers, devices):
            for chunks in (1, 2, 4, 8):
                never = model.evaluate(bounds, chunks, "never").iteration_ms
                for mode in ("except_last", "always"):
                    assert never <= model.evaluate(bounds, chunks, mode).iteration_ms * (1 + 1e-12)


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
    chosen = plan(profile, chunks=8, interleave=1)
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


@pytest.mark.parametrize("seed", range(4))
def test_smallest_memory_is_the_least_largest_stage_of_every_split(seed: int) -> None:
    """The limit the infeasible error names (a min-max DP over a table of every stage's
    memory) against every split, micro-batch count and mode, with skips."""
    rng = random.Random(seed)
    for _ in range(6):
        layers, devices = rng.randint(1, 8), rng.randint(1, 4)
        profile = random_profile(rng, layers, devices, skips=rng.randint(0, 3), per_pair=False)
        model = model_of(profile, [1.0] * devices)
        chunks, modes = candidate_chunks(profile.batch_size, profile.batch_sizes), ["never", "except_last", "always"]
        expected = min(max(s.memory for s in model.evaluate(bounds, m, mode).stages)
                       for bounds in all_splits(layers, devices) for m in chunks for mode in modes)
        assert smallest_memory(model, chunks, modes, devices)[0] == pytest.approx(expected, rel=1e-12)


def test_naming_the_memory_limit_that_fits_keeps_to_the_time_left() -> None:
    """Naming the smallest limit that fits takes a min-max DP per micro-batch count and mode
    (seconds at 1,000 layers): out of time, it names the least found so far, a limit that fits
    (here only the most micro-batches were tried), and says so; with no time left, none."""
    profile = random_profile(random.Random(5), 8, 3, skips=2, per_pair=False)
    model = model_of(profile, [1.0] * 3)
    chunks, modes = candidate_chunks(profile.batch_size, profile.batch_sizes), ["never", "except_last", "always"]
    smallest, *_, complete = smallest_memory(model, chunks, modes, 3)
    found, most, mode, partial = smallest_memory(model, chunks, modes, 3, StopAfter(1))
    assert complete and not partial and most == max(chunks) and found >= smallest
    assert min(max(s.memory for s in model.evaluate(bounds, most, mode).stages)
               for bounds in all_splits(8, 3)) == pytest.approx(found, rel=1e-12)
    options = Options.check(profile, profile.devices, None, smallest / 2, "auto", "momentum", "gpipe", None, None,
                            "local", 1)
    assert "memory limit that would fit (the least found within the time limit" in infeasible(model, options,
                                                                                             StopAfter(1))
    assert "with time_limit=None the error also names" in infeasible(model, options, StopAfter(0))


def test_faster_device_gets_more_layers():
    profile = make_profile([1.0] * 12, sizes=(1, 2, 4, 8), linear=True, devices=2)
    assert plan(profile, chunks=8, interleave=1).balance == [6, 6]
    slow_first = plan(profile, chunks=8, speeds=[1.0, 3.0], interleave=1).balance
    fast_first = plan(profile, chunks=8, speeds=[3.0, 1.0], interleave=1).balance
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
    with pytest.raises(ValueError, match="micro-batches of 1 samples, but the profile measured micro-batches of "
                                         "at least 2; use fewer chunks"):
        plan(profile, chunks=4)
    with pytest.raises(ValueError, match="cannot be split into micro-batches of the profiled sizes"):
        plan(profile, batch_size=1)
    with pytest.raises(ValueError, match="speeds must be 2 finite positive numbers"):
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
@pytest.mark.parametrize("name", [pytest.param("resnet50-128.json", marks=pytest.mark.slow), "resnet18-128.json"])
def test_committed_profiles_plan_for_2_4_8_devices(name, devices):
    path = ROOT / "profiles" / name
    if not path.exists():
        pytest.skip(f"{path} is not committed yet")
    profile = Profile.load(path)
    chosen = plan(profile, devices)
    assert sum(chosen.balance) == len(profile.layers)
    assert chosen.device_count <= devices and len(chosen.stages) == chosen.device_count * chosen.interleave


def label_after(lanes, chunks, mode):
    """``(X, M, V, S)`` after the stages ``lanes`` (``cost.StageLanes``), by the recurrences of
    autopipe.planning.cost, as the search grows its labels."""
    x, peak, v, total = 0.0, 0.0, -math.inf, 0.0
    for stage in lanes:
        back = stage.backward + stage.recompute
        skipped = stage.recompute if mode == "except_last" else 0.0
        x = max(x, stage.copy_in, stage.forward)
        peak = max(peak, back)
        v = max(v - skipped, back - skipped + (chunks - 2) * peak)
        peak = max(peak, stage.copy_grad)
        v = max(v, stage.copy_grad + (chunks - 2) * peak)
        total += stage.copy_in + stage.forward + back + stage.copy_grad
    return x, peak, v, total


@pytest.mark.parametrize("seed", range(3))
def test_dominance_rule_never_drops_a_label_that_could_finish_better(seed):
    """Two partial plans of two stages that end at the same cut (one copy fit for all pairs, so
    what follows costs the same after either): if the rule says ``a`` dominates ``b``, every
    way of finishing gives ``a`` a time no larger than ``b``."""
    from autopipe.planning.search import _beats, _Labels

    rng = random.Random(seed)
    profile = random_profile(rng, 10, 4, skips=2, per_pair=False)
    model = model_of(profile, [1.0, 0.5, 2.0, 1.0], rng.choice(["local", "distributed"]))
    compared = 0
    for _ in range(40):
        chunks, mode = rng.choice([1, 2, 3, 8]), rng.choice(["never", "except_last", "always"])
        cut = rng.randint(2, 8)
        heads = [s for s in all_splits(cut, 2) if len(s) == 3]
        a_bounds, b_bounds = rng.choice(heads), rng.choice(heads)
        for tail in all_splits(10 - cut, 2):
            ends = [cut + t for t in tail[1:]]
            a, b = (model.evaluate((*h, *ends), chunks, mode) for h in (a_bounds, b_bounds))
            labels = _Labels(*(np.zeros(2, dtype=int),) * 2,
                             *(np.array(column) for column in zip(label_after(a.stages[:2], chunks, mode),
                                                                   label_after(b.stages[:2], chunks, mode))),
                             np.zeros(2, dtype=int))
            if _beats(labels, np.array([0]), np.array([1]), chunks)[0]:
                assert a.iteration_ms <= b.iteration_ms * (1 + 1e-12)
                compared += a_bounds != b_bounds
    assert compared >= 20  # the rule fired on distinct heads often enough for the check to mean something


def test_dominance_filters_keep_exactly_the_labels_no_earlier_one_dominates():
    from autopipe.planning.search import _beats, _dominated, _Labels, _led

    rng = np.random.default_rng(0)
    for chunks in (1, 2, 5):
        count = 400
        start = np.sort(rng.integers(0, 4, count))
        columns = rng.integers(0, 4, (4, count)).astype(float)  # small range: ties and duplicates
        labels = _Labels(start, np.zeros(count, dtype=int), *columns, np.arange(count))
        corner = labels.total + (chunks - 1) * labels.x + labels.v
        labels = labels.take(np.lexsort((labels.total, corner, labels.start)))
        survivors = labels.take(np.flatnonzero(~_led(labels, chunks)))
        kept = set(survivors.ref[~_dominated(survivors, chunks, lambda: None)].tolist())
        expected = set()
        for i in range(count):
            earlier = np.flatnonzero(labels.start[:i] == labels.start[i])
            if not _beats(labels, earlier, np.full(len(earlier), i), chunks).any():
                expected.add(int(labels.ref[i]))
        assert kept == expected


@pytest.mark.parametrize("seed", range(3))
def test_completions_bound_every_way_to_finish(seed):
    """For every split and every cut in it, what the grid says the rest costs at least, added to
    the plan so far, is no more than the split's time; and its plans are splits."""
    from autopipe.planning.completion import Completions, grid_levels
    from autopipe.planning.candidates import Candidate

    rng = random.Random(seed)
    for _ in range(12):
        layers, devices = rng.randint(2, 9), rng.randint(1, 4)
        profile = random_profile(rng, layers, devices, skips=rng.randint(0, 2), per_pair=rng.random() < 0.5)
        model = model_of(profile, [rng.choice([0.5, 1.0, 2.0]) for _ in range(devices)],
                         rng.choice(["local", "distributed"]))
        chunks, mode = rng.choice([1, 2, 4, 8]), rng.choice(["never", "except_last", "always"])
        candidate = Candidate.of(model, chunks, mode, devices)
        lanes = None if rng.random() < 0.5 else tuple(f * rng.uniform(1.0, 1.5) for f in candidate.floors)
        grid = Completions.grid(candidate, model.speeds[:devices],
                                *grid_levels(candidate, devices, (math.inf, math.inf), lanes))
        times = []
        for bounds in all_splits(layers, devices):
            evaluation = model.evaluate(bounds, chunks, mode)
            times.append(evaluation.iteration_ms)
            for done in range(1, len(bounds) - 1):
                x, peak, _, total = label_after(evaluation.stages[:done], chunks, mode)
                cut = bounds[done]
                least = (total + candidate.copy_forward[done - 1, cut]
                         + grid.lower_bound(done, np.array([cut]), np.array([x]), np.array([peak]))[0])
                assert least <= evaluation.iteration_ms * (1 + 1e-12)
        assert grid.least() <= min(times) * (1 + 1e-12)
        for bounds in grid.plans(2):
            assert bounds[0] == 0 and bounds[-1] == layers and all(a < b for a, b in zip(bounds, bounds[1:]))


def test_cut_costs_are_the_copies_between_neighbouring_devices():
    from autopipe.planning.candidates import _cut_costs

    profile = make_profile([1.0] * 6, sizes=(1, 2), devices=3, output_bytes=[5, 0, 3, 9, 1, 0],
                           copies={(0, 1): (1.0, 0.1), (1, 0): (2.0, 0.2), (1, 2): (0.5, 0.3), (2, 1): (3.0, 0.1),
                                   (0, 2): (0.0, 0.0), (2, 0): (0.0, 0.0)})
    model = model_of(profile, [1.0] * 3)
    forward, back = _cut_costs(model, model.at(2), 3)
    # the cut before layer c copies layer c-1's output (2 samples per micro-batch)
    for device in range(2):
        for cut, nbytes in zip(range(1, 6), [5, 0, 3, 9, 1]):
            assert forward[device, cut] == pytest.approx(model.copy_ms(device, device + 1, 2 * nbytes))
            assert back[device, cut] == pytest.approx(model.copy_ms(device + 1, device, 2 * nbytes))
    assert not forward[:, [0, 6]].any() and not back[:, [0, 6]].any() and not forward[2].any()


def test_range_minima_against_slicing():
    from autopipe.planning._arrays import RangeMin

    rng = np.random.default_rng(1)
    for _ in range(100):
        rows, count, queries = rng.integers(1, 5), rng.integers(1, 40), rng.integers(1, 60)
        row = rng.integers(0, rows, queries)
        lo = rng.integers(0, count + 1, queries)
        hi = np.clip(lo - 1 + rng.integers(-1, 12, queries), lo - 1, count)  # lo - 1: empty
        values = rng.normal(size=(rows, count + 1))
        expected = [values[r, a: b + 1].min(initial=math.inf) for r, a, b in zip(row, lo, hi)]
        assert RangeMin(row, lo, hi, (rows, count + 1)).of(values, np.zeros_like(values)).tolist() == expected


def test_range_minima_within_columns_read_only_those():
    """Queries within some columns, answered after the table was filled for other values:
    what lies outside the columns is stale and must not be read (the completions' DP fills
    only the stops of the starts a device can have)."""
    from autopipe.planning._arrays import RangeMin

    rng = np.random.default_rng(2)
    for _ in range(100):
        rows, count, queries = rng.integers(1, 5), rng.integers(2, 40), rng.integers(1, 60)
        first = int(rng.integers(0, count))
        last = int(rng.integers(first, count + 1))
        row = rng.integers(0, rows, queries)
        lo = rng.integers(first, last + 1, queries)
        hi = np.clip(lo - 1 + rng.integers(-1, 12, queries), lo - 1, last)
        ranges = RangeMin(row, lo, hi, (rows, count + 1))
        ranges.of(rng.normal(size=(rows, count + 1)), 0.0)  # other values everywhere
        values, plus = rng.normal(size=(rows, count + 1)), rng.normal(size=(rows, count + 1))
        expected = [(values + plus)[r, a: b + 1].min(initial=math.inf) for r, a, b in zip(row, lo, hi)]
        assert ranges.of(values, plus, columns=(first, last)).tolist() == expected


def test_power_spans_against_slicing():
    """Each level's entry is ``combine`` over the ``2^level`` entries from it along the axis,
    those past the end left out; every level up to the axis length, along any axis."""
    from autopipe.planning._arrays import power_spans

    rng = np.random.default_rng(3)
    for _ in range(60):
        shape = tuple(int(n) for n in rng.integers(1, 12, rng.integers(1, 4)))
        axis = int(rng.integers(0, len(shape)))
        values = rng.normal(size=shape)
        for combine, fill, reduce in ((np.minimum, math.inf, np.min), (np.maximum, -math.inf, np.max)):
            table = power_spans(values, combine, fill, axis=axis)
            length = shape[axis]
            assert table.shape == (length.bit_length(), *shape) and table.flags.c_contiguous
            for level in range(len(table)):
                for start in range(length):
                    span = np.take(values, range(start, min(start + (1 << level), length)), axis=axis)
                    expected = reduce(span, axis=axis)
                    assert np.array_equal(np.take(table[level], start, axis=axis), expected)


def test_skip_charges_by_hand():
    """Layers 0..3 on 2 devices, one skip stashed by layer 0 and popped by layer 2: a second
    stage starting at 1 or 2 pops it (and pays to receive it), one starting at 3 does not."""
    from autopipe.planning.candidates import Candidate
    from autopipe.planning.completion import Completions

    profile = make_profile([1.0] * 4, devices=2, skips=[("s", 0, 2, 100)], copies=(0.5, 0.01))
    model = model_of(profile, [1.0, 1.0])
    candidate = Candidate.of(model, 1, "never", 2)
    receive = candidate.receive[0, 0, 1]
    assert receive == pytest.approx(2 * (0.5 + 0.01 * 100 * 8)) and np.isinf(candidate.receive[0, :, 0]).all()
    caps = (np.array([math.inf]),) * 2 + (np.zeros(1),) * 2
    plain, charged = (Completions(candidate, model.speeds, caps, skips=skips) for skips in (False, True))
    # from start p on device 1 the rest is one stage [p, 4): it pops the skip iff 0 < p <= 2; no
    # plan starts there at 0 (device 0 holds a layer at least), which charged rests leave out
    extra = charged.rest[1, 0, 1:4] - plain.rest[1, 0, 1:4]
    assert extra.tolist() == pytest.approx([receive, receive, 0.0]) and np.isinf(charged.rest[1, 0, 0])
    # the whole plan: the best split either keeps the skip in one stage or pays for it
    splits = {cut: model.evaluate((0, cut, 4), 1, "never").iteration_ms for cut in (1, 2, 3)}
    assert charged.least() <= min(min(splits.values()), model.evaluate((0, 4), 1, "never").iteration_ms) + 1e-9


def test_skip_sources_narrow_with_the_caps():
    """6 layers of equal work on 3 devices, a skip stashed by layer 1 and popped by layer 5,
    the last stage [4, 6) on device 2: with every stage capped at 2 layers, devices 0 and 1
    hold [0, 4) two layers each, so layer 1 is on device 0 and the cell charges that copy, not
    the cheaper one from device 1; without caps device 1 could hold it (from layer 1 on)."""
    from autopipe.planning.candidates import Candidate
    from autopipe.planning.completion import Completions

    copies = {(i, j): (0.1, 0.0) for i in range(3) for j in range(3) if i != j}
    copies[(0, 2)] = copies[(2, 0)] = (5.0, 0.0)
    profile = make_profile([1.0] * 6, devices=3, skips=[("s", 1, 5, 100)], copies=copies, linear=True)
    model = model_of(profile, [1.0] * 3)
    candidate = Candidate.of(model, 1, "never", 3)
    far, near = candidate.receive[0, 0, 2], candidate.receive[0, 1, 2]
    assert far == pytest.approx(10.0) and near == pytest.approx(0.2)
    for cap_x, cap_y, expected in ((2.0, 4.0, far), (math.inf, math.inf, near)):
        caps = (np.array([cap_x]), np.array([cap_y]), np.zeros(1), np.zeros(1))
        plain, charged = (Completions(candidate, model.speeds, caps, skips=skips) for skips in (False, True))
        assert charged.rest[2, 0, 4] - plain.rest[2, 0, 4] == pytest.approx(expected)
    # the cell holds one plan, and the relaxation sees all it pays: its lanes' sum, skip included
    capped = Completions(candidate, model.speeds, (np.array([2.0]), np.array([4.0]), np.zeros(1), np.zeros(1)),
                         skips=True)
    stages = model.evaluate((0, 2, 4, 6), 1, "never").stages
    assert capped.rest[0, 0, 0] == pytest.approx(sum(s.forward + s.backward + s.copy_in + s.copy_grad for s in stages))


def test_min_max_split_against_brute_force():
    """compare's baseline uses the solver's min-max bisection, with exactly ``parts`` stages."""
    from autopipe.planning.compare import min_max_split

    rng = random.Random(0)
    for _ in range(200):
        count = rng.randint(1, 9)
        parts = rng.randint(1, count)
        weights = [rng.choice([0, rng.random() * 10, rng.randint(0, 5)]) for _ in range(count)]
        bounds = min_max_split(weights, parts)
        assert len(bounds) == parts + 1 and bounds[0] == 0 and bounds[-1] == count
        assert all(a < b for a, b in zip(bounds, bounds[1:]))
        largest = max(sum(weights[a:b]) for a, b in zip(bounds, bounds[1:]))
        best = min(max(sum(weights[a:b]) for a, b in zip(split, split[1:]))
                   for cuts in itertools.combinations(range(1, count), parts - 1) for split in [(0, *cuts, count)])
        assert largest == pytest.approx(best, rel=1e-9, abs=1e-12)



def test_candidates_built_together_equal_those_built_alone():
    """Candidate.all works out what a micro-batch count's candidates share once (costs, cuts,
    forward floor, skip receipts on demand); each candidate equals the one built alone."""
    from autopipe.planning.candidates import Candidate

    rng = random.Random(3)
    profile = random_profile(rng, 9, 4, skips=2, per_pair=True)
    model = model_of(profile, [1.0, 1.5, 2.0, 1.0])
    counts, modes = [1, 2, 4], ["never", "except_last", "always"]
    together = Candidate.all(model, counts, modes, 4)
    alone = [Candidate.of(model, chunks, mode, 4) for chunks in counts for mode in modes]
    assert len(together) == len(alone)
    for a, b in zip(together, alone):
        assert (a.chunks, a.mode, a.effective, a.lower_bound, a.floors, a.weights, a.work) == \
            (b.chunks, b.mode, b.effective, b.lower_bound, b.floors, b.weights, b.work)
        for name in ("back", "copy_forward", "copy_back", "receive", "skip_stash", "skip_pop"):
            assert np.array_equal(getattr(a, name), getattr(b, name))


def test_a_first_grid_is_placed_around_the_best_plans_lanes_scaled_to_its_micro_batch_count() -> None:
    """With mixed speeds and no skips to pay for, a micro-batch count's first grid of lane caps
    lies around the largest lanes of the best plan so far, scaled by the ratio of the two counts'
    least possible lanes (``solver._guess``): the best plan's own count gets its lanes exactly.
    With equal speeds, skips that cost a copy, or a best plan of another schedule, the grid
    stays coarse (no guess)."""
    from autopipe.planning import solver
    from autopipe.planning.candidates import Candidate, Choice

    speeds = np.array([1.0, 1.5, 2.0])
    model = model_of(random_profile(random.Random(5), 12, 3, per_pair=False), speeds)
    candidates = Candidate.all(model, [2, 4, 8], ["never", "always"], 3)
    source, other = candidates[0], candidates[-1]  # 2 micro-batches never, 8 always
    bounds = (0, 4, 9, 12)
    stages = model.evaluate(bounds, source.chunks, source.mode).stages
    lanes = (max(max(s.forward, s.copy_in) for s in stages),
             max(max(s.backward + s.recompute, s.copy_grad) for s in stages))
    best = Choice(bounds, source.chunks, source.mode, 1.0)
    assert solver._guess(model, speeds, candidates, source, best) == pytest.approx(lanes, rel=1e-12)
    scaled = tuple(lane * mine / theirs for lane, mine, theirs in zip(lanes, other.floors, source.floors))
    assert solver._guess(model, speeds, candidates, other, best) == pytest.approx(scaled, rel=1e-12)
    assert solver._guess(model, speeds, candidates, other, Choice(bounds, 2, "never", 1.0, interleave=2)) is None
    assert solver._guess(model, np.ones(3), candidates, other, best) is None

    idle = model_of(make_profile([0.0] * 6, [1.0] * 6, devices=3), speeds)  # no forward work: a floor of 0
    idle_candidates = Candidate.all(idle, [2], ["never"], 3)
    assert idle_candidates[0].floors[0] == 0
    idle_best = Choice((0, 2, 4, 6), 2, "never", 1.0)
    assert solver._guess(idle, speeds, idle_candidates, idle_candidates[0], idle_best) is None
    assert plan(make_profile([0.0] * 6, [1.0] * 6, devices=3), speeds=speeds, interleave=1).predicted.gap == 0

    skipped = model_of(make_profile([1.0] * 6, devices=3, skips=[("s", 0, 4, 1000)], copies=(1.0, 1e-3)), [1.0] * 3)
    with_skip = Candidate.all(skipped, [2], ["never"], 3)
    assert with_skip[0].pays_skips
    assert solver._guess(skipped, speeds, with_skip, with_skip[0], Choice((0, 2, 4, 6), 2, "never", 1.0)) is None


def test_a_1f1b_search_that_finds_nothing_where_fill_drain_fits_says_so() -> None:
    """Limits a plan fits are not 'too small': where the 1F1B search (a heuristic) found none
    the error says which plan fits them, and without a fill-drain search (``schedule="1f1b"``)
    that a fill-drain one does and how to plan one; below, that none fits."""
    profile = random_profile(random.Random(5), 8, 3, skips=2, per_pair=False)
    model = model_of(profile, [1.0] * 3)
    chunks, modes = candidate_chunks(profile.batch_size, profile.batch_sizes), ["never", "except_last", "always"]
    smallest = smallest_memory(model, chunks, modes, 3)[0]
    for schedule, factor, expected in (
            ("1f1b", 1.5, "though one fits them: a 1F1B plan needs"),
            ("1f1b", 1.5, "a fill-drain plan fits them, needing"), ("auto", 1.5, "though one fits them: a 1F1B plan"),
            ("gpipe", 0.5, "no plan fits the memory limits"), ("gpipe", 0.5, "the smallest per-device")):
        options = Options.check(profile, profile.devices, None, smallest * factor, "auto", "momentum", schedule, None,
                                None, "local", 1)
        assert expected in infeasible(model, options)


def least_device_memory(model: CostModel, chunks: Sequence[int], modes: Sequence[str], devices: int, schedule: str,
                        interleave: int) -> float:
    """The least, over every plan of ``schedule`` with ``interleave`` stages per device (on one
    to ``devices`` devices, two at least where they share one), micro-batch count and mode, of
    the memory of the device that holds the most (the sum of its stages')."""
    best = math.inf
    for k in range(1 if interleave == 1 else 2, min(devices, model.layers // interleave) + 1):
        where = placement(k * interleave, interleave)
        for cuts in itertools.combinations(range(1, model.layers), k * interleave - 1):
            for m in chunks:
                for mode in modes:
                    lanes = model.stage_lanes((0, *cuts, model.layers), m, mode, where, schedule)
                    best = min(best, max(sum(lane.memory for lane, at in zip(lanes, where) if at == device)
                                         for device in range(k)))
    return best


@pytest.mark.parametrize("schedule, interleave", [("gpipe", 2), ("1f1b", 1), ("1f1b", 2), ("auto", "auto")])
def test_the_limit_named_is_the_least_of_the_schedule_and_interleave_asked(schedule: str, interleave) -> None:
    """The limit an infeasible error names is the least any plan of the schedules and stages per
    device asked for fits in, against every split (it was that of one-stage-per-device
    fill-drain plans: 73,200 bytes where interleave=2 needs 84,400, below the 80,000 given, and
    more than 1F1B's 72,500 under schedule='auto'); at that limit a plan is found, or the error
    says one fits that the 1F1B search (a heuristic) missed."""
    rng = random.Random(11)
    cases = [(make_profile([1.0] * 4, devices=2, saved_bytes=1000, param_bytes=10000, output_bytes=100), 2)]
    cases += [(random_profile(rng, rng.randint(4, 7), devices, skips=rng.randint(0, 2), per_pair=False), devices)
              for devices in (2, 3, 3)]
    for profile, devices in cases:
        model = model_of(profile, [1.0] * devices)
        chunks = candidate_chunks(profile.batch_size, profile.batch_sizes)
        families = [(s, v) for s in (["gpipe", "1f1b"] if schedule == "auto" else [schedule])
                    for v in ([1, 2] if interleave == "auto" else [interleave])]
        expected = min(least_device_memory(model, chunks, ["never", "except_last"] + ["always"] * (s == "1f1b"),
                                           devices, s, v) for s, v in families)
        asked = {"schedule": schedule, "interleave": interleave, "time_limit": None}
        with pytest.raises(PlanningError, match=rf"^no (1F1B )?plan fits .* the smallest per-device memory limit "
                                                rf"that would fit is {math.ceil(expected)} bytes") as error:
            plan(profile, devices, memory_limit=math.ceil(expected) - 1, **asked)
        try:
            chosen = plan(profile, devices, memory_limit=math.ceil(expected), **asked)
        except PlanningError as missed:
            assert "though one fits them: an interleaved 1F1B plan" in str(missed), error.value
            continue
        assert max(chosen.device_memory_bytes) <= math.ceil(expected)


def test_candidate_chunks_are_the_least_count_of_each_micro_batch_size_for_any_batch() -> None:
    """Each distinct micro-batch size ceil(B/m) within the profiled sizes, by its least count m
    (checked against every m up to B, which the planner once listed: 9 s at B = 10^8)."""
    rng = random.Random(5)
    for _ in range(300):
        batch, sizes = rng.randint(1, 2000), sorted(rng.sample(range(1, 70), rng.randint(1, 4)))
        least: dict[int, int] = {}
        for m in range(1, batch + 1):
            least.setdefault(-(-batch // m), m)
        expected = sorted(m for size, m in least.items() if sizes[0] <= size <= sizes[-1])
        if expected:
            assert candidate_chunks(batch, sizes) == expected
        else:
            with pytest.raises(OptionError, match="cannot be split into micro-batches"):
                candidate_chunks(batch, sizes)
    assert candidate_chunks(10 ** 9, [1, 64]) == sorted({-(-10 ** 9 // s) for s in range(1, 65)})
