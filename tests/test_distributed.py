"""autopipe.distributed on torch.distributed.pipelining: 2- and 3-process gloo jobs on localhost.

Each job starts its processes once (starting costs seconds) and runs several checks; every rank
saves what it saw (stage gradients under the original names, error messages) and the test
compares that with the unpartitioned model run here, micro-batch by micro-batch, and with the
in-process runtime (``autopipe.Pipeline``).
"""
from __future__ import annotations

import collections
import dataclasses
import functools
import os
import sys
from pathlib import Path
from typing import Any, Callable

import pytest
import torch
from torch import Tensor, nn
from torch.nn.utils import parametrizations, spectral_norm

import autopipe
from autopipe.distributed.local import launch_local
from autopipe.errors import ChainError
from autopipe.model import layer_chain
from autopipe.model.skip import pop, skippable, stash
from distributed_models import MeanOverTime, batch, error_of, inplace_model, padded, plan_for, trim_model
from models import REFUSED, BranchesOnBatchParity, Regain, aliased

JOB_TIMEOUT_S = 100.0
CHUNKS = 4


# ---- models shared by the test and the worker processes (same seed, same weights) ----------

class Split(nn.Module):
    """Ends a stage with a tuple, which the engine unpacks into the next stage's arguments."""

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        return x[:, :8], x[:, 8:] * 2


class Join(nn.Module):
    def forward(self, pair: tuple[Tensor, Tensor]) -> Tensor:
        a, b = pair
        return a * b


class CatJoin(nn.Module):
    """Joins the pair by ``torch.cat``, whose backward gives slices: non-contiguous gradients."""

    def forward(self, pair: tuple[Tensor, Tensor]) -> Tensor:
        return torch.cat(pair, dim=1)


class Counting(nn.Module):
    """Returns a tensor with a count of its calls: a plain value that differs in every micro-batch,
    which the engine cannot send (it sends the form of the shape probe's value once)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def forward(self, x: Tensor) -> tuple[Tensor, int]:
        self.calls += 1
        return x, self.calls


Pair = collections.namedtuple("Pair", ["a", "b"])


@dataclasses.dataclass
class Halves:
    a: Tensor
    b: Any


#: The values a layer returns, by name, from two tensors: a namedtuple, a list, a dataclass holding a
#: dict inserted out of key order with plain items (None, a string), a tuple with plain items, a dict
#: with a 0-dim tensor (an auxiliary loss).
FORMS: dict[str, Callable[[Tensor, Tensor], Any]] = {
    "namedtuple": lambda a, b: Pair(a, b),
    "list": lambda a, b: [a, b],
    "nested": lambda a, b: Halves(a, {"tag": "x", "none": None, "b": b}),
    "plain": lambda a, b: (a, None, 3, b),
    "dict": lambda a, b: {"b": b, "a": a, "aux": (a * a).mean()},
}


def halves(value: Any) -> tuple[Tensor, Tensor, Tensor | float]:
    """The two tensors (and the auxiliary loss, 0 without one) out of a value of :data:`FORMS`, checking
    that it arrived as the layer returned it."""
    if isinstance(value, Pair):
        return value.a, value.b, 0.0
    if isinstance(value, list):
        return value[0], value[1], 0.0
    if isinstance(value, Halves):
        assert list(value.b) == ["tag", "none", "b"] and value.b["tag"] == "x" and value.b["none"] is None
        return value.a, value.b["b"], 0.0
    if isinstance(value, dict):
        return value["a"], value["b"], value["aux"]
    assert type(value) is tuple and value[1:3] == (None, 3), value
    return value[0], value[3], 0.0


class Make(nn.Module):
    """Returns its input's halves as a value of :data:`FORMS` (the stage's last layer)."""

    def __init__(self, form: str) -> None:
        super().__init__()
        self.form = form

    def forward(self, x: Tensor) -> Any:
        half = x.size(1) // 2
        return FORMS[self.form](x[:, :half], x[:, half:] * 2)


class Use(nn.Module):
    """Needs the value as :class:`Make` returned it (the next stage's first layer)."""

    def forward(self, value: Any) -> Tensor:
        a, b, _ = halves(value)
        return a * b - 0.5 * b


def sent_model(form: str) -> nn.Sequential:
    """Balance [2, 2]: the first stage ends with a ``form`` value, the second starts by reading it."""
    torch.manual_seed(2)
    return nn.Sequential(nn.Linear(8, 16), Make(form), Use(), nn.Linear(8, 4))


def output_model(form: str) -> nn.Sequential:
    """Balance [2, 2]: the last stage returns a ``form`` value, read by :func:`halves_loss`."""
    torch.manual_seed(10)
    return nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8), Make(form))


def halves_loss(output: Any, target: Tensor) -> Tensor:
    a, b, aux = halves(output)
    return nn.functional.mse_loss(a * b, target) + aux


class Holder:
    """Holds a tensor in an attribute, which no walk over values sees."""

    def __init__(self, tensor: Tensor) -> None:
        self.tensor = tensor


class Switched(nn.Module):
    """Returns what the worker sets: ``"ok"`` (a dict), or a value with no tensor the engine can
    send: ``"text"`` (a string), ``"hidden"`` (a :class:`Holder`)."""

    def __init__(self) -> None:
        super().__init__()
        self.form = "ok"

    def forward(self, x: Tensor) -> Any:
        return {"ok": lambda: FORMS["dict"](x[:, :4], x[:, 4:]), "text": lambda: "text",
                "hidden": lambda: Holder(x)}[self.form]()


@skippable(stash=["x"])
class StashX(nn.Module):
    def forward(self, x: Tensor) -> Any:
        yield stash("x", x)
        return x


@skippable(stash=["y"])
class StashY(nn.Module):
    def forward(self, x: Tensor) -> Any:
        yield stash("y", x * 3)
        return x


@skippable(pop=["x"])
class AddX(nn.Module):
    def forward(self, x: Tensor) -> Any:
        skip = yield pop("x")
        return x + skip


@skippable(pop=["y"])
class MulY(nn.Module):
    def forward(self, x: Tensor) -> Any:
        skip = yield pop("y")
        return x * skip


def tuple_model() -> nn.Sequential:
    """Balance [2, 2]: the first stage ends with a tuple that the second stage's Join unpacks."""
    torch.manual_seed(2)
    return nn.Sequential(nn.Linear(8, 16), Split(), Join(), nn.Linear(8, 4))


def cat_model() -> nn.Sequential:
    """Balance [2, 2]: the second stage starts with ``torch.cat`` of the pair it receives."""
    torch.manual_seed(2)
    return nn.Sequential(nn.Linear(8, 16), Split(), CatJoin(), nn.Linear(16, 4))


def batchnorm_model() -> nn.Sequential:
    """Balance [2, 2], trained with checkpointing: buffers must update once per micro-batch."""
    torch.manual_seed(3)
    return nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.BatchNorm1d(16), nn.Linear(16, 4))


class Counted(nn.Module):
    """Counts its forward runs, recomputations included (it saves its input for backward, so a
    recomputation, which stops once the saved tensors are back, always reaches it)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def forward(self, x: Tensor) -> Tensor:
        self.calls += 1
        return x * x


def counted_model() -> nn.Sequential:
    """Balance [2, 2]: one Counted per stage."""
    torch.manual_seed(6)
    return nn.Sequential(nn.Linear(8, 8), Counted(), Counted(), nn.Linear(8, 4))


def spectral_model() -> nn.Sequential:
    """Balance [2, 3], trained with checkpointing: each forward updates the spectral norms'
    vectors and assigns a new gain, so a recomputation must start from those its forward found."""
    torch.manual_seed(7)
    return nn.Sequential(spectral_norm(nn.Linear(8, 8)), nn.Tanh(), nn.Linear(8, 8), Regain(),
                         parametrizations.spectral_norm(nn.Linear(8, 4)))


class First(nn.Module):
    def forward(self, pair: tuple[Tensor, Any]) -> Tensor:
        return pair[0]


def counting_model() -> nn.Sequential:
    """Balance [2, 2]: the first stage ends with a :class:`Counting`."""
    torch.manual_seed(4)
    return nn.Sequential(nn.Linear(8, 8), Counting(), First(), nn.Linear(8, 4))


def switched_model() -> nn.Sequential:
    """Balance [2, 2]: the last stage returns what its :class:`Switched` is set to."""
    torch.manual_seed(10)
    return nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8), Switched())


def skip_model() -> nn.Sequential:
    """Balance [3, 3, 3]: 'x' goes from stage 0 to stage 2 (passed along by 1), 'y' from 1 to 2."""
    torch.manual_seed(5)
    return nn.Sequential(nn.Linear(8, 8), StashX(), nn.Linear(8, 8),
                         nn.Tanh(), nn.Linear(8, 8), StashY(),
                         MulY(), AddX(), nn.Linear(8, 4))


def sequence_model() -> nn.Sequential:
    """Balance [1, 2]: the first stage sends (micro-batch, time, features), whose length can change."""
    torch.manual_seed(8)
    return nn.Sequential(nn.Tanh(), MeanOverTime(), nn.Linear(4, 3)).double()


def sequences(length: int) -> tuple[Tensor, Tensor]:
    """A batch of 8 sequences of ``length`` steps and its targets, whose shape does not depend on it."""
    generator = torch.Generator().manual_seed(length)
    return (torch.randn(8, length, 4, generator=generator, dtype=torch.float64),
            torch.randn(8, 3, generator=generator, dtype=torch.float64))


class Embed(nn.Module):
    """Returns the ids beside their embedding: integers go to the next stage."""

    def __init__(self) -> None:
        super().__init__()
        self.embedding = nn.Embedding(50, 8)

    def forward(self, ids: Tensor) -> tuple[Tensor, Tensor]:
        return self.embedding(ids), ids


class EmbedAgain(nn.Module):
    """Embeds the ids the stage before sends, keeping each batch of them it reads in :attr:`seen`."""

    def __init__(self) -> None:
        super().__init__()
        self.embedding = nn.Embedding(50, 8)
        self.seen: list[Tensor] = []

    def forward(self, pair: tuple[Tensor, Tensor]) -> Tensor:
        hidden, ids = pair
        self.seen.append(ids.clone())
        return (hidden + self.embedding(ids)).mean(1)


def ids_model() -> nn.Sequential:
    """Balance [1, 2]: the second stage embeds the ids the first sends."""
    torch.manual_seed(12)
    return nn.Sequential(Embed(), EmbedAgain(), nn.Linear(8, 4))


def token_ids() -> tuple[Tensor, Tensor]:
    generator = torch.Generator().manual_seed(12)
    return torch.randint(0, 50, (8, 5), generator=generator), torch.randn(8, 4, generator=generator)


class Scores(nn.Module):
    """Passes the labels on beside its scores: integer targets go to the next stage."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 5)

    def forward(self, inputs: tuple[Tensor, Tensor]) -> tuple[Tensor, Tensor]:
        x, labels = inputs
        return self.linear(x), labels


class CrossEntropy(nn.Module):
    def forward(self, pair: tuple[Tensor, Tensor]) -> Tensor:
        return nn.functional.cross_entropy(*pair)


def loss_inside_model() -> nn.Sequential:
    """Balance [1, 1]: the model ends with its loss, on labels the first stage sends."""
    torch.manual_seed(13)
    return nn.Sequential(Scores(), CrossEntropy())


def labelled() -> tuple[Tensor, Tensor]:
    generator = torch.Generator().manual_seed(13)
    return torch.randn(8, 8, generator=generator), torch.randint(0, 5, (8,), generator=generator)


def model_loss(output: Tensor, target: Tensor) -> Tensor:
    """The loss the model computed (:func:`loss_inside_model`)."""
    return output


class Calls:
    """``loss_fn`` counting its calls."""

    def __init__(self, loss_fn: Callable[..., Tensor]) -> None:
        self.loss_fn, self.calls = loss_fn, 0

    def __call__(self, output: Tensor, target: Tensor) -> Tensor:
        self.calls += 1
        return self.loss_fn(output, target)


def classifier_model() -> nn.Sequential:
    torch.manual_seed(9)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 5)).double()


#: Class targets with padding (-100): in micro-batches of 2, the third is all padding.
PADDED = torch.tensor([0, 1, 2, -100, -100, -100, 4, 0])


def token_sum_per_position(output: Tensor, target: Tensor) -> Tensor:
    """The loss the docs give for padded targets: a sum over the real targets divided by every
    position, a count that does not depend on the targets."""
    return nn.functional.cross_entropy(output, target, ignore_index=-100, reduction="sum") / target.numel()


class SwitchedLoss:
    """mse_loss in the form the worker sets: ``"mean"`` (right), or a mistake: ``"none"`` (not a
    scalar), ``"float"`` (``.item()``), ``"detached"``."""

    def __init__(self) -> None:
        self.form = "mean"

    def __call__(self, output: Tensor, target: Tensor) -> Any:
        loss = nn.functional.mse_loss(output, target, reduction="none" if self.form == "none" else "mean")
        if self.form == "float":
            return loss.item()
        return loss.detach() if self.form == "detached" else loss


def reference(model: nn.Module, chunks: int, lr: float = 0.0,
              loss_fn: Callable[..., Tensor] = nn.functional.mse_loss,
              data: tuple[Tensor, Tensor] | None = None) -> dict[str, Tensor]:
    """Gradients of the plain model accumulated micro-batch by micro-batch (then an SGD step), of
    the parameters that train."""
    x, y = data or batch()
    for xi, yi in zip(x.chunk(chunks), y.chunk(chunks)):
        (loss_fn(model(xi), yi) / chunks).backward()
    torch.optim.SGD(model.parameters(), lr=lr).step()
    return {name: p.grad for name, p in model.named_parameters() if p.requires_grad}


def in_process(model: nn.Module, balance: list[int], chunks: int) -> dict[str, Tensor]:
    """Gradients from the in-process runtime, the engine a user switches from."""
    from autopipe import Pipeline

    pipe = Pipeline(model, balance=balance, devices=["cpu"] * len(balance), chunks=chunks, checkpoint="never")
    try:
        x, y = batch()
        nn.functional.mse_loss(pipe(x), y).backward()
        return {name: p.grad for name, p in pipe.named_parameters()}
    finally:
        pipe.close()


# ---- worker side ----------------------------------------------------------------------------

def _run(model: nn.Module, balance: list[int] | None, chunks: int | None, schedule: str | None,
         loss_fn: Callable[..., Tensor] = nn.functional.mse_loss, data: tuple[Tensor, Tensor] | None = None,
         **options: Any) -> dict[str, Any]:
    from autopipe.distributed import DistributedPipeline

    runner = DistributedPipeline(model, balance=balance, chunks=chunks, schedule=schedule, loss_fn=loss_fn, **options)
    x, y = data or batch()
    loss = runner.step(x, target=y)
    return {"grads": {n: p.grad.clone() for n, p in runner.named_parameters()},
            "loss": runner.broadcast_loss(loss), "runner": runner}


def _probe_writes() -> dict[str, Any]:
    """One step of the centering model without checkpointing: the engine's shape probe runs the
    running center's forward once more than the plain model does."""
    from autopipe.distributed import DistributedPipeline

    runner = DistributedPipeline(centering_model(), balance=[2, 3], chunks=1, checkpoint="never",
                                 loss_fn=nn.functional.mse_loss)
    x, y = batch()
    runner.step(x, target=y)
    return {"grads": {n: p.grad.clone() for n, p in runner.named_parameters() if p.requires_grad},
            "state": {n: t.clone() for n, t in runner.state_dict().items()}}


def _unfrozen_after_probe() -> dict[str, Any]:
    """The first stage frozen in the first step (its output then needs no gradient), unfrozen for
    the second; then a new pipeline on the unfrozen model."""
    from autopipe.distributed import DistributedPipeline

    model = inplace_model()
    model[:3].requires_grad_(False)
    runner = DistributedPipeline(model, balance=[3, 3], chunks=CHUNKS, loss_fn=nn.functional.mse_loss)
    x, y = batch()
    runner.step(x, target=y)
    model[0].requires_grad_(True)
    refused = error_of(lambda: runner.step(x, target=y))
    model.zero_grad(set_to_none=True)
    rebuilt = DistributedPipeline(model, balance=[3, 3], chunks=CHUNKS, loss_fn=nn.functional.mse_loss)
    rebuilt.step(x, target=y)
    return {"refused": refused,
            "rebuilt": {n: p.grad.clone() for n, p in rebuilt.named_parameters() if p.requires_grad}}


def _odd_batch_on_an_even_branch() -> str:
    """A batch of 7 where the capture's sample (8) took the even branch."""
    from autopipe.distributed import DistributedPipeline

    torch.manual_seed(0)
    layers = autopipe.chain(BranchesOnBatchParity("even", outputs=4), batch(8)[0])
    runner = DistributedPipeline(layers, balance=[1, len(layers) - 1], chunks=1, loss_fn=nn.functional.mse_loss)
    x, y = batch(7)
    return error_of(lambda: runner.step(x, target=y))


def first_inplace_model() -> nn.Sequential:
    """Balance [2, 2]: the first stage starts by writing into the caller's batch."""
    torch.manual_seed(4)
    return nn.Sequential(nn.LeakyReLU(0.1, inplace=True), nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))


class RunningCenter(nn.Module):
    """A running mean of its inputs kept in a frozen ``nn.Parameter``, updated in every forward."""

    def __init__(self) -> None:
        super().__init__()
        self.center = nn.Parameter(torch.zeros(8), requires_grad=False)

    def forward(self, x: Tensor) -> Tensor:
        with torch.no_grad():
            self.center.mul_(0.5).add_(x.mean(0), alpha=0.5)
        return x - self.center


def centering_model() -> nn.Sequential:
    """Balance [2, 3]: the second stage starts with the running center."""
    torch.manual_seed(8)
    return nn.Sequential(nn.Linear(8, 8), nn.Tanh(), RunningCenter(), nn.Tanh(), nn.Linear(8, 4))


class PairWrite(nn.Module):
    """Writes into the first of its pair, then reads the second: ``4x`` where both are ``x``."""

    def forward(self, pair: tuple[Tensor, Tensor]) -> Tensor:
        a, b = pair
        a.mul_(2.0)
        return a + b


def pair_model() -> nn.Sequential:
    torch.manual_seed(5)
    return nn.Sequential(PairWrite(), nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))


def _passed_twice() -> dict[str, Tensor]:
    """``step(x, x)``: refused on the first rank only (the other waited for the timeout)."""
    from autopipe.distributed import DistributedPipeline

    runner = DistributedPipeline(pair_model(), balance=[2, 2], chunks=CHUNKS, loss_fn=nn.functional.mse_loss)
    x, y = batch()
    runner.step(x, x, target=y)
    return {n: p.grad.clone() for n, p in runner.named_parameters()}


def _structure_refusals() -> dict[str, str]:
    """Hooks on the model itself, and a module replaced after building: the stages never ran them."""
    from autopipe.distributed import DistributedPipeline

    hooked = inplace_model()
    hooked.register_forward_hook(lambda module, args, out: out * 3)
    refusals = {"root_hook": error_of(lambda: DistributedPipeline(hooked, balance=[3, 3], chunks=CHUNKS,
                                                                  loss_fn=nn.functional.mse_loss))}
    model = inplace_model()
    runner = DistributedPipeline(model, balance=[3, 3], chunks=CHUNKS, loss_fn=nn.functional.mse_loss)
    model[5] = nn.Linear(16, 4)
    refusals["replaced"] = error_of(lambda: runner.step(batch()[0], target=batch()[1]))
    return refusals


def _job_two(out: Path) -> dict[str, Any]:
    from autopipe.distributed import DistributedPipeline

    result: dict[str, Any] = {}
    gpipe = _run(inplace_model(), [3, 3], CHUNKS, "gpipe")
    result["inplace_gpipe"] = gpipe["grads"]
    result["inplace_checkpoint"] = _run(inplace_model(), [3, 3], CHUNKS, "gpipe", checkpoint="except_last")["grads"]
    result["inplace_loss"] = gpipe["loss"]
    plan = plan_for(inplace_model(), [3, 3], CHUNKS, "1f1b")
    result["inplace_1f1b"] = _run(inplace_model(), None, None, None, plan=plan)["grads"]
    result["other_model"] = error_of(lambda: DistributedPipeline(tuple_model(), plan, loss_fn=nn.functional.mse_loss))
    result["tuple"] = _run(tuple_model(), [2, 2], 2, "gpipe")["grads"]
    result["cat"] = _run(cat_model(), [2, 2], 2, "gpipe")["grads"]
    twice = _run(inplace_model(), [3, 3], CHUNKS, "gpipe")["runner"]
    twice.step(*batch()[:1], target=batch()[1])  # no zero_grad: the second step adds to the first's
    result["accumulated"] = {n: p.grad.clone() for n, p in twice.named_parameters()}
    wide = DistributedPipeline(inplace_model().double(), balance=[3, 3], chunks=CHUNKS, loss_fn=nn.functional.mse_loss)
    x, y = batch()
    result["loss64"] = wide.broadcast_loss(wide.step(x.double(), target=y.double()))
    bn = _run(batchnorm_model(), [2, 2], CHUNKS, "1f1b", checkpoint="except_last")
    torch.optim.SGD(bn["runner"].parameters(), lr=0.1).step()
    result["checkpoint_grads"] = bn["grads"]
    path = bn["runner"].save_checkpoint(out / "model.pt")
    result["checkpoint_path"] = str(path) if path else None
    for mode in ("always", "except_last"):
        result[f"forwards_{mode}"] = _forwards_in_second_step(mode)
    result["spectral"] = _run(spectral_model(), [2, 3], CHUNKS, "gpipe", checkpoint="always")["grads"]
    result["moved_parameter"] = error_of(lambda: _run(centering_model(), [2, 3], CHUNKS, "gpipe", checkpoint="always"))
    result["probe_center"] = _probe_writes()
    result["unfrozen"] = _unfrozen_after_probe()
    result["odd_batch"] = _odd_batch_on_an_even_branch()
    runner = gpipe["runner"]
    x, y = batch(6)
    result["changed_batch"] = error_of(lambda: runner.step(x, target=y))
    result["1f1b_few_chunks"] = error_of(lambda: DistributedPipeline(
        inplace_model(), balance=[3, 3], chunks=1, schedule="1f1b", loss_fn=nn.functional.mse_loss))
    result["uneven_batch"] = error_of(lambda: DistributedPipeline(
        inplace_model(), balance=[3, 3], chunks=3, batch_size=8, loss_fn=nn.functional.mse_loss))
    result["shapes"] = _refused_shapes()
    result["losses"] = _refused_losses()
    result["padded"] = _run(classifier_model(), [2, 1], CHUNKS, "gpipe", loss_fn=token_sum_per_position,
                            data=(batch()[0].double(), PADDED))["grads"]
    for form in FORMS:
        result[f"sent_{form}"] = _run(sent_model(form), [2, 2], 2, "gpipe")["grads"]
        result[f"output_{form}"] = _run(output_model(form), [2, 2], 2, "1f1b", loss_fn=halves_loss)["grads"]
    result["outputs_refused"] = _refused_outputs()
    runner = DistributedPipeline(inplace_model(), balance=[3, 3], chunks=CHUNKS, loss_fn=nn.functional.mse_loss)
    result["hooks"] = with_hooks(dict(runner.named_parameters()), lambda: runner.step(batch()[0], target=batch()[1]))
    result["changing_form"] = error_of(lambda: _run(counting_model(), [2, 2], 2, "gpipe"))
    result["sent_shapes"] = _refused_sent_shapes()
    result["integers"] = _integers_between_stages()
    result.update(_structure_refusals())
    result["first_inplace"] = _run(first_inplace_model(), [2, 2], 1, "gpipe")["grads"]
    result["passed_twice"] = _passed_twice()
    x, y = batch()
    unequal = DistributedPipeline(inplace_model(), balance=[3, 3], chunks=CHUNKS, loss_fn=nn.functional.mse_loss)
    result["unequal_target"] = error_of(lambda: unequal.step(x, target=y[:4]))
    return result


def _refused_sent_shapes() -> dict[str, Any]:
    """A first stage whose output's length follows the data, refused on every rank where a micro-batch's
    differs from the shape probe's: micro-batch 1 of the first step, and micro-batch 0 of a later step
    with the stage frozen (what it sends needs no gradient).  Then a step of full-length sequences."""
    from autopipe.distributed import DistributedPipeline

    full = padded([6, 6, 6, 6])
    result: dict[str, Any] = {}
    for frozen, refused in ((False, [6, 2, 3, 1]), (True, [2, 1, 1, 2])):
        runner = DistributedPipeline(trim_model(frozen), balance=[2, 2], chunks=2, loss_fn=nn.functional.mse_loss)
        if frozen:  # the first step fixes full-length sequences, and a later one is shorter
            runner.step(full[0], target=full[1])
        x, y = padded(refused)
        result[f"frozen={frozen}"] = error_of(functools.partial(runner.step, x, target=y))
        runner.module.zero_grad()
        runner.step(full[0], target=full[1])
        result[f"grads frozen={frozen}"] = {n: p.grad.clone() for n, p in runner.named_parameters() if p.requires_grad}
    return result


def _integers_between_stages() -> dict[str, Any]:
    """Ids and labels sent between stages, which the next stage's shape probe must read as they are;
    ``loss_fn`` runs once per micro-batch (not in the probe)."""
    from autopipe.distributed import DistributedPipeline

    loss_fn = Calls(nn.functional.mse_loss)
    ids = _run(ids_model(), [1, 2], 2, "gpipe", loss_fn=loss_fn, data=token_ids())
    result = {"ids": ids["grads"], "loss_calls": loss_fn.calls,
              "ids_seen": ids["runner"].module.layers[0].seen if ids["runner"].is_last else []}
    runner = DistributedPipeline(loss_inside_model(), balance=[1, 1], chunks=2, loss_fn=model_loss)
    runner.step(*labelled(), target=torch.zeros(8))
    result["loss_inside"] = {n: p.grad.clone() for n, p in runner.named_parameters()}
    return result


def with_hooks(params: dict[str, Tensor], step: Callable[[], Any]) -> dict[str, dict[str, Any]]:
    """``step()`` with a clamping tensor hook and a counting post-accumulate hook on every parameter:
    each one's call count, the ``.grad`` its post hook saw and ``.grad`` after."""
    calls, seen = dict.fromkeys(params, 0), {}
    for name, param in params.items():
        param.register_hook(lambda grad: grad.clamp(-0.01, 0.01))

        def post(param: Tensor, name: str = name) -> None:
            calls[name] += 1
            seen[name] = param.grad.clone()

        param.register_post_accumulate_grad_hook(post)
    step()
    return {"calls": calls, "seen": seen, "grads": {name: p.grad.clone() for name, p in params.items()}}


def _refused_outputs() -> dict[str, Any]:
    """Steps whose last stage returns no tensor, refused on every rank; then a right step, whose
    gradients are the plain model's (the refused steps ran with zero losses)."""
    from autopipe.distributed import DistributedPipeline

    runner = DistributedPipeline(switched_model(), balance=[2, 2], chunks=2, loss_fn=halves_loss)
    switched = runner.module.layers[-1] if runner.is_last else Switched()
    x, y = batch()
    result: dict[str, Any] = {}
    for form in ("text", "hidden"):
        switched.form = form
        result[form] = error_of(lambda: runner.step(x, target=y))
    switched.form = "ok"
    runner.step(x, target=y)
    result["grads"] = {n: p.grad.clone() for n, p in runner.named_parameters()}
    return result


def _refused_shapes() -> dict[str, Any]:
    """Steps with another sequence length and another dtype than the first step's, refused on every
    rank (the last sees nothing wrong: its targets keep their shape), then the first shape again."""
    from autopipe.distributed import DistributedPipeline

    runner = DistributedPipeline(sequence_model(), balance=[1, 2], chunks=2, loss_fn=nn.functional.mse_loss)
    (x, y), (short, same_shape_y) = sequences(10), sequences(6)
    runner.step(x, target=y)
    result = {"shorter": error_of(lambda: runner.step(short, target=same_shape_y)),
              "float32": error_of(lambda: runner.step(x.float(), target=y))}
    runner.module.zero_grad()
    result["loss"] = runner.broadcast_loss(runner.step(x, target=y))
    result["grads"] = {n: p.grad.clone() for n, p in runner.named_parameters()}
    return result


def _refused_losses() -> dict[str, Any]:
    """Steps whose loss is no scalar on the output's graph, and a step under ``no_grad``, each refused
    on every rank; then a right step, whose gradients are the plain model's (the refused losses
    stood in as zeros)."""
    from autopipe.distributed import DistributedPipeline

    loss_fn = SwitchedLoss()
    runner = DistributedPipeline(inplace_model(), balance=[3, 3], chunks=CHUNKS, loss_fn=loss_fn)
    x, y = batch()
    result: dict[str, Any] = {}
    for form in ("none", "float", "detached"):
        loss_fn.form = form
        result[form] = error_of(lambda: runner.step(x, target=y))
    loss_fn.form = "mean"
    with torch.no_grad():
        result["no_grad"] = error_of(lambda: runner.step(x, target=y))
    runner.step(x, target=y)
    result["grads"] = {n: p.grad.clone() for n, p in runner.named_parameters()}
    return result


def _forwards_in_second_step(checkpoint: str) -> int:
    """Forward runs of this rank's Counted in one step after the first (which probes shapes)."""
    from autopipe.distributed import DistributedPipeline

    runner = DistributedPipeline(counted_model(), balance=[2, 2], chunks=CHUNKS, checkpoint=checkpoint,
                                 loss_fn=nn.functional.mse_loss)
    x, y = batch()
    runner.step(x, target=y)
    counted = next(m for m in runner.module.modules() if isinstance(m, Counted))
    counted.calls = 0
    runner.step(x, target=y)
    return counted.calls


def _job_three(out: Path) -> dict[str, Any]:
    from autopipe.distributed import DistributedPipeline

    gpipe = _run(skip_model(), [3, 3, 3], CHUNKS, "gpipe")
    x, y = batch(6)
    return {
        "skip_gpipe": gpipe["grads"],
        "changed_batch": error_of(lambda: gpipe["runner"].step(x, target=y)),
        "skip_1f1b": _run(skip_model(), [3, 3, 3], CHUNKS, "1f1b")["grads"],
        "1f1b_few_chunks": error_of(lambda: DistributedPipeline(
            skip_model(), balance=[3, 3, 3], chunks=2, schedule="1f1b", loss_fn=nn.functional.mse_loss)),
        "world_mismatch": error_of(lambda: DistributedPipeline(
            skip_model(), balance=[4, 5], chunks=2, loss_fn=nn.functional.mse_loss)),
    }


def _worker(job: str, out: Path) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    rank = int(os.environ["RANK"])
    result = {"two": _job_two, "three": _job_three}[job](out)
    torch.save(result, out / f"rank{rank}.pt")
    dist.barrier()
    dist.destroy_process_group()


# ---- test side ------------------------------------------------------------------------------

def _launch(job: str, nprocs: int, out: Path) -> list[dict[str, Any]]:
    launch_local([sys.executable, __file__, job, str(out)], nprocs, out, JOB_TIMEOUT_S)
    return [torch.load(out / f"rank{r}.pt") for r in range(nprocs)]


def _merged(results: list[dict[str, Any]], key: str) -> dict[str, Tensor]:
    merged: dict[str, Tensor] = {}
    for result in results:
        assert not merged.keys() & result[key].keys(), "a parameter appears on two ranks"
        merged.update(result[key])
    return merged


def _assert_grads_equal(got: dict[str, Tensor], expected: dict[str, Tensor]) -> None:
    assert sorted(got) == sorted(expected)
    for name, grad in expected.items():
        torch.testing.assert_close(got[name], grad, msg=lambda m, n=name: f"{n}: {m}")


@pytest.fixture(scope="module")
def two(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return _launch("two", 2, tmp_path_factory.mktemp("two"))


@pytest.fixture(scope="module")
def three(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return _launch("three", 3, tmp_path_factory.mktemp("three"))


@pytest.mark.slow
@pytest.mark.parametrize("run", ["gpipe", "1f1b", "checkpoint"])  # 1f1b: from a plan
def test_gradients_equal_plain_model_with_inplace_first_op(two: list[dict[str, Any]], run: str) -> None:
    got = _merged(two, f"inplace_{run}")
    _assert_grads_equal(got, reference(inplace_model(), CHUNKS))
    _assert_grads_equal(got, in_process(inplace_model(), [3, 3], CHUNKS))


@pytest.mark.slow
def test_an_in_place_first_layer_gives_the_plain_gradients_from_the_first_step(two: list[dict[str, Any]]) -> None:
    """The engine's shape probe ran stage 0 on the caller's batch itself: the first layer's write
    stayed in it, so the first step computed on it written twice (loss 0.783 for 0.798)."""
    _assert_grads_equal(_merged(two, "first_inplace"), reference(first_inplace_model(), 1))


@pytest.mark.slow
def test_one_tensor_passed_twice_is_one_tensor_as_in_the_plain_model(two: list[dict[str, Any]]) -> None:
    model, (x, y) = pair_model(), batch()
    for xi, yi in zip(x.chunk(CHUNKS), y.chunk(CHUNKS)):
        (nn.functional.mse_loss(model((xi.clone(),) * 2), yi) / CHUNKS).backward()
    _assert_grads_equal(_merged(two, "passed_twice"), {n: p.grad for n, p in model.named_parameters()})


@pytest.mark.slow
def test_hooks_on_the_model_and_modules_replaced_after_building_are_refused(two: list[dict[str, Any]]) -> None:
    """Both ran silently without what the plain model runs (a root hook's x3; the new head)."""
    for result in two:
        assert result["root_hook"].startswith("ChainError: the model has hooks"), result["root_hook"]
        assert result["replaced"].startswith("DistributedError: the model's module at '5' is a new Linear"), \
            result["replaced"]


@pytest.mark.slow
def test_last_rank_loss_reaches_every_rank(two: list[dict[str, Any]]) -> None:
    model, (x, y) = inplace_model(), batch()
    expected = torch.stack([nn.functional.mse_loss(model(a), b) for a, b in zip(x.chunk(CHUNKS), y.chunk(CHUNKS))])
    assert two[0]["inplace_loss"] == two[1]["inplace_loss"] == pytest.approx(expected.mean().item(), rel=1e-5)


@pytest.mark.slow
def test_parameter_hooks_fire_once_on_the_whole_gradient(two: list[dict[str, Any]]) -> None:
    """An optimizer in backward (a post-accumulate hook) and a clamping tensor hook see the step's
    whole gradient once, as on the plain model, not each micro-batch's."""
    plain = inplace_model()
    x, y = batch()
    expected = with_hooks(dict(plain.named_parameters()), lambda: nn.functional.mse_loss(plain(x), y).backward())
    for key in ("calls", "seen", "grads"):
        got = {name: value for result in two for name, value in result["hooks"][key].items()}
        if key == "calls":
            assert got == expected["calls"] == dict.fromkeys(expected["calls"], 1)
        else:
            _assert_grads_equal(got, expected[key])


@pytest.mark.slow
def test_gradients_accumulate_over_steps_as_in_the_plain_model(two: list[dict[str, Any]]) -> None:
    """Two steps of one batch without ``zero_grad``: twice one step's gradients (the engine's own
    averaging divided the first step's again)."""
    once = reference(inplace_model(), CHUNKS)
    _assert_grads_equal(_merged(two, "accumulated"), {name: 2 * grad for name, grad in once.items()})


@pytest.mark.slow
def test_a_float64_loss_reaches_every_rank(two: list[dict[str, Any]]) -> None:
    model, (x, y) = inplace_model().double(), batch()
    expected = torch.stack([nn.functional.mse_loss(model(a), b)
                            for a, b in zip(x.double().chunk(CHUNKS), y.double().chunk(CHUNKS))])
    assert two[0]["loss64"] == two[1]["loss64"] == pytest.approx(expected.mean().item(), rel=1e-12)


@pytest.mark.slow
def test_a_join_by_cat_sends_its_input_gradients_back(two: list[dict[str, Any]]) -> None:
    """``torch.cat``'s backward gives non-contiguous slices, which gloo refuses to send."""
    _assert_grads_equal(_merged(two, "cat"), reference(cat_model(), 2))


@pytest.mark.slow
def test_plan_for_another_model_refused(two: list[dict[str, Any]]) -> None:
    for result in two:
        assert result["other_model"].startswith(
            "DistributedError: the plan was made for another model: layer 1 differs")


@pytest.mark.slow
def test_tuple_output_crosses_stages(two: list[dict[str, Any]]) -> None:
    _assert_grads_equal(_merged(two, "tuple"), reference(tuple_model(), 2))
    _assert_grads_equal(_merged(two, "tuple"), in_process(tuple_model(), [2, 2], 2))


@pytest.mark.slow
def test_checkpointed_batchnorm_and_merged_checkpoint_load_into_plain_model(two: list[dict[str, Any]]) -> None:
    model = batchnorm_model()
    _assert_grads_equal(_merged(two, "checkpoint_grads"), reference(model, CHUNKS, lr=0.1))
    assert two[1]["checkpoint_path"] is None
    saved = torch.load(two[0]["checkpoint_path"])
    batchnorm_model().load_state_dict(saved, strict=True)
    for name, value in model.state_dict().items():  # weights after SGD, running stats per micro-batch
        torch.testing.assert_close(saved[name], value, msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.slow
def test_checkpoint_modes_recompute_like_the_in_process_runtime(two: list[dict[str, Any]]) -> None:
    for result in two:  # CHUNKS forwards, plus one recomputation per checkpointed micro-batch
        assert result["forwards_always"] == 2 * CHUNKS
        assert result["forwards_except_last"] == 2 * CHUNKS - 1


@pytest.mark.slow
def test_recomputation_starts_from_the_buffers_its_forward_found(two: list[dict[str, Any]]) -> None:
    """Every forward updates the spectral norms' vectors and assigns a new gain; the checkpointed
    micro-batches recompute after all the forwards, from what each forward found: the plain
    model's gradients."""
    _assert_grads_equal(_merged(two, "spectral"), reference(spectral_model(), CHUNKS))


def test_changed_batch_size_raises_on_every_rank(two: list[dict[str, Any]], three: list[dict[str, Any]]) -> None:
    """The first and last ranks see the change; a stage between, which sees no batch, raises with them
    rather than wait for a micro-batch that will not come."""
    for ranks in (two, three):
        assert ranks[0]["changed_batch"].startswith("DistributedError: the input batch has 6 samples")
        assert ranks[-1]["changed_batch"].startswith("DistributedError: the target batch has 6 samples")
        assert "drop_last=True" in ranks[0]["changed_batch"]
    assert three[1]["changed_batch"].startswith("DistributedError: another rank refused this step, so no rank ran it")


@pytest.mark.slow
def test_a_changed_sequence_length_or_dtype_is_refused_on_every_rank(two: list[dict[str, Any]]) -> None:
    """The first rank sees the change; the last, whose targets keep their shape, refuses with it
    (a rank refusing alone would leave the other waiting inside the engine).  The first shape
    still runs after: the plain model's loss and gradients."""
    first, last = (result["shapes"] for result in two)
    assert first["shorter"].startswith("DistributedError: this step's input (8, 6, 4) float64 differs from the "
                                       "first step's input (8, 10, 4) float64")
    assert "build a new DistributedPipeline for the new shapes on every rank" in first["shorter"]
    assert first["float32"].startswith("DistributedError: this step's input (8, 10, 4) float32 differs")
    for key in ("shorter", "float32"):
        assert last[key].startswith("DistributedError: another rank refused this step, so no rank ran it")
    model, (x, y) = sequence_model(), sequences(10)
    losses = [nn.functional.mse_loss(model(a), b) for a, b in zip(x.chunk(2), y.chunk(2))]
    (sum(losses) / 2).backward()
    assert first["loss"] == last["loss"] == pytest.approx((sum(losses) / 2).item(), rel=1e-12)
    _assert_grads_equal(first["grads"] | last["grads"], {n: p.grad for n, p in model.named_parameters()})


@pytest.mark.slow
def test_a_loss_that_is_not_one_number_on_the_graph_and_no_grad_are_refused_on_every_rank(
        two: list[dict[str, Any]]) -> None:
    """The loss runs mid-step on the last rank: a zero stands in, the step ends everywhere, then every
    rank raises, and the pipeline goes on (the next right step gives the plain model's gradients)."""
    first, last = (result["losses"] for result in two)
    assert last["none"].startswith("DistributedError: loss_fn returned a tensor of shape (2, 4), and the engine "
                                   "runs the backward of one number per micro-batch")
    assert "reduction='mean', not 'none'" in last["none"]
    assert last["float"].startswith("DistributedError: loss_fn returned a float,")
    assert last["detached"].startswith("DistributedError: loss_fn returned a tensor that does not require grad")
    for form in ("none", "float", "detached"):
        assert first[form].startswith("DistributedError: another rank refused a value of this step or its loss")
    for result in (first, last):
        assert result["no_grad"].startswith("DistributedError: step() trains (forward and backward) but runs under "
                                            "torch.no_grad()")
    _assert_grads_equal(first["grads"] | last["grads"], reference(inplace_model(), CHUNKS))


@pytest.mark.slow
def test_padded_targets_train_as_the_plain_model_with_the_documented_loss(two: list[dict[str, Any]]) -> None:
    """cross_entropy's mean over the real targets differs per micro-batch (NaN where all are padding);
    the docs' sum over every position is the same on micro-batches as on the whole batch."""
    model = classifier_model()
    token_sum_per_position(model(batch()[0].double()), PADDED).backward()
    _assert_grads_equal(_merged(two, "padded"), {n: p.grad for n, p in model.named_parameters()})


@pytest.mark.slow
def test_uneven_micro_batches_refused(two: list[dict[str, Any]]) -> None:
    for result in two:
        assert result["uneven_batch"].startswith("DistributedError: batch size 8 does not split into 3")


@pytest.mark.slow
@pytest.mark.parametrize("form", list(FORMS))
def test_a_value_between_stages_arrives_as_the_layer_returned_it(two: list[dict[str, Any]], form: str) -> None:
    """Its containers (namedtuple, list, dataclass, dict in its key order) and plain items, not a plain
    tuple of its tensors: the next stage's layer reads it as in the plain model."""
    _assert_grads_equal(_merged(two, f"sent_{form}"), reference(sent_model(form), 2))


@pytest.mark.slow
@pytest.mark.parametrize("form", list(FORMS))
def test_the_last_stage_output_reaches_loss_fn_as_the_layer_returned_it(two: list[dict[str, Any]], form: str) -> None:
    """A namedtuple, list, dataclass, dict (with a 0-dim auxiliary loss) or a tuple holding None and a
    number: loss_fn reads it as in the plain model, with the plain model's gradients."""
    expected = reference(output_model(form), 2, loss_fn=halves_loss)
    _assert_grads_equal(_merged(two, f"output_{form}"), expected)


@pytest.mark.slow
def test_a_last_stage_output_without_a_tensor_is_refused_on_every_rank(two: list[dict[str, Any]]) -> None:
    """The last rank refuses naming the layer, what it returns and the fix; the first rank raises
    with it (not left waiting), and the pipeline goes on: the next right step gives the plain
    model's gradients."""
    first, last = (result["outputs_refused"] for result in two)
    assert last["text"].startswith("DistributedError: the last stage ends with layer '3', which returns a str, with "
                                   "no tensor in it; torch.distributed.pipelining sends and differentiates tensors")
    assert "Fix: make that layer return its tensors" in last["text"]
    assert last["hidden"].startswith("DistributedError: the last stage ends with layer '3', which returns a Holder: "
                                     "a value of type Holder holds tensors in its attributes (tensor)")
    for form in ("text", "hidden"):
        assert last[form].endswith("This step ran with a zero loss in its place")
        assert first[form].startswith("DistributedError: another rank refused a value of this step or its loss")
    expected = reference(switched_model(), 2, loss_fn=halves_loss)
    _assert_grads_equal(first["grads"] | last["grads"], expected)


@pytest.mark.slow
def test_a_recomputation_moving_a_parameter_its_forward_wrote_is_refused_on_every_rank(
        two: list[dict[str, Any]]) -> None:
    """A running mean kept in an nn.Parameter: the recomputation would update it again and compute
    from the new value (the in-process runtime refuses it too, tests/test_checkpoint_params.py)."""
    first, last = (result["moved_parameter"] for result in two)
    assert last.startswith("DistributedError: stage 1, checkpointed micro-batch 0, wrote into parameter(s) "
                           "'2.center' in its forward, and its recomputation moved them again")
    assert "register_buffer" in last
    assert first.startswith("DistributedError: another rank refused a value of this step or its loss, or a "
                            "recomputation")


@pytest.mark.slow
def test_the_shape_probe_leaves_a_parameter_its_forward_writes_as_it_found_it(two: list[dict[str, Any]]) -> None:
    """The engine's shape probe, a forward the plain model never runs, wrote the running center
    kept in a frozen nn.Parameter once more (0.12 off after one step, and the gradients after it)."""
    plain = centering_model()
    expected = reference(plain, 1)
    _assert_grads_equal({k: v for r in two for k, v in r["probe_center"]["grads"].items()}, expected)
    state = {k: v for r in two for k, v in r["probe_center"]["state"].items()}
    assert sorted(state) == sorted(plain.state_dict())
    for name, value in plain.state_dict().items():
        torch.testing.assert_close(state[name], value, msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.slow
def test_unfreezing_a_stage_whose_outputs_needed_no_gradient_in_the_probe_is_refused(
        two: list[dict[str, Any]]) -> None:
    """The probe fixed that no gradient goes back to the frozen first stage: torch raised mid-step
    ("grad can be implicitly created only for scalar outputs") and the other rank lost its peer.
    Refused on every rank before the step, naming the fix; a new pipeline trains the stage."""
    first, last = (result["unfrozen"] for result in two)
    assert first["refused"].startswith("DistributedError: requires_grad of ['0.weight', '0.bias'] was set since the "
                                       "first step, in which stage 0's outputs needed no gradient")
    assert "build a new DistributedPipeline on every rank after unfreezing" in first["refused"]
    assert last["refused"].startswith("DistributedError: another rank refused this step")
    expected = inplace_model()
    expected[2].requires_grad_(False)
    _assert_grads_equal(first["rebuilt"] | last["rebuilt"], reference(expected, CHUNKS))


@pytest.mark.slow
def test_a_batch_the_exported_branch_does_not_hold_for_is_refused_on_every_rank(two: list[dict[str, Any]]) -> None:
    """As in the in-process runtime (tests/test_capture.py): the first rank runs export's checks of
    the inputs, whose graph kept the even branch, on the batch before the step."""
    assert two[0]["odd_batch"].startswith("DistributedError: the model was captured with torch.export, and its "
                                          "forward branches on the input sizes: export kept the sample's branches, "
                                          "which hold only where x.size()[0] % 2 == 0")
    assert two[1]["odd_batch"].startswith("DistributedError: another rank refused this step")


@pytest.mark.slow
def test_a_value_between_stages_unlike_the_shape_probes_is_refused_naming_it(two: list[dict[str, Any]]) -> None:
    """The sending rank refuses it and sends zeros in its place, so the step ends and every rank raises."""
    message = two[0]["changing_form"]
    assert message.startswith("DistributedError: stage 0 ends with layer '1', which returns a tuple of (Tensor, int) "
                              "in micro-batch 0 unlike in the first step's shape probe")
    assert "return the same containers and plain values whatever the input" in message
    assert two[1]["changing_form"].startswith("DistributedError: another rank refused a value of this step")


@pytest.mark.slow
def test_a_value_between_stages_of_another_shape_than_the_probes_is_refused_on_every_rank(
        two: list[dict[str, Any]]) -> None:
    """The receiver reads each micro-batch into a buffer of the probe's shape: a shorter or longer value
    would be read wrong (a frozen stage's, which gets no gradient, without any error).  The sending rank
    refuses it naming the shapes, the step ends with zeros in its place on every rank and raises on all,
    and the pipeline goes on: a step of the probe's shapes gives the plain model's gradients."""
    first, last = (result["sent_shapes"] for result in two)
    assert first["frozen=False"].startswith(
        "DistributedError: stage 0 sends the value its last layer '1' returns with shape (2, 3, 4) float64 in "
        "micro-batch 1 but (2, 6, 4) float64 in the first step's shape probe")
    assert first["frozen=True"].startswith(
        "DistributedError: stage 0 sends the value its last layer '1' returns with shape (2, 2, 4) float64 in "
        "micro-batch 0 but (2, 6, 4) float64")
    for frozen in (False, True):
        assert "Fix: give every micro-batch the same shapes (pad to a fixed length" in first[f"frozen={frozen}"]
        assert "call zero_grad() before the next step" in first[f"frozen={frozen}"]
        assert last[f"frozen={frozen}"].startswith("DistributedError: another rank refused a value of this step")
        expected = reference(trim_model(frozen), 2, data=padded([6, 6, 6, 6]))
        _assert_grads_equal(first[f"grads frozen={frozen}"] | last[f"grads frozen={frozen}"], expected)


@pytest.mark.slow
def test_integers_between_stages_train_as_the_plain_model(two: list[dict[str, Any]]) -> None:
    """Ids an embedding reads and labels a loss inside the model reads: the next stage's shape probe runs
    on the values the stage before computed in its own, not on uninitialised memory (an out-of-range id
    or label).  The probe does not call ``loss_fn``: it runs once per micro-batch."""
    integers = [result["integers"] for result in two]
    _assert_grads_equal(_merged(integers, "ids"), reference(ids_model(), 2, data=token_ids()))
    first, second = token_ids()[0].chunk(2)  # the micro-batches' ids; the probe runs on the first
    assert [seen.tolist() for seen in integers[1]["ids_seen"]] == [first.tolist(), first.tolist(), second.tolist()]
    assert integers[1]["loss_calls"] == 2
    model, (x, labels) = loss_inside_model(), labelled()
    for xi, li in zip(x.chunk(2), labels.chunk(2)):
        (model((xi, li)) / 2).backward()
    _assert_grads_equal(_merged(integers, "loss_inside"), {n: p.grad for n, p in model.named_parameters()})


@pytest.mark.slow
def test_inputs_and_a_target_of_different_batch_sizes_are_refused_on_every_rank(two: list[dict[str, Any]]) -> None:
    """Each rank sees only what it feeds: the first step compares the sizes, and every rank refuses."""
    for result in two:
        assert result["unequal_target"].startswith(
            "DistributedError: the ranks feed batches of different sizes: 8 samples on rank 0 and 4 samples on rank 1")


def test_a_stage_value_without_a_tensor_is_refused_naming_it() -> None:
    """Checked by the sending rank before anything is sent (the shape probe runs the stage first)."""
    from autopipe.distributed import StageModule
    from autopipe.errors import StageOutputError
    from autopipe.runtime.balance import stage_of_layer
    from autopipe.runtime.skips import skip_spans

    switched = switched_model()
    switched[3].form = "text"
    layers = layer_chain(nn.Sequential(*switched, nn.Linear(4, 4)))
    first = StageModule(layers[:4], 0, 2, skip_spans(layers, stage_of_layer([4, 1])))
    with pytest.raises(StageOutputError, match="stage 0 ends with layer '3', which returns a str, with no tensor"):
        first(torch.randn(3, 8))


def test_a_stage_value_whose_form_was_not_sent_is_refused_unless_bare() -> None:
    """Where torch never called the metadata hook that sends a value's form (a torch without it),
    the receiver would read a dict as a plain tuple: the sender refuses it at its first micro-batch
    (and sends zeros in its place, so the step ends on every rank), and still sends a tensor or a
    plain tuple of tensors, which the receiver reads right."""
    from autopipe.distributed import StageModule
    from autopipe.runtime.balance import stage_of_layer
    from autopipe.runtime.skips import skip_spans

    layers = layer_chain(nn.Sequential(*switched_model(), nn.Linear(4, 4)))
    first = StageModule(layers[:4], 0, 2, skip_spans(layers, stage_of_layer([4, 1])))
    first(torch.randn(3, 8))  # the shape probe (micro_batch None) keeps the form
    first.micro_batch = 0
    assert len(first(torch.randn(3, 8))) == 3  # zeros for the dict's three tensors
    assert first.refusal is not None and "did not pass its form to the next stage" in first.refusal
    first.form_sent, first.refusal = True, None
    assert len(first(torch.randn(3, 8))) == 3  # the dict's three tensors
    assert first.refusal is None


def test_a_stage_value_of_another_shape_or_dtype_than_the_probes_is_refused_with_zeros_in_its_place() -> None:
    """The sending rank refuses a tensor unlike the probe's, naming it, and sends zeros of the probe's
    shapes in its place (on the received tensors' graph where it needed a gradient), so the step ends on
    every rank; the first refusal of a step is the one kept."""
    from autopipe.distributed import StageModule
    from autopipe.runtime.balance import stage_of_layer
    from autopipe.runtime.skips import skip_spans

    layers = layer_chain(skip_model())
    middle = StageModule(layers[3:6], 1, 3, skip_spans(layers, stage_of_layer([3, 3, 3])))
    middle(torch.randn(4, 8, requires_grad=True), torch.randn(4, 8))  # the probe: main and the skip 'x'
    middle.micro_batch, middle.form_sent = 1, True
    received = torch.randn(4, 8, requires_grad=True)
    sent = middle(received, torch.randn(2, 8))
    assert middle.refusal is not None and middle.refusal.startswith(
        "stage 1 sends the skip 'x' with shape (2, 8) float32 in micro-batch 1 but (4, 8) float32 in the first "
        "step's shape probe")
    # the main value and the skip 'y' computed from it need a gradient, the relayed skip 'x' does not
    assert [(t.shape, t.dtype, t.requires_grad) for t in sent] == [((4, 8), torch.float32, grad)
                                                                    for grad in (True, False, True)]
    sum(t.sum() for t in sent).backward()
    assert torch.equal(received.grad, torch.zeros(4, 8))
    middle.layers[1].double()
    middle(torch.randn(4, 8, dtype=torch.float64), torch.randn(4, 8))
    assert middle.refusal.startswith("stage 1 sends the skip 'x'")
    middle.refusal = None  # as each step starts
    middle(torch.randn(4, 8, dtype=torch.float64), torch.randn(4, 8))
    assert middle.refusal.startswith("stage 1 sends the value its last layer '5' returns with shape (4, 8) float64 "
                                     "in micro-batch 1 but (4, 8) float32")


@pytest.mark.slow
def test_skip_crossing_two_stages(three: list[dict[str, Any]]) -> None:
    for schedule in ("gpipe", "1f1b"):
        _assert_grads_equal(_merged(three, f"skip_{schedule}"), reference(skip_model(), CHUNKS))
        _assert_grads_equal(_merged(three, f"skip_{schedule}"), in_process(skip_model(), [3, 3, 3], CHUNKS))


@pytest.mark.slow
def test_1f1b_with_fewer_micro_batches_than_stages_names_the_fix(
        two: list[dict[str, Any]], three: list[dict[str, Any]]) -> None:
    for result in two:
        assert "chunks=1 for 2 stages. Fix: use chunks >= 2 or schedule='gpipe'" in result["1f1b_few_chunks"]
    for result in three:
        assert "chunks=2 for 3 stages. Fix: use chunks >= 3 or schedule='gpipe'" in result["1f1b_few_chunks"]


@pytest.mark.slow
def test_world_size_must_match_stages(three: list[dict[str, Any]]) -> None:
    for result in three:
        assert "the plan has 2 stages but the job has 3 ranks" in result["world_mismatch"]
        assert "torchrun --nproc-per-node 2" in result["world_mismatch"]


@pytest.mark.slow
def test_example_trains_from_a_plan_and_writes_a_checkpoint_the_plain_model_loads(tmp_path: Path) -> None:
    import torchvision

    plan = plan_for(torchvision.models.resnet18(weights=None), [7, 8], 2, "1f1b", checkpoint="except_last")
    example = Path(__file__).parents[1] / "examples" / "distributed_train.py"
    launch_local([sys.executable, str(example), "--plan", str(plan.save(tmp_path / "plan.json")),
                  "--image-size", "32", "--steps", "2", "--save", str(tmp_path / "model.pt")],
                 2, tmp_path, JOB_TIMEOUT_S)
    printed = (tmp_path / "rank0.log").read_text()
    losses = [float(line.split()[-1]) for line in printed.splitlines() if line.startswith("step ")]
    assert len(losses) == 2 and losses[1] < losses[0]  # the same batch twice: training lowers its loss
    assert f"saved {tmp_path / 'model.pt'}: loads into the plain model (strict=True)" in printed


def test_skip_routes_pass_along_every_stage_between() -> None:
    from autopipe.distributed import StageModule
    from autopipe.runtime.balance import stage_of_layer
    from autopipe.runtime.skips import skip_spans

    layers = layer_chain(skip_model())
    routes = skip_spans(layers, stage_of_layer([3, 3, 3]))
    assert [(str(r.key), r.src, r.dst) for r in routes] == [("x", 0, 2), ("y", 1, 2)]
    middle = StageModule(layers[3:6], 1, 3, routes)
    assert [str(k) for k in middle.skips_in] == ["x"]
    assert [str(k) for k in middle.skips_out] == ["x", "y"]


@pytest.mark.parametrize("case, balance", [(case, b) for case, balances in REFUSED.items() for b in balances])
def test_a_write_into_a_stashed_tensor_across_a_split_is_refused(case: str, balance: list[int]) -> None:
    """The stage modules in a row, each given what the one before sends as separate tensors (as
    the engine does): the stage that writes into a tensor stashed under another name refuses,
    as in the in-process runtime; the same model split elsewhere runs."""
    from autopipe.distributed import StageModule
    from autopipe.runtime.balance import stage_of_layer
    from autopipe.runtime.skips import skip_spans

    layers = layer_chain(aliased(case))
    routes = skip_spans(layers, stage_of_layer(balance))
    ends = [sum(balance[:i]) for i in range(len(balance) + 1)]
    stages = [StageModule(layers[a:b], i, len(balance), routes) for i, (a, b) in enumerate(zip(ends, ends[1:]))]
    sent: Any = (torch.randn(3, 4),)
    with pytest.raises(ChainError, match=r"write in place into .*, which arrives equal to .*cannot tell"):
        for stage in stages:
            sent = [t.detach().clone().requires_grad_() for t in stage(*sent)]  # as received
    whole = StageModule(layers, 0, 1, skip_spans(layers, [0] * len(layers)))
    assert whole(torch.randn(3, 4)).shape[0] == 3


@pytest.mark.parametrize("name, value", [("chunks", 0), ("chunks", -2), ("chunks", 2.0), ("replicas", 0),
                                         ("batch_size", 0)])
def test_counts_that_are_not_positive_integers_are_refused_on_every_rank(name: str, value: Any) -> None:
    """Each rank checks the settings alike before running: 0 is not read as 'the default', and a
    float or negative count is named, not left to fail inside torch at the first step."""
    from autopipe.distributed._settings import RunSettings
    from autopipe.errors import DistributedError

    layers = layer_chain(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)))
    with pytest.raises(DistributedError, match=f"{name} must be a positive integer, got {value!r}"):
        RunSettings.resolve(layers, None, [1, 1], **{name: value})


def test_a_batch_that_does_not_split_into_equal_replica_shares_is_refused() -> None:
    """Replicas average their gradients, weighing each share alike: shares of 5 and 4 samples
    would weigh the samples unequally (3% off the plain model's loss, 8-20% off its gradients)."""
    from types import SimpleNamespace

    from autopipe.distributed import DistributedPipeline
    from autopipe.errors import DistributedError

    replica = SimpleNamespace(replicas=2, replica=1)  # what shard reads of a running pipeline
    assert DistributedPipeline.shard(replica, torch.arange(8)).tolist() == [4, 5, 6, 7]
    with pytest.raises(DistributedError, match="a batch of 9 does not split into 2 equal replica shares"):
        DistributedPipeline.shard(replica, torch.arange(9))


@skippable(stash=["x"])
class StashPair(nn.Module):
    def forward(self, x: Tensor) -> Any:
        yield stash("x", (x, x * 3))
        return x


@skippable(pop=["x"])
class AddPair(nn.Module):
    def forward(self, x: Tensor) -> Any:
        a, b = yield pop("x")
        return x + a * b


def test_a_skip_holding_a_tuple_across_stages_is_refused_naming_it() -> None:
    """The engine sends tensors only; the in-process runtime runs the same split."""
    from autopipe.distributed import StageModule
    from autopipe.errors import StageOutputError
    from autopipe.runtime.balance import stage_of_layer
    from autopipe.runtime.skips import skip_spans

    model = nn.Sequential(nn.Linear(4, 4), StashPair(), nn.Tanh(), AddPair())
    pipe = autopipe.Pipeline(model, balance=[2, 2], devices=["cpu", "cpu"], chunks=1)
    pipe(torch.randn(3, 4)).sum().backward()  # in-process: runs
    layers = layer_chain(model)
    first = StageModule(layers[:2], 0, 2, skip_spans(layers, stage_of_layer([2, 2])))
    with pytest.raises(StageOutputError, match=r"the skip 'x' holds a tuple of \(Tensor, Tensor\) and crosses from "
                                               r"stage 0 .* must be one tensor"):
        first(torch.randn(3, 4))


@skippable(stash=["x"])
class StashCopy(nn.Module):
    def forward(self, x: Tensor) -> Any:
        yield stash("x", x.clone())
        return x


def test_a_write_into_a_tensor_equal_to_a_stashed_copy_names_what_this_engine_can_do() -> None:
    """A stash of a copy is a tensor of its own in the plain model (the in-process runtime runs
    it), but arrives here equal to the stage's input: the refusal says the engine cannot tell them
    apart and names what works (an out-of-place layer), not the copy the model already makes."""
    from autopipe.distributed import StageModule
    from autopipe.runtime.balance import stage_of_layer
    from autopipe.runtime.skips import skip_spans

    model = nn.Sequential(nn.Linear(4, 4), StashCopy(), nn.ReLU(inplace=True), AddX())
    pipe = autopipe.Pipeline(model, balance=[2, 2], devices=["cpu", "cpu"], chunks=1)
    pipe(torch.randn(3, 4)).sum().backward()  # in-process: runs
    layers = layer_chain(model)
    routes = skip_spans(layers, stage_of_layer([2, 2]))
    first, second = StageModule(layers[:2], 0, 2, routes), StageModule(layers[2:], 1, 2, routes)
    sent = [t.detach().clone().requires_grad_() for t in first(torch.randn(3, 4))]  # as received
    with pytest.raises(ChainError, match=r"cannot tell whether they are one tensor.*ReLU\(inplace=False\)") as error:
        second(*sent)
    assert "stash(name, x.clone())" not in str(error.value)


if __name__ == "__main__":
    _worker(sys.argv[1], Path(sys.argv[2]))
