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


# -- a frozen pipeline ---------------------------------------------------------------------------

@pytest.mark.timeout(60)
def test_a_frozen_pipeline_on_data_gives_an_output_without_a_graph() -> None:
    """Neither input nor parameter requires grad: the plain model's output requires none and its
    backward raises; the pipeline's output required grad (through the tie), so a backward ran
    every stage's recomputation and backward for no gradient, silently."""
    model = two_linears().requires_grad_(False)
    reference = copy.deepcopy(model)
    pipe = autopipe.Pipeline(model, balance=[2, 1], chunks=2)
    x = torch.randn(6, 4)
    out, expected = pipe(x), reference(x)
    assert out.requires_grad is expected.requires_grad is False
    assert_close(out, expected, "output")
    for value in (expected, out):
        with pytest.raises(RuntimeError, match="element 0 of tensors does not require grad"):
            value.sum().backward()
    assert {e.kind for e in pipe.last_trace()} == {"F"}
    x_pipe, x_ref = x.clone().requires_grad_(), x.clone().requires_grad_()  # an input needing its gradient
    pipe(x_pipe).pow(2).sum().backward()
    reference(x_ref).pow(2).sum().backward()
    assert_close(x_pipe.grad, x_ref.grad, "input gradient")
    assert all(p.grad is None for p in pipe.parameters())


# -- gradients the caller names ------------------------------------------------------------------

@pytest.mark.timeout(60)
@pytest.mark.parametrize("options", [{"balance": [3, 2], "checkpoint": "except_last"},
                                     {"balance": [3, 2], "replicas": 2, "devices": ["cpu"] * 4},
                                     {"balance": [2, 1, 1, 1], "interleave": 2, "devices": ["cpu"] * 2}], ids=str)
def test_autograd_grad_of_the_input_is_the_plain_models_and_touches_no_grad(options: dict[str, Any]) -> None:
    """``torch.autograd.grad(loss, x)`` gives the plain model's input gradient and, as there,
    leaves every ``.grad`` alone (one filled would reach the next optimizer step), with replicas
    and interleaved stages too (:mod:`test_runtime` checks skips and checkpoint modes)."""
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4)).double()
    reference = copy.deepcopy(model)
    pipe = autopipe.Pipeline(model, chunks=2, **options)
    x = torch.randn(6, 4, dtype=torch.float64, requires_grad=True)
    mine, expected = (torch.autograd.grad(m(x).pow(2).sum(), x)[0] for m in (pipe, reference))
    assert_close(mine, expected, "input gradient")
    assert all(p.grad is None for p in pipe.parameters())


# -- a second backward through one output ------------------------------------------------------

def _two_losses(model: nn.Module, x: Tensor) -> Tensor:
    """Two losses on one output, backwarded in turn (the first retaining the graph): the
    gradients of both, in ``.grad`` and the input's."""
    x = x.detach().requires_grad_()
    out = model(x)
    out.pow(2).sum().backward(retain_graph=True)
    torch.autograd.grad(out.sum(), x, retain_graph=True)  # an input gradient alone in between
    out.tanh().sum().backward()
    assert x.grad is not None
    return x.grad


@pytest.mark.timeout(60)
@pytest.mark.parametrize("checkpoint", ["never", "always"])
def test_a_second_backward_through_a_retained_graph_is_the_plain_models(checkpoint: str) -> None:
    """``backward(retain_graph=True)`` then another backward through the same output works on
    the plain model; the pipeline had freed its stages' state and refused the second."""
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4)).double()
    reference = copy.deepcopy(model)
    pipe = autopipe.Pipeline(model, balance=[2, 2, 1], devices=["cpu"] * 3, chunks=2, checkpoint=checkpoint)
    x = torch.randn(6, 4, dtype=torch.float64)
    assert_close(_two_losses(pipe, x), _two_losses(reference, x), "input gradient")
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        assert_close(p.grad, q.grad, f"{name}.grad")


@pytest.mark.timeout(60)
def test_a_second_backward_without_retain_graph_is_refused_as_autograd_refuses_it() -> None:
    """Without ``retain_graph=True`` the plain model's second backward raises autograd's error,
    which says to retain the graph; the pipeline's says the same."""
    model = two_linears()
    reference = copy.deepcopy(model)
    pipe = autopipe.Pipeline(model, balance=[2, 1], chunks=2)
    x = torch.randn(6, 4)
    for m in (reference, pipe):
        out = m(x)
        out.sum().backward()
        with pytest.raises(RuntimeError, match="backward through .* a second time.*Specify retain_graph=True"):
            out.sum().backward()
    for p, q in zip(pipe.parameters(), reference.parameters()):
        assert_close(p.grad, q.grad, "grad")


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


# -- a training step without gradients -------------------------------------------------------

def _assert_next_step_matches(pipe: autopipe.Pipeline, reference: nn.Module) -> None:
    """No gradient left by the refused step, and a correct step after it gives the plain model's."""
    assert all(p.grad is None for p in pipe.parameters())
    x = torch.randn(6, 4)
    assert_close(_train(pipe, x), _train(reference, x), "loss")
    for p, q in zip(pipe.parameters(), reference.parameters()):
        assert_close(p.grad, q.grad, "grad")


@pytest.mark.timeout(60)
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("disabled", [torch.no_grad, torch.inference_mode])
def test_train_step_with_gradients_disabled_is_refused(schedule: str, disabled: Any) -> None:
    """The plain model's ``loss.backward()`` raises under ``no_grad`` or ``inference_mode``; the
    pipeline's workers ran the step with gradients anyway and filled ``.grad``."""
    model = two_linears()
    reference = copy.deepcopy(model)
    pipe = autopipe.Pipeline(model, balance=[2, 1], chunks=2, schedule=schedule)
    x = torch.randn(6, 4)
    with disabled(), pytest.raises(RuntimeError, match="does not require grad"):
        _train(reference, x)
    with disabled(), pytest.raises(RuntimeError, match="called with gradients disabled .* call train_step outside"):
        _train(pipe, x)
    _assert_next_step_matches(pipe, reference)


def _detached(out: Tensor, target: Tensor) -> Tensor:
    return nn.functional.mse_loss(out, target).detach()


def _constant(out: Tensor, target: Tensor) -> Tensor:
    return torch.tensor(1.0)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("checkpoint", ["never", "always"])
@pytest.mark.parametrize("loss_fn", [_detached, _constant])
def test_a_loss_without_a_graph_is_refused(schedule: str, checkpoint: str, loss_fn: Any) -> None:
    """The plain model's ``loss_fn(model(x), y).backward()`` raises for a loss without a graph;
    the pipeline's step ran no backward and returned the loss, silently without gradients."""
    model = two_linears()
    reference = copy.deepcopy(model)
    pipe = autopipe.Pipeline(model, balance=[2, 1], chunks=2, schedule=schedule, checkpoint=checkpoint)
    x = torch.randn(6, 4)
    with pytest.raises(RuntimeError, match="does not require grad"):
        loss_fn(reference(x), x).backward()
    with pytest.raises(RuntimeError, match="loss that requires grad in no micro-batch .* return the loss computed"):
        pipe.train_step(x, target=x, loss_fn=loss_fn)
    _assert_next_step_matches(pipe, reference)


IGNORED = -100.0


def _labelled_sum(out: Tensor, target: Tensor) -> Tensor:
    """A summed loss over the rows not marked :data:`IGNORED`, a constant where there are none."""
    kept = target[:, 0] != IGNORED
    if not kept.any():
        return torch.zeros(())
    return nn.functional.mse_loss(out[kept], target[kept], reduction="sum")


@pytest.mark.timeout(60)
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_a_loss_without_a_graph_in_some_micro_batches_is_the_plain_models(schedule: str) -> None:
    """A micro-batch without labels may give a constant loss: the other micro-batches' gradients
    are the plain model's, so only a step where no micro-batch's loss has a graph is refused."""
    model = two_linears()
    reference = copy.deepcopy(model)
    pipe = autopipe.Pipeline(model, balance=[2, 1], chunks=2, schedule=schedule)
    x, target = torch.randn(8, 4), torch.randn(8, 4)
    target[:4] = IGNORED
    loss = pipe.train_step(x, target=target, loss_fn=_labelled_sum, reduction="sum")
    expected = _labelled_sum(reference(x), target)
    _assert_loss_step(loss, expected, pipe, reference)


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
    _assert_loss_step(loss, expected, pipe, reference)


def _assert_loss_step(loss: Tensor, expected: Tensor, pipe: nn.Module, reference: nn.Module) -> None:
    """``train_step``'s ``loss`` and gradients are the plain model's ``expected`` loss and its backward's."""
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
