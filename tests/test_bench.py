"""``bench``: the structure of its table and JSON, and the figures it derives from traces."""
from __future__ import annotations

import copy
import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import autopipe
from autopipe.bench import (Row, Times, Trainer, bench_plan, describe_plan, plan_of, round_robin, stage_times,
                            synthetic_batch)
from autopipe.cli import main
from autopipe.errors import DeviceError
from autopipe.profiling.profiles import ReductionFit, Stat
from autopipe.planning.simulate import simulate_plan
from autopipe.timeline import Event

FEATURES = 16
BATCH = 8


def tiny_model() -> nn.Module:
    """The model the CLI builds from the spec ``test_bench:tiny_model``."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(FEATURES, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4))


class TwoHeads(nn.Module):
    """Two outputs, as a tuple or a dict: logits and features."""

    def __init__(self, as_dict: bool) -> None:
        super().__init__()
        self.as_dict = as_dict
        self.a, self.b, self.c = nn.Linear(FEATURES, 32), nn.Linear(32, 32), nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> Any:
        h = self.a(x).relu()
        logits, features = self.c(self.b(h).relu()), h.mean(dim=1)
        return {"logits": logits, "features": features} if self.as_dict else (logits, features)


class Column(nn.Module):
    """Takes one number per sample (a batch of shape ``(B,)``)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.unsqueeze(1)


#: The calls of :func:`recording_model`, which only a command line that names it may make.
BUILT: list[str] = []


def recording_model() -> nn.Module:
    """The spec ``test_bench:recording_model``: the tiny model, each build recorded."""
    BUILT.append("test_bench:recording_model")
    return tiny_model()


def scalar_model() -> nn.Module:
    """The spec ``test_bench:scalar_model``: samples of no dimensions (input shape ``[]``)."""
    torch.manual_seed(0)
    return nn.Sequential(Column(), nn.Linear(1, 16), nn.ReLU(), nn.Linear(16, 4))


def tuple_model() -> nn.Module:
    """The spec ``test_bench:tuple_model``."""
    torch.manual_seed(0)
    return TwoHeads(as_dict=False)


def dict_model() -> nn.Module:
    """The spec ``test_bench:dict_model``."""
    torch.manual_seed(0)
    return TwoHeads(as_dict=True)


@pytest.fixture(autouse=True)
def _importable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(Path(__file__).parent))


@pytest.fixture(scope="module")
def tiny_profile() -> autopipe.Profile:
    torch.set_num_threads(1)
    return autopipe.profile(tiny_model(), torch.randn(BATCH, FEATURES), ["cpu", "cpu"],
                            batch_sizes=[4, 8], warmup=0, repeats=1, quiet=True)


@pytest.fixture(scope="module")
def two_stage_plan(tiny_profile: autopipe.Profile,
                   tmp_path_factory: pytest.TempPathFactory) -> tuple[autopipe.Plan, Path]:
    """A hand-made two-stage plan of the tiny model, saved, as ``plan -o`` would."""
    plan = plan_of(tiny_profile, ["cpu", "cpu"], [3, 2], chunks=2)
    return plan, plan.save(tmp_path_factory.mktemp("plans") / "tiny.json")


def test_stage_times_sums_lanes_and_leaves_the_rest_idle() -> None:
    events = [
        Event(0, "compute", "F", 0, 0.0, 2.0), Event(0, "compute", "F", 1, 2.0, 4.0),
        Event(1, "copy", "C", 0, 2.0, 2.5), Event(1, "compute", "F", 0, 2.5, 5.0),
        Event(1, "compute", "R", 0, 6.0, 7.0), Event(1, "compute", "B", 0, 7.0, 10.0),
        Event(0, "copy", "G", 0, 10.0, 10.5), Event(0, "compute", "B", 0, 10.5, 14.0),
    ]
    first, second = stage_times(events, 2, iteration_ms=15.0)
    assert first == Times(forward_ms=4.0, backward_ms=3.5, copy_ms=0.5, idle_ms=7.5)
    assert second == Times(forward_ms=2.5, backward_ms=4.0, copy_ms=0.5, idle_ms=8.5)
    # both stages on one device: each sees the device idle only when neither computes
    first, second = stage_times(events, 2, iteration_ms=15.0, placement=[0, 0])
    assert first.idle_ms == second.idle_ms == 15.0 - 7.5 - 6.5


def test_errors_are_relative_to_measured_and_skip_tiny_figures() -> None:
    row = Row("x", Times(11.0, 18.0, 0.02, 1.0), Times(10.0, 20.0, 0.001, 0.0), 30.0, 30.0)
    errors = row.errors(scale_ms=30.0)
    assert errors["forward_ms"] == pytest.approx(10.0)
    assert errors["backward_ms"] == pytest.approx(-10.0)
    assert errors["copy_ms"] is None and errors["idle_ms"] is None
    assert errors["total_ms"] == pytest.approx(0.0)


def test_round_robin_drops_warmup_and_steps_every_trainer() -> None:
    model = tiny_model()
    batch, target = synthetic_batch(model, [FEATURES], BATCH)
    trainers = {name: Trainer(tiny_model(), batch, target) for name in ("a", "b", "c")}
    round_robin(trainers, steps=3, warmup=2)
    for trainer in trainers.values():
        assert len(trainer.times) == 3 and len(trainer.losses) == 5
        assert all(t.step_ms >= t.iteration_ms > 0 for t in trainer.times)


def test_bench_plan_file_prints_every_stage_and_writes_json(
        two_stage_plan: tuple[autopipe.Plan, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    plan, path = two_stage_plan
    out = tmp_path / "out" / "bench.json"
    code = main(["bench", "test_bench:tiny_model", "--plan", str(path), "--input-shape", str(FEATURES),
                 "--steps", "2", "--json", str(out)])
    assert code == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("2 stages, balance [3, 2], 2 micro-batches of 4, checkpoint never")
    assert any(line.startswith("#0 0..2 (cpu)") for line in lines)
    assert any(line.startswith("#1 3..4 (cpu)") for line in lines)
    assert any(line.startswith("iteration ") for line in lines)
    assert "speedup" in lines[-2] and lines[-1] == f"wrote {out}"

    document = json.loads(out.read_text())
    assert document["kind"] == "bench" and document["model_spec"] == "test_bench:tiny_model"
    assert (document["balance"], document["chunks"], document["steps"]) == ([3, 2], 2, 2)
    assert [row["name"] for row in document["rows"]] == ["#0 0..2 (cpu)", "#1 3..4 (cpu)", "iteration"]
    for row in document["rows"]:
        assert set(row["predicted"]) == set(row["measured"]) == {"forward_ms", "backward_ms", "copy_ms", "idle_ms"}
        assert set(row["error_pct"]) == {"forward_ms", "backward_ms", "copy_ms", "idle_ms", "total_ms"}
        assert row["measured"]["forward_ms"] > 0 and row["measured"]["backward_ms"] > 0
    for stage, row in zip(plan.stages, document["rows"]):  # the predicted side is the plan's own
        assert row["predicted"]["forward_ms"] == pytest.approx(plan.chunks * stage.forward_ms, abs=1e-3)
        assert row["predicted"]["backward_ms"] == pytest.approx(plan.chunks * stage.backward_ms, abs=1e-3)
    whole = document["rows"][-1]
    assert whole["predicted_total_ms"] == pytest.approx(plan.predicted.iteration_ms, abs=1e-3)
    assert whole["predicted_total_ms"] == pytest.approx(simulate_plan(plan).iteration_ms, abs=1e-3)
    assert document["speedup"] == pytest.approx(
        document["single_device"]["step_ms"] / document["pipeline"]["step_ms"], rel=1e-3, abs=1e-4)  # 4 places


def test_bench_model_profiles_and_plans_first(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["bench", "test_bench:tiny_model", "--input-shape", str(FEATURES), "--batch-size", str(BATCH),
                 "--devices", "cpu,cpu", "--steps", "1"])
    assert code == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("planned: ")
    planned = lines[0].removeprefix("planned: ").rsplit(", predicted ", 1)[0]
    assert lines[1].startswith(f"{planned};")  # the table is of the plan just made
    stages = len(json.loads(planned.split("balance ")[1].split("]")[0] + "]"))
    assert sum(line.startswith("#") for line in lines) == stages
    assert "speedup" in lines[-1]


def test_bench_refuses_a_plan_for_another_batch(two_stage_plan: tuple[autopipe.Plan, Path],
                                                capsys: pytest.CaptureFixture[str]) -> None:
    _, path = two_stage_plan
    code = main(["bench", "test_bench:tiny_model", "--plan", str(path), "--input-shape", str(FEATURES),
                 "--batch-size", "16"])
    assert code == 2
    assert "plan is for batch size 8, not 16" in capsys.readouterr().err


def test_bench_needs_a_model(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench"]) == 2
    assert "name the model" in capsys.readouterr().err


def test_a_plan_from_the_cli_names_its_model_and_shape(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    profile_path, plan_path = tmp_path / "tiny.json", tmp_path / "plan.json"
    assert main(["profile", "test_bench:tiny_model", "--input-shape", str(FEATURES), "--batch-size", "8",
                 "--batch-sizes", "2,4,8", "--repeats", "1", "--warmup", "0", "--quiet",
                 "-o", str(profile_path)]) == 0
    assert main(["plan", str(profile_path), "--devices", "cpu,cpu", "--chunks", "2", "-o", str(plan_path)]) == 0
    plan = autopipe.Plan.load(plan_path)
    assert (plan.model["spec"], plan.model["input_shape"]) == ("test_bench:tiny_model", [FEATURES])
    capsys.readouterr()
    # the shape is the plan's; a model that is not torchvision:NAME is given on the command line
    assert main(["bench", "test_bench:tiny_model", "--plan", str(plan_path), "--steps", "1", "--warmup", "0"]) == 0
    assert any(line.startswith("iteration ") for line in capsys.readouterr().out.splitlines())


@pytest.mark.parametrize("build", [tuple_model, dict_model])
def test_a_tuple_or_dict_output_gets_a_target_per_tensor_and_trains_like_the_plain_model(build: Any) -> None:
    model = build()
    batch, target = synthetic_batch(model, [FEATURES], BATCH)
    output = model(batch)
    keys = output.keys() if isinstance(output, dict) else range(len(output))
    assert all(target[k].shape == output[k].shape for k in keys)
    trainer = Trainer(copy.deepcopy(model), batch, target)
    trainer.step()
    expected = sum(nn.functional.mse_loss(output[k], target[k]) for k in keys)
    assert trainer.losses == [pytest.approx(expected.item())]


@pytest.mark.parametrize("spec", ["tuple_model", "dict_model"])
def test_bench_runs_a_model_with_tuple_or_dict_outputs(spec: str, capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["bench", f"test_bench:{spec}", "--input-shape", str(FEATURES), "--batch-size", str(BATCH),
                 "--devices", "cpu,cpu", "--chunks", "2", "--steps", "1", "--warmup", "0"])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    assert "speedup" in captured.out.splitlines()[-1]


def test_bench_refuses_a_model_without_a_float_output_in_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    model = nn.Sequential(nn.Linear(FEATURES, 4), Argmax())
    with pytest.raises(ValueError, match="no floating-point tensor"):
        synthetic_batch(model, [FEATURES], BATCH)


class Argmax(nn.Module):
    """An integer output: nothing to regress."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.argmax(dim=1)


def test_a_1f1b_plan_trains_with_its_loss_inside_like_the_plain_model() -> None:
    """A 1F1B pipeline needs the loss inside (``train_step``): the trainer (and so ``bench --plan``)
    steps it that way, to the plain model's loss and parameters, with the forward phase ending
    at its last forward."""
    torch.set_num_threads(1)
    model = tiny_model().double()
    plain = copy.deepcopy(model)
    x = torch.randn(BATCH, FEATURES, dtype=torch.double)
    target = torch.randn(BATCH, 4, dtype=torch.double)
    pipe = autopipe.Pipeline(model, balance=[3, 2], devices=["cpu", "cpu"], chunks=4, schedule="1f1b")
    try:
        trainers = [Trainer(plain, x, target), Trainer(pipe, x, target, devices=["cpu", "cpu"])]
        steps = [trainer.step() for trainer in trainers]
    finally:
        pipe.close()
    assert trainers[1].losses[0] == pytest.approx(trainers[0].losses[0], rel=1e-12)
    for (name, mine), theirs in zip(pipe.named_parameters(), plain.parameters()):
        torch.testing.assert_close(mine, theirs, msg=name)
    assert 0 < steps[1].forward_ms < steps[1].iteration_ms


@pytest.mark.parametrize("device, words", [
    pytest.param("cuda:0", "CUDA is not available", marks=pytest.mark.skipif(
        torch.cuda.is_available(), reason="the plan's devices exist here")),
])
def test_a_plan_for_devices_not_here_is_refused_before_the_model_moves(
        two_stage_plan: tuple[autopipe.Plan, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str],
        device: str, words: str) -> None:
    """``bench`` checks a plan's devices as :class:`~autopipe.Pipeline` does, with its error, before
    moving the model there (torch's RuntimeError, with a traceback, until then)."""
    document = json.loads(two_stage_plan[1].read_text())
    document.update(devices=[device, device], replica_devices=[[device, device]])
    for stage in document["stages"]:
        stage["device"] = device
    path = tmp_path / "elsewhere.json"
    path.write_text(json.dumps(document))
    plan = autopipe.Plan.load(path)
    with pytest.raises(DeviceError) as pipeline:
        autopipe.Pipeline(tiny_model(), plan)
    batch, target = synthetic_batch(tiny_model(), [FEATURES], BATCH)
    with pytest.raises(DeviceError) as bench:
        bench_plan(tiny_model(), plan, batch, target, steps=1)
    assert str(bench.value) == str(pipeline.value) and words in str(bench.value)
    assert main(["bench", "--plan", str(path), "--steps", "1"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err == f"autopipe bench: error: {bench.value}\n"


def test_bench_takes_the_devices_of_every_replica_of_its_plan(
        tiny_profile: autopipe.Profile, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A two-replica plan made on cpu,cpu runs with ``--devices cpu,cpu``; one replica's devices
    alone are refused, naming all of them."""
    plan = autopipe.plan(tiny_profile, ["cpu", "cpu"], replicas=2, chunks=1)
    assert plan.used_devices == ["cpu", "cpu"] and plan.device_count == 1
    path = plan.save(tmp_path / "replicas.json")
    bench = ["bench", "test_bench:tiny_model", "--plan", str(path), "--input-shape", str(FEATURES), "--steps", "1",
             "--warmup", "0"]
    assert main([*bench, "--devices", "cpu"]) == 2
    assert "the plan fixes its devices (cpu,cpu: 2 replicas)" in capsys.readouterr().err
    assert main([*bench, "--devices", "cpu, cpu"]) == 0
    assert "speedup" in capsys.readouterr().out


def test_a_profile_of_scalar_samples_is_benched_with_its_own_empty_shape(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A profile's ``input_shape`` ``[]`` (one number per sample) is the shape benched, not
    replaced by the default 3,64,64 the model cannot take."""
    profile = autopipe.profile(scalar_model(), torch.randn(BATCH), ["cpu"], batch_sizes=[4, 8], warmup=0,
                               repeats=1, quiet=True)
    path = profile.save(tmp_path / "scalar.json")
    assert autopipe.Profile.load(path).input_shape == []
    code = main(["bench", "test_bench:scalar_model", "--profile", str(path), "--batch-size", str(BATCH),
                 "--devices", "cpu", "--steps", "1", "--warmup", "0"])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    assert "speedup" in captured.out


def test_a_plan_for_the_distributed_engine_is_refused_saying_how_to_run_it(
        tiny_profile: autopipe.Profile, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Bench ran such a plan in this process without a word, against predictions made for one
    process per stage: refused, before the model is built, naming torchrun with the plan's
    process count; the library call too."""
    plan = autopipe.plan(tiny_profile, ["cpu", "cpu"], engine="distributed", chunks=2, replicas=1)
    path = plan.save(tmp_path / "distributed.json")
    processes = len(plan.stages)
    capsys.readouterr()
    assert main(["bench", "--plan", str(path), "--steps", "1"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1
    assert err.startswith(f"autopipe bench: error: {path} was made for --engine distributed")
    assert f"torchrun --nproc-per-node {processes} examples/distributed_train.py --plan {path}" in err
    batch, target = synthetic_batch(tiny_model(), [FEATURES], BATCH)
    with pytest.raises(ValueError, match=f"the plan was made for --engine distributed.*--nproc-per-node {processes}"):
        bench_plan(tiny_model(), plan, batch, target, steps=1)


@pytest.mark.parametrize("options, header, recorded", [
    (dict(replicas=2, chunks=1), "2 replicas (data parallel) on [cpu], [cpu], each 1 stage, balance [5], "
     "1 micro-batch of 4 (batch 8, 4 per replica), checkpoint never;",
     dict(devices=["cpu"], replicas=2, replica_devices=[["cpu"], ["cpu"]], interleave=1, schedule="gpipe")),
    (dict(replicas=1, interleave=2, schedule="1f1b", chunks=2), "4 stages, 2 per device, balance {balance}, "
     "2 micro-batches of 4, checkpoint never, schedule 1f1b;",
     dict(devices=["cpu"] * 4, replicas=1, replica_devices=[["cpu"] * 4], interleave=2, schedule="1f1b")),
])
def test_bench_reports_and_records_replicas_interleave_and_schedule(
        tiny_profile: autopipe.Profile, tmp_path: Path, capsys: pytest.CaptureFixture[str],
        options: dict[str, Any], header: str, recorded: dict[str, Any]) -> None:
    """A data-parallel plan was printed and recorded as one device ("1 stage, balance [5]",
    devices ['cpu']): the header says every replica's devices, and an interleaved 1F1B plan its
    stages per device and schedule; the JSON has them beside its old keys."""
    plan = autopipe.plan(tiny_profile, ["cpu", "cpu"], checkpoint="never", **options)
    path, out = plan.save(tmp_path / "plan.json"), tmp_path / "bench.json"
    capsys.readouterr()
    assert main(["bench", "test_bench:tiny_model", "--plan", str(path), "--input-shape", str(FEATURES),
                 "--steps", "1", "--warmup", "0", "--json", str(out)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith(header.format(balance=plan.balance)), lines[0]
    document = json.loads(out.read_text())
    assert {key: document[key] for key in recorded} == recorded
    assert (document["balance"], document["chunks"], document["batch_size"]) == (plan.balance, plan.chunks, BATCH)


@pytest.fixture
def data_parallel_profile(tiny_profile: autopipe.Profile, tmp_path: Path) -> Path:
    """The tiny model's profile with every layer taking 10 ms per 4 samples and a cheap
    reduction: two replicas on two devices beat any pipeline (no bubble, half the work each)."""
    def slow(samples: int) -> Stat:
        return Stat(2.5 * samples, 2.5 * samples, 2.5 * samples, 1)

    layers = [dataclasses.replace(layer, forward={b: slow(b) for b in layer.forward},
                                  backward={b: slow(b) for b in layer.backward}) for layer in tiny_profile.layers]
    reduction = ReductionFit("local", 2, 0.01, 0.0, [(1024, 0.01), (2048, 0.01)])
    return dataclasses.replace(tiny_profile, layers=layers, reductions=[reduction]).save(tmp_path / "slow.json")


def test_bench_plans_from_a_profile_as_the_plan_command_does(
        data_parallel_profile: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``bench MODEL --profile`` planned pipelines only, for a batch of 32 whatever the profile's:
    it plans as ``plan`` does (data parallel searched too), for the profile's batch."""
    plan_path, out = tmp_path / "plan.json", tmp_path / "bench.json"
    assert main(["plan", str(data_parallel_profile), "-o", str(plan_path)]) == 0
    planned = autopipe.Plan.load(plan_path)
    assert (planned.replicas, planned.batch_size) == (2, BATCH)  # the case: data parallel wins here
    capsys.readouterr()
    code = main(["bench", "test_bench:tiny_model", "--profile", str(data_parallel_profile), "--steps", "1",
                 "--warmup", "0", "--json", str(out)])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    assert captured.out.splitlines()[0] == \
        f"planned: {describe_plan(planned)}, predicted {planned.predicted.iteration_ms:.1f} ms"
    document = json.loads(out.read_text())
    fields = ("replicas", "replica_devices", "balance", "chunks", "checkpoint", "batch_size")
    assert [document[name] for name in fields] == [getattr(planned, name) for name in fields]


def test_the_predicted_timeline_of_replicas_ends_with_their_reduction(data_parallel_profile: Path) -> None:
    """bench drew a replica plan's predicted timeline without the gradient reduction (``show``
    drew it): its end fell short of the predicted iteration by the reduction's tail."""
    plan = autopipe.plan(data_parallel_profile)
    assert plan.replicas == 2 and plan.stages[0].reduce_ms > 0
    batch, target = synthetic_batch(tiny_model(), [FEATURES], BATCH)
    result = bench_plan(tiny_model(), plan, batch, target, steps=1, warmup=0)
    reductions = [event for event in result.predicted_events if event.kind == "A"]
    assert len(reductions) == len(plan.stages)
    assert max(event.end_ms for event in result.predicted_events) == pytest.approx(plan.predicted.iteration_ms)


def test_a_plan_without_its_input_shape_names_the_option_when_the_default_does_not_fit(
        two_stage_plan: tuple[autopipe.Plan, Path], capsys: pytest.CaptureFixture[str]) -> None:
    """A plan made in Python records no input shape: bench tries 3,64,64, and when the model does
    not take it the error says where that shape came from and which option gives another."""
    assert main(["bench", "test_bench:tiny_model", "--plan", str(two_stage_plan[1]), "--steps", "1"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert err.rstrip().endswith("check that the model takes samples of shape [3, 64, 64] (bench's default, as "
                                 "the plan records none: give the model's with --input-shape)"), err


def _naming(source: Path, spec: str, target: Path) -> Path:
    """A copy of the plan or profile ``source`` whose model is ``spec``, as a shared file may say."""
    document = json.loads(source.read_text())
    document["model"]["spec"] = spec
    target.write_text(json.dumps(document))
    return target


@pytest.mark.parametrize("command", [
    ["bench", "--plan", "{plan}", "--input-shape", str(FEATURES), "--steps", "1"],
    ["bench", "--profile", "{profile}", "--steps", "1"],
    ["profile", "--bytes-of", "{profile}", "--quiet"],
])
def test_a_file_naming_a_model_factory_never_makes_autopipe_import_it(
        two_stage_plan: tuple[autopipe.Plan, Path], tiny_profile: autopipe.Profile, tmp_path: Path,
        capsys: pytest.CaptureFixture[str], command: list[str]) -> None:
    """A plan or profile's ``model.spec`` made bench and ``profile --bytes-of`` import any module
    and call any function (``os:abort``): JSON that ran code, as a pickle does.  Refused, in one
    line saying how to give a trusted model on the command line, and the factory never runs."""
    spec = "test_bench:recording_model"
    files = {"plan": _naming(two_stage_plan[1], spec, tmp_path / "plan.json"),
             "profile": _naming(tiny_profile.save(tmp_path / "saved.json"), spec, tmp_path / "profile.json")}
    argv = [word.format(**files) for word in command]
    path, option = argv[2], argv[1]
    BUILT.clear()
    capsys.readouterr()
    assert main(argv) == 2
    out, err = capsys.readouterr()
    assert (out, BUILT) == ("", [])
    assert err == (f"autopipe {argv[0]}: error: {path} names the model '{spec}', and autopipe does not import code a "
                   f"file names; if you trust it, give it on the command line as MODEL: python -m autopipe "
                   f"{argv[0]} {spec} {option} {path}\n")


def test_a_file_naming_a_torchvision_model_is_built(two_stage_plan: tuple[autopipe.Plan, Path],
                                                     tiny_profile: autopipe.Profile, tmp_path: Path,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    """``torchvision:NAME`` imports no code the file names: such a file's model is built (and
    here found not to be the one the file was made for), for bench and ``--bytes-of`` alike."""
    spec = "torchvision:resnet18"
    plan = _naming(two_stage_plan[1], spec, tmp_path / "plan.json")
    profile = _naming(tiny_profile.save(tmp_path / "saved.json"), spec, tmp_path / "profile.json")
    for argv, expected in ((["bench", "--plan", str(plan), "--steps", "1"], "the plan was made for another model"),
                           (["profile", "--bytes-of", str(profile), "--quiet"], "the profile is of another model")):
        capsys.readouterr()
        assert main(argv) == 2
        assert expected in capsys.readouterr().err
