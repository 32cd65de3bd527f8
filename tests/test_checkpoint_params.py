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



# -- parameters the model writes in its own forward ----------------------------------------


class Pool(nn.Module):
    def forward(self, x: Tensor) -> Tensor:
        return x.mean(1)


class ClampedLinear(nn.Linear):
    """A max-norm style weight constraint applied in the forward, in place."""

    def forward(self, x: Tensor) -> Tensor:
        with torch.no_grad():
            self.weight.clamp_(-0.3, 0.3)
        return super().forward(x)


WRITERS = ["Embedding(max_norm)", "clamp in forward"]


def writer(kind: str) -> nn.Sequential:
    """A model whose first layer writes its weight in every forward (stage 0 of :func:`pipeline`):
    an Embedding's ``max_norm`` renormalises the rows it looks up, a clamp bounds every entry."""
    torch.manual_seed(0)
    first = [nn.Embedding(20, 4, max_norm=1.0), Pool()] if kind == WRITERS[0] else [ClampedLinear(4, 4), nn.Tanh()]
    return nn.Sequential(*first, nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2)).double()


def writer_batch(kind: str) -> tuple[Tensor, Tensor]:
    """Inputs (token ids, or features needing no gradient) and targets."""
    torch.manual_seed(1)
    x = torch.randint(0, 20, (8, 3)) if kind == WRITERS[0] else torch.randn(8, 4, dtype=torch.float64)
    return x, torch.randn(8, 2, dtype=torch.float64)


def in_micro_batches(net: nn.Module, x: Tensor) -> Tensor:
    """The plain model's output from one forward per micro-batch in order, as the pipeline's
    forwards run: each writes the weight as the pipeline's does (both writes are idempotent on
    the rows and entries they touch, so the recomputations write nothing new)."""
    return torch.cat([net(chunk) for chunk in x.chunk(CHUNKS)])


@pytest.mark.timeout(60)
@pytest.mark.parametrize("checkpoint", CHECKPOINTS)
@pytest.mark.parametrize("kind", WRITERS)
@pytest.mark.parametrize("how", ["backward", "train_step gpipe", "train_step 1f1b"])
def test_a_model_writing_its_weights_in_its_forward_trains_as_the_plain_model(checkpoint: str, kind: str,
                                                                              how: str) -> None:
    """The stage's own forwards and recomputations write the weight between a micro-batch's
    forward and its recomputation, as the plain model's forwards do: not the caller's
    ``optimizer.step()``, so nothing to refuse, and the gradients and weights are the plain
    model's over several steps."""
    reference, net = writer(kind), writer(kind)
    pipe = pipeline(net, checkpoint, schedule=how.split()[-1] if how != "backward" else "gpipe")
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.5) for m in (reference, net)]
    x, y = writer_batch(kind)
    for _ in range(3):
        nn.functional.mse_loss(in_micro_batches(reference, x), y).backward()
        if how == "backward":
            nn.functional.mse_loss(pipe(x), y).backward()
        else:
            pipe.train_step(x, target=y, loss_fn=nn.functional.mse_loss)
        assert_same_gradients(net, reference)
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    for (name, actual), expected in zip(net.named_parameters(), reference.parameters()):
        assert_close(actual, expected, f"{name} after the steps")


@pytest.mark.timeout(60)
@pytest.mark.parametrize("checkpoint", CHECKPOINTS)
@pytest.mark.parametrize("kind", WRITERS)
def test_the_callers_write_is_still_refused_where_the_forward_writes_too(checkpoint: str, kind: str) -> None:
    """Between the forwards and the backward the stage's own writes (one per forward) and the
    caller's add up in the weight's version counter: the caller's alone are refused."""
    reference, net = writer(kind), writer(kind)
    pipe = pipeline(net, checkpoint)
    x, y = writer_batch(kind)
    outputs = [in_micro_batches(reference, x), pipe(x)]
    for m in (reference, net):
        with torch.no_grad():
            m[0].weight.mul_(0.5)
    nn.functional.mse_loss(outputs[0], y).backward()  # the plain model saved no weight it wrote
    if checkpoint == "never":
        nn.functional.mse_loss(outputs[1], y).backward()
        assert_same_gradients(net, reference)
    else:
        with pytest.raises(RuntimeError, match=rf"{MODIFIED}: the parameter '0.weight' of stage 0 .* 1 time"):
            nn.functional.mse_loss(outputs[1], y).backward()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("checkpoint", ["except_last", "always"])
@pytest.mark.parametrize("how", ["backward", "train_step 1f1b"])
def test_a_weight_two_stages_share_and_one_writes_in_its_forward_is_refused_by_the_other(checkpoint: str,
                                                                                       how: str) -> None:
    """A stage counts its own writes only: another stage's forward writing a weight it shares
    (one clamped Linear at positions 0 and 2) changes what its recomputation would read, as a
    caller's write would, and the plain model run in micro-batches raises autograd's error (the
    second position saved the weight the next micro-batch's first position writes); so does a
    non-checkpointed stage.  Refused whatever the two threads' timing, over three steps."""
    torch.manual_seed(0)
    shared = ClampedLinear(4, 4)
    net = nn.Sequential(shared, nn.Tanh(), shared, nn.Tanh(), nn.Linear(4, 2)).double()
    pipe = pipeline(net, checkpoint, schedule=how.split()[-1] if how != "backward" else "gpipe")
    x, y = writer_batch("clamp in forward")
    with pytest.raises(RuntimeError, match=MODIFIED):
        for _ in range(3):
            if how == "backward":
                nn.functional.mse_loss(pipe(x), y).backward()
            else:
                pipe.train_step(x, target=y, loss_fn=nn.functional.mse_loss)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("checkpoint", ["except_last", "always"])
@pytest.mark.parametrize("kind", WRITERS)
def test_replicas_sharing_a_model_that_writes_its_weights_train_as_the_plain_model(checkpoint: str, kind: str) -> None:
    """Each replica's forwards write the weights the other runs: not refused as the caller's writes."""
    reference, net = writer(kind), writer(kind)
    pipe = pipeline(net, checkpoint, 2)
    assert pipe._copies is None  # CPU replicas share the modules
    x, y = writer_batch(kind)
    nn.functional.mse_loss(in_micro_batches(reference, x), y).backward()
    nn.functional.mse_loss(pipe(x), y).backward()
    assert_same_gradients(pipe, reference)


class RunningCenter(nn.Module):
    """Subtracts a running mean of its inputs that it updates in every forward, kept in a frozen
    ``nn.Parameter`` or in a buffer: an update that moves the value each time it runs."""

    def __init__(self, as_buffer: bool) -> None:
        super().__init__()
        if as_buffer:
            self.register_buffer("center", torch.zeros(8, dtype=torch.float64))
        else:
            self.center = nn.Parameter(torch.zeros(8, dtype=torch.float64), requires_grad=False)

    def forward(self, x: Tensor) -> Tensor:
        with torch.no_grad():
            self.center.mul_(0.5).add_(x.mean(0), alpha=0.5)
        return x - self.center


def centering(as_buffer: bool) -> nn.Sequential:
    """Stage 1 of :func:`pipeline` (layers 2-4) starts with the running center."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), RunningCenter(as_buffer), nn.Tanh(), nn.Linear(8, 2)).double()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("checkpoint", CHECKPOINTS)
@pytest.mark.parametrize("kept_in", ["parameter", "buffer"])
def test_state_a_forward_moves_each_time_is_replayed_in_a_buffer_and_refused_in_a_parameter(checkpoint: str,
                                                                                             kept_in: str) -> None:
    """A recomputation would apply such an update twice and compute from the value the forward
    left, not the one it read (0.04 off in the output, 0.7 in the gradients).  A buffer is kept
    and replayed as the forward found it, so the pipeline trains as the plain model; a parameter
    is not, and the recomputation that moves it is refused, the value put back as the plain
    model's forwards left it."""
    reference, net = centering(kept_in == "buffer"), centering(kept_in == "buffer")
    pipe = pipeline(net, checkpoint)
    x = batch()
    outputs = [in_micro_batches(reference, x), pipe(x.detach().requires_grad_())]
    outputs[0].pow(2).sum().backward()
    if checkpoint != "never" and kept_in == "parameter":
        with pytest.raises(RuntimeError, match=r"stage 1 .*, checkpointed micro-batch \d, wrote into parameter\(s\) "
                                               r"'2.center' .*register_buffer"):
            outputs[1].pow(2).sum().backward()
    else:
        outputs[1].pow(2).sum().backward()
        assert_close(outputs[1], outputs[0], "output")
        assert_same_gradients(net, reference)
    assert_close(net[2].center, reference[2].center, "the running center")
