"""The planner's schedules: 1F1B memory by hand, the choice under a memory limit, plan files and
the runtime running a 1F1B plan."""
from __future__ import annotations

import itertools
import json
import random

import numpy as np
import pytest
import torch
from synthetic import make_profile, random_profile
from torch import nn

import autopipe
from autopipe.cli import main
from autopipe.planning.cost import CostModel
from autopipe.planning.plans import Plan
from autopipe.planning.simulate import evaluate, simulate_plan
from autopipe.planning.solver import PlanningError, candidate_chunks, plan


def eight_layers(devices: int = 4):
    """8 equal layers; each saves 1000 bytes per sample and outputs 10 per sample."""
    return make_profile([1.0] * 8, sizes=(1, 2, 4, 8), devices=devices, saved_bytes=1000, output_bytes=10,
                        linear=True)


def test_1f1b_memory_by_hand() -> None:
    """4 stages of 2 layers, 8 micro-batches of 1 sample: stage s holds min(4 - s, 8) of them."""
    model = CostModel(eight_layers(), ["cpu"] * 4, [1.0] * 4, 8, 2.0)
    bounds = [0, 2, 4, 6, 8]
    never = [lane.memory for lane in model.stage_lanes(bounds, 8, "never", schedule="1f1b")]
    # per in-flight micro-batch: 2 layers x 1000 saved and the stage's 10-byte output (held for the
    # next stage, not among its saved tensors); plus the output's 10-byte gradient in backward and,
    # in the steady state (a forward refills the in-flight set between backwards), the 10-byte
    # gradients of the stage's input from the two backwards before (the runtime's window of
    # three), which the stage before may not have used yet (none for stage 0)
    held = [4, 3, 2, 1]
    grad_in = [0, 20, 20, 20]
    assert never == [n * 2010 + 10 + g for n, g in zip(held, grad_in)]
    # checkpointed: one micro-batch's saved tensors, every in-flight output, the input's gradients
    # (none for stage 0) and the output's gradient beside the recomputed output (20 transient)
    always = [lane.memory for lane in model.stage_lanes(bounds, 8, "always", schedule="1f1b")]
    assert always == [2000 + n * 10 + g + 20 for n, g in zip(held, grad_in)]
    # except_last: stages with a warm-up hold the last micro-batch's saved tensors while recomputing
    last = [lane.memory for lane in model.stage_lanes(bounds, 8, "except_last", schedule="1f1b")]
    assert last == [2000 * (2 if n > 1 else 1) + n * 10 + g + 20 for n, g in zip(held, grad_in)]
    gpipe = [lane.memory for lane in model.stage_lanes(bounds, 8, "never")]
    assert gpipe == [8 * 2010 + 10] * 4


def test_under_a_memory_limit_auto_chooses_1f1b_without_checkpointing() -> None:
    profile = eight_layers()
    gpipe = plan(profile, memory_limit=12000, schedule="gpipe")
    assert gpipe.checkpoint != "never"  # fill-drain must checkpoint to fit
    chosen = plan(profile, memory_limit=12000, schedule="auto")
    assert chosen.schedule == "1f1b" and chosen.checkpoint == "never"
    assert chosen.predicted.iteration_ms < gpipe.predicted.iteration_ms
    assert max(s.memory_bytes for s in chosen.stages) <= 12000
    assert chosen.predicted.iteration_ms == pytest.approx(simulate_plan(chosen).iteration_ms)
    # without a limit fill-drain (here interleaved) is predicted faster and auto keeps it
    assert plan(profile, schedule="auto").schedule == "gpipe"


def test_1f1b_plans_fit_or_fail_with_the_reason() -> None:
    profile = eight_layers()
    for limit in (3000, 6000, 20000):
        chosen = plan(profile, memory_limit=limit, schedule="1f1b")
        assert max(s.memory_bytes for s in chosen.stages) <= limit
        assert chosen.schedule == "1f1b"
        bound = chosen.predicted.lower_bound_ms
        assert bound is not None and bound <= chosen.predicted.iteration_ms
    with pytest.raises(PlanningError, match="no 1F1B plan fits"):
        plan(profile, memory_limit=500, schedule="1f1b")
    with pytest.raises(ValueError, match="schedule 'pipedream' is not one of"):
        plan(profile, schedule="pipedream")


def test_interleaved_1f1b_plans_are_priced_by_the_simulator_and_fit() -> None:
    """Two stages per device under 1F1B: each device holds the sum of its stages, the
    prediction is the simulator's, and under a limit it can beat one stage per device."""
    profile = eight_layers()
    for limit in (6000, 12000, None):
        chosen = plan(profile, memory_limit=limit, schedule="1f1b", interleave=2, time_limit=None)
        assert chosen.schedule == "1f1b" and chosen.interleave == 2 and len(chosen.stages) == 2 * chosen.device_count
        assert limit is None or max(chosen.device_memory_bytes) <= limit
        assert chosen.predicted.iteration_ms == pytest.approx(simulate_plan(chosen).iteration_ms)
        assert chosen.predicted.lower_bound_ms <= chosen.predicted.iteration_ms


def test_1f1b_plan_file_round_trip_and_old_files_load_as_gpipe(tmp_path) -> None:
    chosen = plan(eight_layers(), memory_limit=12000, schedule="1f1b")
    path = chosen.save(tmp_path / "p.json")
    assert Plan.load(path) == chosen
    document = json.loads(path.read_text())
    del document["schedule"]
    path.write_text(json.dumps(document))
    assert Plan.load(path).schedule == "gpipe"


def test_cli_schedule_option(tmp_path, capsys) -> None:
    path = eight_layers().save(tmp_path / "profile.json")
    out = tmp_path / "plan.json"
    assert main(["plan", str(path), "--schedule", "auto", "--memory-limit", "12000", "-o", str(out)]) == 0
    assert "schedule: 1f1b" in capsys.readouterr().out
    assert Plan.load(out).schedule == "1f1b"


@pytest.mark.timeout(60)
def test_pipeline_runs_a_1f1b_plan() -> None:
    """A 1F1B plan made for a real model runs it with train_step, as the plain model would."""
    model = nn.Sequential(*[nn.Linear(6, 6) for _ in range(4)])
    profile = autopipe.profile(model, torch.randn(4, 6), devices=["cpu", "cpu"], batch_sizes=[1, 2, 4],
                               repeats=1, warmup=0, quiet=True)
    chosen = plan(profile, schedule="1f1b", chunks=4)
    pipe = autopipe.Pipeline(model, chosen)
    assert pipe.schedule == "1f1b"
    x, y = torch.randn(4, 6), torch.randn(4, 6)
    reference = nn.Sequential(*[nn.Linear(6, 6) for _ in range(4)])
    reference.load_state_dict(model.state_dict())
    nn.functional.mse_loss(reference(x), y).backward()
    pipe.train_step(x, target=y, loss_fn=nn.functional.mse_loss)
    for (name, param), ref in zip(pipe.named_parameters(), reference.parameters()):
        torch.testing.assert_close(param.grad, ref.grad, msg=name)


def test_group_bound_never_exceeds_a_simulated_1f1b_time() -> None:
    """Every split's simulated 1F1B time, one stage per device or two, is at least the bound
    its group is skipped by (work over the devices, one micro-batch's chain and copies, or with
    one stage per device the largest stage's work after and before that chain)."""
    from autopipe.planning import one_f_one_b
    from autopipe.planning.interleaved import timed

    rng = random.Random(5)
    for _ in range(8):
        layers, devices = rng.randint(4, 7), rng.randint(2, 3)
        model = CostModel(random_profile(rng, layers, devices, skips=rng.randint(0, 2)), ["cpu"] * devices,
                          [rng.choice([0.5, 1.0, 2.0]) for _ in range(devices)], 8, 2.0)
        for factor, k, chunks, mode in itertools.product((1, 2), range(1, devices + 1), (1, 2, 4, 8),
                                                         ("never", "except_last", "always")):
            stages = k * factor
            if stages > layers or k == 1 < factor:  # no split, or no such group in the search
                continue
            bound = one_f_one_b._bound(model, chunks, mode, k, one_f_one_b._cuts(model, chunks, k, factor))
            if factor == 1:
                bound = max(bound, one_f_one_b._staged(model, chunks, mode, k))
            for cuts in itertools.combinations(range(1, layers), stages - 1):
                ms = timed(model, (0, *cuts, layers), chunks, mode, factor, np.full(devices, np.inf), "1f1b")[0]
                assert bound <= ms * (1 + 1e-9)


@pytest.mark.parametrize(("mode", "within"), [("never", 0.96), ("always", 0.85)])
def test_group_bound_is_near_the_best_split(mode: str, within: float) -> None:
    """Equal layers, equal speeds, free copies: the group bound of one stage per device lies
    within 4% of the best split's simulated 1F1B time (brute force) without checkpointing and
    within 15% with, where work over the devices and one micro-batch's chain alone lie up to 42%
    below it (the first backward's wait for micro-batch 0 through the later stages raised the
    first from 12.5%)."""
    from autopipe.planning import one_f_one_b

    profile = make_profile([1.0] * 12, sizes=(1, 2, 4, 8), linear=True, devices=4)
    model = CostModel(profile, ["cpu"] * 4, [1.0] * 4, 8, 2.0)
    for k, chunks in itertools.product((1, 2, 3, 4), (2, 4, 8)):
        best = min(evaluate(model, (0, *cuts, 12), chunks, mode, "1f1b").iteration_ms
                   for cuts in itertools.combinations(range(1, 12), k - 1))
        bound = max(one_f_one_b._bound(model, chunks, mode, k, one_f_one_b._cuts(model, chunks, k, 1)),
                    one_f_one_b._staged(model, chunks, mode, k))
        assert within * best <= bound <= best * (1 + 1e-9), (k, chunks)


@pytest.mark.parametrize("seed", range(3))
def test_a_1f1b_plan_is_no_slower_than_the_fill_drain_split_run_under_1f1b(seed: int) -> None:
    """Per-pair copies and skips: the groups' min-max splits leave copies out, the fill-drain
    search prices them, so its split run under 1F1B (at any micro-batch count and mode) is a
    plan the 1F1B search must match; with ``"auto"`` too."""
    rng = random.Random(seed)
    profile = random_profile(rng, 40, 6, per_pair=True, skips=4, sizes=(1, 2, 4, 8, 16, 32))
    profile.batch_size = 32
    model = CostModel(profile, profile.devices, [1.0] * 6, 32, "momentum")
    split = plan(profile, schedule="gpipe", interleave=1, time_limit=None)
    bounds = (0, *itertools.accumulate(split.balance))
    under_1f1b = min(evaluate(model, bounds, m, mode, "1f1b").iteration_ms
                     for m in candidate_chunks(32, profile.batch_sizes) for mode in ("never", "except_last", "always"))
    for schedule, known in (("1f1b", under_1f1b), ("auto", min(under_1f1b, split.predicted.iteration_ms))):
        chosen = plan(profile, schedule=schedule, interleave=1, time_limit=None)
        assert chosen.predicted.iteration_ms <= known * (1 + 1e-9)
        assert chosen.predicted.iteration_ms == pytest.approx(simulate_plan(chosen).iteration_ms)


def test_group_bound_counts_the_copies_the_first_micro_batch_crosses() -> None:
    """Two layers of 1 ms forward and 2 ms backward per sample on two devices, 8 micro-batches
    of one sample: the second stage waits for micro-batch 0 through the first (3 ms) and its
    copies there and back (0.5 ms + 100 bytes at 1 µs, each way: 1.2 ms), then runs its 24 ms."""
    from autopipe.planning import one_f_one_b

    profile = make_profile([8.0, 8.0], [16.0, 16.0], sizes=(1, 2, 4, 8), linear=True, devices=2,
                           output_bytes=100, copies=(0.5, 0.001))
    model = CostModel(profile, ["cpu"] * 2, [1.0] * 2, 8, 2.0)
    bound = one_f_one_b._staged(model, 8, "never", 2)
    assert bound == pytest.approx(3.0 + 1.2 + 24.0, rel=1e-4)  # the bisection stops within 1e-4
    assert bound <= evaluate(model, (0, 1, 2), 8, "never", "1f1b").iteration_ms


def test_groups_past_the_dp_cap_are_left_and_smaller_ones_still_searched(monkeypatch) -> None:
    """Interleaved 1F1B on 4 devices of 8 layers: the DP of ``k`` devices costs ``k · 2 · 36``
    cells; with a cap of 150 only ``k = 2`` fits.  The groups of least bound (more devices)
    are left unsearched with their bounds, and the plan comes from ``k = 2`` instead of none
    (which read as no plan fitting the memory limits, with none given)."""
    from autopipe.planning import one_f_one_b

    monkeypatch.setattr(one_f_one_b, "CELLS", 150)
    chosen = plan(eight_layers(), schedule="1f1b", interleave=2, time_limit=None)
    assert chosen.schedule == "1f1b" and chosen.interleave == 2 and chosen.device_count == 2
    assert chosen.predicted.lower_bound_ms <= chosen.predicted.iteration_ms
    assert chosen.predicted.iteration_ms == pytest.approx(simulate_plan(chosen).iteration_ms)


def test_no_1f1b_plan_within_the_cap_and_no_memory_limit_says_so(monkeypatch) -> None:
    """Where the 1F1B search may take no DP at all, the error names the search's cap, not
    memory limits that were never given."""
    from autopipe.planning import one_f_one_b

    monkeypatch.setattr(one_f_one_b, "CELLS", 0)
    with pytest.raises(PlanningError, match="within the 1F1B search's cap on its work; plan with schedule='gpipe'"):
        plan(eight_layers(), schedule="1f1b", interleave=2, time_limit=None)


def test_under_a_memory_limit_the_group_likeliest_to_fit_is_searched_first() -> None:
    """Most devices, micro-batches and recomputation first: a search stopped after that one
    group (at its first time check) has a plan that fits, where otherwise it had none."""
    from helpers import StopAfter

    from autopipe.planning import one_f_one_b

    model = CostModel(eight_layers(), ["cpu"] * 4, [1.0] * 4, 8, 2.0)
    limits = np.full(4, 3000.0)
    outcome = one_f_one_b.search(model, [1, 2, 4, 8], ["never", "except_last", "always"], limits, None, StopAfter(1))
    assert outcome.choice is not None and outcome.choice.schedule == "1f1b"
    chosen = outcome.choice
    lanes = model.stage_lanes(chosen.bounds, chosen.chunks, chosen.mode, schedule="1f1b")
    assert all(lane.memory <= 3000 for lane in lanes)
    assert outcome.lower_bound <= chosen.iteration_ms


def test_interleaved_1f1b_plans_hold_every_stage_and_reload(tmp_path) -> None:
    """Interleaved 1F1B starts from the split of least largest lane; where the greedy split behind
    it leaves a stage empty, the stages are still ``k · 2``, each with a layer (round-robin
    placement needs them all), and the plan saved reloads (its bubble share never below 0)."""
    rng = random.Random(0)
    for index in range(40):
        layers, devices = rng.randint(4, 12), rng.randint(2, 4)
        profile = random_profile(rng, layers, devices, skips=rng.randint(0, 3), per_pair=rng.random() < 0.7)
        speeds = [rng.choice([0.5, 1.0, 1.5, 2.0]) for _ in range(devices)]
        chosen = plan(profile, speeds=speeds, schedule="1f1b", interleave=2, time_limit=None)
        assert len(chosen.stages) % 2 == 0 and len(chosen.stages) >= 4
        assert all(stage.stop > stage.start for stage in chosen.stages)
        assert Plan.load(chosen.save(tmp_path / f"{index}.json")).balance == chosen.balance


def test_interleaved_1f1b_finds_a_split_whose_device_sums_fit() -> None:
    """Four layers on two devices, two stages each: the one split (stages 0 and 2 on device 0,
    1 and 3 on device 1) fits the limit on each device, though stage 1 alone needs more than
    half of it; the search must find it, not report that no plan fits."""
    rng = random.Random(622)
    layers, devices = rng.randint(2, 8), rng.randint(2, 4)
    profile = random_profile(rng, layers, devices, skips=rng.randint(0, 3), per_pair=rng.random() < 0.7)
    profile.batch_size = 8
    limit = 377_100
    chosen = plan(profile, memory_limit=limit, checkpoint="except_last", schedule="1f1b", speeds=[0.5, 0.5],
                  interleave=2, time_limit=None)
    assert chosen.balance == [1, 1, 1, 1] and chosen.interleave == 2
    stage_memory = [stage.memory_bytes for stage in chosen.stages]
    assert max(stage_memory) > limit / 2 and max(chosen.device_memory_bytes) <= limit
