"""Deferred batch norm: one running-statistics update per mini-batch, as the plain model's."""
from __future__ import annotations

import copy
import io
from typing import Any

import pytest
import torch
from torch import Tensor, nn

import autopipe
from autopipe.runtime.batchnorm import DeferredBatchNorm
from autopipe.runtime.microbatch import split_sizes
from helpers import Overlap, assert_close, reference_step


def conv_bn(momentum: float | None = 0.1) -> nn.Sequential:
    return nn.Sequential(
        nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4, momentum=momentum), nn.ReLU(),
        nn.Conv2d(4, 4, 3), nn.BatchNorm2d(4, momentum=momentum),
    )


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "batch,chunks,checkpoint,momentum",
    [
        (8, 4, "never", 0.1),
        (7, 4, "always", 0.1),       # uneven micro-batches 2, 2, 2, 1; recomputation not counted
        (3, 4, "except_last", 0.1),  # fewer micro-batches (3) than chunks (4)
        (8, 2, "never", None),       # cumulative moving average
    ],
)
def test_running_stats_equal_full_batch_batch_norm(batch: int, chunks: int, checkpoint: str,
                                                   momentum: float | None) -> None:
    """The first batch norm sees the mini-batch itself; the second sees what the per-micro-
    batch normalised layers before it produce, so its reference is a full-batch batch norm on
    those features."""
    model = conv_bn(momentum)
    per_micro_batch = copy.deepcopy(model)
    first, second = copy.deepcopy(model[1]), copy.deepcopy(model[4])
    pipe = autopipe.Pipeline(model, balance=[2, 3], devices=["cpu", "cpu"], chunks=chunks,
                             checkpoint=checkpoint, deferred_batch_norm=True)
    for _ in range(2):
        x = torch.randn(batch, 3, 8, 8) * 3 + 1
        out = pipe(x)
        g = torch.randn_like(out)
        (out * g).sum().backward()
        first(per_micro_batch[0](x))
        features = [per_micro_batch[:4](xs) for xs in torch.split(x, split_sizes(batch, chunks))]
        second(torch.cat(features))
        # normalisation (and so outputs and gradients) stays per micro-batch
        assert_close(out, reference_step(per_micro_batch, x, g, chunks), "output")
    state = pipe.state_dict()
    for prefix, expected in (("1.", first), ("4.", second)):
        for name in ("running_mean", "running_var"):
            assert_close(state[prefix + name], getattr(expected, name), prefix + name)
        assert state[prefix + "num_batches_tracked"].item() == 2
    for name, p in pipe.named_parameters():
        assert_close(p.grad, dict(per_micro_batch.named_parameters())[name].grad, name)


def test_alone_it_is_batch_norm() -> None:
    bn = nn.BatchNorm1d(5)
    deferred = DeferredBatchNorm.convert(copy.deepcopy(bn))
    assert isinstance(deferred, DeferredBatchNorm)
    x = torch.randn(6, 5)
    assert torch.allclose(deferred(x), bn(x))
    assert torch.allclose(deferred.running_var, bn.running_var)
    assert list(deferred.state_dict()) == list(bn.state_dict())


def test_convert_shares_parameters_and_buffers() -> None:
    model = conv_bn()
    bn = model[1]
    converted = DeferredBatchNorm.convert(model)
    assert converted is model and isinstance(model[1], DeferredBatchNorm)
    assert model[1].weight is bn.weight and model[1].running_mean is bn.running_mean


@pytest.mark.timeout(60)
@pytest.mark.parametrize("options", [{"deferred_batch_norm": True, "devices": ["cpu", "cpu"]},
                                     {"replicas": 2, "devices": ["cpu"] * 4}])
def test_a_top_level_batch_norm_stays_the_models(options: dict) -> None:
    """A layer that is itself a batch norm becomes deferred in place: ``model.eval()``,
    ``.double()`` and ``model.state_dict()`` reach the module the pipeline runs (a new module
    in its place was the pipeline's alone: after ``model.eval()`` the pipeline normalised by
    the batch and moved the running statistics, outputs off by up to 1.7; after ``.double()``
    and a step the model's statistics stayed at 0)."""
    model = conv_bn()
    pipe = autopipe.Pipeline(model, balance=[2, 3], chunks=2, **options)
    assert isinstance(model[1], DeferredBatchNorm) and pipe[1] is model[1]
    pipe.double()
    x = torch.randn(8, 3, 8, 8, dtype=torch.float64) * 2 + 1
    pipe(x).sum().backward()
    state = pipe.state_dict()
    for name, value in model.state_dict().items():
        assert torch.equal(value, state[name]), name
    assert model[1].running_mean.abs().sum() > 0
    model.eval()
    before = model[1].running_mean.clone()
    with torch.no_grad():
        assert_close(pipe(x), model(x), "eval output")
    assert torch.equal(model[1].running_mean, before)


class TwiceNormalised(nn.Module):
    """One batch norm called twice in a forward (a weight-shared block)."""

    def __init__(self, momentum: float | None) -> None:
        super().__init__()
        self.bn = nn.BatchNorm1d(3, momentum=momentum)
        self.linear = nn.Linear(3, 3)

    def forward(self, x: Tensor) -> Tensor:
        return self.bn(self.linear(torch.tanh(self.bn(x))))


def at_two_positions(momentum: float | None) -> nn.Sequential:
    bn = nn.BatchNorm1d(3, momentum=momentum)
    return nn.Sequential(nn.Linear(3, 3), bn, nn.Tanh(), bn, nn.Linear(3, 3))


def twice_in_a_layer(momentum: float | None) -> nn.Sequential:
    return nn.Sequential(nn.Linear(3, 3), TwiceNormalised(momentum), nn.Linear(3, 3))


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "make,momentum,options",
    [
        (at_two_positions, 0.1, {"balance": [4, 1], "chunks": 1, "deferred_batch_norm": True}),
        (at_two_positions, None, {"balance": [4, 1], "chunks": 3, "deferred_batch_norm": True}),
        (twice_in_a_layer, 0.1, {"balance": [2, 1], "chunks": 2, "replicas": 2}),
        (twice_in_a_layer, None, {"balance": [2, 1], "chunks": 2, "deferred_batch_norm": True,
                                  "checkpoint": "always"}),
    ],
)
def test_a_batch_norm_called_twice_per_forward_updates_twice(make: Any, momentum: float | None,
                                                            options: dict) -> None:
    """A batch norm called twice in each forward updates its running statistics twice per step,
    in call order, as the plain model does: each call's from its micro-batches' statistics
    together (one update from both calls' statistics pooled gave other statistics and half the
    ``num_batches_tracked``).  With one micro-batch and one replica that is the plain model's
    step itself; otherwise the reference is a plain batch norm run on each call's inputs of
    every micro-batch, in call order."""
    model = make(momentum).double()
    per_micro_batch = copy.deepcopy(model)
    prefix, bn = next((f"{name}.", m) for name, m in per_micro_batch.named_modules() if isinstance(m, nn.BatchNorm1d))
    pooled = copy.deepcopy(bn)
    inputs: list[Tensor] = []
    bn.register_forward_pre_hook(lambda _, args: inputs.append(args[0].detach()))
    replicas = options.get("replicas", 1)
    pipe = autopipe.Pipeline(model, devices=["cpu"] * (2 * replicas), **options)
    for _ in range(2):
        x = torch.randn(12, 3, dtype=torch.float64) * 3 + 1
        out = pipe(x)
        g = torch.randn_like(out)
        (out * g).sum().backward()
        inputs.clear()
        assert_close(out, reference_step(per_micro_batch, x, g, options["chunks"], replicas), "output")
        for call in range(2):  # every micro-batch's forward called it twice
            pooled(torch.cat(inputs[call::2]))
    state = pipe.state_dict()
    for name in ("running_mean", "running_var"):
        assert_close(state[prefix + name], getattr(pooled, name), prefix + name)
    assert state[prefix + "num_batches_tracked"].item() == 4
    for name, p in pipe.named_parameters():
        assert_close(p.grad, dict(per_micro_batch.named_parameters())[name].grad, name)


@autopipe.skippable(stash=["t"])
class StashBN(nn.BatchNorm1d):
    """A batch norm that also stashes its output: a subclass with a forward of its own."""

    def forward(self, x: Tensor) -> Any:  # type: ignore[override]
        yield autopipe.stash("t", super().forward(x))
        return x


@autopipe.skippable(pop=["t"])
class AddBN(nn.BatchNorm1d):
    def forward(self, x: Tensor) -> Any:  # type: ignore[override]
        t = yield autopipe.pop("t")
        return super().forward(x) + t


class ScaledBN(nn.BatchNorm1d):
    def forward(self, x: Tensor) -> Tensor:
        return super().forward(x) * 3


@pytest.mark.timeout(30)
@pytest.mark.parametrize("options", [{"deferred_batch_norm": True}, {"replicas": 2}])
@pytest.mark.parametrize("build", [
    lambda: nn.Sequential(nn.Linear(4, 4), StashBN(4), nn.Linear(4, 4), AddBN(4)),
    lambda: nn.Sequential(nn.Linear(4, 4), ScaledBN(4), nn.Linear(4, 4), nn.Tanh()),
])
def test_deferral_refuses_a_batch_norm_subclass(build: Any, options: dict[str, Any]) -> None:
    """Deferral swaps a batch norm's class: a subclass's own forward (here a stash and pop, or a
    scale) would be lost, the output wrong or the skip's consumer waiting forever; refused."""
    devices = ["cpu"] * 2 * options.get("replicas", 1)
    with pytest.raises(autopipe.ChainError, match="subclass of nn.BatchNorm"):
        autopipe.Pipeline(build(), balance=[2, 2], devices=devices, chunks=2, **options)


def test_a_batch_norm_subclass_trains_as_itself_without_deferral() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), ScaledBN(4), nn.Linear(4, 4), nn.Tanh()).double()
    reference = copy.deepcopy(model)
    pipe = autopipe.Pipeline(model, balance=[2, 2], devices=["cpu", "cpu"], chunks=1)
    x, g = torch.randn(8, 4, dtype=torch.double), torch.randn(8, 4, dtype=torch.double)
    out = pipe(x)
    (out * g).sum().backward()
    assert_close(out, reference_step(reference, x, g, chunks=1), "output")


class Holds(nn.Module):
    """The identity, whose forward holds the first call until the second's starts."""

    def __init__(self, overlap: Overlap) -> None:
        super().__init__()
        self.overlap = overlap

    def forward(self, x: Tensor) -> Tensor:
        self.overlap.hold()
        return x


@pytest.mark.timeout(120)
def test_overlapping_calls_of_replicas_each_update_once() -> None:
    """Two threads call a pipeline of two replicas at once: the replicas share the batch norm,
    bracketed per call, and each call's step collects its own statistics (one call's start had
    reset the other's, and its end left the other's micro-batches updating one by one)."""
    torch.manual_seed(0)
    overlap = Overlap()
    plain = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Tanh(), nn.Linear(8, 2))
    model = nn.Sequential(Holds(overlap), *copy.deepcopy(plain))
    pipe = autopipe.Pipeline(model, balance=[2, 3], devices=["cpu"] * 4, chunks=2, replicas=2)
    xs = [torch.randn(16, 4) * 2 + 1 for _ in range(2)]

    def call(x: Tensor) -> None:
        with torch.no_grad():
            pipe(x)

    overlap.run(lambda: call(xs[0]), lambda: call(xs[1]))
    assert model[2].num_batches_tracked.item() == 2
    ends = []
    for order in ((0, 1), (1, 0)):  # the calls end in either order
        reference = copy.deepcopy(plain[:2])
        for index in order:
            reference(xs[index])
        ends.append(reference[1])
    for name in ("running_mean", "running_var"):
        assert min(float((getattr(model[2], name) - getattr(end, name)).abs().max()) for end in ends) < 1e-5, name
    pipe.close()


def test_a_module_pickled_with_one_steps_statistics_trains_in_a_pipeline() -> None:
    """A ``torch.save`` of a whole model from when a deferred batch norm kept one step's
    statistics (``_step``, ``_stepping``) loads and trains (it lacked the steps by key)."""
    model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 2))
    DeferredBatchNorm.convert(model)
    state = vars(model[1])
    del state["_steps"]
    state["_step"], state["_stepping"] = [], False
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    assert "_step" not in vars(loaded[1]) and "_stepping" not in vars(loaded[1])
    pipe = autopipe.Pipeline(loaded, balance=[2, 2], chunks=2)
    pipe(torch.randn(8, 4)).sum().backward()
    assert loaded[1].num_batches_tracked.item() == 1
    pipe.close()
