"""``autopipe._partition``: profile → plan → run in one call, against the plain model."""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import autopipe


def mlp(width: int = 8) -> nn.Sequential:
    return nn.Sequential(nn.Linear(6, width), nn.ReLU(), nn.Linear(width, width), nn.Tanh(), nn.Linear(width, 3))


def test_partition_returns_a_planned_pipeline_with_the_models_gradients() -> None:
    model = mlp()
    plain = copy.deepcopy(model)
    x = torch.randn(8, 6)
    pipe = autopipe.partition(model, x, ["cpu", "cpu"], memory_limit=10**9, chunks=2)
    assert isinstance(pipe, autopipe.Pipeline)
    assert pipe.plan.chunks == 2 and sum(pipe.plan.balance) == 5 and pipe.plan.batch_size == 8
    pipe(x).square().sum().backward()
    plain(x).square().sum().backward()
    for (name, got), (_, want) in zip(pipe.named_parameters(), plain.named_parameters()):
        assert got.grad is not None and torch.allclose(got.grad, want.grad, rtol=1e-5, atol=1e-7), name


def test_partition_takes_a_saved_profile_and_refuses_another_models(tmp_path) -> None:
    x = torch.randn(4, 6)
    path = autopipe.profile(mlp(), x, ["cpu", "cpu"], warmup=0, repeats=1, quiet=True).save(tmp_path / "p.json")
    pipe = autopipe.partition(mlp(), x, ["cpu", "cpu"], profile=path)
    assert pipe.plan.profile_digest == autopipe.Profile.load(path).digest
    with pytest.raises(ValueError, match="the profile was made for another model: layer 0 differs"):
        autopipe.partition(mlp(width=5), x, ["cpu", "cpu"], profile=path)


class _Branching(nn.Module):
    """A batch norm behind a Python branch on a size: fx cannot trace it, torch.export captures
    it, baking the train/eval modes it sees into the graph."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.bn, self.b = nn.Linear(8, 8), nn.BatchNorm1d(8), nn.Linear(8, 3)
        self.bn.running_mean.uniform_()
        self.bn.running_var.uniform_(0.5, 2.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        if h.shape[1] > 4:
            h = h * 2
        return self.b(self.bn(h))


def _assert_trains_like(pipe: autopipe.Pipeline, reference: nn.Module, x: torch.Tensor) -> None:
    """One step of ``pipe`` gives ``reference``'s output, parameter gradients and buffers."""
    out, want = pipe(x), reference(x)
    torch.testing.assert_close(out, want)
    out.square().sum().backward()
    want.square().sum().backward()
    expected = dict(reference.named_parameters())
    for name, param in pipe.named_parameters():
        torch.testing.assert_close(param.grad, expected[name].grad, msg=name)
    torch.testing.assert_close(dict(pipe.named_buffers()), dict(reference.named_buffers()))


def test_partition_keeps_a_batch_norm_frozen_in_a_training_model() -> None:
    """``model.train(); model.bn.eval()`` (fine-tuning with frozen statistics): the export sees the
    frozen batch norm in eval mode, so the pipeline normalises with the running statistics and
    leaves them as they were, as the model does."""
    torch.manual_seed(0)
    model = _Branching().double()
    model.bn.eval()
    reference = copy.deepcopy(model)
    x = torch.randn(8, 8, dtype=torch.float64)
    pipe = autopipe.partition(model, x, ["cpu", "cpu"], chunks=2, replicas=1)
    assert [m.training for m in model.modules()] == [True, True, False, True]
    _assert_trains_like(pipe, reference, x)


def test_partition_trains_a_model_in_eval_mode_as_train_sets_it() -> None:
    """A model in eval mode (as ``from_pretrained`` returns one) is captured and profiled with
    every module in train mode, as ``model.train()`` sets them for training; its flags come back."""
    torch.manual_seed(0)
    model = _Branching().double().eval()
    reference = copy.deepcopy(model).train()
    x = torch.randn(8, 8, dtype=torch.float64)
    pipe = autopipe.partition(model, x, ["cpu", "cpu"], chunks=1, replicas=1)
    assert not any(m.training for m in model.modules())
    _assert_trains_like(pipe, reference, x)
