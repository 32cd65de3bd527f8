"""Replicas of a pipeline in one process: outputs, every gradient and the optimizer's steps
equal the plain model's on the whole batch; batch norm statistics are the whole batch's."""
from __future__ import annotations

import copy

import pytest
import torch
from models import UNet
from helpers import assert_close, assert_step_matches, reference_step
from torch import Tensor, nn

import autopipe
import autopipe.runtime.pipeline


def mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 16),
                         nn.GELU(), nn.Linear(16, 4))


def assert_replicas_transparent(model: nn.Module, x: Tensor, balance: list[int], replicas: int, chunks: int,
                                checkpoint: str, steps: int = 1) -> autopipe.Pipeline:
    """``steps`` SGD steps of the pipeline and of the plain model: same outputs, gradients and
    parameters after each."""
    reference = copy.deepcopy(model)
    pipe = autopipe.Pipeline(model, balance=balance, devices=["cpu"] * (len(balance) * replicas),
                             chunks=chunks, checkpoint=checkpoint, replicas=replicas)
    assert len(list(pipe.parameters())) == len(list(reference.parameters()))
    ours = torch.optim.SGD(pipe.parameters(), lr=0.1, momentum=0.9)
    theirs = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    expected_params = dict(reference.named_parameters())
    for step in range(steps):
        assert_step_matches(pipe, reference, x.detach().clone().requires_grad_(True), chunks, replicas,
                            f"step {step} ")
        ours.step(), theirs.step(), ours.zero_grad(), theirs.zero_grad()
        for name, param in pipe.named_parameters():
            assert_close(param, expected_params[name], f"step {step} {name} after the update")
    return pipe


@pytest.mark.parametrize("checkpoint", ["never", "except_last", "always"])
def test_hybrid_two_replicas_of_two_stages_on_four_devices(checkpoint: str) -> None:
    pipe = assert_replicas_transparent(mlp(), torch.randn(14, 8), [3, 4], replicas=2, chunks=3,
                                       checkpoint=checkpoint, steps=2)
    assert [str(s.device) for e in pipe._engines for s in e.stages] == ["cpu"] * 4


def test_pure_data_parallel_two_replicas() -> None:
    assert_replicas_transparent(mlp(), torch.randn(9, 8), [7], replicas=2, chunks=2, checkpoint="never", steps=2)


@pytest.mark.parametrize("checkpoint", ["never", "always"])
def test_skips_and_deferred_batch_norm_in_every_replica(checkpoint: str) -> None:
    """A U-Net (skips across stages, batch norms) as 2 replicas x 2 stages: batch norm trains
    per micro-batch, so outputs and gradients are the plain model's per micro-batch."""
    assert_unet_replicas_transparent(checkpoint)


def assert_unet_replicas_transparent(checkpoint: str = "except_last") -> None:
    """A U-Net as 2 replicas x 2 stages of 2 micro-batches: outputs and gradients are the plain
    model's, micro-batch by micro-batch."""
    torch.manual_seed(1)
    model = UNet()
    layers = autopipe.layer_chain(model)
    x = torch.randn(8, 3, 8, 8)
    reference = copy.deepcopy(model)
    pipe = autopipe.Pipeline(layers, balance=[4, len(layers) - 4], devices=["cpu"] * 4, chunks=2,
                             checkpoint=checkpoint, replicas=2)
    assert_step_matches(pipe, reference, x, 2, 2)


def test_batch_norm_statistics_are_the_whole_batch() -> None:
    """Replicas defer batch norm: one update of the running statistics with the whole batch's
    mean and unbiased variance, as nn.BatchNorm on the whole batch.  Repeated: the replicas'
    checkpointed backwards once raced to put the statistics back as their forwards found them,
    and about 2 runs in 5 ended with the statistics never updated."""
    torch.manual_seed(2)
    x = torch.randn(13, 6) * 3 + 1  # shares of 7 and 6, micro-batches of 2 or 3
    for attempt in range(10):
        model = nn.Sequential(nn.BatchNorm1d(6), nn.Linear(6, 3))
        reference = copy.deepcopy(model)
        pipe = autopipe.Pipeline(model, balance=[1, 1], devices=["cpu"] * 4, chunks=3, replicas=2)
        pipe(x).sum().backward()
        reference(x)
        state = reference.state_dict()
        for name, value in pipe.state_dict().items():
            assert_close(value.float(), state[name].float(), f"run {attempt} {name}")


#: (tag, scale, recomputing) per forward of :class:`Counted`, whichever replica's copy ran it
READ: list[tuple[float, float, bool]] = []


class Counted(nn.Module):
    """Scales by a counter buffer, which each forward then increments (as a spectral norm's
    vectors, read and updated by every forward); logs in :data:`READ` the scale each
    micro-batch (tagged by its first input) read, in its forward and in its recomputation."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("scale", torch.ones(1))
        self.weight = nn.Parameter(torch.ones(1))

    def forward(self, x: Tensor) -> Tensor:
        READ.append((x[0, 0].item(), self.scale.item(), autopipe.is_recomputing()))
        y = x * self.weight * self.scale.clone()
        with torch.no_grad():
            self.scale.add_(1)
        return y


class Recounted(Counted):
    """:class:`Counted`, counting by assigning the buffer a new tensor rather than in place."""

    def forward(self, x: Tensor) -> Tensor:
        READ.append((x[0, 0].item(), self.scale.item(), autopipe.is_recomputing()))
        y = x * self.weight * self.scale
        self.scale = self.scale.detach() + 1
        return y


@pytest.mark.parametrize("counter", [Counted, Recounted])
@pytest.mark.parametrize("sharing", ["shared", "copies"])
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_replicas_recompute_on_the_buffers_their_own_forward_read(monkeypatch: pytest.MonkeyPatch, schedule: str,
                                                                   sharing: str, counter: type[Counted]) -> None:
    """Each micro-batch recomputes on the counter its forward read, whether the counter is
    written in place or assigned anew, though the other replica recomputes and (under 1F1B)
    runs forwards at once.  Replicas on CPU share the counter, and its stage runs one replica at
    a time in a call that checkpoints: unlocked, one replica's recomputation put its older value
    back while the other read it (some other micro-batch's scale in 15-18 runs of 20: timing,
    so repeated); a counter assigned anew was replayed into the tensor it no longer held.  On
    copies each replica counts its own, from the first's counter at the start of the call."""
    if sharing == "copies":
        monkeypatch.setattr(autopipe.runtime.pipeline, "shares_parameters", lambda groups: False)
    x = torch.arange(16.0).unsqueeze(1).repeat(1, 3)  # micro-batches of 2 rows, tagged by the first
    for attempt in range(6):
        model = nn.Sequential(counter(), nn.Linear(3, 3))
        pipe = autopipe.Pipeline(model, balance=[1, 1], devices=["cpu"] * 4, chunks=4, replicas=2,
                                 checkpoint="always", schedule=schedule)
        first = 1.0
        for step in range(2):
            READ.clear()
            pipe.train_step(x, target=torch.zeros(16, 3), loss_fn=nn.functional.mse_loss)
            forwards = {tag: scale for tag, scale, again in READ if not again}
            recomputed = {tag: scale for tag, scale, again in READ if again}
            assert len(forwards) == 8 and recomputed == forwards, f"run {attempt} step {step}"
            counts = range(8) if sharing == "shared" else [c for c in range(4) for _ in range(2)]
            assert sorted(forwards.values()) == [first + c for c in counts], f"run {attempt} step {step}"
            first += 8 if sharing == "shared" else 4
            assert pipe.state_dict()["0.scale"].item() == first  # every forward counted once


class Masked(nn.Linear):
    """A linear layer under a constant mask buffer (as a model's position ids or causal mask)."""

    def __init__(self, size: int) -> None:
        super().__init__(size, size)
        self.register_buffer("mask", torch.rand(size, size) > 0.3)

    def forward(self, x: Tensor) -> Tensor:
        return nn.functional.linear(x, self.weight * self.mask, self.bias)


@pytest.mark.parametrize("checkpoint", ["never", "always"])
def test_replicas_with_constant_buffers_train_as_the_model(checkpoint: str) -> None:
    """Replicas sharing layers with buffers besides batch norm's: two steps give the plain
    model's outputs, gradients and parameters, checkpointed or not."""
    torch.manual_seed(3)
    model = nn.Sequential(Masked(6), nn.Tanh(), Masked(6), nn.Tanh(), nn.BatchNorm1d(6), Masked(6))
    assert_replicas_transparent(model, torch.randn(10, 6), [2, 4], replicas=2, chunks=2, checkpoint=checkpoint,
                                steps=2)


def test_what_the_caller_does_to_the_model_reaches_every_replica() -> None:
    """On CPU the replicas run the model's own modules: ``model.eval()`` after wrapping (not
    ``pipe.eval()``) and a hook registered then reach the whole batch, as on the plain model."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.5), Masked(4), nn.Linear(4, 2))
    pipe = autopipe.Pipeline(model, balance=[2, 2], devices=["cpu"] * 4, chunks=2, replicas=2)
    model.eval()
    seen: list[int] = []
    model[2].register_forward_hook(lambda module, args, output: seen.append(len(output)))
    x = torch.randn(8, 4)
    with torch.no_grad():
        assert torch.equal(pipe(x), model(x))
    assert sum(seen) == 16  # 8 rows through the replicas, 8 through the plain model


def test_eval_and_no_grad_join_the_replicas() -> None:
    model = mlp()
    reference = copy.deepcopy(model)
    pipe = autopipe.Pipeline(model, balance=[3, 4], devices=["cpu"] * 4, chunks=2, replicas=2).eval()
    x = torch.randn(10, 8)
    with torch.no_grad():
        assert_close(pipe(x), reference(x), "no-grad output")


def test_planned_replicas_run_from_the_plan(tmp_path) -> None:
    model = mlp()
    reference = copy.deepcopy(model)
    x = torch.randn(16, 8)
    pipe = autopipe.partition(model, x, devices=["cpu", "cpu"], replicas=2)
    assert pipe.plan.replicas == 2 and pipe.replicas == 2
    loaded = autopipe.Plan.load(pipe.plan.save(tmp_path / "plan.json"))
    assert loaded.replicas == 2
    assert_step_matches(pipe, reference, x, pipe.chunks, 2)


def test_bad_replica_counts_are_refused() -> None:
    with pytest.raises(ValueError, match=r"4 devices for 2 stages in each of 3 replicas; give one device per stage"):
        autopipe.Pipeline(mlp(), balance=[3, 4], devices=["cpu"] * 4, replicas=3)
    with pytest.raises(ValueError, match="replicas must be a positive integer"):
        autopipe.Pipeline(mlp(), balance=[7], replicas=0)


def test_a_failing_replica_is_reported_and_the_pipeline_lives_on() -> None:
    class Picky(nn.Module):
        def forward(self, x: Tensor) -> Tensor:
            if x.shape[0] == 1:
                raise KeyError("one sample")
            return x

    pipe = autopipe.Pipeline(nn.Sequential(nn.Linear(4, 4), Picky()), balance=[2], devices=["cpu"] * 2,
                             chunks=1, replicas=2)
    with pytest.raises(KeyError) as error:  # the layer's own exception, with a note naming the stage
        pipe(torch.randn(3, 4))  # shares of 2 and 1 samples: the second replica fails
    assert any("stage 0" in note for note in error.value.__notes__)
    assert pipe(torch.randn(4, 4)).shape == (4, 4)


@pytest.fixture
def copies(monkeypatch: pytest.MonkeyPatch) -> None:
    """Replicas on copies of the modules (what CUDA devices get), run on CPU devices."""
    monkeypatch.setattr(autopipe.runtime.pipeline, "shares_parameters", lambda groups: False)


def test_copied_replicas_give_functional_call_tensors_their_whole_gradient(copies: None) -> None:
    """The copies' gradients go to the tensors ``functional_call`` put in place for the forward,
    not to those it puts back before the backward; a tensor computed from others is refused, as
    the copies could not pass its gradient on, and the pipeline runs on.  (Checkpointed, the
    backward is refused: its recomputation would run on the tensors put back.)"""
    model = mlp()
    plain = copy.deepcopy(model)
    pipe = autopipe.Pipeline(model, balance=[3, 4], devices=["cpu"] * 4, replicas=2, chunks=2, checkpoint="never")
    x = torch.randn(10, 8)
    given = {name: p.detach().clone().requires_grad_() for name, p in plain.named_parameters()}
    expected = {name: p.detach().clone().requires_grad_() for name, p in plain.named_parameters()}
    torch.func.functional_call(pipe, given, (x,)).pow(2).sum().backward()
    torch.func.functional_call(plain, expected, (x,)).pow(2).sum().backward()
    for name in given:
        assert_close(given[name].grad, expected[name].grad)
    assert all(p.grad is None for p in pipe.parameters())
    computed = {name: p * 1.5 for name, p in given.items()}
    with pytest.raises(RuntimeError, match=r"0.weight is computed from other tensors .* replicas=1"):
        torch.func.functional_call(pipe, computed, (x,))
    assert_close(pipe(x), plain(x))


@pytest.mark.parametrize("checkpoint", ["never", "except_last"])
def test_copied_replicas_reduce_into_one_parameter_set(copies: None, checkpoint: str) -> None:
    pipe = assert_replicas_transparent(mlp(), torch.randn(14, 8), [3, 4], replicas=2, chunks=3,
                                       checkpoint=checkpoint, steps=2)
    assert pipe._copies is not None
    first = {id(p) for s in pipe._engines[0].stages for m in s.modules for p in m.parameters()}
    second = [p for s in pipe._engines[1].stages for m in s.modules for p in m.parameters()]
    assert first == {id(p) for p in pipe.parameters()} and not first & {id(p) for p in second}
    assert all(p.grad is None for p in second)  # reduced into the first replica's


def test_copied_replicas_with_skips(copies: None) -> None:
    assert_unet_replicas_transparent()


def normed() -> nn.Sequential:
    """A spectral norm run once: its module holds the ``weight`` that forward computed, a tensor
    of the autograd graph, which ``copy.deepcopy`` refuses.  In eval mode, where its power
    iteration stands still, so that each copy computes the plain model's weight."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.utils.spectral_norm(nn.Linear(8, 16)), nn.Tanh(), nn.Linear(16, 4))
    model(torch.randn(2, 8))
    return model.eval()


@pytest.mark.parametrize("checkpoint", ["never", "always"])
def test_copied_replicas_of_a_norm_a_forward_has_run(copies: None, checkpoint: str) -> None:
    pipe = autopipe.Pipeline(normed(), balance=[1, 2], devices=["cpu"] * 4, chunks=2, checkpoint=checkpoint,
                             replicas=2)
    assert pipe._copies is not None
    assert_step_matches(pipe, normed(), torch.randn(8, 8), 2, 2)


@pytest.mark.parametrize("checkpoint", ["never", "always"])
def test_copied_replicas_follow_freezing_and_eval_after_building(copies: None, checkpoint: str) -> None:
    """Replicas on copies: a parameter frozen after building (on the model or through the
    pipeline) and a dropout put in eval mode reach the copies, as they reach shared modules; the
    copies kept training (dropout on) and gave the frozen parameter a gradient."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Dropout(0.5), nn.Linear(16, 4)).double()
    reference = copy.deepcopy(model)
    pipe = autopipe.Pipeline(model, balance=[2, 2], devices=["cpu"] * 4, chunks=2, checkpoint=checkpoint,
                             replicas=2)
    for module in (model, reference):
        module[2].eval()
        module[0].weight.requires_grad_(False)
    pipe[3].bias.requires_grad_(False)
    reference[3].bias.requires_grad_(False)
    for step in range(2):  # the second unfreezes the weight
        x = torch.randn(6, 8, dtype=torch.float64, requires_grad=True)
        x_ref = x.detach().clone().requires_grad_()
        out = pipe(x)
        g = torch.randn_like(out)
        expected = reference_step(reference, x_ref, g, 2, 2)
        (out * g).sum().backward()
        assert_close(out, expected, f"step {step} output")
        assert_close(x.grad, x_ref.grad, f"step {step} input gradient")
        expected_params = dict(reference.named_parameters())
        for name, param in pipe.named_parameters():
            if expected_params[name].grad is None:
                assert param.grad is None, f"step {step}: {name} is frozen but has a gradient"
            else:
                assert_close(param.grad, expected_params[name].grad, f"step {step} {name}.grad")
        for module in (model, reference):
            module[0].weight.requires_grad_(True)
            module.zero_grad()


@pytest.mark.cuda
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_cuda_replicas_equal_the_plain_model() -> None:
    model = mlp()
    reference = copy.deepcopy(model)
    x = torch.randn(12, 8)
    pipe = autopipe.Pipeline(model, balance=[7], devices=["cuda:0", "cuda:1"], chunks=2, replicas=2)
    out = pipe(x.cuda(0))
    g = torch.randn_like(out)
    expected = reference_step(reference, x, g.cpu(), 2, 2)
    (out * g).sum().backward()
    assert_close(out.cpu(), expected, "output")
    expected_params = dict(reference.named_parameters())
    for name, param in pipe.named_parameters():
        assert_close(param.grad.cpu(), expected_params[name].grad, f"{name}.grad")


def test_a_failed_backward_leaves_no_gradient_in_the_copies(copies: None) -> None:
    """Replicas on copies: a backward that fails part way leaves gradients in some copies;
    after ``zero_grad`` the next step's gradients are the plain model's, not those plus the
    leftovers."""
    class Boom(Exception):
        pass

    class FailBackward(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x: Tensor) -> Tensor:  # type: ignore[override]
            return x.clone()

        @staticmethod
        def backward(ctx, grad: Tensor) -> Tensor:  # type: ignore[override]
            raise Boom("backward failed")

    class MaybeFail(nn.Module):
        armed = False

        def forward(self, x: Tensor) -> Tensor:
            return FailBackward.apply(x) if self.armed else x

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), MaybeFail(), nn.Linear(4, 4), nn.Linear(4, 2))
    reference = copy.deepcopy(model)
    pipe = autopipe.Pipeline(model, balance=[2, 2], devices=["cpu"] * 4, chunks=2, replicas=2)
    x = torch.randn(8, 4)
    model[1].armed = True
    with pytest.raises(Boom):  # the second stage of each replica finishes its backward, the first fails
        pipe(x).sum().backward()
    model[1].armed = False
    pipe.zero_grad(set_to_none=True)
    pipe(x).sum().backward()
    reference(x).sum().backward()
    expected = dict(reference.named_parameters())
    for name, param in pipe.named_parameters():
        assert_close(param.grad, expected[name].grad, f"{name}.grad")


class RecordingDropout(nn.Dropout):
    """Dropout that records the mask each forward drew, keyed by its input; with ``replay``, it
    applies the recorded mask instead (the plain model's reference run)."""

    def __init__(self, p: float) -> None:
        super().__init__(p)
        self.masks: dict[bytes, Tensor] = {}
        self.recomputed: dict[bytes, Tensor] = {}
        self.replay: dict[bytes, Tensor] | None = None

    def forward(self, x: Tensor) -> Tensor:
        key = x.detach().numpy().tobytes()
        if self.replay is not None:
            return x * self.replay[key]
        mask = nn.functional.dropout(torch.ones_like(x), self.p, True)
        (self.recomputed if autopipe.is_recomputing() else self.masks)[key] = mask
        return x * mask


def test_dropout_replays_when_only_one_replica_checkpoints() -> None:
    """3 samples on 2 replicas of 4 micro-batches with except_last: the first replica
    checkpoints a micro-batch, the second none.  The second's dropout still draws under the
    generator's lock, so the first's recomputation replays the mask its forward drew, and the
    gradients are the plain model's with the forward's masks (unlocked, about a third of the
    calls replayed another mask)."""
    for trial in range(30):
        torch.manual_seed(trial)
        model = nn.Sequential(nn.Linear(4, 8), RecordingDropout(0.5), nn.Linear(8, 8), RecordingDropout(0.5),
                              nn.Linear(8, 2)).double()
        reference = copy.deepcopy(model)
        pipe = autopipe.Pipeline(model, balance=[5], devices=["cpu", "cpu"], chunks=4, replicas=2,
                                 checkpoint="except_last")
        x = torch.randn(3, 4, dtype=torch.double)
        pipe(x).sum().backward()
        drops = [m for m in model if isinstance(m, RecordingDropout)]
        for drop in drops:
            assert drop.recomputed and all(torch.equal(drop.masks[k], mask) for k, mask in drop.recomputed.items())
        for drop, twin in zip(drops, [m for m in reference if isinstance(m, RecordingDropout)]):
            twin.replay = drop.masks
        for part in (x[:1], x[1:2], x[2:]):  # the micro-batches: shares of 2 and 1 samples
            reference(part).sum().backward()
        expected = dict(reference.named_parameters())
        for name, param in pipe.named_parameters():
            assert_close(param.grad, expected[name].grad, f"trial {trial} {name}.grad")
        pipe.close()


def test_copied_replicas_take_two_forwards_before_their_backwards(copies: None) -> None:
    """Refreshing the copies' weights for the second forward must not count as a write into
    the tensors the first forward saved: both backwards then run, and the gradients are the
    plain model's over both batches."""
    model = mlp()
    reference = copy.deepcopy(model)
    pipe = autopipe.Pipeline(model, balance=[3, 4], devices=["cpu"] * 4, chunks=2, replicas=2)
    first, second = torch.randn(8, 8), torch.randn(6, 8)
    (pipe(first).sum() + pipe(second).sum()).backward()
    (reference(first).sum() + reference(second).sum()).backward()
    expected = dict(reference.named_parameters())
    for name, param in pipe.named_parameters():
        assert_close(param.grad, expected[name].grad, f"{name}.grad")


def test_copies_gather_gradients_when_the_last_backward_under_way_ends() -> None:
    """Two calls' backward phases can run at once (two forwards, one loss): gathering the copies'
    gradients when the first ends would read and clear them while the second still adds to
    them.  They are gathered when the last ends, or dropped if one of them failed."""
    from autopipe.model import layer_chain
    from autopipe.runtime.replicas import Copies, copied_layers

    primary = layer_chain(nn.Sequential(nn.Linear(2, 2)))
    twin = copied_layers(primary)
    copies = Copies(primary, [twin])
    source, target = primary[0].module.weight, twin[0].module.weight
    for failed in (False, True):
        source.grad, target.grad = None, torch.ones(2, 2)
        copies.begin_backward(), copies.begin_backward()
        copies.end_backward(failed)
        assert source.grad is None and target.grad is not None  # the other phase still adds to it
        copies.end_backward(False)
        assert target.grad is None
        assert (source.grad is None) if failed else torch.equal(source.grad, torch.ones(2, 2))
