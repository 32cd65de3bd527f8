"""Transparency: a pipeline's outputs and gradients equal the unpartitioned model's.

The reference runs the plain model on each micro-batch and accumulates gradients, which is
exactly the plain model's full-batch step where no layer looks across samples, and is what a
pipeline does where batch norm trains per micro-batch.
"""
from __future__ import annotations

import copy
from typing import Any, Sequence

import pytest
import torch
import torchvision
from torch import Tensor, nn

import autopipe
from autopipe.runtime.microbatch import split_sizes


def assert_close(actual: Tensor, expected: Tensor, what: str = "", rel: float = 1e-5) -> None:
    """Equal within ``rel`` relative to the expected tensor's norm."""
    assert actual.shape == expected.shape, what
    error = (actual.detach() - expected.detach()).norm().item()
    scale = max(expected.detach().norm().item(), 1e-12)
    assert error <= rel * scale, f"{what}: relative error {error / scale:.2e}"


def reference_step(model: nn.Module, x: Tensor, g: Tensor, chunks: int) -> Tensor:
    """The plain model on each micro-batch, loss ``sum(out * g)``, gradients accumulated."""
    outputs = []
    for xs, gs in zip(torch.split(x, split_sizes(len(x), chunks)), torch.split(g, split_sizes(len(x), chunks))):
        out = model(xs)
        (out * gs).sum().backward()
        outputs.append(out.detach())
    return torch.cat(outputs)


def assert_transparent(model: nn.Module, x: Tensor, balance: Sequence[int], chunks: int,
                       checkpoint: str, **options: Any) -> autopipe.Pipeline:
    reference = copy.deepcopy(model)
    x_ref = x.detach().clone().requires_grad_(x.requires_grad)
    devices = ["cpu"] * (len(balance) // options.get("interleave", 1))
    pipe = autopipe.Pipeline(model, balance=list(balance), devices=devices,
                             chunks=chunks, checkpoint=checkpoint, **options)
    out = pipe(x)
    g = torch.randn_like(out)
    expected = reference_step(reference, x_ref, g, chunks)
    (out * g).sum().backward()
    assert_close(out, expected, "output")
    if x.requires_grad:
        assert_close(x.grad, x_ref.grad, "input gradient")
    expected_state = reference.state_dict(keep_vars=True)
    for name, value in pipe.state_dict(keep_vars=True).items():
        assert_close(value.float(), expected_state[name].float(), name)
        if isinstance(value, nn.Parameter):
            assert value.grad is not None, name
            assert_close(value.grad, expected_state[name].grad, f"{name}.grad")
    return pipe


def mlp() -> nn.Sequential:
    return nn.Sequential(
        nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(inplace=True),
        nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 3),
    )


def balances(stages: int, layers: int) -> list[int]:
    return [layers // stages + (1 if s < layers % stages else 0) for s in range(stages)]


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

@autopipe.skippable(stash=["a"])
class StashA(nn.Linear):
    def forward(self, x: Tensor):  # type: ignore[override]
        y = super().forward(x)
        yield autopipe.stash("a", y)
        return torch.relu(y)


@autopipe.skippable(stash=["b"], pop=["a"])
class PopAStashB(nn.Linear):
    def forward(self, x: Tensor):  # type: ignore[override]
        a = yield autopipe.pop("a")
        y = super().forward(x) * a
        yield autopipe.stash("b", y)
        return y


@autopipe.skippable(pop=["b"])
class PopB(nn.Linear):
    def forward(self, x: Tensor):  # type: ignore[override]
        b = yield autopipe.pop("b")
        return super().forward(x) + b


def skip_model() -> nn.Sequential:
    """Layer 0 stashes a, layer 3 pops a and stashes b, layer 6 pops b."""
    return nn.Sequential(
        StashA(8, 8), nn.Linear(8, 8), nn.Tanh(), PopAStashB(8, 8),
        nn.Linear(8, 8), nn.Tanh(), PopB(8, 8), nn.Linear(8, 4),
    )


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


@pytest.mark.timeout(60)
@pytest.mark.parametrize("checkpoint", ["except_last", "always"])
def test_dropout_masks_replayed(checkpoint: str) -> None:
    """y = drop(w2 * drop(w1 * x)) is linear in w1 and in w2, so w·dL/dw == y.sum() for
    L = y.sum() — only if the backward's recomputed masks equal the forward's.  Both stages
    draw random numbers concurrently, so this also tests the generator locks."""
    model = nn.Sequential(Scale(64), nn.Dropout(0.5), nn.Linear(64, 64), Scale(64), nn.Dropout(0.5))
    with torch.no_grad():
        model[2].weight.copy_(torch.eye(64))
        model[2].bias.zero_()
    pipe = autopipe.Pipeline(model, balance=[2, 3], devices=["cpu", "cpu"], chunks=4, checkpoint=checkpoint)
    for _ in range(3):
        pipe.zero_grad()
        y = pipe(torch.randn(32, 64))
        y.sum().backward()
        total = y.sum()
        for scale in (model[0], model[3]):
            assert torch.allclose((scale.weight * scale.weight.grad).sum(), total, rtol=1e-5)
    assert [stage.random.draws for stage in pipe.stages] == [True, True]
