"""Parameter hooks see one backward as on the plain model, though the stages run one backward
per micro-batch (and replica): a post-accumulate hook fires once on the whole gradient (an
optimizer stepping in it trains as on the plain model), a tensor hook transforms the whole
gradient, and a backward into named inputs fires none (:mod:`autopipe.runtime.hooks`)."""
from __future__ import annotations

import copy
import threading
from typing import Any, Callable

import pytest
import torch
from torch import Tensor, nn

import autopipe
from helpers import Overlap, assert_close, mlp

#: name -> (the pipeline's options, how a step runs: "call" backwards through pipe(x), "train_step")
CONFIGS: dict[str, tuple[dict[str, Any], str]] = {
    "never": ({"balance": [3, 4], "chunks": 4, "checkpoint": "never"}, "call"),
    "always": ({"balance": [3, 4], "chunks": 4, "checkpoint": "always"}, "call"),
    "gpipe-train-step": ({"balance": [3, 4], "chunks": 4}, "train_step"),
    "1f1b": ({"balance": [3, 4], "chunks": 4, "schedule": "1f1b"}, "train_step"),
    "replicas": ({"balance": [3, 4], "chunks": 2, "replicas": 2, "devices": ["cpu"] * 4}, "call"),
    "copies": ({"balance": [3, 4], "chunks": 2, "replicas": 2, "devices": ["cpu"] * 4}, "call"),
    "interleave": ({"balance": [2, 2, 2, 1], "chunks": 4, "interleave": 2, "checkpoint": "always"}, "train_step"),
}

Step = Callable[[Tensor, Tensor], None]


def _loss(out: Tensor, target: Tensor) -> Tensor:
    return nn.functional.mse_loss(out, target)


def _pair(config: str, monkeypatch: pytest.MonkeyPatch) -> tuple[nn.Module, nn.Module, Step, Step]:
    """The plain model, a pipeline of a copy of it, and a training step of each (loss, backward)."""
    if config == "copies":  # replicas on copies of the modules, as on CUDA
        monkeypatch.setattr(autopipe.runtime.pipeline, "shares_parameters", lambda groups: False)
    options, how = CONFIGS[config]
    torch.manual_seed(0)
    plain = mlp()
    pipe = autopipe.Pipeline(copy.deepcopy(plain), **options)

    def plain_step(x: Tensor, y: Tensor) -> None:
        _loss(plain(x), y).backward()

    def pipe_step(x: Tensor, y: Tensor) -> None:
        if how == "train_step":
            pipe.train_step(x, target=y, loss_fn=_loss)
        else:
            _loss(pipe(x), y).backward()

    return plain, pipe, plain_step, pipe_step


def _batch() -> tuple[Tensor, Tensor]:
    return torch.randn(12, 6), torch.randn(12, 3)


@pytest.mark.parametrize("config", CONFIGS)
def test_post_accumulate_hook_fires_once_on_the_whole_gradient(config: str, monkeypatch: pytest.MonkeyPatch) -> None:
    plain, pipe, plain_step, pipe_step = _pair(config, monkeypatch)
    seen: dict[str, list[Tensor]] = {name: [] for name, _ in pipe.named_parameters()}
    handles = [p.register_post_accumulate_grad_hook(lambda p, name=name: seen[name].append(p.grad.clone()))
               for name, p in pipe.named_parameters()]
    x, y = _batch()
    plain_step(x, y)
    pipe_step(x, y)
    expected = dict(plain.named_parameters())
    for name, grads in seen.items():
        assert len(grads) == 1, f"{name}: fired {len(grads)} times"
        assert_close(grads[0], expected[name].grad, name)
    for handle in handles:  # the hooks were put back where their handles remove them
        handle.remove()
    pipe_step(x, y)
    assert all(len(grads) == 1 for grads in seen.values())
    pipe.close()


def _stepping(optimizer: torch.optim.Optimizer) -> Callable[[Tensor], None]:
    """A post-accumulate hook that steps ``optimizer`` (on its one parameter) and clears the gradient."""
    def hook(_: Tensor) -> None:
        optimizer.step()
        optimizer.zero_grad()
    return hook


@pytest.mark.parametrize("config", CONFIGS)
def test_optimizer_in_backward_trains_as_the_plain_model(config: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The "optimizer in backward" recipe: each parameter steps in its post-accumulate hook."""
    plain, pipe, plain_step, pipe_step = _pair(config, monkeypatch)
    for model in (plain, pipe):
        for p in model.parameters():
            p.register_post_accumulate_grad_hook(_stepping(torch.optim.SGD([p], lr=0.1, momentum=0.9)))
    for _ in range(2):
        x, y = _batch()
        plain_step(x, y)
        pipe_step(x, y)
    expected = dict(plain.named_parameters())
    for name, p in pipe.named_parameters():
        assert p.grad is None, name
        assert_close(p, expected[name], name)
    pipe.close()


@pytest.mark.parametrize("config", CONFIGS)
def test_tensor_hook_transforms_the_whole_gradient(config: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A non-linear hook (a clamp) on the whole gradient, not on each micro-batch's; a gradient
    already in ``.grad`` (accumulation) is added to, not passed through the hook."""
    plain, pipe, plain_step, pipe_step = _pair(config, monkeypatch)
    x, y = _batch()
    plain_step(x, y)
    pipe_step(x, y)
    for model in (plain, pipe):
        for p in model.parameters():
            p.register_hook(lambda g: g.clamp(-0.01, 0.01))
    x, y = _batch()
    plain_step(x, y)
    pipe_step(x, y)
    expected = dict(plain.named_parameters())
    for name, p in pipe.named_parameters():
        assert_close(p.grad, expected[name].grad, name)
    pipe.close()


def test_a_backward_into_the_inputs_fires_no_parameter_hook() -> None:
    """``autograd.grad(loss, x)`` runs no parameter's ``AccumulateGrad`` on the plain model; a
    later ``backward()`` fires each hook once."""
    pipe = autopipe.Pipeline(mlp(), balance=[3, 4], chunks=4)
    calls: list[Tensor] = []
    for p in pipe.parameters():
        p.register_hook(lambda g: calls.append(g))
        p.register_post_accumulate_grad_hook(calls.append)
    x = torch.randn(12, 6, requires_grad=True)
    out = pipe(x).sum()
    torch.autograd.grad(out, x, retain_graph=True)
    assert calls == [] and all(p.grad is None for p in pipe.parameters())
    out.backward()
    assert len(calls) == 2 * len(list(pipe.parameters()))
    pipe.close()


class FailOnNaN(nn.Module):
    """Raises on a micro-batch holding NaN, after earlier micro-batches' backwards ran (1F1B)."""

    def forward(self, x: Tensor) -> Tensor:
        if x.isnan().any():
            raise ValueError("NaN")
        return x


def test_a_failed_step_fires_no_hook_and_keeps_them() -> None:
    """A failed step's gradient is partial: an optimizer in backward must not step on it."""
    model = nn.Sequential(nn.Linear(6, 6), nn.Tanh(), FailOnNaN(), nn.Linear(6, 3))
    pipe = autopipe.Pipeline(model, balance=[2, 2], chunks=4, schedule="1f1b", checkpoint="never")
    calls: list[str] = []
    for name, p in pipe.named_parameters():
        p.register_post_accumulate_grad_hook(lambda _, name=name: calls.append(name))
    x, y = _batch()
    x[-1] = float("nan")
    with pytest.raises(ValueError, match="NaN"):
        pipe.train_step(x, target=y, loss_fn=_loss)
    assert calls == [] and all(p.grad is None for p in pipe.parameters())
    x, y = _batch()
    pipe.train_step(x, target=y, loss_fn=_loss)
    assert sorted(calls) == sorted(name for name, _ in pipe.named_parameters())
    pipe.close()


@pytest.mark.parametrize("config", ["never", "always", "1f1b"])
def test_a_hook_removed_during_the_backward_stays_removed(config: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A one-shot hook, disarmed by a layer's backward hook while the stages run: it fires as
    often as on the plain model (never: the layer's backward hook runs first) and is gone after."""
    plain, pipe, plain_step, pipe_step = _pair(config, monkeypatch)
    counts = []
    for model, step in ((plain, plain_step), (pipe, pipe_step)):
        fired: list[int] = []
        weight = model[0].weight
        handle = weight.register_post_accumulate_grad_hook(lambda p, fired=fired: fired.append(1))
        model[4].register_full_backward_hook(lambda module, grad_in, grad_out, handle=handle: handle.remove())
        for _ in range(2):
            step(*_batch())
        counts.append((len(fired), len(weight._post_accumulate_grad_hooks or {})))
    assert counts[1] == counts[0] == (0, 0)


def test_a_hook_removed_by_another_parameters_hook_does_not_fire() -> None:
    """The last layer's bias is reached first in a backward; its hook removes the first weight's
    (tripling) hook, which then never fires, on the plain model as on the pipeline."""
    grads = []
    for pipelined in (False, True):
        torch.manual_seed(0)
        net = mlp()
        model = autopipe.Pipeline(net, balance=[3, 4], chunks=4) if pipelined else net
        tripled = net[0].weight.register_hook(lambda grad: grad * 3)
        net[6].bias.register_hook(lambda grad, tripled=tripled: tripled.remove())
        x, y = _batch()
        _loss(model(x), y).backward()
        grads.append(net[0].weight.grad)
    assert_close(grads[1], grads[0], "first weight's gradient")


class _Held(torch.autograd.Function):
    """The identity, whose backward holds the first call's backward until the second's starts."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, overlap: Overlap) -> Tensor:
        ctx.overlap = overlap
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        ctx.overlap.hold()
        return grad, None


class HoldsBackward(nn.Module):
    def __init__(self, overlap: Overlap) -> None:
        super().__init__()
        self.overlap = overlap

    def forward(self, x: Tensor) -> Tensor:
        return _Held.apply(x, self.overlap)


@pytest.mark.timeout(120)
def test_overlapping_backwards_from_two_threads_keep_the_hooks() -> None:
    """Two threads' backward phases under way at once share one hold: the hooks fire once, on
    the two calls' summed gradient, and are in place afterwards (a second hold had taken the
    first's stand-ins for the hooks and put them back for good)."""
    torch.manual_seed(0)
    plain = mlp()
    overlap = Overlap()
    pipe = autopipe.Pipeline(nn.Sequential(*copy.deepcopy(plain), HoldsBackward(overlap)), balance=[3, 5], chunks=4)
    fired = {name: 0 for name, _ in pipe.named_parameters()}
    for name, p in pipe.named_parameters():
        p.register_hook(lambda g: g * 2)
        p.register_post_accumulate_grad_hook(lambda p, name=name: fired.__setitem__(name, fired[name] + 1))
    (xa, ya), (xb, yb) = _batch(), _batch()
    losses = [_loss(pipe(xa), ya), _loss(pipe(xb), yb)]
    overlap.run(losses[0].backward, losses[1].backward)
    assert set(fired.values()) == {1}, fired
    _loss(plain(xa), ya).backward()
    _loss(plain(xb), yb).backward()
    expected = dict(plain.named_parameters())
    for name, p in pipe.named_parameters():
        assert_close(p.grad, 2 * expected[name].grad, name)
    pipe.zero_grad()
    plain.zero_grad()
    _loss(pipe(xa), ya).backward()  # an ordinary step after them: each hook fires once, the gradient doubled
    _loss(plain(xa), ya).backward()
    assert set(fired.values()) == {2}, fired
    for name, p in pipe.named_parameters():
        assert_close(p.grad, 2 * expected[name].grad, name)
    pipe.close()


@pytest.mark.timeout(120)
def test_a_hook_may_wait_for_another_threads_pipeline() -> None:
    """Hooks fire outside any lock: two threads training their own pipelines, each hook waiting
    for the other's (a threaded gradient sync), both finish, as with the plain models (the
    hooks had fired under one process-wide lock, and the two waited for each other)."""
    meeting = threading.Barrier(2, timeout=20)
    models = [nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 1)) for _ in range(2)]
    for model in models:
        model[0].weight.register_post_accumulate_grad_hook(lambda p: meeting.wait() and None)
    pipes = [autopipe.Pipeline(model, balance=[2, 1], chunks=2) for model in models]
    failures: list[BaseException] = []

    def train(pipe: autopipe.Pipeline) -> None:
        try:
            pipe(torch.randn(4, 4)).sum().backward()
        except BaseException as error:  # reported below
            failures.append(error)

    threads = [threading.Thread(target=train, args=(pipe,)) for pipe in pipes]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert not failures, failures
    assert all(model[0].weight.grad is not None for model in models)
    for pipe in pipes:
        pipe.close()
