"""Values between stages, in skips and in and out of a pipeline: dataclasses, namedtuples and
dicts are split, detached, differentiated and joined as tensors are, so outputs and every
gradient equal the plain model's; an object hiding tensors in its attributes is refused.  And
``train_step``'s loss runs under the caller's autocast, as the plain model's loss does."""
from __future__ import annotations

import collections
import copy
import dataclasses
from typing import Any, Callable

import pytest
import torch
import torch.nn.functional as F
from helpers import assert_close
from torch import Tensor, nn

import autopipe
from autopipe.runtime.microbatch import map_tensors, tensors_of

CHECKPOINTS = ["never", "except_last", "always"]


@dataclasses.dataclass
class State:
    h: Tensor
    scale: float = 1.0


Pair = collections.namedtuple("Pair", ["h", "aux"])


class Holder:
    """Not a container autopipe walks: its tensor would travel unseen."""

    def __init__(self, h: Tensor) -> None:
        self.h = h


class Wrap(nn.Linear):
    """A linear layer whose output is ``make(h)``: a container of its result."""

    def __init__(self, make: Callable[[Tensor], Any]) -> None:
        super().__init__(4, 4)
        self.make = make

    def forward(self, x: Any) -> Any:
        return self.make(super().forward(unwrap(x)))


def unwrap(value: Any) -> Tensor:
    """The tensor a container made by :class:`Wrap` holds (both its tensors, for a Pair)."""
    if isinstance(value, State):
        return value.h * value.scale
    if isinstance(value, Pair):
        return value.h + value.aux
    if isinstance(value, Holder):
        return value.h
    return value


def chain(make: Callable[[Tensor], Any], last: Callable[[Tensor], Any] = lambda h: h) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(Wrap(make), Wrap(make), Wrap(last)).double()


def assert_like_the_model(model: nn.Module, x: Any, loss: Callable[[Any], Tensor], balance: list[int],
                          chunks: int = 3, **options: Any) -> None:
    """``model`` as a pipeline and a deep copy of it plain: outputs (of the same type), loss,
    every parameter's gradient and the input's gradient equal."""
    reference = copy.deepcopy(model)
    pipe = autopipe.Pipeline(model, balance=balance, devices=["cpu"] * len(balance), chunks=chunks, **options)
    x_ref = map_tensors(x, lambda t: t.detach().clone().requires_grad_(t.requires_grad))
    out, expected = pipe(x), reference(x_ref)
    assert type(out) is type(expected)
    assert len(tensors_of(out)) == len(tensors_of(expected))
    for i, (actual, wanted) in enumerate(zip(tensors_of(out), tensors_of(expected))):
        assert_close(actual, wanted, f"output tensor {i}")
    ours, theirs = loss(out), loss(expected)
    assert_close(ours, theirs, "loss")
    ours.backward()
    theirs.backward()
    for i, (actual, wanted) in enumerate(zip(tensors_of(x), tensors_of(x_ref))):
        if wanted.requires_grad:
            assert_close(actual.grad, wanted.grad, f"input tensor {i}'s gradient")
    expected_params = dict(reference.named_parameters())
    for name, param in pipe.named_parameters():
        assert_close(param.grad, expected_params[name].grad, f"{name}.grad")


def batch() -> Tensor:
    return torch.randn(6, 4, dtype=torch.float64, requires_grad=True)


@pytest.mark.parametrize("checkpoint", CHECKPOINTS)
def test_a_dataclass_between_stages_is_detached_and_differentiated(checkpoint: str) -> None:
    """Stage 0 returns ``State(h)``, stage 1 reads ``s.h``: its tensor was sent undetached, so a
    checkpointed forward (run without grad) gave stage 0 other gradients."""
    model = chain(lambda h: State(h, 2.0))
    assert_like_the_model(model, batch(), lambda out: out.pow(2).sum(), [1, 1, 1], checkpoint=checkpoint)


@pytest.mark.parametrize("checkpoint", CHECKPOINTS)
def test_a_namedtuple_between_stages_keeps_its_type(checkpoint: str) -> None:
    """A namedtuple was rebuilt from a generator, a ``TypeError`` in its ``__new__``."""
    model = chain(lambda h: Pair(h, h * 2))
    assert_like_the_model(model, batch(), lambda out: out.pow(2).sum(), [1, 1, 1], checkpoint=checkpoint)


@dataclasses.dataclass
class Box:
    t: Tensor


@autopipe.skippable(stash=["s"])
class Stash(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)

    def forward(self, x: Tensor) -> Any:
        h = self.linear(x)
        yield autopipe.stash("s", Box(h))
        return torch.tanh(h)


@autopipe.skippable(pop=["s"])
class Pop(nn.Module):
    def forward(self, x: Tensor) -> Any:
        box = yield autopipe.pop("s")
        return x + box.t


@pytest.mark.parametrize("checkpoint", CHECKPOINTS)
def test_a_dataclass_stashed_as_a_skip(checkpoint: str) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(Stash(), nn.Linear(4, 4), Pop()).double()
    assert_like_the_model(model, batch(), lambda out: out.pow(2).sum(), [1, 1, 1], checkpoint=checkpoint)


#: What layers make of their result, and a batch of that kind, of leaves.
CONTAINERS = {"dataclass": (lambda h: State(h, 3.0), lambda: State(batch(), 3.0)),
              "namedtuple": (lambda h: Pair(h, h.exp()), lambda: Pair(batch(), batch()))}


@pytest.mark.parametrize("kind", list(CONTAINERS))
def test_container_inputs_are_split_and_outputs_joined_of_their_type(kind: str) -> None:
    """A dataclass or namedtuple argument is split into micro-batches as a tuple is, and the
    last stage's is joined into one of its type (a namedtuple came back a plain tuple)."""
    make, inputs = CONTAINERS[kind]
    model = chain(make, last=make)
    assert_like_the_model(model, inputs(), lambda out: unwrap(out).pow(2).sum(), [1, 2], chunks=4)


class Keyed(nn.Module):
    """Returns ``{"a", "b"}`` or ``{"b", "a"}``: the key order depends on the data."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 3), nn.Linear(4, 3)

    def forward(self, x: Tensor) -> dict[str, Tensor]:
        a, b = self.a(x), self.b(x)
        return {"a": a, "b": b} if x[0, 0] > 0 else {"b": b, "a": a}


def test_a_dict_output_in_another_key_order_per_micro_batch() -> None:
    """The outputs were joined by key in micro-batch 0's order and the gradients paired by
    position in each micro-batch's own: ``a``'s gradient went to ``b`` in micro-batch 1."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Identity(), Keyed()).double()
    x = batch()
    with torch.no_grad():
        x[0, 0], x[3, 0] = 1.0, -1.0  # micro-batch 0: a, b; micro-batch 1: b, a
    assert_like_the_model(model, x, lambda out: out["a"].sum() + 3 * out["b"].pow(2).sum(), [1, 1], chunks=2)


class Sometimes(nn.Module):
    def forward(self, x: Tensor) -> dict[str, Tensor]:
        return {"a": x, "b": x * 2} if x[0, 0] > 0 else {"a": x}


def test_outputs_holding_other_keys_per_micro_batch_are_refused() -> None:
    pipe = autopipe.Pipeline(nn.Sequential(nn.Identity(), Sometimes()), balance=[1, 1], chunks=2)
    x = torch.randn(4, 4)
    x[0, 0], x[2, 0] = 1.0, -1.0
    message = (r"output is a dict with keys \['a', 'b'\] in micro-batch 0 but a dict with keys \['a'\] in "
               r"micro-batch 1; .* return the same keys")
    with pytest.raises(ValueError, match=message):
        pipe(x)


def test_an_object_holding_tensors_in_its_attributes_is_refused() -> None:
    """Its tensors would cross stages undetached, unsplit: wrong gradients, silently."""
    pipe = autopipe.Pipeline(chain(Holder), balance=[1, 2], chunks=2)
    message = r"type Holder holds tensors in its attributes \(h\).*make Holder a @dataclass"
    with pytest.raises(TypeError, match=message):
        pipe(batch())
    with pytest.raises(TypeError, match=message):
        pipe(Holder(batch()))


@dataclasses.dataclass(frozen=True)
class Derived:
    h: Tensor
    rows: int = dataclasses.field(init=False)
    extra: Any = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "rows", len(self.h))


def test_the_walk_rebuilds_containers_of_their_type() -> None:
    """A frozen dataclass keeps its fields that ``__init__`` does not take; dict items are
    visited in one order however inserted (also with keys of several types); a dataclass's
    tensor outside its fields is refused."""
    value = Derived(torch.ones(3), extra={"b": torch.zeros(1), 1: Pair(torch.ones(2), None)})
    doubled = map_tensors(value, lambda t: t * 2)
    assert type(doubled) is Derived and doubled.rows == 3 and type(doubled.extra[1]) is Pair
    assert list(doubled.extra) == ["b", 1] and doubled.extra[1].aux is None
    assert [t.tolist() for t in tensors_of(doubled)] == [[2.0] * 3, [2.0, 2.0], [0.0]]
    swapped = Derived(torch.ones(3), extra={1: Pair(torch.ones(2), None), "b": torch.zeros(1)})
    assert [t.tolist() for t in tensors_of(swapped)] == [t.tolist() for t in tensors_of(value)]
    object.__setattr__(value, "cache", torch.ones(1))
    with pytest.raises(TypeError, match=r"Derived holds tensors in its attributes \(cache\)"):
        tensors_of(value)


def test_tensors_nested_deep_in_an_objects_attributes_are_refused_too() -> None:
    """A tensor two containers down an attribute is as hidden as one in the attribute itself;
    a container that holds itself is looked into once."""
    holder = Holder(torch.ones(2))
    holder.h = {"w": [torch.ones(2)]}
    with pytest.raises(TypeError, match=r"Holder holds tensors in its attributes \(h\)"):
        tensors_of(holder)
    looped: list[Any] = [1, (2, {"k": [3]})]
    looped.append(looped)
    holder.h = looped
    assert tensors_of(holder) == []


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_train_step_runs_the_loss_under_the_callers_autocast(schedule: str) -> None:
    """``F.cross_entropy(model(x), y)`` under autocast computes in float32 (autocast's rule for
    it); the loss ran after the stage's autocast ended, on the bfloat16 logits, in bfloat16.
    float32, not float64: autocast leaves float64 alone."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 10))
    reference = copy.deepcopy(model)
    pipe = autopipe.Pipeline(model, balance=[2, 1], devices=["cpu"] * 2, chunks=2, schedule=schedule)
    x, y = torch.randn(8, 16), torch.randint(0, 10, (8,))
    with torch.autocast("cpu", torch.bfloat16):
        loss = pipe.train_step(x, target=y, loss_fn=F.cross_entropy)
    losses = []
    for xj, yj in zip(x.split(4), y.split(4)):  # as the stages: one autocast (one cast of the weights) each
        with torch.autocast("cpu", torch.bfloat16):
            losses.append(F.cross_entropy(reference(xj), yj) * len(xj) / len(x))
        losses[-1].backward()
    expected = sum(losses)
    assert loss.dtype == expected.dtype == torch.float32
    assert_close(loss, expected, "loss")
    expected_params = dict(reference.named_parameters())
    for name, param in pipe.named_parameters():
        assert_close(param.grad, expected_params[name].grad, f"{name}.grad")
