"""The skip API: stash/pop outside and inside a pipeline, verification and namespaces."""
from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch import nn

import autopipe
from models import REFUSED, Add, Save, aliased
from helpers import assert_step_matches, assert_transparent


def unet_like() -> nn.Sequential:
    """Two levels built from one Save/Add pair, isolated by namespaces (outer around inner)."""
    outer, inner = autopipe.Namespace("outer"), autopipe.Namespace("inner")
    return nn.Sequential(
        nn.Linear(4, 4), Save().isolate(outer), nn.Linear(4, 4), Save().isolate(inner),
        nn.Linear(4, 4), Add().isolate(inner), nn.Linear(4, 4), Add().isolate(outer), nn.Linear(4, 2),
    )


def test_runs_outside_a_pipeline_like_the_plain_computation() -> None:
    model = unet_like()
    x = torch.randn(3, 4)
    h0 = model[0](x)
    h2 = model[2](h0)
    expected = model[8](model[6](model[4](h2) + h2) + h0)
    assert torch.allclose(model(x), expected)


def test_a_deep_copy_keeps_its_namespaces_and_runs_like_the_original() -> None:
    model = unet_like()
    twin = copy.deepcopy(model)
    assert twin[1].namespace is model[1].namespace and twin[3].namespace is model[3].namespace
    x = torch.randn(3, 4)
    assert torch.allclose(twin(x), model(x))
    autopipe.verify_skippables(twin)


def test_verify_lists_every_mismatch_at_once() -> None:
    with pytest.raises(TypeError) as info:
        autopipe.verify_skippables(nn.Sequential(Add(), Save(), Save()))
    message = str(info.value)
    assert "'skip' is popped by layer '0' but no earlier layer stashes it" in message
    assert "'skip' is stashed more than once (again by layer '2')" in message
    assert "'skip' is stashed by layer '2' but never popped" in message


@pytest.mark.timeout(60)
@pytest.mark.parametrize("balance", [[2, 7], [1, 3, 3, 2], [4, 2, 3]])
def test_namespaced_skips_in_a_pipeline(balance: list[int]) -> None:
    assert_transparent(unet_like(), torch.randn(6, 4, requires_grad=True), balance, 2, "except_last")


def test_a_layer_pairing_a_skip_inside_itself_keeps_it_local() -> None:
    block = nn.Sequential(Save(), nn.Linear(4, 4), Add())
    model = nn.Sequential(nn.Linear(4, 4), nn.Sequential(block), nn.Linear(4, 4))
    pipe = autopipe.Pipeline(copy.deepcopy(model), balance=[2, 1], devices=["cpu", "cpu"])
    assert all(not s.routes.arriving and not s.routes.leaving for s in pipe.stages)
    x = torch.randn(2, 4)
    assert torch.allclose(pipe(x), model(x))


@autopipe.skippable()
class ReturnsWithoutYielding(nn.Module):
    def forward(self, x: torch.Tensor):  # type: ignore[no-untyped-def]
        if False:  # pragma: no cover - makes this a generator that never yields
            yield
        return x * 3


def test_a_skippable_that_never_yields_returns_its_value() -> None:
    x = torch.randn(2, 3)
    assert torch.equal(ReturnsWithoutYielding()(x), x * 3)


@pytest.mark.parametrize("checkpoint", ["never", "always"])
@pytest.mark.parametrize("case, balance", [(case, b) for case, balances in REFUSED.items() for b in balances])
def test_a_write_into_a_stashed_tensor_across_a_split_is_refused(case: str, balance: list[int],
                                                                  checkpoint: str) -> None:
    """In the plain model the write changes every name of the tensor; the pipeline sends them
    apart, so it cannot give the plain model's output and gradient.  It says so instead of
    computing another result, and keeps working."""
    pipe = autopipe.Pipeline(aliased(case), balance=balance, devices=["cpu"] * len(balance), chunks=2,
                             checkpoint=checkpoint)
    for _ in range(2):  # the stages live on: the second call fails the same way, it does not hang
        with pytest.raises(autopipe.ChainError, match=r"write in place into .* same tensor as .* sent here as a "
                                                      r"tensor of its own.*ReLU\(inplace=False\)"):
            pipe(torch.randn(6, 4))


@pytest.mark.parametrize("case, balance", [("input", [1, 4]), ("input", [3, 2]), ("passed on", [4, 2]),
                                           ("popped", [1, 3]), ("two names", [1, 5]), ("returned twice", [1, 3])])
def test_a_write_into_a_stashed_tensor_within_a_stage_is_the_plain_models(case: str, balance: list[int]) -> None:
    assert_transparent(aliased(case), torch.randn(6, 4, requires_grad=True), balance, chunks=2,
                       checkpoint="except_last")


@autopipe.skippable(stash=["aux"])
class SaveAux(nn.Module):
    def forward(self, x: torch.Tensor) -> Any:
        yield autopipe.stash("aux", x)
        return x


@autopipe.skippable(pop=["aux"])
class AddAux(nn.Module):
    def forward(self, x: torch.Tensor) -> Any:
        aux = yield autopipe.pop("aux")
        return x + aux


class TrainOnly(nn.Module):
    """Calls its skippable child only in training mode (an auxiliary branch)."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x) if self.training else x


@pytest.mark.timeout(30)
def test_a_skip_not_stashed_in_a_forward_is_refused_not_waited_for() -> None:
    """In eval mode the branch holding the stash and the pop does not run: the plain model is
    fine, and the stage that pops in another stage would wait forever; refused instead, and the
    pipeline then trains as the plain model."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), TrainOnly(SaveAux()), nn.Linear(4, 4), TrainOnly(AddAux())).double()
    reference = copy.deepcopy(model)
    pipe = autopipe.Pipeline(model, balance=[2, 2], devices=["cpu", "cpu"], chunks=2)
    pipe.eval()
    with torch.no_grad(), pytest.raises(autopipe.ChainError, match=r"did not stash \['aux'\] .* stage 1 pops"):
        pipe(torch.randn(4, 4, dtype=torch.double))
    pipe.train()
    assert_step_matches(pipe, reference, torch.randn(4, 4, dtype=torch.double), chunks=2)


@autopipe.skippable(stash=["a", "b"])
class StashTwo(nn.Module):
    def forward(self, x: torch.Tensor) -> Any:
        yield autopipe.stash("a", x)
        yield autopipe.stash("b", 2 * x)
        return x


@autopipe.skippable(pop=["a"])
class PopA(nn.Module):
    def forward(self, x: torch.Tensor) -> Any:
        return x + (yield autopipe.pop("a"))


@autopipe.skippable(pop=["b"])
class PopB(nn.Module):
    def forward(self, x: torch.Tensor) -> Any:
        return x * (yield autopipe.pop("b"))


def test_isolate_only_some_names() -> None:
    """torchgpipe's ``isolate(ns, only=...)``: two layers stashing ``a`` and ``b`` each, the
    second's names isolated one by one into two scopes (its ``b`` popped at once, its ``a`` last);
    a name the layer does not have is refused."""
    first, second = autopipe.Namespace("first"), autopipe.Namespace("second")
    model = nn.Sequential(
        nn.Linear(4, 4), StashTwo(), nn.Linear(4, 4), PopB(),
        StashTwo().isolate(first, only=["a"]).isolate(second, only=["b"]), PopB().isolate(second),
        nn.Linear(4, 4), PopA(), nn.Linear(4, 4), PopA().isolate(first), nn.Linear(4, 2),
    ).double()
    autopipe.verify_skippables(model)
    x = torch.randn(6, 4, dtype=torch.double)
    h0 = model[0](x)
    h2 = model[2](h0)
    h3 = h2 * (2 * h0)
    h5 = h3 * (2 * h3)
    expected = model[10](model[8](model[6](h5) + h0) + h3)
    torch.testing.assert_close(model(x), expected)
    assert_transparent(model, x, [3, 4, 4], chunks=2, checkpoint="except_last")
    with pytest.raises(ValueError, match=r"neither stashes nor pops \['c'\]"):
        StashTwo().isolate(first, only=["c"])
