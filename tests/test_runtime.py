"""Transparency: a pipeline's outputs and gradients equal the unpartitioned model's.

The reference runs the plain model on each micro-batch and accumulates gradients, which is
exactly the plain model's full-batch step where no layer looks across samples, and is what a
pipeline does where batch norm trains per micro-batch.
"""
from __future__ import annotations

import copy
import threading
import time
from typing import Any

import pytest
import torch
import torchvision
from torch import Tensor, nn

import autopipe
from helpers import assert_close, assert_step_matches, assert_training_matches, assert_transparent, balances, mlp
from models import skip_model


@pytest.mark.timeout(60)
@pytest.mark.parametrize("checkpoint", ["never", "except_last", "always"])
@pytest.mark.parametrize("chunks", [1, 2, 4])
@pytest.mark.parametrize("stages", [1, 2, 3, 4])
def test_mlp(stages: int, chunks: int, checkpoint: str) -> None:
    x = torch.randn(10, 6, requires_grad=True)  # 10 over 4 micro-batches: sizes 3, 3, 2, 2
    assert_transparent(mlp(), x, balances(stages, 7), chunks, checkpoint)


@pytest.mark.timeout(60)
@pytest.mark.timeout(60)
@pytest.mark.parametrize("checkpoint", ["never", "except_last", "always"])
@pytest.mark.parametrize("chunks", [1, 2, 4])
@pytest.mark.parametrize("balance, interleave", [([2, 2, 2, 1], 2), ([1, 2, 1, 1, 1, 1], 2), ([2, 2, 2, 1], 4)])
def test_interleaved_mlp(balance: list[int], interleave: int, chunks: int, checkpoint: str) -> None:
    """Several stages per device (taking turns on it) change nothing in the results."""
    x = torch.randn(10, 6, requires_grad=True)
    assert_transparent(mlp(), x, balance, chunks, checkpoint, interleave=interleave)


def test_inplace_layer_first_in_a_stage() -> None:
    # The split right before ReLU(inplace=True): the stage's input must not be a leaf.
    assert_transparent(mlp(), torch.randn(8, 6, requires_grad=True), [3, 4], 2, "never")


class PassOn(nn.Module):
    """Its input passed on unchanged beside ``exp`` of it (which saves its output, not ``x``)."""

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        return x, torch.exp(x)


class NegateFirst(nn.Module):
    """Writes into the first tensor it receives."""

    def forward(self, pair: tuple[Tensor, Tensor]) -> Tensor:
        a, b = pair
        return a.neg_() * b


@autopipe.skippable(stash=["kept"])
class StashInput(nn.Module):
    def forward(self, x: Tensor):
        yield autopipe.stash("kept", x)
        return torch.tanh(x)


@autopipe.skippable(pop=["kept"])
class ScalePopped(nn.Module):
    """Writes into the skip it pops."""

    def forward(self, h: Tensor):
        kept = yield autopipe.pop("kept")
        return h + kept.mul_(3.0)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("checkpoint", ["never", "except_last", "always"])
@pytest.mark.parametrize("middle", ["output", "skip"])
def test_a_write_into_an_input_the_sender_passed_on(middle: str, checkpoint: str) -> None:
    """A stage passes its input on (as output or skip) and the next writes into it in place:
    on one device that is the sender's own saved input, so the receiver's recomputation must
    work on a copy, or the sender's recomputation after it reads the written values (gradients
    10-70% off from the second step, without an error)."""
    layers = [PassOn(), NegateFirst()] if middle == "output" else [StashInput(), ScalePopped()]
    model = nn.Sequential(nn.Linear(3, 3), *layers, nn.Linear(3, 1)).double()
    reference = copy.deepcopy(model)
    pipe = autopipe.Pipeline(model, balance=[1, 1, 2], devices=["cpu"] * 3, chunks=2, checkpoint=checkpoint)
    inputs = [torch.randn(4, 3, dtype=torch.float64) for _ in range(3)]
    assert_training_matches(pipe, model, reference, inputs, chunks=2)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("checkpoint", ["never", "always"])
def test_eval_between_a_forward_and_its_backward(checkpoint: str) -> None:
    """Validation run between a training forward and its backward: without checkpointing the
    gradients are the forward's; a checkpointed stage, which would recompute its forward in
    eval mode (running statistics: gradients off by 1.8), refuses with what to do, and the
    next step is exact."""
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Tanh(), nn.Linear(4, 4), nn.BatchNorm1d(4),
                          nn.Linear(4, 1)).double()
    reference = copy.deepcopy(model)
    pipe = autopipe.Pipeline(model, balance=[3, 3], devices=["cpu", "cpu"], chunks=1, checkpoint=checkpoint)
    x = torch.randn(8, 4, dtype=torch.float64) * 2 + 1
    out, expected = pipe(x), reference(x)
    pipe.eval(), reference.eval()
    with torch.no_grad():
        pipe(x), reference(x)
    expected.sum().backward()
    if checkpoint == "never":
        out.sum().backward()
        for mine, theirs in zip(model.parameters(), reference.parameters()):
            torch.testing.assert_close(mine.grad, theirs.grad)
        return
    with pytest.raises(RuntimeError, match=r"train\(\)/eval\(\) changed between this step's forward and its"):
        out.sum().backward()
    pipe.train(), reference.train()
    reference.zero_grad(), model.zero_grad()
    assert_training_matches(pipe, model, reference, [x], chunks=1)


def resnet18() -> nn.Module:
    return torchvision.models.resnet18(weights=None, num_classes=10)


@pytest.mark.timeout(90)
@pytest.mark.parametrize(
    "balance,chunks,checkpoint",
    [([15], 1, "never"), ([2, 13], 2, "except_last"), ([5, 5, 5], 2, "never"), ([7, 8], 4, "always"),
     ([4, 4, 4, 3], 4, "except_last")],
)
def test_resnet18(balance: list[int], chunks: int, checkpoint: str) -> None:
    # Batch norm trains per micro-batch in both; running statistics are compared too, so a
    # recomputation must not update them a second time.
    assert_transparent(resnet18(), torch.randn(8, 3, 32, 32), balance, chunks, checkpoint)


# -- skips across stages ----------------------------------------------------------------

@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "balance",
    [
        [8],             # both skips inside one stage
        [2, 6],          # a crosses one boundary, b stays inside
        [1, 2, 5],       # a crosses two boundaries (not relayed through stage 1), b inside
        [1, 2, 2, 3],    # a crosses two, b crosses one
        [1, 3, 2, 2],    # a crosses one, b crosses two
    ],
)
@pytest.mark.parametrize("checkpoint", ["never", "always"])
def test_skips_cross_stages(balance: list[int], checkpoint: str) -> None:
    assert_transparent(skip_model(), torch.randn(9, 8, requires_grad=True), balance, 4, checkpoint)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("balance", [[1, 2, 2, 3], [1, 3, 2, 2]])  # a skip from stage 0 to 2: one device
@pytest.mark.parametrize("checkpoint", ["never", "always"])
def test_skips_cross_interleaved_stages(balance: list[int], checkpoint: str) -> None:
    assert_transparent(skip_model(), torch.randn(9, 8, requires_grad=True), balance, 4, checkpoint, interleave=2)


def test_skip_routes() -> None:
    """Each skip goes straight from its producer to its consumer, past the stages between."""
    pipe = autopipe.Pipeline(skip_model(), balance=[1, 2, 2, 3], devices=["cpu"] * 4)
    routes = [({str(k): v for k, v in s.routes.arriving.items()}, {str(k): v for k, v in s.routes.leaving.items()})
              for s in pipe.stages]
    assert routes == [({}, {"a": 2}), ({}, {}), ({"a": 0}, {"b": 3}), ({"b": 2}, {})]


# -- dropout under checkpointing ----------------------------------------------------------

class Scale(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.rand(width) + 0.5)

    def forward(self, x: Tensor) -> Tensor:
        return x * self.weight


def _off_then_on(model: nn.Module, step: int, how: str) -> None:
    """Dropout drawing from the first step, or turned on only at the second: ``p`` from 0 to
    0.5 (a dropout schedule), or ``train()`` after ``eval()``."""
    for drop in (m for m in model.modules() if isinstance(m, nn.Dropout)):
        if how == "p":
            drop.p = 0.0 if step == 0 else 0.5
        elif how == "mode":
            drop.train(step > 0)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("checkpoint", ["except_last", "always"])
@pytest.mark.parametrize("how", ["on", "p", "mode"])
def test_dropout_masks_replayed(checkpoint: str, how: str) -> None:
    """y = drop(w2 * drop(w1 * x)) is linear in w1 and in w2, so w·dL/dw == y.sum() for
    L = y.sum() — only if the backward's recomputed masks equal the forward's.  Both stages
    draw random numbers concurrently, so this also tests the generator locks; and where
    dropout draws only from the second step on, that each call measures again whether a stage
    draws.  In float64: the sum of ±values can be small enough for float32 rounding to exceed
    the tolerance."""
    model = nn.Sequential(Scale(64), nn.Dropout(0.5), nn.Linear(64, 64), Scale(64), nn.Dropout(0.5)).double()
    with torch.no_grad():
        model[2].weight.copy_(torch.eye(64))
        model[2].bias.zero_()
    pipe = autopipe.Pipeline(model, balance=[2, 3], devices=["cpu", "cpu"], chunks=4, checkpoint=checkpoint)
    for step in range(3):
        _off_then_on(model, step, how)
        pipe.zero_grad()
        y = pipe(torch.randn(32, 64, dtype=torch.float64))
        y.sum().backward()
        total = y.sum()
        for scale in (model[0], model[3]):
            assert torch.allclose((scale.weight * scale.weight.grad).sum(), total, rtol=1e-5)
        drawing = how == "on" or step > 0
        assert [stage.random.draws for stage in pipe.stages] == [drawing, drawing]


# -- complex tensors between stages ---------------------------------------------------------

class Spectrum(nn.Module):
    """Real to complex: the FFT along the features (a spectral layer, as in FNet)."""

    def forward(self, x: Tensor) -> Tensor:
        return torch.fft.fft(x)


class Mix(nn.Module):
    """Complex to real."""

    def forward(self, z: Tensor) -> Tensor:
        return z.real * 2 + z.imag


@pytest.mark.timeout(60)
@pytest.mark.parametrize("checkpoint", ["except_last", "always"])
def test_a_complex_tensor_from_a_checkpointed_micro_batch(checkpoint: str) -> None:
    """A complex tensor that a checkpointed micro-batch sends to the next stage needs its
    gradient as a real one does (taken for no gradient, it left the stage before without those
    micro-batches' gradients)."""
    model = nn.Sequential(nn.Linear(4, 4), Spectrum(), Mix(), nn.Linear(4, 2)).double()
    assert_transparent(model, torch.randn(8, 4, dtype=torch.float64, requires_grad=True), [2, 2], 4, checkpoint)


# -- the caller's backward taking input gradients only ------------------------------------

def _input_gradient(model: nn.Module, x: Tensor, how: str) -> Tensor:
    x = x.detach().requires_grad_()
    loss = model(x).pow(2).sum()
    if how == "autograd.grad":
        return torch.autograd.grad(loss, x)[0]
    loss.backward(inputs=[x])
    assert x.grad is not None
    return x.grad


@pytest.mark.timeout(60)
@pytest.mark.parametrize("checkpoint", ["never", "always"])
@pytest.mark.parametrize("how", ["autograd.grad", "backward(inputs=...)"])
def test_an_input_gradient_alone_leaves_parameter_gradients_alone(how: str, checkpoint: str) -> None:
    """``autograd.grad(loss, x)`` and ``loss.backward(inputs=[x])`` give ``x`` its gradient and
    leave every parameter's ``.grad`` as it was, as in the plain model: an adversarial step
    takes the input's gradient and then trains on the perturbed input (the parameters got both
    backwards' gradients).  Skips cross stages, so a stage's leaves include skips."""
    model = skip_model().double()
    reference = copy.deepcopy(model)
    pipe = autopipe.Pipeline(model, balance=[1, 2, 2, 3], devices=["cpu"] * 4, chunks=2, checkpoint=checkpoint)
    x = torch.randn(6, 8, dtype=torch.float64)
    mine, expected = (_input_gradient(m, x, how) for m in (pipe, reference))
    assert_close(mine, expected, "input gradient")
    assert [name for name, p in model.named_parameters() if p.grad is not None] == []
    assert_step_matches(pipe, reference, x + 0.1 * expected.sign(), chunks=2)


# -- a backward the caller abandons -----------------------------------------------------------

class Opening(torch.autograd.Function):
    """Identity that keeps an event ``opened`` for its backward."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, opened: threading.Event) -> Tensor:  # type: ignore[override]
        ctx.opened = opened
        return x.clone()


class Gate(Opening):
    """Its backward waits for ``opened`` (up to half a second) and a little more: a stage's slow
    backward."""

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:  # type: ignore[override]
        if ctx.opened.wait(timeout=0.5):
            time.sleep(0.1)
        return grad, None


class Gated(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.opened = threading.Event()

    def forward(self, x: Tensor) -> Tensor:
        return Gate.apply(x, self.opened)


class Fail(Opening):
    """Its backward opens ``opened`` and raises: the caller's own graph failing."""

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:  # type: ignore[override]
        ctx.opened.set()
        raise MemoryError("the caller's backward failed")


@pytest.mark.timeout(60)
def test_a_failed_backward_of_the_caller_leaves_no_gradient_behind() -> None:
    """The caller's backward fails in its own graph after the pipeline's backward began (the
    input is data); the caller drops the gradients and trains on: no stage may add into
    ``.grad`` once the caller's backward has raised (the abandoned step's gradients were added
    into the next step's).  The stage's backward waits until the caller's failure unless the
    pipeline waits for it first."""
    model = nn.Sequential(nn.Linear(4, 4), Gated(), nn.Linear(4, 1)).double()
    reference = nn.Sequential(copy.deepcopy(model[0]), nn.Identity(), copy.deepcopy(model[2]))
    pipe = autopipe.Pipeline(model, balance=[2, 1], devices=["cpu", "cpu"], chunks=1)
    x = torch.randn(6, 4, dtype=torch.float64)
    weight = Fail.apply(torch.randn(6, 1, dtype=torch.float64, requires_grad=True), model[1].opened)
    with pytest.raises(MemoryError, match="the caller's backward failed"):
        (pipe(x) * weight).sum().backward()
    model.zero_grad(set_to_none=True)
    time.sleep(0.3)  # an abandoned stage would be adding into .grad now
    assert [name for name, p in model.named_parameters() if p.grad is not None] == []
    assert_step_matches(pipe, reference, x, chunks=1)
