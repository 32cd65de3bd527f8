"""1F1B and ``train_step``: orders, memory in flight, transparency against the plain model."""
from __future__ import annotations

import copy
import functools
from typing import Any, Sequence

import pytest
import torch
from torch import Tensor, nn

import autopipe
from autopipe.errors import OptionError
from autopipe.planning.schedules import in_flight, order
from helpers import assert_close, balances, mlp
from models import skip_model


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_orders_run_every_task_once_forward_first(schedule: str) -> None:
    for stages in range(1, 6):
        for chunks in range(1, 8):
            for stage in range(stages):
                tasks = order(schedule, stage, stages, chunks)
                assert sorted(tasks) == sorted([(k, j) for k in "FB" for j in range(chunks)])
                assert all(tasks.index(("F", j)) < tasks.index(("B", j)) for j in range(chunks))
                assert [j for k, j in tasks if k == "F"] == list(range(chunks))
                held = peak = 0
                for kind, _ in tasks:
                    held += 1 if kind == "F" else -1
                    peak = max(peak, held)
                assert peak == in_flight(schedule, stage, stages, chunks)


def test_1f1b_order_by_hand() -> None:
    assert order("1f1b", 0, 3, 4) == [("F", 0), ("F", 1), ("F", 2), ("B", 0), ("F", 3), ("B", 1), ("B", 2), ("B", 3)]
    assert order("1f1b", 2, 3, 4) == [("F", 0), ("B", 0), ("F", 1), ("B", 1), ("F", 2), ("B", 2), ("F", 3), ("B", 3)]
    assert order("1f1b", 0, 4, 2) == [("F", 0), ("F", 1), ("B", 0), ("B", 1)]


def assert_train_step_transparent(model: nn.Module, x: Tensor, y: Tensor, balance: Sequence[int], chunks: int,
                                  checkpoint: str, schedule: str, reduction: str = "mean", **options: Any) -> None:
    """``train_step`` gives the plain model's loss ``mse(model(x), y)`` (reduced by ``reduction``)
    and its gradients."""
    reference = copy.deepcopy(model)
    loss_fn = functools.partial(nn.functional.mse_loss, reduction=reduction)
    loss_ref = loss_fn(reference(x), y)
    loss_ref.backward()
    devices = ["cpu"] * (len(balance) // options.get("interleave", 1) * options.get("replicas", 1))
    pipe = autopipe.Pipeline(model, balance=list(balance), devices=devices, chunks=chunks,
                             checkpoint=checkpoint, schedule=schedule, **options)
    loss = pipe.train_step(x, target=y, loss_fn=loss_fn, reduction=reduction)
    assert_close(loss, loss_ref.detach(), "loss")
    expected = dict(reference.named_parameters())
    for name, param in pipe.named_parameters():
        assert param.grad is not None, name
        assert_close(param.grad, expected[name].grad, f"{name}.grad")
    trace = pipe.last_trace()
    assert sorted((e.stage, e.micro_batch) for e in trace if e.kind == "B") == sorted(
        (s, j) for s in range(len(balance)) for j in range(min(chunks, len(x))))


@pytest.mark.timeout(60)
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("replicas", [1, 2])
def test_train_step_with_a_summed_loss(schedule: str, replicas: int) -> None:
    """A loss that sums its samples: the micro-batches' (of uneven sizes, 9 samples in 4) add up
    to the batch's sum, not its mean (which would train on a quarter of it, silently)."""
    torch.manual_seed(3)
    x, y = torch.randn(9, 6, dtype=torch.float64), torch.randn(9, 3, dtype=torch.float64)
    assert_train_step_transparent(mlp().double(), x, y, [3, 4], 4, "never", schedule, "sum", replicas=replicas)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("replicas", [1, 2])
def test_train_step_without_a_target(schedule: str, replicas: int) -> None:
    """A loss that needs no target (a model computing its own) takes ``None``, in every micro-batch
    and replica (``target`` was required, and a ``None`` one could not be split)."""
    torch.manual_seed(3)
    x = torch.randn(9, 6, dtype=torch.float64)
    model = mlp().double()
    reference = copy.deepcopy(model)
    want = reference(x).square().mean()
    want.backward()
    pipe = autopipe.Pipeline(model, balance=[3, 4], devices=["cpu"] * 2 * replicas, chunks=4, schedule=schedule,
                             replicas=replicas)
    targets = []

    def own_loss(out: Tensor, target: Any) -> Tensor:
        targets.append(target)
        return out.square().mean()

    assert_close(pipe.train_step(x, loss_fn=own_loss), want.detach(), "loss")
    assert targets == [None] * len(targets) and targets
    expected = dict(reference.named_parameters())
    for name, param in model.named_parameters():
        assert_close(param.grad, expected[name].grad, f"{name}.grad")


def test_train_step_refuses_an_unknown_reduction() -> None:
    pipe = autopipe.Pipeline(mlp(), balance=[3, 4], devices=["cpu", "cpu"], chunks=2)
    with pytest.raises(OptionError, match="reduction 'none' is not one of"):
        pipe.train_step(torch.randn(4, 6), target=torch.randn(4, 3), loss_fn=nn.functional.mse_loss,
                        reduction="none")  # type: ignore[arg-type]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("checkpoint", ["never", "except_last", "always"])
@pytest.mark.parametrize("chunks", [1, 3, 5])
@pytest.mark.parametrize("stages", [1, 2, 4])
def test_train_step_mlp(stages: int, chunks: int, checkpoint: str, schedule: str) -> None:
    x, y = torch.randn(10, 6), torch.randn(10, 3)  # 10 over 3 micro-batches: sizes 4, 3, 3
    assert_train_step_transparent(mlp(), x, y, balances(stages, 7), chunks, checkpoint, schedule)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("checkpoint", ["never", "except_last", "always"])
@pytest.mark.parametrize("balance", [[2, 2, 2, 1], [1, 2, 1, 1, 1, 1]])
def test_train_step_interleaved_1f1b(balance: list[int], checkpoint: str) -> None:
    """Two stages per device, each running 1F1B, taking turns on the device."""
    x, y = torch.randn(10, 6), torch.randn(10, 3)
    assert_train_step_transparent(mlp(), x, y, balance, 4, checkpoint, "1f1b", interleave=2)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("checkpoint", ["never", "except_last", "always"])
@pytest.mark.parametrize("balance, interleave", [([1, 2, 2, 3], 1), ([1, 3, 2, 2], 1), ([1, 2, 2, 3], 2)])
def test_train_step_1f1b_skips(balance: list[int], interleave: int, checkpoint: str) -> None:
    x = torch.randn(9, 8)
    model = skip_model()
    with torch.no_grad():
        out_width = model(x).shape[1]
    assert_train_step_transparent(model, x, torch.randn(9, out_width), balance, 4, checkpoint, "1f1b",
                                  interleave=interleave)


@pytest.mark.timeout(60)
def test_1f1b_holds_at_most_stages_minus_s_micro_batches() -> None:
    """Measured from the trace: on stage s, forwards run ahead of backwards by at most S - s."""
    pipe = autopipe.Pipeline(mlp(), balance=[2, 2, 2, 1], chunks=6, schedule="1f1b")
    pipe.train_step(torch.randn(12, 6), target=torch.randn(12, 3), loss_fn=nn.functional.mse_loss)
    for s in range(4):
        held = peak = 0
        for event in sorted((e for e in pipe.last_trace() if e.stage == s and e.kind in "FB"),
                            key=lambda e: e.start_ms):
            held += 1 if event.kind == "F" else -1
            peak = max(peak, held)
        assert peak == 4 - s


def test_1f1b_pipeline_refuses_a_caller_backward_and_runs_inference() -> None:
    model = mlp()
    pipe = autopipe.Pipeline(model, balance=[3, 4], chunks=2, schedule="1f1b")
    with pytest.raises(RuntimeError, match="train_step"):
        pipe(torch.randn(4, 6))
    x = torch.randn(4, 6)
    with torch.no_grad():
        assert_close(pipe(x), model(x), "inference output")
    with pytest.raises(ValueError, match="schedule 'pipedream'"):
        autopipe.Pipeline(mlp(), balance=[3, 4], schedule="pipedream")


def test_train_step_errors_name_the_problem() -> None:
    pipe = autopipe.Pipeline(mlp(), balance=[3, 4], chunks=2, schedule="1f1b")
    with pytest.raises(ValueError, match="target has batch size 5 but the inputs 4"):
        pipe.train_step(torch.randn(4, 6), target=torch.randn(5, 3), loss_fn=nn.functional.mse_loss)
    with pytest.raises(TypeError, match="loss_fn must return a tensor of one element") as info:
        pipe.train_step(torch.randn(4, 6), target=torch.randn(4, 3), loss_fn=lambda out, y: out - y)
    assert any("stage 1" in note for note in info.value.__notes__)
    # the pipeline is still usable
    pipe.train_step(torch.randn(4, 6), target=torch.randn(4, 3), loss_fn=nn.functional.mse_loss)
