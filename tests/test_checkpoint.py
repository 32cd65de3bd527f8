"""Checkpointing: the recomputation flag, random draws and buffers replayed exactly."""
from __future__ import annotations

import copy

import pytest
import torch
from torch import Tensor, nn
from torch.nn.utils import parametrizations, spectral_norm

import autopipe
from autopipe.runtime.checkpoint import RandomGuard
from helpers import assert_step_matches, assert_training_matches
from models import Regain


class Record(nn.Module):
    """Records ``is_recomputing()`` at each call."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[bool] = []

    def forward(self, x: Tensor) -> Tensor:
        self.seen.append(autopipe.is_recomputing())
        return x


@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    "checkpoint,expected",
    [
        ("never", [False] * 3),
        ("except_last", [False] * 3 + [True] * 2),   # micro-batches 1 and 0 recomputed
        ("always", [False] * 3 + [True] * 3),
    ],
)
def test_is_recomputing_only_during_recomputation(checkpoint: str, expected: list[bool]) -> None:
    record = Record()
    model = nn.Sequential(nn.Linear(3, 3), record, nn.Linear(3, 3))
    pipe = autopipe.Pipeline(model, balance=[1, 2], devices=["cpu", "cpu"], chunks=3, checkpoint=checkpoint)
    pipe(torch.randn(6, 3)).sum().backward()
    assert record.seen == expected
    assert not autopipe.is_recomputing()


@pytest.mark.timeout(30)
def test_stages_without_random_draws_do_not_lock() -> None:
    model = nn.Sequential(nn.Linear(3, 3), nn.Dropout(0.5), nn.Linear(3, 3), nn.Tanh())
    pipe = autopipe.Pipeline(model, balance=[2, 2], devices=["cpu", "cpu"], chunks=2, checkpoint="always")
    pipe(torch.randn(4, 3)).sum().backward()
    assert [stage.random.draws for stage in pipe.stages] == [True, False]


def test_replay_repeats_the_draws_then_continues_the_stream() -> None:
    guard = RandomGuard(torch.device("cpu"))
    torch.manual_seed(1)
    with guard.forward() as states:
        first = torch.rand(4)
    second = torch.rand(4)
    with guard.replay(states):
        again = torch.rand(4)
        assert autopipe.is_recomputing()
    after = torch.rand(4)
    torch.manual_seed(1)
    expected = [torch.rand(4) for _ in range(3)]
    assert torch.equal(again, first) and torch.equal(first, expected[0])
    assert torch.equal(second, expected[1]) and torch.equal(after, expected[2])
    assert guard.draws is True


class Gain(nn.Module):
    """Grows its gain at each call, then multiplies by it: autograd saves the buffer itself."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("gain", torch.ones(()))

    def forward(self, x: Tensor) -> Tensor:
        self.gain.mul_(1.5)
        return x * self.gain


class Count(nn.Module):
    """Counts the samples it has seen, as a plain module would: without asking is_recomputing()."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("seen", torch.zeros((), dtype=torch.long))

    def forward(self, x: Tensor) -> Tensor:
        self.seen += len(x)
        return x


@pytest.mark.timeout(60)
@pytest.mark.parametrize("checkpoint", ["always", "except_last"])
def test_recomputation_sees_and_leaves_buffers_as_its_forward(checkpoint: str) -> None:
    """Spectral norm updates its power-iteration vectors (buffers) at every forward and divides
    the weight by the norm they give: a recomputation must use the vectors its forward used,
    which later forwards have updated since, and must not update them, or the count, again; the
    backward must see the gain its recomputation saved.  Two training steps equal the plain
    model's, run micro-batch by micro-batch (outputs, every gradient, every buffer)."""
    model = nn.Sequential(spectral_norm(nn.Linear(4, 8)), Count(), nn.Tanh(), Gain(),
                          parametrizations.spectral_norm(nn.Linear(8, 3))).double()
    reference = copy.deepcopy(model)
    pipe = autopipe.Pipeline(model, balance=[2, 3], devices=["cpu", "cpu"], chunks=3, checkpoint=checkpoint)
    inputs = [torch.randn(6, 4, dtype=torch.double) for _ in range(2)]
    assert_training_matches(pipe, model, reference, inputs, chunks=3)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("checkpoint", ["always", "except_last"])
def test_recomputation_replays_a_buffer_its_forward_assigned_anew(checkpoint: str, schedule: str) -> None:
    """A forward that assigns its buffer a new tensor (``self.gain = self.gain * 1.5``) leaves the
    module holding another tensor than the one the stage found: the recomputation must still read
    the gain its forward read and not grow it again (it once read the latest gain and grew it
    once more per checkpointed micro-batch: gradients off by 50-300%)."""
    model = nn.Sequential(nn.Linear(4, 8), Regain(), nn.Tanh(), nn.Linear(8, 3)).double()
    reference = copy.deepcopy(model)
    pipe = autopipe.Pipeline(model, balance=[2, 2], devices=["cpu", "cpu"], chunks=3, checkpoint=checkpoint,
                             schedule=schedule)
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, reference)]
    for step in range(2):
        for optimizer in optimizers:
            optimizer.zero_grad(set_to_none=True)
        x, y = torch.randn(6, 4, dtype=torch.double), torch.randn(6, 3, dtype=torch.double)
        pipe.train_step(x, target=y, loss_fn=nn.functional.mse_loss)
        for xs, ys in zip(x.split(2), y.split(2)):
            (nn.functional.mse_loss(reference(xs), ys) / 3).backward()
        for (name, p), q in zip(model.named_parameters(), reference.parameters()):
            torch.testing.assert_close(p.grad, q.grad, msg=f"step {step} {name}.grad")
        torch.testing.assert_close(pipe.state_dict()["1.gain"], reference[1].gain, msg=f"step {step} gain")
        for optimizer in optimizers:
            optimizer.step()


def two_tanh_layers() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 3)).double()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("chunks", [1, 3])
def test_a_spectral_norm_added_after_building_is_replayed(chunks: int) -> None:
    """A parametrization added to a stage's layer after the pipeline was built brings buffers
    (spectral norm's power-iteration vectors) that the stage must keep and replay like its
    others: it once read its buffers when built, so the recomputation advanced ``_u`` again and
    differentiated another weight than the forward used.  Two steps equal the plain model's,
    run micro-batch by micro-batch (outputs, gradients, the vectors)."""
    model, plain = two_tanh_layers(), two_tanh_layers()
    pipe = autopipe.Pipeline(model, balance=[2, 3], devices=["cpu", "cpu"], chunks=chunks, checkpoint="always")
    for net in (model, plain):
        torch.manual_seed(5)
        parametrizations.spectral_norm(net[2])
    optimizers = [torch.optim.SGD(net.parameters(), lr=0.1) for net in (pipe, plain)]
    for step in range(2):
        x, g = torch.randn(6, 4, dtype=torch.double), torch.randn(6, 3, dtype=torch.double)
        out = pipe(x)
        (out * g).sum().backward()
        expected = []
        for xs, gs in zip(x.tensor_split(chunks), g.tensor_split(chunks)):
            expected.append(plain(xs))
            (expected[-1] * gs).sum().backward()
        torch.testing.assert_close(out, torch.cat(expected), msg=f"step {step} output")
        for (name, p), q in zip(plain.named_parameters(), pipe.parameters()):
            torch.testing.assert_close(q.grad, p.grad, msg=f"step {step} {name}.grad")
        torch.testing.assert_close(pipe.state_dict(), plain.state_dict(), msg=f"step {step} state")
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad()


@pytest.mark.timeout(30)
def test_a_module_added_between_a_forward_and_its_backward_is_refused() -> None:
    """A checkpointed micro-batch recomputes on the modules and buffers its forward ran with."""
    model = two_tanh_layers()
    pipe = autopipe.Pipeline(model, balance=[2, 3], devices=["cpu", "cpu"], chunks=2, checkpoint="always")
    out = pipe(torch.randn(4, 4, dtype=torch.double))
    parametrizations.spectral_norm(model[2])
    with pytest.raises(RuntimeError, match="added or removed between this step's forward and its backward"):
        out.sum().backward()


@pytest.mark.timeout(30)
@pytest.mark.parametrize("checkpoint", ["always", "except_last"])
@pytest.mark.parametrize("written", ["all", "another micro-batch's rows"])
def test_an_input_written_between_a_forward_and_its_backward_is_refused(checkpoint: str, written: str) -> None:
    """A checkpointed micro-batch recomputes from its inputs, which are the caller's batch: the
    plain model (and ``torch.utils.checkpoint``) refuses a write into it before the backward,
    where the pipeline gave the gradients of the written batch.  Rows of one micro-batch are a
    view of the batch, so a write into any of its rows counts, as in the plain model."""
    model = two_tanh_layers()
    reference = copy.deepcopy(model)
    pipe = autopipe.Pipeline(model, balance=[2, 3], devices=["cpu", "cpu"], chunks=2, checkpoint=checkpoint)
    x = torch.randn(4, 4, dtype=torch.double)
    for m in (reference, pipe):
        out = m(x)
        with torch.no_grad():
            (x if written == "all" else x[2:]).add_(1.0)
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            out.sum().backward()
    for m in (reference, pipe):
        m.zero_grad(set_to_none=True)  # what both backwards added before they failed
    assert_step_matches(pipe, reference, x, chunks=2)
