"""The cost model's formulas against hand-computed values."""
from __future__ import annotations

import dataclasses
import time

import pytest
from synthetic import make_profile

from autopipe.errors import DeviceError
from autopipe.planning import candidates
from autopipe.planning.candidates import Candidate, filled
from autopipe.planning.cost import CostModel, copy_matrix, interpolate


def model_of(profile, devices=None, speeds=None, batch=None, factor=2.0, engine="local"):
    devices = devices or profile.devices
    return CostModel(profile, devices, speeds or [1.0] * len(devices),
                     batch or profile.batch_size, factor, engine)


def test_interpolation_is_piecewise_linear_and_refuses_extrapolation():
    table = {2: 10.0, 4: 14.0, 8: 30.0}
    assert interpolate(table, 3) == 12.0
    assert interpolate(table, 6) == 22.0
    assert interpolate(table, 8) == 30.0
    with pytest.raises(ValueError, match="outside the profiled sizes 2..8"):
        interpolate(table, 1)
    with pytest.raises(ValueError, match="outside"):
        interpolate(table, 9)


def test_stage_times_divide_by_speed_and_interpolate():
    profile = make_profile([4.0, 8.0], sizes=(2, 4), batch_size=6, devices=2)  # scale: 0.25+0.75*b/4
    model = model_of(profile, speeds=[1.0, 2.0])
    # 2 micro-batches of 3, halfway between 2 (0.625) and 4 (1.0): 0.8125; both layers on device 1
    stage, = model.stage_lanes((0, 2), 2, "never", placement=[1])
    assert stage.forward == pytest.approx(12.0 * 0.8125 / 2)
    assert stage.backward == pytest.approx(24.0 * 0.8125 / 2)


def test_memory_terms_for_each_checkpoint_mode():
    """planning.memory by hand: 3 layers, batch 4 in m = 2 micro-batches of b = 2, on CPU."""
    def profile(saved_output):
        return make_profile([1.0, 1.0, 1.0], sizes=(1, 2, 4), devices=2, output_bytes=[100, 200, 300],
                            saved_bytes=[1000, 2000, 3000], param_bytes=[10, 20, 30], input_bytes=50,
                            workspace_bytes=[7, 11, 13], output_saved=[False, False, saved_output])
    model = model_of(profile(False), factor=3.0)
    m = 2
    # stage [1, 3), b = 2: P = 50, steady state P + P + 3P = 250.  Per micro-batch S = 10000
    # saved, out = 600 output (O = 600 unless saved), input gradient g = 200.
    # backward_l: layer 1: S(1..1) 4000 + out 600 + w 22 + its output's gradient 400 = 5022;
    #             layer 2 (last): S 10000 + O 600 + w 26 (its output gradient is the next stage's) = 10626.
    # first backward adds the gradients that exist: P(1..3) = 50 at layer 1, P(2..3) = 30 at layer 2.
    first, later = max(5022 + 50, 10626 + 30), max(5022, 10626)
    h = 10000 + 600
    # a later backward also finds W - 1 = 2 finished input gradients (the runtime's window of three)
    never = max(250 - 50 + first + h * (m - 1), 250 + later + h * (m - 2) + 2 * 200)  # first: 21456
    always = max(250 - 50 + first + 600 * m, 250 + later + 600 * m + 2 * 200)  # later: 12476
    expected = {"never": never, "always": always, "except_last": always}
    assert (never, always) == (21456, 12476)
    for mode, value in expected.items():
        assert model.evaluate([0, 1, 3], m, mode).stages[1].memory == value
    # the output among the saved bytes (made by layer 2) is not counted again from layer 2 on
    counted = model_of(profile(True), factor=3.0)
    first, later = max(5022 + 50, 10026 + 30), max(5022, 10026)
    assert counted.evaluate([0, 1, 3], m, "never").stages[1].memory == 200 + first + 10000
    assert counted.evaluate([0, 1, 3], m, "always").stages[1].memory == 250 + later + 600 * m + 2 * 200
    # stage 0: its input (the batch) needs no gradient and is the caller's memory on CPU;
    # S 2000 + O 200 + w 14, its parameters' gradient 10 in the first backward
    assert model.evaluate([0, 1, 3], m, "never").stages[0].memory == 50 - 10 + (2214 + 10) + 2200
    # distributed: a stage after the first also keeps its received input, once per micro-batch
    relayed = model_of(profile(False), factor=3.0, engine="distributed")
    assert relayed.evaluate([0, 1, 3], m, "never").stages[1].memory == never + 200 * m


def test_memory_terms_on_devices_with_own_memory_and_without_a_measured_workspace():
    """On CUDA a stage holds a copy of its input per micro-batch and its last layer's output
    gradient; a profile without workspace gets the stated estimate (parameters + input)."""
    profile = make_profile([1.0, 1.0, 1.0], sizes=(1, 2, 4), devices=["cuda:0", "cuda:1"],
                           output_bytes=[100, 200, 300], saved_bytes=[1000, 2000, 3000],
                           param_bytes=[10, 20, 30], input_bytes=50)
    model = model_of(profile, factor=1.0)
    m = 2
    terms = model.memory_terms(model.at(2), 1, 3, m, "never", 0.0)
    assert terms.inputs == 200 * m
    # w estimated: layer 1 20 + 200, layer 2 30 + 400; layer 2's output gradient 600 is a copy
    first = max(4000 + 600 + 220 + 400 + 50, 10000 + 600 + 430 + 600 + 30)
    assert terms.total == 150 + 200 * m - 50 + first + 10600 * (m - 1)
    assert (terms.optimizer, terms.activations, terms.outputs) == (50, 20000, 1200)
    assert terms.dominant() == "activations"


def test_optimizer_state_names_and_factors():
    from autopipe.planning.memory import optimizer_factor
    assert [optimizer_factor(n) for n in ("sgd", "momentum", "adam", 1.5)] == [0.0, 1.0, 2.0, 1.5]
    for bad in ("lamb", -1.0):
        with pytest.raises(ValueError, match="optimizer_state"):
            optimizer_factor(bad)


def test_skip_crossing_two_cuts_is_charged_once_on_its_route():
    copies = {(i, j): (1.0 * (i + 1), 0.001 * (j + 1)) for i in range(3) for j in range(3) if i != j}
    profile = make_profile([1.0] * 6, sizes=(1, 2), devices=3, output_bytes=100, copies=copies,
                           skips=[("s", 0, 5, 1000)])
    model = model_of(profile)
    stages = model.evaluate([0, 2, 4, 6], 1, "never").stages
    b = 2
    main = lambda src, dst: copies[(src, dst)][0] + 100 * b * copies[(src, dst)][1]  # noqa: E731
    skip = copies[(0, 2)][0] + 1000 * b * copies[(0, 2)][1]
    assert stages[1].copy_in == pytest.approx(main(0, 1))
    assert stages[2].copy_in == pytest.approx(main(1, 2) + skip)
    assert stages[0].copy_grad == pytest.approx(main(1, 0) + copies[(2, 0)][0] + 1000 * b * copies[(2, 0)][1])
    assert stages[1].copy_grad == pytest.approx(main(2, 1))
    # the skip is held by its producer and its consumer, not by the stage it passes
    held = [model.held_bytes(model.at(b), s, e) for s, e in [(0, 2), (2, 4), (4, 6)]]
    assert held == [1000 * b, 0, 1000 * b]


def test_an_output_that_does_not_grow_with_the_batch_is_priced_per_micro_batch():
    """A layer's ``output_fixed_bytes`` (a batch mean passed on) are the same at every
    micro-batch size: the cut after it copies them whole, and the next stage holds them whole."""
    copies = {(0, 1): (1.0, 0.001), (1, 0): (2.0, 0.002)}
    profile = make_profile([1.0] * 4, sizes=(1, 2, 4), devices=2, output_bytes=100, copies=copies)
    fixed = dataclasses.replace(profile, layers=[*profile.layers[:1],
                                                 dataclasses.replace(profile.layers[1], output_fixed_bytes=5000),
                                                 *profile.layers[2:]])
    for b in (1, 4):
        plain, costs = model_of(profile).at(b), model_of(fixed).at(b)
        assert costs.input_bytes[2] - plain.input_bytes[2] == 5000  # whatever b: 100 * b + 5000 in all
        assert costs.output_bytes[1] - plain.output_bytes[1] == 5000
    m = 4  # micro-batches of 1 of the batch of 4
    stages = model_of(fixed).evaluate([0, 2, 4], m, "never").stages
    assert stages[1].copy_in == pytest.approx(1.0 + (100 + 5000) * 0.001)
    assert stages[0].copy_grad == pytest.approx(2.0 + (100 + 5000) * 0.002)
    plain = model_of(profile).evaluate([0, 2, 4], m, "never").stages
    assert stages[1].memory - plain[1].memory >= 5000  # its input, held while in flight


def test_relayed_skip_is_charged_on_every_hop_in_distributed_mode():
    copies = {(i, j): (1.0 * (i + 1), 0.001 * (j + 1)) for i in range(3) for j in range(3) if i != j}
    profile = make_profile([1.0] * 6, sizes=(1, 2), devices=3, output_bytes=100, copies=copies,
                           skips=[("s", 0, 5, 1000)])
    b, m = 2, 1
    copy = lambda src, dst, n: copies[(src, dst)][0] + n * b * copies[(src, dst)][1]  # noqa: E731
    local = model_of(profile).evaluate([0, 2, 4, 6], m, "never").stages
    relayed = model_of(profile, engine="distributed").evaluate([0, 2, 4, 6], m, "never").stages
    # local: once, 0 -> 2 (and its gradient 2 -> 0)
    assert [s.copy_in for s in local] == pytest.approx([0.0, copy(0, 1, 100), copy(1, 2, 100) + copy(0, 2, 1000)])
    assert [s.copy_grad for s in local] == pytest.approx([copy(1, 0, 100) + copy(2, 0, 1000), copy(2, 1, 100), 0.0])
    # distributed: on both hops, 0 -> 1 and 1 -> 2 (gradients 2 -> 1 and 1 -> 0)
    assert [s.copy_in for s in relayed] == pytest.approx(
        [0.0, copy(0, 1, 100) + copy(0, 1, 1000), copy(1, 2, 100) + copy(1, 2, 1000)])
    assert [s.copy_grad for s in relayed] == pytest.approx(
        [copy(1, 0, 100) + copy(1, 0, 1000), copy(2, 1, 100) + copy(2, 1, 1000), 0.0])
    # the middle stage holds the skip it passes along, and its received input, per micro-batch
    assert relayed[1].memory - local[1].memory == 1000 * b * m + 100 * b * m
    assert relayed[2].memory - local[2].memory == 100 * b * m
    assert relayed[0].memory == local[0].memory


def test_iteration_time_closed_form_by_hand():
    profile = make_profile([2.0, 3.0], [4.0, 6.0], sizes=(1,), linear=True, devices=2, output_bytes=10,
                           copies=(1.0, 0.0))
    model = model_of(profile)
    # forward lanes F0=2, C1=1, F1=3: 6 + 3*3; backward lanes B1=6, G0=1, B0=4: 11 + 3*6
    evaluation = model.evaluate([0, 1, 2], 4, "never")
    assert (evaluation.forward_ms, evaluation.backward_ms) == (15.0, 29.0)
    # always: B lanes 6+3, 4+2 → 16 + 3*9
    assert model.evaluate([0, 1, 2], 4, "always").backward_ms == 43.0
    # except_last: job 1 unrecomputed (6, 1, 4) the rest (9, 1, 6): longest path 6 + 9*3 + 1 + 6 = 40
    assert model.evaluate([0, 1, 2], 4, "except_last").backward_ms == 40.0


def test_copy_fits_by_position_then_name_cpu_pairs_free_otherwise_an_error():
    profile = make_profile([1.0], devices=["cpu", "cuda:0"], copies=(2.0, 0.5))
    latency, per_byte = copy_matrix(profile, ["cpu", "cuda:0", "cpu"])
    assert latency[0, 1] == 2.0 and latency[2, 1] == 2.0 and per_byte[1, 2] == 0.5
    assert latency[0, 2] == 0.0
    with pytest.raises(ValueError, match="no copy measurement from cuda:0 to cuda:1"):
        copy_matrix(profile, ["cuda:0", "cuda:1"])


def per_pair(profile, devices):
    """:func:`copy_matrix` by its definition, pair by pair: the fit of the same indices where the
    profile's devices there have the same names, else the first fit between those names, else 0
    between CPUs (``None``: no cost known)."""
    known = profile.devices

    def fit(i, j):
        if i == j:
            return 0.0, 0.0
        same = max(i, j) < len(known) and known[i] == devices[i] and known[j] == devices[j]
        found = next((f for f in profile.copies if same and (f.src, f.dst) == (i, j)), None) or next(
            (f for f in profile.copies if (known[f.src], known[f.dst]) == (devices[i], devices[j])), None)
        if found is not None:
            return found.latency_ms, found.ms_per_byte
        return (0.0, 0.0) if devices[i].startswith("cpu") and devices[j].startswith("cpu") else None

    return [[fit(i, j) for j in range(len(devices))] for i in range(len(devices))]


def test_copy_matrix_is_its_per_pair_definition():
    """Built per pair of names and spread over the devices (a loop over every pair took 4 s of a
    plan on 1,000 devices): the same values, a measured pair on the same indices first."""
    names = ["cuda:0", "cpu", "cuda:1", "cuda:0", "cpu"]
    fits = {(i, j): (1.0 + i + 0.1 * j, 1e-3 * (1 + j)) for i in range(5) for j in range(5) if i != j}
    profile = make_profile([1.0], devices=names, copies=fits)
    for devices in (names, names[::-1], ["cuda:1", "cuda:0", "cpu", "cuda:0"], ["cpu", "cpu:1", "cpu", "cpu"],
                    names + ["cpu", "cuda:0"]):
        latency, per_byte = copy_matrix(profile, devices)
        expected = per_pair(profile, devices)
        assert [[(latency[i, j], per_byte[i, j]) for j in range(len(devices))] for i in range(len(devices))] == expected


def test_a_pair_without_copy_times_is_a_device_error_naming_the_first():
    profile = make_profile([1.0], devices=["cpu", "cuda:0"], copies=(2.0, 0.5))
    assert per_pair(profile, ["cpu", "cuda:0", "meta", "cuda:0"])[0][2] is None
    with pytest.raises(DeviceError, match="^the profile has no copy measurement from cpu to meta: it was measured on "
                                          "cpu, cuda:0; plan on those devices"):
        copy_matrix(profile, ["cpu", "cuda:0", "meta", "cuda:0"])
    with pytest.raises(DeviceError, match=r"from cuda:0 to cuda:1: .*; plan on those devices, or profile on these "
                                          r"\(python -m autopipe profile ... --devices cuda:0,cuda:1\)$"):
        copy_matrix(profile, ["cuda:0", "cuda:1"])


def test_the_lower_bound_fills_no_more_devices_than_layers(monkeypatch):
    """A plan has at most one stage per layer: the rows of :func:`filled` beyond the layer count
    were never read, and on 1,000 devices its 1,000² tables took most of a one-second plan."""
    profile = make_profile([1.0, 2.0, 3.0, 4.0], sizes=(1, 2, 4))
    model = model_of(profile, ["cpu"] * 1000)
    widths = []

    def spy(work, speeds, floor, weight):
        widths.append(len(speeds))
        return filled(work, speeds, floor, weight)

    monkeypatch.setattr(candidates, "filled", spy)
    bounds = [c.lower_bound for c in Candidate.all(model, [1, 2, 4], ["never", "except_last"], 1000)]
    assert widths and max(widths) == 4
    monkeypatch.undo()
    assert bounds == [c.lower_bound for c in Candidate.all(model_of(profile, ["cpu"] * 4), [1, 2, 4],
                                                           ["never", "except_last"], 4)]


def test_copy_matrix_of_the_most_devices_taken_is_quick():
    """A Python loop over the pairs took 10 s at 4,096 devices (0.6 s at 1,000, for each cost
    model of a plan); spread from the pairs of names, a fraction of a second."""
    profile = make_profile([1.0], devices=["cpu", "cpu"], copies=(2.0, 0.5))
    start = time.perf_counter()
    latency, per_byte = copy_matrix(profile, ["cpu"] * 4096)  # planning._options.MAX_DEVICES
    assert time.perf_counter() - start < 2.0
    assert latency[0, 1] == 2.0 and latency[1, 2] == 2.0 and latency[5, 5] == 0.0 and per_byte[7, 3] == 0.5
