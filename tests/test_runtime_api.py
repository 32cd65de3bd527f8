"""The pipeline as an ``nn.Module``: state, modes, inputs, plans, devices, errors, threads."""
from __future__ import annotations

import copy
import dataclasses
import gc
import re
import warnings
from typing import Any

import pytest
import torch
import torchvision
from torch import Tensor, nn

import autopipe
from autopipe.model.fingerprint import model_fingerprint
from autopipe.planning.plans import Plan, Prediction, StagePlan
from helpers import assert_close, assert_step_matches, mlp, reference_step
from models import skip_model


def resnet() -> nn.Module:
    return torchvision.models.resnet18(weights=None, num_classes=10)


# -- state --------------------------------------------------------------------------------

@pytest.mark.timeout(60)
@pytest.mark.parametrize("deferred", [False, True])
def test_state_dict_is_the_models(deferred: bool) -> None:
    model = resnet()
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    pipe = autopipe.Pipeline(model, balance=[5, 5, 5], devices=["cpu"] * 3, deferred_batch_norm=deferred)
    state = pipe.state_dict()
    assert list(state) == list(expected)
    for key, value in expected.items():
        assert torch.equal(state[key], value), key
    assert {n for n, _ in pipe.named_parameters()} == {n for n, _ in model.named_parameters()}

    other = resnet()  # different random weights: load both ways
    pipe.load_state_dict(other.state_dict())
    assert all(torch.equal(pipe.state_dict()[k], v) for k, v in other.state_dict().items())
    fresh = resnet()
    fresh.load_state_dict(pipe.state_dict())
    assert all(torch.equal(fresh.state_dict()[k], v) for k, v in other.state_dict().items())


@pytest.mark.timeout(60)
class LearnedTemperature(nn.Module):
    """A learnable scale the loss reads outside ``forward``: no layer holds it."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 2)
        self.log_scale = nn.Parameter(torch.zeros(()))

    def forward(self, x: Tensor) -> Tensor:
        return self.b(torch.tanh(self.a(x)))


def test_model_tensors_no_layer_holds_are_named_in_a_warning() -> None:
    """pipe.parameters() leaves out a parameter only the loss reads: an optimizer given them left
    it untrained, silently; the warning names it and the fix, and a model whose tensors the
    layers all hold gets none."""
    with pytest.warns(UserWarning, match=r"the model's tensors 'log_scale' are in no layer the pipeline runs.*"
                                         r"Give the optimizer model.parameters\(\)"):
        pipe = autopipe.Pipeline(LearnedTemperature(), balance=[1, 1], devices=["cpu", "cpu"], chunks=2)
    assert "log_scale" not in dict(pipe.named_parameters())
    pipe.close()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        autopipe.Pipeline(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2)), balance=[1, 1], chunks=2).close()


def test_parameters_feed_an_optimizer() -> None:
    model = mlp()
    reference = copy.deepcopy(model)
    pipe = autopipe.Pipeline(model, balance=[3, 4], devices=["cpu", "cpu"], chunks=2)
    x, g = torch.randn(6, 6), torch.randn(6, 3)
    for net in (pipe, reference):
        optimizer = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
        for _ in range(3):
            optimizer.zero_grad()
            (net(x) * g).sum().backward()
            optimizer.step()
    for key, value in reference.state_dict().items():
        assert_close(pipe.state_dict()[key], value, key)


# -- modes --------------------------------------------------------------------------------

@pytest.mark.timeout(60)
def test_no_grad_runs_forward_only() -> None:
    model = resnet().eval()
    expected = model(torch.ones(4, 3, 32, 32)).detach()
    pipe = autopipe.Pipeline(model, balance=[7, 8], devices=["cpu", "cpu"], chunks=2).eval()
    with torch.no_grad():
        out = pipe(torch.ones(4, 3, 32, 32))
    assert out.grad_fn is None and not out.requires_grad
    assert_close(out, expected, "output")
    assert {e.kind for e in pipe.last_trace()} == {"F"}


@pytest.mark.timeout(60)
def test_eval_uses_running_stats_and_still_gives_gradients() -> None:
    model = resnet()
    model(torch.randn(8, 3, 32, 32))  # move the running statistics away from 0 and 1
    model.eval()
    reference = copy.deepcopy(model)
    pipe = autopipe.Pipeline(model, balance=[7, 8], devices=["cpu", "cpu"], chunks=4, checkpoint="always")
    pipe.eval()
    assert not any(m.training for stage in pipe.stages for m in stage.modules)
    x = torch.randn(8, 3, 32, 32)
    g = torch.randn(8, 10)
    out = pipe(x)
    (out * g).sum().backward()
    expected = reference_step(reference, x, g, 1)  # eval: the full batch is the reference
    assert_close(out, expected, "output")
    for (name, p), q in zip(pipe.named_parameters(), reference.parameters()):
        assert_close(p.grad, q.grad, name)
    assert "R" not in {e.kind for e in pipe.last_trace()}  # no checkpointing in eval
    pipe.train()
    assert all(m.training for stage in pipe.stages for m in stage.modules)


@pytest.mark.timeout(60)
def test_two_forwards_before_one_backward() -> None:
    model = skip_model()
    reference = copy.deepcopy(model)
    pipe = autopipe.Pipeline(model, balance=[1, 2, 2, 3], devices=["cpu"] * 4, chunks=3)
    x1, x2 = torch.randn(5, 8), torch.randn(7, 8)
    out1, out2 = pipe(x1), pipe(x2)
    dropped = pipe(x1)  # a forward whose output is never backpropagated
    del dropped
    (out2.sum() + 2 * out1.sum()).backward()
    (reference(x2).sum() + 2 * reference(x1).sum()).backward()
    for (name, p), q in zip(pipe.named_parameters(), reference.parameters()):
        assert_close(p.grad, q.grad, name)
    with pytest.raises(RuntimeError, match="a second time"):  # a retained graph allows it: test_runtime_misuse
        loss = pipe(x1).sum()
        loss.backward()
        loss.backward()


# -- inputs and outputs ---------------------------------------------------------------------

class TwoInputs(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 5), nn.Linear(3, 5)

    def forward(self, x: Tensor, y: Tensor, scale: float) -> tuple[Tensor, Tensor]:
        return self.a(x) * scale, self.b(y)


class Pair(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(5, 5)

    def forward(self, pair: tuple[Tensor, Tensor]) -> tuple[Tensor, Tensor]:
        return self.linear(pair[0]) + pair[1], pair[1] * 2


@pytest.mark.timeout(60)
def test_tuple_inputs_outputs_and_plain_arguments() -> None:
    model = nn.Sequential(TwoInputs(), Pair(), Pair())
    reference = copy.deepcopy(model)
    pipe = autopipe.Pipeline(model, balance=[1, 1, 1], devices=["cpu"] * 3, chunks=4)
    x = torch.randn(6, 4, requires_grad=True)
    y = torch.randn(6, 3)
    first, second = pipe(x, y, 0.5)
    x_ref = x.detach().clone().requires_grad_()
    ref = reference[2](reference[1](reference[0](x_ref, y, 0.5)))
    assert_close(first, ref[0], "first")
    assert_close(second, ref[1], "second")
    (first.sum() + second.pow(2).sum()).backward()
    (ref[0].sum() + ref[1].pow(2).sum()).backward()
    assert_close(x.grad, x_ref.grad, "x.grad")
    for (name, p), q in zip(pipe.named_parameters(), reference.parameters()):
        assert_close(p.grad, q.grad, name)


@pytest.mark.timeout(60)
def test_batch_smaller_than_chunks_gives_one_sample_per_micro_batch() -> None:
    pipe = autopipe.Pipeline(mlp(), balance=[3, 4], devices=["cpu", "cpu"], chunks=4)
    pipe(torch.randn(3, 6)).sum().backward()
    forwards = [e for e in pipe.last_trace() if e.kind == "F" and e.stage == 0]
    assert [e.micro_batch for e in forwards] == [0, 1, 2]


# -- plans and devices ----------------------------------------------------------------------

def plan_for(model: nn.Module, balance: list[int], chunks: int = 2) -> Plan:
    layers = autopipe.layer_chain(model)
    stages, start = [], 0
    for index, count in enumerate(balance):
        where = dict(index=index, device="cpu", start=start, stop=start + count,
                     first_layer=layers[start].name, last_layer=layers[start + count - 1].name)
        costs = {f.name: 0 for f in dataclasses.fields(StagePlan) if f.name not in where and f.name != "memory_terms"}
        stages.append(StagePlan(**where, **costs))
        start += count
    return Plan(model_fingerprint(layers), "", ["cpu"] * len(balance), 8, chunks, "never", "gpipe",
                stages, Prediction(0.0, 0.0, 0.0, 0.0))


@pytest.mark.timeout(60)
def test_plan_is_followed_and_checked(tmp_path) -> None:
    model = mlp()
    plan_for(model, [2, 5], chunks=4).save(tmp_path / "plan.json")
    plan = Plan.load(tmp_path / "plan.json")
    pipe = autopipe.Pipeline(model, plan)
    assert (pipe.balance, pipe.chunks, pipe.checkpoint) == ([2, 5], 4, "never")
    other = mlp()
    other[2] = nn.Linear(16, 17)
    with pytest.raises(ValueError, match=r"another model: layer 2 differs: expected 2 \(Linear, bias \(16,\)"):
        autopipe.Pipeline(other, plan)


@pytest.mark.timeout(60)
def test_missing_devices_are_refused_before_any_work() -> None:
    model = mlp()
    with pytest.raises(autopipe.DeviceError, match="cuda:3"):
        autopipe.Pipeline(model, balance=[3, 4], devices=["cpu", "cuda:3"])
    assert all(p.device.type == "cpu" for p in model.parameters())
    with pytest.raises(ValueError, match="covers 6 layers but the model has 7"):
        autopipe.Pipeline(model, balance=[3, 3], devices=["cpu", "cpu"])


@autopipe.skippable(pop=["a"])
class PopAndRecordDevice(nn.Module):
    seen: list[torch.device] = []

    def forward(self, x: Tensor):  # type: ignore[no-untyped-def]
        a = yield autopipe.pop("a")
        PopAndRecordDevice.seen.append(a.device)
        return x + a


@autopipe.skippable(stash=["a"])
class Stash(nn.Module):
    def forward(self, x: Tensor):  # type: ignore[no-untyped-def]
        yield autopipe.stash("a", x)
        return x


@pytest.mark.timeout(60)
def test_meta_last_stage_places_everything_on_its_device() -> None:
    """With "meta" as the last stage's device a misrouted tensor would raise a device
    mismatch; meta tensors have no data, so only devices and shapes are compared."""
    model = nn.Sequential(nn.Linear(4, 4), Stash(), nn.Linear(4, 4), nn.Linear(4, 4), PopAndRecordDevice(),
                          nn.Linear(4, 2))
    pipe = autopipe.Pipeline(model, balance=[3, 3], devices=["cpu", "meta"], chunks=2, checkpoint="except_last")
    PopAndRecordDevice.seen.clear()
    x = torch.randn(6, 4, requires_grad=True)
    out = pipe(x)
    assert out.device.type == "meta" and out.shape == (6, 2)
    out.sum().backward()  # the output gradient is created on meta, like the output
    # two forwards and the recomputation of micro-batch 0 (checkpoint="except_last")
    assert PopAndRecordDevice.seen == [torch.device("meta")] * 3
    assert x.grad is not None and x.grad.device.type == "cpu" and x.grad.shape == x.shape
    assert [p.grad.device.type for p in pipe.parameters()] == ["cpu"] * 4 + ["meta"] * 4
    kinds = {(e.stage, e.lane, e.kind) for e in pipe.last_trace()}
    assert {(1, "copy", "C"), (0, "copy", "G")} <= kinds


# -- errors -------------------------------------------------------------------------------

class FailOn(nn.Module):
    """Raises in the forward (or the backward) of the given micro-batch call."""

    def __init__(self, call: int, backward: bool = False) -> None:
        super().__init__()
        self.call, self.backward, self.calls = call, backward, 0

    def forward(self, x: Tensor) -> Tensor:
        self.calls += 1
        if self.calls - 1 == self.call:
            if not self.backward:
                raise ValueError("forward boom")
            return _RaiseInBackward.apply(x)
        return x


class _RaiseInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):  # type: ignore[no-untyped-def, override]
        return x.clone()

    @staticmethod
    def backward(ctx, g):  # type: ignore[no-untyped-def, override]
        raise KeyError("backward boom")


@pytest.mark.timeout(30)
@pytest.mark.parametrize("stage", [0, 1])  # a failing stage 0 leaves stage 1 waiting for input
def test_forward_error_keeps_its_type_names_the_stage_and_the_pipeline_survives(stage: int) -> None:
    layers = [nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4)]
    layers.insert(1 if stage == 0 else 3, FailOn(call=2))
    pipe = autopipe.Pipeline(nn.Sequential(*layers), balance=[2, 2], devices=["cpu", "cpu"], chunks=4)
    names = ["0..1", "2..3"][stage]
    with pytest.raises(ValueError, match="forward boom") as info:
        pipe(torch.randn(8, 4))
    assert info.value.__notes__ == [f"autopipe: raised by stage {stage} ({names}) on cpu in forward of micro-batch 2"]
    pipe(torch.randn(8, 4)).sum().backward()  # the workers live on
    assert all(worker.alive for worker in pipe._engine.workers)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("stage", [0, 1])  # a failing stage 1 leaves stage 0 waiting for dy
@pytest.mark.parametrize("input_grad", [False, True])  # the tie waits in a callback, or inline
def test_backward_error_names_the_stage(stage: int, input_grad: bool) -> None:
    layers = [nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4)]
    layers.insert(1 if stage == 0 else 3, FailOn(call=1, backward=True))
    pipe = autopipe.Pipeline(nn.Sequential(*layers), balance=[2, 2], devices=["cpu", "cpu"], chunks=3,
                             checkpoint="never")
    out = pipe(torch.randn(6, 4, requires_grad=input_grad))
    names = ["0..1", "2..3"][stage]
    with pytest.raises(KeyError, match="backward boom") as info:
        out.sum().backward()
    assert info.value.__notes__ == [f"autopipe: raised by stage {stage} ({names}) on cpu in backward of micro-batch 1"]
    pipe(torch.randn(6, 4)).sum().backward()


@pytest.mark.timeout(30)
def test_workers_stop_when_the_pipeline_is_collected() -> None:
    pipe = autopipe.Pipeline(mlp(), balance=[3, 4], devices=["cpu", "cpu"], chunks=2)
    pipe(torch.randn(4, 6)).sum().backward()
    workers = pipe._engine.workers
    del pipe
    gc.collect()
    for worker in workers:
        worker.join(timeout=10)
        assert not worker.alive


@pytest.mark.timeout(30)
def test_close_stops_the_workers_and_refuses_further_calls() -> None:
    pipe = autopipe.Pipeline(mlp(), balance=[3, 4], devices=["cpu", "cpu"])
    pipe.close()
    for worker in pipe._engine.workers:
        worker.join(timeout=10)
        assert not worker.alive
    with pytest.raises(RuntimeError, match="closed"):
        pipe(torch.randn(2, 6))


# -- trace --------------------------------------------------------------------------------

@pytest.mark.timeout(60)
def test_trace_has_every_action_of_the_last_iteration() -> None:
    pipe = autopipe.Pipeline(mlp(), balance=[3, 4], devices=["cpu", "cpu"], chunks=4, checkpoint="except_last")
    for _ in range(2):
        pipe(torch.randn(8, 6)).sum().backward()
    events = pipe.last_trace()
    for stage in (0, 1):
        assert sorted(e.micro_batch for e in events if e.stage == stage and e.kind == "F") == [0, 1, 2, 3]
        assert sorted(e.micro_batch for e in events if e.stage == stage and e.kind == "B") == [0, 1, 2, 3]
        assert sorted(e.micro_batch for e in events if e.stage == stage and e.kind == "R") == [0, 1, 2]
    assert all(0 <= e.start_ms <= e.end_ms for e in events)
    f3 = next(e for e in events if e.stage == 1 and e.kind == "F" and e.micro_batch == 3)
    b3 = next(e for e in events if e.stage == 1 and e.kind == "B" and e.micro_batch == 3)
    assert f3.end_ms <= b3.start_ms


@pytest.mark.timeout(60)
def test_stages_on_one_device_take_turns() -> None:
    """Interleaved stages share a device: their compute never overlaps on it, while the other
    device's stages run alongside."""
    pipe = autopipe.Pipeline(mlp(), balance=[2, 2, 2, 1], devices=["cpu", "cpu"], interleave=2, chunks=4,
                             checkpoint="except_last")
    assert [stage.device for stage in pipe.stages] == [torch.device("cpu")] * 4
    assert pipe.stages[0].turns is pipe.stages[2].turns is not pipe.stages[1].turns
    for _ in range(3):
        pipe(torch.randn(64, 6)).sum().backward()
    events = [e for e in pipe.last_trace() if e.lane == "compute"]
    assert {(e.stage, e.kind) for e in events} >= {(s, k) for s in range(4) for k in "FB"}
    for device in (0, 1):
        # a recomputation and its backward are one turn: R ends before B starts
        spans = sorted((e.start_ms, e.end_ms) for e in events if e.stage % 2 == device)
        assert all(end <= next_start for (_, end), (next_start, _) in zip(spans, spans[1:]))


def test_interleave_must_divide_the_stages_and_match_the_devices() -> None:
    with pytest.raises(ValueError, match="interleave=3 must be a positive integer dividing the 4 stages"):
        autopipe.Pipeline(mlp(), balance=[2, 2, 2, 1], interleave=3)
    with pytest.raises(ValueError, match=r"1 devices for 4 stages; give one device per 2 stages \(interleave=2\)"):
        autopipe.Pipeline(mlp(), balance=[2, 2, 2, 1], devices=["cpu"], interleave=2)


@pytest.mark.timeout(60)
def test_meta_interleaved_stages_keep_skips_on_their_device() -> None:
    """Stages 0 and 2 on cpu, 1 and 3 on meta: a skip from stage 0 to 2 stays on cpu, the main
    path goes back and forth, and nothing is misrouted in forward or backward."""
    model = nn.Sequential(nn.Linear(4, 4), Stash(), nn.Linear(4, 4), nn.Linear(4, 4), PopAndRecordDevice(),
                          nn.Linear(4, 2))
    pipe = autopipe.Pipeline(model, balance=[2, 1, 2, 1], devices=["cpu", "meta"], interleave=2, chunks=2,
                             checkpoint="never")
    assert [s.device.type for s in pipe.stages] == ["cpu", "meta", "cpu", "meta"]
    PopAndRecordDevice.seen.clear()
    x = torch.randn(6, 4, requires_grad=True)
    out = pipe(x)
    assert out.device.type == "meta" and out.shape == (6, 2)
    out.sum().backward()
    assert PopAndRecordDevice.seen == [torch.device("cpu")] * 2
    assert x.grad is not None and x.grad.device.type == "cpu"
    assert [p.grad.device.type for p in pipe.parameters()] == ["cpu", "cpu", "meta", "meta"] * 2


class Slice(nn.Module):
    """A captured layer's shape: holds some of the model's modules (and maybe its top-level
    parameters) at their original paths, so its state prefix is ""."""

    def __init__(self, model: nn.Module, names: list[str], scale: bool) -> None:
        super().__init__()
        self.names = names
        for name in names:
            self._modules[name] = model._modules[name]
        if scale:
            self.scale = model.scale

    def forward(self, x: Tensor) -> Tensor:
        for name in self.names:
            x = self._modules[name](x)
        return x * self.scale if hasattr(self, "scale") else x


@pytest.mark.timeout(30)
def test_layers_with_empty_prefix_keep_the_models_keys() -> None:
    model = nn.Module()
    model.enc = nn.Sequential(nn.Linear(3, 3), nn.BatchNorm1d(3))
    model.scale = nn.Parameter(torch.tensor(2.0))
    model.dec = nn.Linear(3, 2)
    layers = [autopipe.Layer("enc", Slice(model, ["enc"], True), prefix=""),
              autopipe.Layer("dec", Slice(model, ["dec"], False), prefix="")]
    pipe = autopipe.Pipeline(layers, balance=[1, 1], devices=["cpu", "cpu"], chunks=2)
    assert set(pipe.state_dict()) == set(model.state_dict())
    assert {n for n, _ in pipe.named_parameters()} == {n for n, _ in model.named_parameters()}
    pipe(torch.randn(4, 3)).sum().backward()
    assert model.scale.grad is not None


class TopLevel(nn.Module):
    """Tensors held by the model itself, which capture leaves on its layers: a parameter and a
    counter read by the first layer, a buffer by the second, and a parameter of a bare
    ``nn.Module`` container (``head.bias``) by the last."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.linspace(0.5, 1.5, 8))
        self.register_buffer("count", torch.zeros(()))
        self.register_buffer("shift", torch.full((8,), 0.25))
        self.head = nn.Module()
        self.head.bias = nn.Parameter(torch.zeros(3))
        self.l1, self.l2, self.l3 = nn.Linear(4, 8), nn.Linear(8, 8), nn.Linear(8, 3)

    def forward(self, x: Tensor) -> Tensor:
        self.count += 1
        h = torch.tanh(self.l1(x)) * self.scale
        h = torch.tanh(self.l2(h)) + self.shift
        return self.l3(h) + self.head.bias


@pytest.mark.timeout(60)
@pytest.mark.parametrize("swap", ["load_state_dict(assign=True)", "double()", "functional_call"])
def test_tensors_swapped_through_the_pipeline_reach_a_captured_models_stages(swap: str) -> None:
    """Each of these replaces the tensors in the module's slots (``double()`` the buffers), which
    must be the slots the stages read: the captured layers' own top-level tensors and their bare
    containers' were registered on the pipeline as second references, which a swap parted from
    the stages' (outputs, gradients and ``state_dict`` silently off the plain model's).  A
    checkpointed micro-batch (``except_last``) recomputes after ``functional_call`` has put the
    tensors back, as ``torch.utils.checkpoint`` does, so that one runs without checkpointing."""
    torch.manual_seed(0)
    plain = TopLevel() if swap == "double()" else TopLevel().double()
    x, g = torch.randn(6, 4, dtype=torch.double), torch.randn(6, 3, dtype=torch.double)
    pipe = autopipe.Pipeline(autopipe.chain(copy.deepcopy(plain), x), balance=[1, 2], devices=["cpu", "cpu"],
                             chunks=2, checkpoint="never" if swap == "functional_call" else "except_last")
    new = {k: torch.randn_like(v) for k, v in plain.state_dict().items()}
    tensors = {m: {k: v.clone().requires_grad_(v.is_floating_point() and k in dict(plain.named_parameters()))
                   for k, v in new.items()} for m in ("plain", "pipe")}
    for name, module in (("plain", plain), ("pipe", pipe)):
        if swap == "double()":
            module.double()
        elif swap == "load_state_dict(assign=True)":
            module.load_state_dict({k: v.detach() for k, v in tensors[name].items()}, assign=True)
    if swap == "functional_call":
        out = torch.func.functional_call(pipe, tensors["pipe"], (x,))
        expected = torch.cat([torch.func.functional_call(plain, tensors["plain"], (xs,)) for xs in x.split(3)])
        (expected * g).sum().backward()
        got, want = tensors["pipe"], tensors["plain"]
    else:
        out = pipe(x)
        expected = reference_step(plain, x, g, chunks=2)
        got, want = dict(pipe.named_parameters()), dict(plain.named_parameters())
    (out * g).sum().backward()
    torch.testing.assert_close(out, expected)
    assert list(got) == list(want)
    for name in want:
        torch.testing.assert_close(got[name].grad, want[name].grad, msg=name)
    state = tensors["pipe"] if swap == "functional_call" else pipe.state_dict()
    for key, value in (tensors["plain"] if swap == "functional_call" else plain.state_dict()).items():
        torch.testing.assert_close(state[key], value, msg=key)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("swap", ["load_state_dict(assign=True)", "double()"])
def test_replicas_on_copies_take_the_tensors_swapped_in(monkeypatch: pytest.MonkeyPatch, swap: str) -> None:
    """Replicas on copies of the modules (CUDA's, forced here on CPU devices) copy the first
    replica's tensors before each forward and add their gradients into them: tensors swapped into
    the first replica since are those (they were paired once, when the pipeline was built)."""
    monkeypatch.setattr(autopipe.runtime.pipeline, "shares_parameters", lambda groups: False)
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))
    pipe = autopipe.Pipeline(copy.deepcopy(plain), balance=[2, 1], devices=["cpu"] * 4, chunks=2, replicas=2)
    new = {k: torch.randn_like(v, dtype=torch.double) for k, v in plain.state_dict().items()}
    for module in (plain, pipe):
        if swap == "double()":
            module.double()
        else:
            module.load_state_dict({k: v.clone() for k, v in new.items()}, assign=True)
    assert_step_matches(pipe, plain, torch.randn(8, 4, dtype=torch.double), chunks=2, replicas=2)


@pytest.mark.timeout(30)
def test_replicas_on_copies_refuse_a_model_changed_after_building(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(autopipe.runtime.pipeline, "shares_parameters", lambda groups: False)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))
    pipe = autopipe.Pipeline(model, balance=[2, 1], devices=["cpu"] * 4, chunks=2, replicas=2)
    nn.utils.parametrizations.spectral_norm(model[0])
    with pytest.raises(RuntimeError, match="build the pipeline after changing the model"):
        pipe(torch.randn(4, 4))


@pytest.mark.timeout(120)
def test_a_tiny_vision_transformer_loaded_with_assign_is_the_plain_models() -> None:
    """torchvision's VisionTransformer holds ``class_token`` itself and ``encoder.pos_embedding``
    in its encoder, which capture leaves on its first layer and a bare container."""
    torch.manual_seed(0)
    plain = torchvision.models.VisionTransformer(image_size=16, patch_size=8, num_layers=2, num_heads=2,
                                                 hidden_dim=16, mlp_dim=32, num_classes=5).double()
    x = torch.randn(4, 3, 16, 16, dtype=torch.double)
    layers = autopipe.chain(copy.deepcopy(plain), x)
    pipe = autopipe.Pipeline(layers, balance=[3, len(layers) - 3], devices=["cpu", "cpu"], chunks=2)
    new = {k: torch.randn_like(v) for k, v in plain.state_dict().items()}
    for module in (plain, pipe):
        module.load_state_dict({k: v.clone() for k, v in new.items()}, assign=True)
    assert_step_matches(pipe, plain, x, chunks=2)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("compiled", ["function", "pipeline"])
def test_a_compiled_caller_runs_the_pipeline_eagerly(compiled: str) -> None:
    """``torch.compile`` of a function that calls the pipeline, or of the pipeline itself: the
    pipeline is a graph break and the rest compiles (dynamo once failed inside the pipeline's
    own code with an internal error)."""
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3)).double()
    pipe = autopipe.Pipeline(copy.deepcopy(plain), balance=[2, 1], devices=["cpu", "cpu"], chunks=2)

    def loss(model: nn.Module, x: Tensor) -> Tensor:
        return (model(x * 2).tanh() ** 2).sum()

    x = torch.randn(6, 4, dtype=torch.double, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_()
    if compiled == "function":
        got = torch.compile(loss, backend="aot_eager")(pipe, x)
    else:
        got = loss(torch.compile(pipe, backend="aot_eager"), x)
    expected = loss(plain, x_ref)
    got.backward(), expected.backward()
    torch.testing.assert_close(got, expected)
    torch.testing.assert_close(x.grad, x_ref.grad)
    for (name, p), q in zip(plain.named_parameters(), pipe.parameters()):
        torch.testing.assert_close(q.grad, p.grad, msg=name)


@pytest.mark.cuda
@pytest.mark.timeout(120)
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_stages_with_skips_are_transparent() -> None:
    """Streams, event-ordered copies and record_stream, on one or two GPUs and the CPU."""
    gpus = ["cuda:0", f"cuda:{min(1, torch.cuda.device_count() - 1)}"]
    model = skip_model()
    reference = copy.deepcopy(model)
    pipe = autopipe.Pipeline(model, balance=[1, 2, 2, 3], devices=["cpu", gpus[0], gpus[1], gpus[0]],
                             chunks=4, checkpoint="except_last")
    x = torch.randn(9, 8)
    out = pipe(x)
    g = torch.randn(9, 4)
    (out * g.to(out.device)).sum().backward()
    expected = reference_step(reference, x, g, 4)
    assert_close(out.cpu(), expected, "output")
    for (name, p), q in zip(pipe.named_parameters(), reference.parameters()):
        assert_close(p.grad.cpu(), q.grad, name)


@pytest.mark.timeout(30)
def test_one_tuple_argument_like_nn_sequential() -> None:
    model = nn.Sequential(Pair(), Pair())
    reference = copy.deepcopy(model)
    pipe = autopipe.Pipeline(model, balance=[1, 1], devices=["cpu", "cpu"], chunks=3)
    a, b = torch.randn(5, 5, requires_grad=True), torch.randn(5, 5)
    a_ref = a.detach().clone().requires_grad_()
    out, ref = pipe((a, b)), reference((a_ref, b))
    assert_close(out[0], ref[0], "first")
    assert_close(out[1], ref[1], "second")
    out[0].sum().backward()
    ref[0].sum().backward()
    assert_close(a.grad, a_ref.grad, "a.grad")


@pytest.mark.timeout(30)
def test_the_callers_autocast_applies_on_the_workers() -> None:
    model = mlp()
    pipe = autopipe.Pipeline(copy.deepcopy(model), balance=[3, 4], devices=["cpu", "cpu"], chunks=2,
                             checkpoint="always")
    x = torch.randn(4, 6)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out, expected = pipe(x), model(x)
    assert out.dtype == expected.dtype == torch.bfloat16
    assert_close(out.float(), expected.float(), "output", rel=1e-2)
    out.float().sum().backward()  # recomputation under autocast too
    assert all(p.grad is not None for p in pipe.parameters())


# -- outputs: joined along the batch dim ---------------------------------------------------

class Nested(nn.Module):
    """Returns ``(h, (2h, 3h))``: a tuple output with a tuple inside."""

    def forward(self, h: Tensor) -> tuple[Tensor, tuple[Tensor, Tensor]]:
        return h, (h * 2, h * 3)


class WithExtra(nn.Module):
    """Returns ``h`` with a second output whose dim 0 is not the batch: ``extra(h)``."""

    def __init__(self, extra: Any) -> None:
        super().__init__()
        self.extra = extra

    def forward(self, h: Tensor) -> tuple[Tensor, Tensor]:
        return h, self.extra(h)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("used", ["all", "first", "nested"])
def test_nested_tuple_outputs_get_gradients_like_the_plain_model(used: str) -> None:
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), Nested())
    reference = copy.deepcopy(model)
    pipe = autopipe.Pipeline(model, balance=[2, 1], devices=["cpu", "cpu"], chunks=2)
    x = torch.randn(6, 8, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_()
    out, ref = pipe(x), reference(x_ref)
    torch.testing.assert_close(out, ref)

    def loss(value: Any) -> Tensor:
        first, (second, third) = value
        return {"all": first.sum() + second.pow(2).sum() + third.mean(), "first": first.sum(),
                "nested": third.pow(2).sum()}[used]

    loss(out).backward()
    loss(ref).backward()
    torch.testing.assert_close(x.grad, x_ref.grad)
    for (name, p), q in zip(pipe.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad, msg=name)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("extra, shape", [
    (lambda h: torch.ones(5), (5,)),                                # batch-independent
    (lambda h: h.unsqueeze(0).expand(3, -1, -1), (3, 2, 8)),        # batch in dim 1, as LSTM's h_n
])
def test_an_output_whose_dim_0_is_not_the_batch_is_refused(extra: Any, shape: tuple[int, ...]) -> None:
    pipe = autopipe.Pipeline(nn.Sequential(nn.Linear(8, 8), WithExtra(extra)), balance=[1, 1],
                             devices=["cpu", "cpu"], chunks=3)
    message = rf"output \[1\] has shape {re.escape(str(shape))} in a micro-batch of 2 .* along dim 0"
    for grad in (True, False):  # a second call fails alike: the first left nothing behind
        with torch.set_grad_enabled(grad), pytest.raises(ValueError, match=message):
            pipe(torch.randn(6, 8))


@pytest.mark.timeout(30)
def test_with_one_micro_batch_any_output_passes_and_a_scalar_is_the_batch_mean() -> None:
    model = nn.Sequential(nn.Linear(8, 8), WithExtra(lambda h: torch.ones(5)))
    reference = copy.deepcopy(model)
    x = torch.randn(6, 8)
    one = autopipe.Pipeline(model, balance=[1, 1], devices=["cpu", "cpu"], chunks=1)
    torch.testing.assert_close(one(x), reference(x))
    one.close()
    model = nn.Sequential(nn.Linear(8, 8), WithExtra(lambda h: h.pow(2).mean()))
    reference = copy.deepcopy(model)
    pipe = autopipe.Pipeline(model, balance=[1, 1], devices=["cpu", "cpu"], chunks=4)  # sizes 2, 2, 1, 1
    out, ref = pipe(x), reference(x)
    torch.testing.assert_close(out, ref)
    out[1].backward()
    ref[1].backward()
    for p, q in zip(pipe.parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("chunks, batch", [(1, 6), (3, 1)], ids=["chunks-1", "batch-of-1"])
def test_with_one_micro_batch_an_output_not_batch_first_gets_gradients(chunks: int, batch: int) -> None:
    """One micro-batch returns any output as the model does; its gradient was split by the batch
    (``split_with_sizes`` failed in backward)."""
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), WithExtra(lambda h: h.mean(0)))
    reference = copy.deepcopy(model)
    pipe = autopipe.Pipeline(model, balance=[2, 1], devices=["cpu", "cpu"], chunks=chunks)
    x = torch.randn(batch, 8)
    out, ref = pipe(x), reference(x)
    torch.testing.assert_close(out, ref)
    (out[0].sum() + out[1].pow(2).sum()).backward()
    (ref[0].sum() + ref[1].pow(2).sum()).backward()
    for p, q in zip(pipe.parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad)


class Heads(nn.Module):
    """A dict output: ``{"logits": ..., "hidden": ...}``, as many models return."""

    def __init__(self) -> None:
        super().__init__()
        self.head = nn.Linear(8, 3)

    def forward(self, h: Tensor) -> dict[str, Tensor]:
        return {"logits": self.head(h), "hidden": h}


@pytest.mark.timeout(30)
def test_dict_outputs_join_by_key_with_the_plain_models_gradients() -> None:
    model = nn.Sequential(nn.Linear(8, 8), Heads())
    reference = copy.deepcopy(model)
    pipe = autopipe.Pipeline(model, balance=[1, 1], devices=["cpu", "cpu"], chunks=3)
    x = torch.randn(7, 8)
    out, ref = pipe(x), reference(x)
    assert list(out) == ["logits", "hidden"]
    torch.testing.assert_close(out, ref)
    (out["logits"].pow(2).sum() + out["hidden"].sum()).backward()
    (ref["logits"].pow(2).sum() + ref["hidden"].sum()).backward()
    for (name, p), q in zip(pipe.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad, msg=name)
