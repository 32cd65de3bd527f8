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
