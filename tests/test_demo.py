"""``demo``: every step of the README's main job runs and reports, in order, and plans as
``python -m autopipe plan`` does."""
from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch
from torch import nn

from autopipe.cli import main

#: A slow layer's wait per call and per sample, in seconds, forward and backward alike.
CALL, SAMPLE = 3e-3, 0.5e-3


class Wait(torch.autograd.Function):
    """The work of a layer as a wait, which replicas and stages on other threads overlap as they
    overlap compute on other cores: a fixed part per call makes many micro-batches dear."""

    @staticmethod
    def forward(ctx: torch.autograd.function.FunctionCtx, x: torch.Tensor) -> torch.Tensor:
        time.sleep(CALL + SAMPLE * x.shape[0])
        return x.clone()

    @staticmethod
    def backward(ctx: torch.autograd.function.FunctionCtx, grad: torch.Tensor) -> torch.Tensor:
        time.sleep(CALL + SAMPLE * grad.shape[0])
        return grad


class Slow(nn.Linear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return Wait.apply(super().forward(x))


def slow_model() -> nn.Module:
    """The spec ``test_demo:slow_model``: four slow layers, for which two replicas beat any
    pipeline on two devices (no bubble, and one call per layer and replica)."""
    torch.manual_seed(0)
    return nn.Sequential(*(Slow(16, 16) for _ in range(4)))


@pytest.fixture(autouse=True)
def _importable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(Path(__file__).parent))


def test_the_demo_searches_data_parallel_as_plan_does(capsys: pytest.CaptureFixture[str]) -> None:
    """The demo planned pipelines only (the pipeline planner), where ``plan`` also searches
    replicas: here two replicas win, and the demo runs and reports them."""
    assert main(["demo", "--model", "test_demo:slow_model", "--input-shape", "16", "--batch-size", "8",
                 "--steps", "1", "--repeats", "1", "--devices", "cpu,cpu"]) == 0
    lines = capsys.readouterr().out.splitlines()
    planned = next(line for line in lines if line.startswith("2. planned in"))
    chosen = planned.split(" s: ", 1)[1].rsplit(", predicted ", 1)[0]
    assert chosen.startswith("2 replicas (data parallel) on [cpu], [cpu], each 1 stage, balance [4], "), planned
    assert any(line.startswith(f"{chosen};") for line in lines)  # the bench table's header: what ran


@pytest.mark.slow
def test_quick_demo_profiles_plans_trains_and_compares(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["demo", "--quick", "--devices", "cpu,cpu"]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    steps = ["autopipe demo: torchvision:resnet18, batch 4 of 3x64x64, on cpu, cpu", "1. profiled 15 layers",
             "2. planned in", "3. trained 2 steps", "predicted timeline:", "measured timeline (last step):",
             "4. predicted against measured:", "demo done in"]
    found = [next(i for i, line in enumerate(lines) if line.startswith(step)) for step in steps]
    assert found == sorted(found), "the demo's steps are out of order"

    chosen = lines[found[2]].split(" s: ", 1)[1].rsplit(", predicted ", 1)[0]
    balance = [int(n) for n in chosen.split("balance [")[1].split("]")[0].split(",")]
    assert sum(balance) == 15
    table = lines[found[6] + 1:found[7]]
    assert table[0].startswith(f"{chosen};")
    assert sum(line.startswith("#") for line in table) == len(balance)
    assert any(line.startswith("iteration ") for line in table)
    assert "speedup" in table[-2]
    losses = lines[found[3]].split("losses ")[1].split(", ")
    assert len(losses) == 2 and all(float(loss) > 0 for loss in losses)
