"""Checkpointing and parameters changed between a forward and its backward.

A checkpointed micro-batch recomputes its forward in the backward, on the parameters it then
finds; the plain model's backward uses the graph its forward built.  The two must not differ
silently: a weight written in place since the forward (``optimizer.step()`` before
``backward()``) is refused, and a parameter frozen in the forward gets no gradient though it
was unfrozen before the backward (a GAN's discriminator around the generator's loss).
"""
from __future__ import annotations

import pytest
import torch
from torch import Tensor, nn

import autopipe
import autopipe.runtime.pipeline
from helpers import assert_close

CHECKPOINTS = ["never", "except_last", "always"]
CHUNKS = 4
MODIFIED = "modified by an inplace operation"


def model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 2)).double()


def pipeline(net: nn.Module, checkpoint: str, replicas: int = 1, schedule: str = "gpipe") -> autopipe.Pipeline:
    """``net`` over two stages (layers 0-1 and 2-4), per replica."""
    return autopipe.Pipeline(net, balance=[2, 3], devices=["cpu"] * 2 * replicas, chunks=CHUNKS,
                             checkpoint=checkpoint, replicas=replicas, schedule=schedule)


def batch(requires_grad: bool = True) -> Tensor:
    torch.manual_seed(1)
    return torch.randn(8, 4, dtype=torch.float64, requires_grad=requires_grad)


def assert_same_gradients(pipe: nn.Module, reference: nn.Module) -> None:
    """Every parameter's ``.grad`` is the plain model's, ``None`` where it is ``None``."""
    expected = dict(reference.named_parameters())
    for name, param in pipe.named_parameters():
        if expected[name].grad is None:
            assert param.grad is None, f"{name} has a gradient where the plain model's has none"
        else:
            assert param.grad is not None, name
            assert_close(param.grad, expected[name].grad, f"{name}.grad")


@pytest.fixture
def copies(monkeypatch: pytest.MonkeyPatch) -> None:
    """Replicas on copies of the modules (what CUDA devices get), run on CPU devices."""
    monkeypatch.setattr(autopipe.runtime.pipeline, "shares_parameters", lambda groups: False)


# -- parameters written in place ---------------------------------------------------------


def stepped(net: nn.Module, how: str) -> None:
    """Write into every parameter of ``net`` in place, as a step taken before the backward would."""
    if how == "optimizer.step":
        for p in net.parameters():
            p.grad = torch.full_like(p, 0.1)
        torch.optim.SGD(net.parameters(), lr=1.0).step()
        net.zero_grad(set_to_none=True)
    else:
        net.load_state_dict({name: value + 0.1 for name, value in model().state_dict().items()})


@pytest.mark.timeout(60)
@pytest.mark.parametrize("checkpoint", CHECKPOINTS)
@pytest.mark.parametrize("how", ["optimizer.step", "load_state_dict"])
@pytest.mark.parametrize("replicas", ["one", "shared", "copies"])
def test_weights_written_before_the_backward_are_refused_as_by_the_plain_model(
        checkpoint: str, how: str, replicas: str, request: pytest.FixtureRequest) -> None:
    """The plain model raises autograd's error (it saved the weights); a recomputation would
    have silently mixed the forward's weights (its output) with the new ones (its gradients).
    The call fails as a whole, and the next one runs as the plain model.  Copies of replicas
    take the weights through ``.data``, uncounted: the first replica's stages tell."""
    if replicas == "copies":
        request.getfixturevalue("copies")
    reference, net = model(), model()
    pipe = pipeline(net, checkpoint, 1 if replicas == "one" else 2)
    x = batch()
    for m in (reference, pipe):
        out = m(x)
        stepped(m, how)
        with pytest.raises(RuntimeError, match=MODIFIED):
            out.sum().backward()
    for m in (reference, pipe):
        m.zero_grad(set_to_none=True)
        m(x).sum().backward()
    assert_same_gradients(pipe, reference)


def test_the_error_names_the_parameter_stage_and_micro_batch() -> None:
    pipe = pipeline(model(), "always")
    out = pipe(batch())
    stepped(pipe, "optimizer.step")
    with pytest.raises(RuntimeError, match=MODIFIED) as error:
        out.sum().backward()
    message = str(error.value)
    assert "the parameter '2.weight' of stage 1" in message and f"micro-batch {CHUNKS - 1}" in message
    assert "optimizer.step()" in message and "after backward()" in message


@pytest.mark.timeout(60)
@pytest.mark.parametrize("checkpoint", CHECKPOINTS)
def test_a_bias_written_before_the_backward_is_refused_where_it_would_be_recomputed(checkpoint: str) -> None:
    """The plain model saved what its backward needs and gives the forward's gradients; a
    recomputation on the written bias would give others (the tanh after it sees new values),
    so a checkpointed pipeline refuses rather than differ."""
    reference, net = model(), model()
    pipe = pipeline(net, checkpoint)
    x = batch(requires_grad=False)
    outputs = [m(x) for m in (reference, pipe)]
    for m in (reference, pipe):
        with torch.no_grad():
            m[2].bias.add_(1.0)
    outputs[0].sum().backward()
    if checkpoint == "never":
        outputs[1].sum().backward()
        assert_same_gradients(pipe, reference)
    else:
        with pytest.raises(RuntimeError, match=rf"{MODIFIED}: the parameter '2.bias' of stage 1"):
            outputs[1].sum().backward()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("checkpoint", CHECKPOINTS)
def test_a_parameter_replaced_before_the_backward_is_refused_where_it_would_be_recomputed(checkpoint: str) -> None:
    """The plain model's backward gives its gradient to the parameter its forward read; a
    recomputation would read (and give it to) the new one."""
    reference, net = model(), model()
    pipe = pipeline(net, checkpoint)
    x = batch()
    outputs = [reference(x), pipe(x)]
    for m in (reference, net):
        m[2].weight = nn.Parameter(m[2].weight.detach() + 1.0)
    outputs[0].sum().backward()
    if checkpoint == "never":
        outputs[1].sum().backward()
        assert_same_gradients(net, reference)
    else:
        with pytest.raises(RuntimeError, match="parameters were replaced, added or removed"):
            outputs[1].sum().backward()


# -- parameters frozen in the forward ------------------------------------------------------


def frozen_part(net: nn.Module, part: str) -> list[nn.Parameter]:
    """The parameters frozen around the forward: all (a discriminator), or one layer of each stage."""
    return list(net.parameters()) if part == "all" else [*net[0].parameters(), *net[4].parameters()]


def toggled_backward(net: nn.Module, x: Tensor, part: str, order: str, how: str) -> Tensor | None:
    """A forward and a backward of ``net`` with ``part``'s ``requires_grad`` toggled between them;
    the input's gradient."""
    frozen = frozen_part(net, part)
    for p in frozen:
        p.requires_grad_(order != "unfrozen before backward")
    loss = -net(x).mean()
    for p in frozen:
        p.requires_grad_(order == "unfrozen before backward")
    if how == "autograd.grad":
        return torch.autograd.grad(loss, x)[0]
    x.grad = None
    loss.backward()
    return x.grad


@pytest.mark.timeout(60)
@pytest.mark.parametrize("checkpoint", CHECKPOINTS)
@pytest.mark.parametrize("part", ["all", "one layer per stage"])
@pytest.mark.parametrize("order", ["unfrozen before backward", "frozen before backward"])
@pytest.mark.parametrize("how", ["backward", "autograd.grad"])
def test_gradients_follow_requires_grad_at_the_forward(checkpoint: str, part: str, order: str, how: str) -> None:
    """The GAN pattern (``D.requires_grad_(False); loss = -D(G(z)).mean(); D.requires_grad_(True);
    loss.backward()``): the plain model's graph, built at the forward, gives the frozen
    parameters no gradient; the opposite order gives none either (autograd skips a parameter
    that no longer requires grad); and a backward into the input alone gives the same input
    gradient."""
    reference, net = model(), model()
    pipe = pipeline(net, checkpoint)
    expected = toggled_backward(reference, batch(), part, order, how)
    actual = toggled_backward(pipe, batch(), part, order, how)
    assert actual is not None and expected is not None
    assert_close(actual, expected, "input gradient")
    assert_same_gradients(pipe, reference)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("checkpoint", CHECKPOINTS)
@pytest.mark.parametrize("sharing", ["shared", "copies"])
@pytest.mark.parametrize("order", ["unfrozen before backward", "frozen before backward"])
def test_replicas_give_no_gradient_to_parameters_frozen_in_the_forward(checkpoint: str, sharing: str, order: str,
                                                                      request: pytest.FixtureRequest) -> None:
    """Every replica recomputes on the flags its own forward saw (copies take them at the forward),
    and the copies' gradients go into no parameter frozen since (autograd skips it)."""
    if sharing == "copies":
        request.getfixturevalue("copies")
    reference, net = model(), model()
    pipe = pipeline(net, checkpoint, replicas=2)
    assert (pipe._copies is None) == (sharing == "shared")
    expected = toggled_backward(reference, batch(), "all", order, "backward")
    actual = toggled_backward(pipe, batch(), "all", order, "backward")
    assert actual is not None and expected is not None
    assert_close(actual, expected, "input gradient")
    assert_same_gradients(pipe, reference)


# -- train_step ---------------------------------------------------------------------------


@pytest.mark.timeout(60)
@pytest.mark.parametrize("checkpoint", ["except_last", "always"])
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_train_step_steps_and_toggles_between_calls_as_the_plain_model(checkpoint: str, schedule: str) -> None:
    """``train_step`` runs each micro-batch's backward in the call of its forward, so an
    optimizer step or a freeze comes between calls: the checks must not refuse the weights a
    step wrote before the next call, nor keep a flag of the last call."""
    reference, net = model(), model()
    pipe = pipeline(net, checkpoint, schedule=schedule)
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (reference, net)]
    x, y = batch(requires_grad=False), torch.randn(8, 2, dtype=torch.float64)
    for frozen in [True, False, True]:
        for m in (reference, net):
            m[2].requires_grad_(not frozen)
        nn.functional.mse_loss(reference(x), y).backward()
        pipe.train_step(x, target=y, loss_fn=nn.functional.mse_loss)
        assert_same_gradients(net, reference)
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    assert_close(net[2].weight, reference[2].weight, "weight after the steps")

