"""Models and plans shared by the distributed tests and their worker processes (same seed, same weights)."""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

import torch
from torch import Tensor, nn

from autopipe.model import layer_chain
from autopipe.model.fingerprint import model_fingerprint
from autopipe.planning.plans import Plan, Prediction, StagePlan

BATCH = 8


class Double(nn.Module):
    def forward(self, x: Tensor) -> Tensor:
        return x.mul_(2)


def inplace_model() -> nn.Sequential:
    """Balance [3, 3]: the second stage starts with in-place ops on what it receives."""
    torch.manual_seed(1)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16),
                         Double(), nn.ReLU(inplace=True), nn.Linear(16, 4))


class MeanOverTime(nn.Module):
    def forward(self, x: Tensor) -> Tensor:
        return x.mean(dim=1)


class Trim(nn.Module):
    """Cuts (batch, time, features) to the micro-batch's longest sequence (padding steps are zeros):
    the shape of what it returns follows the data."""

    def forward(self, x: Tensor) -> Tensor:
        return x[:, : int((x.abs().sum(-1) > 0).sum(1).max())]


def trim_model(frozen: bool) -> nn.Sequential:
    """Balance [2, 2]: the first stage trims padding, and its Linear trains unless ``frozen`` (then
    nothing it sends needs a gradient)."""
    torch.manual_seed(11)
    model = nn.Sequential(Trim(), nn.Linear(4, 4), MeanOverTime(), nn.Linear(4, 3)).double()
    model[1].requires_grad_(not frozen)
    return model


def padded(lengths: list[int]) -> tuple[Tensor, Tensor]:
    """Sequences of 6 steps, zeros after ``lengths``, and their targets."""
    generator = torch.Generator().manual_seed(sum(lengths))
    x = torch.randn(len(lengths), 6, 4, generator=generator, dtype=torch.float64)
    for row, length in zip(x, lengths):
        row[length:] = 0
    return x, torch.randn(len(lengths), 3, generator=generator, dtype=torch.float64)


def batch(size: int = BATCH) -> tuple[Tensor, Tensor]:
    generator = torch.Generator().manual_seed(0)
    return torch.randn(size, 8, generator=generator), torch.randn(size, 4, generator=generator)


def plan_for(model: nn.Module, balance: list[int], chunks: int, schedule: str, checkpoint: str = "never") -> Plan:
    """A plan as the planner would write it; the predicted costs do not matter to the engine."""
    layers, bounds = layer_chain(model), [sum(balance[:i]) for i in range(len(balance) + 1)]
    zeros = {f.name: 0 for f in dataclasses.fields(StagePlan) if f.name != "memory_terms"}
    stages = [StagePlan(**zeros | {"index": i, "device": "cpu", "start": a, "stop": b, "first_layer": layers[a].name,
                                   "last_layer": layers[b - 1].name})
              for i, (a, b) in enumerate(zip(bounds, bounds[1:]))]
    return Plan(model_fingerprint(layers), "", ["cpu"] * len(balance), BATCH, chunks, checkpoint, schedule, stages,
                Prediction(**{f.name: 0 for f in dataclasses.fields(Prediction)}))


def error_of(call: Callable[[], Any]) -> str:
    """What ``call`` raised, as ``"Type: message"`` for a test to check, or ``"no error"``."""
    try:
        call()
    except Exception as error:  # noqa: BLE001 - the test checks type and message
        return f"{type(error).__name__}: {error}"
    return "no error"
