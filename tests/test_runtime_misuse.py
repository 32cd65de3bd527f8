"""What a caller may do wrong with a pipeline, or do from several threads: each is refused with
an error naming it, or works as with the plain model; none gives other results silently, hangs
or keeps the pipeline alive."""
from __future__ import annotations

import copy
import gc
import threading
import weakref
from typing import Any

import pytest
import torch
from torch import Tensor, nn

import autopipe
from autopipe.errors import DeviceError
from autopipe.runtime.worker import Worker
from helpers import assert_close, assert_step_matches


def two_linears() -> nn.Sequential:
    return nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4))


MARKER = 999.0


class FailOnMarker(nn.Module):
    """Raises in the forward of a micro-batch holding :data:`MARKER`: one chosen micro-batch fails."""

    def forward(self, x: Tensor) -> Tensor:
        if (x == MARKER).any():
            raise ValueError("forward boom")
        return x


def marked(batch: int, row: int) -> Tensor:
    x = torch.randn(batch, 4)
    x[row, 0] = MARKER
    return x


# -- meta tensors from the caller -------------------------------------------------------

@pytest.mark.timeout(60)
def test_a_meta_input_or_target_for_a_stage_with_data_is_refused() -> None:
    """A meta tensor has no values; the plain model refuses it, and the pipeline used to copy it
    to its CPU stages as zeros and return their output."""
    model = two_linears()
    reference = copy.deepcopy(model)
    pipe = autopipe.Pipeline(model, balance=[2, 1], chunks=2)
    x_meta = torch.randn(8, 4, device="meta")
    with pytest.raises(RuntimeError):
        reference(x_meta)
    with pytest.raises(DeviceError, match="an input of the pipeline is a meta tensor .* stage on cpu"):
        pipe(x_meta)
    with torch.no_grad(), pytest.raises(DeviceError, match="meta tensor"):
        pipe(x_meta)
    with pytest.raises(DeviceError, match="target is a meta tensor"):
        pipe.train_step(torch.randn(8, 4), target=torch.randn(8, 4, device="meta"), loss_fn=nn.functional.mse_loss)
    assert all(p.grad is None for p in pipe.parameters())
    assert_step_matches(pipe, reference, torch.randn(8, 4), chunks=2)


@pytest.mark.timeout(60)
def test_a_meta_input_to_meta_stages_still_runs() -> None:
    """Stages on meta (tests' way of checking devices and shapes) take meta inputs as before."""
    pipe = autopipe.Pipeline(two_linears(), balance=[2, 1], devices=["meta", "meta"], chunks=2)
    out = pipe(torch.randn(8, 4, device="meta"))
    assert out.device.type == "meta" and out.shape == (8, 4)
    out.sum().backward()
    assert all(p.grad is not None and p.grad.device.type == "meta" for p in pipe.parameters())


# -- double backward --------------------------------------------------------------------

def _double_backward(pipe: nn.Module, how: str) -> None:
    x = torch.randn(6, 4, requires_grad=True)
    if how == "backward(create_graph=True)":
        pipe(x).pow(2).sum().backward(create_graph=True)
    else:  # a gradient penalty (WGAN-GP), whose loss needs the gradient's own graph
        g, = torch.autograd.grad(pipe(x).sum(), x, create_graph=True)
        ((g.norm(dim=1) - 1) ** 2).mean().backward()


@pytest.mark.timeout(60)
@pytest.mark.filterwarnings("ignore:Using backward\\(\\) with create_graph=True")
@pytest.mark.parametrize("how", ["backward(create_graph=True)", "autograd.grad(create_graph=True)"])
def test_double_backward_is_refused(how: str) -> None:
    """The stages' gradients come back without a graph, so a penalty on them lost its
    second-order terms silently (the plain model's gradients have them)."""
    model = two_linears()
    reference = copy.deepcopy(model)
    pipe = autopipe.Pipeline(model, balance=[2, 1], chunks=2)
    with pytest.raises(RuntimeError, match="double backward through a pipeline is not supported"):
        _double_backward(pipe, how)
    assert all(p.grad is None for p in pipe.parameters())
    assert_step_matches(pipe, reference, torch.randn(6, 4), chunks=2)


# -- several threads ----------------------------------------------------------------------

class Interleaved:
    """Makes two calls' jobs reach the workers interleaved: the first thread's first job of a
    phase with backwards goes to stage 0's worker, then that thread waits (half a second at
    most) until the second thread's jobs of some phase have reached every worker."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, pipe: autopipe.Pipeline) -> None:
        last = pipe._engine.workers[-1]
        self.second_may_start = threading.Event()
        self.second_submitted = threading.Event()
        self.paused = False
        submit = Worker.submit

        def interleaved_submit(worker: Worker, run: Any, actions: list[Any]) -> None:
            submit(worker, run, actions)
            name = threading.current_thread().name
            if name == "first" and not self.paused and any(action.kind == "B" for action in actions):
                self.paused = True
                self.second_may_start.set()
                self.second_submitted.wait(timeout=0.5)
            elif name == "second" and worker is last:
                self.second_submitted.set()

        monkeypatch.setattr(Worker, "submit", interleaved_submit)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_two_threads_training_one_pipeline_neither_hang_nor_mix_up(schedule: str,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """Two threads each train one pipeline (``pipe(x).sum().backward()``, or ``train_step``) at
    once: the workers got the calls' jobs in different orders and each waited for a message
    of the call it did not run, forever.  The gradients are the plain model's on both batches."""
    model = nn.Sequential(*[nn.Linear(4, 4) for _ in range(4)]).double()
    reference = copy.deepcopy(model)
    pipe = autopipe.Pipeline(model, balance=[1, 1, 1, 1], chunks=4, checkpoint="never", schedule=schedule)
    interleaved = Interleaved(monkeypatch, pipe)
    batches = [torch.randn(8, 4, dtype=torch.float64) for _ in range(2)]

    def train(x: Tensor) -> None:
        if threading.current_thread().name == "second":
            interleaved.second_may_start.wait(timeout=10)
        if schedule == "gpipe":
            pipe(x).sum().backward()
        else:
            pipe.train_step(x, target=x, loss_fn=nn.functional.mse_loss)

    threads = [threading.Thread(target=train, args=(x,), name=name, daemon=True)
               for x, name in zip(batches, ["first", "second"])]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=10)
    assert interleaved.paused
    assert not any(thread.is_alive() for thread in threads), "the two calls deadlocked"
    for x in batches:
        out = reference(x)
        (out.sum() if schedule == "gpipe" else nn.functional.mse_loss(out, x)).backward()
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        assert_close(p.grad, q.grad, f"{name}.grad", rel=1e-9)


# -- a failed call keeps nothing alive ------------------------------------------------------

def _fail(pipe: autopipe.Pipeline, phase: str) -> None:
    """A call of ``pipe`` that fails in a stage's ``phase``."""
    if phase == "forward":
        pipe(torch.randn(4, 5))  # the first layer's own shape error
    else:
        out = pipe(torch.randn(4, 4))
        pipe[0].weight.register_hook(_raise)
        out.sum().backward()


def _raise(grad: Tensor) -> Tensor:
    raise ZeroDivisionError("a hook's own error in a stage's backward")


@pytest.mark.timeout(60)
@pytest.mark.parametrize("phase", ["forward", "backward"])
def test_a_pipeline_dropped_after_a_failed_call_is_collected(phase: str) -> None:
    """The worker kept its last job's run, and the run its error, whose traceback holds the
    caller's frames (the pipeline's forward; after a backward, the loss, whose autograd graph
    holds the run again through C++, out of the garbage collector's sight): the pipeline and
    its threads lived on."""
    pipe = autopipe.Pipeline(two_linears(), balance=[2, 1], chunks=2)
    with pytest.raises((RuntimeError, ZeroDivisionError)):
        _fail(pipe, phase)
    workers = pipe._engine.workers
    collected = weakref.ref(pipe)
    del pipe
    gc.collect()
    assert collected() is None
    for worker in workers:
        worker.join(timeout=10)
        assert not worker.alive


# -- a failed train_step's gradients -------------------------------------------------------

def _failing_1f1b() -> tuple[autopipe.Pipeline, nn.Sequential]:
    """A 1F1B pipeline whose stage 0 fails in the forward of any micro-batch holding the marker
    (micro-batches 0-2's backwards run before micro-batch 3's forward), and the plain model."""
    model = nn.Sequential(FailOnMarker(), nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4))
    reference = copy.deepcopy(model)
    return autopipe.Pipeline(model, balance=[2, 2], chunks=4, schedule="1f1b"), reference


def _train(model: nn.Module, x: Tensor) -> Any:
    if isinstance(model, autopipe.Pipeline):
        return model.train_step(x, target=x, loss_fn=nn.functional.mse_loss)
    loss = nn.functional.mse_loss(model(x), x)
    loss.backward()
    return loss.detach()


@pytest.mark.timeout(60)
def test_a_failed_train_step_leaves_no_gradient_where_there_was_none() -> None:
    """The plain model's failed forward leaves ``.grad`` as ``None``; a 1F1B step whose last
    forward failed left micro-batches 0-2's gradients there."""
    pipe, reference = _failing_1f1b()
    x = marked(8, row=7)
    with pytest.raises(ValueError, match="forward boom") as info:
        _train(pipe, x)
    assert not any("zero_grad" in note for note in info.value.__notes__)
    with pytest.raises(ValueError, match="forward boom"):
        _train(reference, x)
    assert [p.grad for p in pipe.parameters()] == [q.grad for q in reference.parameters()] == [None] * 4
    good = torch.randn(8, 4)
    assert_close(_train(pipe, good), _train(reference, good), "loss")
    for p, q in zip(pipe.parameters(), reference.parameters()):
        assert_close(p.grad, q.grad, "grad")


@pytest.mark.timeout(60)
def test_a_failed_train_step_onto_accumulated_gradients_says_to_zero_them() -> None:
    """Where ``.grad`` held an earlier step's gradients the failed step's part cannot be taken
    back cheaply: the error says so.  A parameter whose ``.grad`` was ``None`` still gets ``None``."""
    pipe, _ = _failing_1f1b()
    _train(pipe, torch.randn(8, 4))
    params = list(pipe.parameters())
    params[0].grad = None
    before = [None if p.grad is None else p.grad.clone() for p in params]
    with pytest.raises(ValueError, match="forward boom") as info:
        _train(pipe, marked(8, row=7))
    assert any("call optimizer.zero_grad()" in note for note in info.value.__notes__)
    assert params[0].grad is None
    assert any(not torch.equal(p.grad, b) for p, b in zip(params[1:], before[1:]))


@pytest.mark.timeout(60)
def test_a_train_step_failing_before_any_backward_adds_no_note() -> None:
    """A failure before any backward leaves accumulated gradients as they were: no note."""
    pipe, _ = _failing_1f1b()
    _train(pipe, torch.randn(8, 4))
    before = [p.grad.clone() for p in pipe.parameters()]
    with pytest.raises(ValueError, match="forward boom") as info:
        _train(pipe, marked(8, row=0))
    assert not any("zero_grad" in note for note in info.value.__notes__)
    assert all(torch.equal(p.grad, b) for p, b in zip(pipe.parameters(), before))


# -- errors that name the mistake ------------------------------------------------------------

@pytest.mark.timeout(60)
@pytest.mark.parametrize("target, error, message", [
    (torch.tensor(1.0), ValueError, "target is a scalar tensor but the inputs have batch size 6"),
    (torch.randn(5, 4), ValueError, "target has batch size 5 but the inputs 6"),
    ((torch.randn(6, 4), torch.randn(3)), ValueError, "target has batch size 3 but the inputs 6"),
    ([1, 2, 3, 4, 5, 6], TypeError, "target is of type list"),
    (3, TypeError, "target is of type int"),
])
def test_train_step_names_a_target_it_cannot_split(target: Any, error: type, message: str) -> None:
    pipe = autopipe.Pipeline(two_linears(), balance=[2, 1], chunks=2, schedule="1f1b")
    with pytest.raises(error, match=message):
        pipe.train_step(torch.randn(6, 4), target=target, loss_fn=lambda out, _: out.mean())
    assert all(p.grad is None for p in pipe.parameters())


@pytest.mark.timeout(60)
def test_train_step_on_an_empty_batch() -> None:
    """A mean over no samples is undefined (the plain model's loss and gradients are NaN):
    refused, naming the empty batch; a sum is zero, as the plain model's."""
    model = two_linears()
    reference = copy.deepcopy(model)
    pipe = autopipe.Pipeline(model, balance=[2, 1], chunks=2, schedule="1f1b")
    x = torch.randn(0, 4)
    with pytest.raises(ValueError, match="batch of 0 samples"):
        pipe.train_step(x, target=x, loss_fn=nn.functional.mse_loss)

    def summed(out: Tensor, y: Tensor) -> Tensor:
        return nn.functional.mse_loss(out, y, reduction="sum")

    loss = pipe.train_step(x, target=x, loss_fn=summed, reduction="sum")
    expected = summed(reference(x), x)
    expected.backward()
    assert_close(loss, expected.detach(), "loss")
    for p, q in zip(pipe.parameters(), reference.parameters()):
        assert_close(p.grad, q.grad, "grad")


class WithCount(nn.Module):
    """Returns its input and its micro-batch's size: a plain value that differs per micro-batch."""

    def forward(self, x: Tensor) -> tuple[Tensor, int]:
        return x, len(x)


@pytest.mark.timeout(60)
def test_an_output_item_that_cannot_be_joined_is_named() -> None:
    pipe = autopipe.Pipeline(nn.Sequential(nn.Linear(4, 4), WithCount()), balance=[1, 1], chunks=2)
    with pytest.raises(TypeError, match=r"output \[1\] is int \(3, 2 in its micro-batches\).* may return tensors"):
        pipe(torch.randn(5, 4))


@pytest.mark.timeout(60)
def test_an_error_in_a_replica_names_the_replica() -> None:
    model = nn.Sequential(FailOnMarker(), nn.Linear(4, 4), nn.Linear(4, 4))
    pipe = autopipe.Pipeline(model, balance=[2, 1], chunks=2, replicas=2, devices=["cpu"] * 4)
    with pytest.raises(ValueError, match="forward boom") as info:
        pipe(marked(8, row=6))  # the second micro-batch of the second replica's share
    assert info.value.__notes__ == [
        "autopipe: raised by stage 0 of replica 1 (0..1) on cpu in forward of micro-batch 1"]
