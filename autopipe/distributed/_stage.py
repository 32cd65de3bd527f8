"""One rank's layers as the engine's stage module; the engine only talks to neighbours, so a skip
is relayed by every stage between its producer and its consumer."""
from __future__ import annotations

import itertools
from typing import Any, Hashable, Sequence

import torch
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint as checkpoint_fn

from .._vocab import CheckpointMode
from ..errors import StageOutputError
from ..model import Layer
from ..model._tensors import Value, items_of, map_tensors, tensors_of
from ..model.skip import SkipTracker, use_skip_tracker
from ..runtime.aliases import Watch
from ..runtime.inplace import aliased_copies
from ..runtime.checkpoint import (buffer_slots, buffers_kept, buffers_replayed, buffers_restored, checkpointed,
                                  is_recomputing, recomputing, writes_undone)
from ..runtime.skips import SkipSpan
from ._probe import params_kept

__all__ = ["StageModule", "zero_on"]


class StageModule(nn.Module):
    """One rank's layers as the engine's stage: ``(main, *skips_in) -> (main, *skips_out)``.

    The engine sends tensors only, each as one positional argument of the next stage, so the main
    value travels as its tensors (walked as the in-process runtime walks values) and its form (the
    value with placeholders for them: containers, keys, non-tensor items) goes once, with the shape
    probe's metadata (:class:`~autopipe.distributed._schedule.Stage`).  The receiver knows how many
    trailing arguments are skips and fills the form with the rest.  The probe also fixes each sent
    tensor's shape and dtype (the receiver's buffers): the sending rank refuses a micro-batch's value
    of another form, shape or dtype and sends zeros of the probe's in its place (:attr:`refusal`),
    so the step ends on every rank before it raises.  The last stage's output reaches
    ``loss_fn`` from here (:meth:`take_output`), not through the engine, so any value with tensors
    that the in-process runtime returns reaches the loss as the layer returned it.
    """

    def __init__(self, layers: Sequence[Layer], index: int, num_stages: int,
                 routes: Sequence[SkipSpan], checkpoint: CheckpointMode = "never", chunks: int = 1) -> None:
        super().__init__()
        self.layers = nn.ModuleList(layer.module for layer in layers)
        self.layer_names = [layer.name for layer in layers]
        self._path_of = [layer.path for layer in layers]  # each layer's paths in the model, for messages
        self.index = index
        self.is_last = index == num_stages - 1
        self.skips_in = [route.key for route in routes if route.crosses_into(index)]
        self.skips_out = [route.key for route in routes if route.crosses_out_of(index)]
        self.checkpoint = checkpoint
        self.chunks = chunks
        #: The micro-batch being run, set by :class:`_Stage`; ``None`` in the engine's shape probe.
        self.micro_batch: int | None = None
        #: The form of the main value this stage sent in the shape probe, and its signature, which every
        #: micro-batch's must equal: the receiver fills that one form.
        self.sent_form: Value = None
        self._sent_signature: Hashable = None
        #: Each tensor sent in the shape probe: its shape, dtype and whether it needed a gradient, which every
        #: micro-batch's must equal (the receiver's buffers have them); and its values, until they go to the next
        #: stage, whose probe then runs on them (:meth:`_take_probe_values`).
        self._sent_metas: list[tuple[torch.Size, torch.dtype, bool]] = []
        self.probe_sent: tuple[Tensor, ...] | None = None
        #: Which parameters required grad in the shape probe, where this stage sends something (else ``None``).
        self.probe_trainable: list[bool] | None = None
        #: Whether the form went to the next stage (a torch without the metadata hooks never sends it:
        #: the receiver then reads one tensor as itself and several as a tuple, so nothing else may go).
        self.form_sent = False
        #: The form of the main value the stage before sent, ``None`` on the first stage (its inputs are the step's).
        self.received_form: Value = None
        #: The values the stage before sent in its shape probe, until this stage's probe takes them.
        self.probe_received: tuple[Tensor, ...] | None = None
        #: The last stage's output in the micro-batch run last, until ``loss_fn`` takes it.
        self.output: Any = None
        #: Why a value this stage computed in a micro-batch cannot go on (the last stage's output to ``loss_fn``,
        #: another stage's to the next rank), set mid-step (raising there would leave the other ranks waiting)
        #: while zeros stand in for it; the pipeline raises it on every rank after the step.
        self.refusal: str | None = None

    def forward(self, *received: Tensor) -> Any:
        if self.micro_batch is None:  # the engine's shape probe, which the plain model never ran
            self._take_probe_values(received)
            with buffers_restored(buffer_slots([self])), params_kept(self.parameters()):
                return self._run(*received)
        if self._checkpointing():
            return self._checkpointed(*received)
        return self._run(*received)

    def _run(self, *received: Tensor) -> Any:
        # Received activations are autograd leaves; an in-place first op (ReLU(inplace=True))
        # on a leaf that requires grad fails, so the layers work on a copy (which also leaves
        # a checkpoint's saved inputs intact for the recomputation).  The first stage's are the
        # caller's batch (in the shape probe its very memory), which such an op would write: the
        # probe's write would reach the first micro-batch, and the micro-batches' views share one
        # version counter, so they work on copies too (one for tensors that are one).
        received = aliased_copies(received) if self.index == 0 else tuple(_non_leaf(t) for t in received)
        n_main = len(received) - len(self.skips_in)
        main = self._main_of(received[:n_main])
        tracker = SkipTracker()
        for key, tensor in zip(self.skips_in, received[n_main:]):
            tracker.save(key, tensor)
        named = [("their input" if n_main == 1 else f"their input (tensor {i})", t)
                 for i, t in enumerate(received[:n_main])]
        named += [(f"the skip '{key}'", t) for key, t in zip(self.skips_in, received[n_main:])]
        watch = Watch([(what, tensor, {0: others}) for what, tensor, others in _equals(named)], by_value=True)
        with use_skip_tracker(tracker):
            for layer in self.layers:
                main = layer(main)
        watch.check(f"stage {self.index} ('{self.layer_names[0]}'..)", self.micro_batch)
        if self.is_last:
            return self._output(main, received)
        try:
            return self._sent(main, tracker)
        except StageOutputError as error:
            if self._probing():  # nothing fixed yet to stand in for
                raise
            # the first refusal of the step is the one reported
            self.refusal = self.refusal or (f"{error}. This step ran with zeros in its place, so its gradients are "
                                            "not the plain model's: call zero_grad() before the next step")
            return self._stand_in(received)

    def _probing(self) -> bool:
        """Whether this run is the engine's shape probe (``micro_batch`` is ``None`` in a recomputation too)."""
        return self.micro_batch is None and not is_recomputing()

    def _take_probe_values(self, received: Sequence[Tensor]) -> None:
        """Give the probe the values the stage before computed in its own (the first micro-batch's): torch
        makes this probe's tensors from their shapes alone, uninitialised, and a layer would read garbage
        (ids an embedding refuses, targets out of range).  The first stage's probe gets the first micro-batch."""
        if self.probe_received is None:
            return
        with torch.no_grad():
            for tensor, value in zip(received, self.probe_received):
                tensor.copy_(value)
        self.probe_received = None

    def _checkpointing(self) -> bool:
        """As the in-process runtime: ``except_last`` keeps the last micro-batch's activations."""
        if not torch.is_grad_enabled() or self.micro_batch is None:
            return False
        return checkpointed(self.checkpoint, self.micro_batch, self.chunks)

    def _checkpointed(self, *received: Tensor) -> Any:
        """Recompute the stage in backward on its buffers as the forward found them (the later
        micro-batches' forwards update them: a spectral norm's vectors), and put back what the
        recomputation writes (``nn.BatchNorm`` does not ask :func:`is_recomputing`), refusing a
        parameter the forward wrote into and the recomputation moved (:func:`writes_undone`) at the
        step's end, on every rank."""
        buffers = buffer_slots([self])
        kept = buffers_kept(buffers)
        named = [(path(name), param) for path, module in zip(self._path_of, self.layers)
                 for name, param in module.named_parameters()]
        versions = [param._version for _, param in named]
        where = f"stage {self.index}, checkpointed micro-batch {self.micro_batch},"
        calls = 0

        def run(*args: Tensor) -> Any:
            nonlocal calls
            calls += 1
            if calls == 1:
                return self._run(*args)
            written = [(name, param) for (name, param), then in zip(named, versions) if param._version != then]
            with recomputing(), buffers_replayed(buffers, kept), writes_undone(written, where, self._refuse):
                return self._run(*args)

        return checkpoint_fn(run, *received, use_reentrant=False)

    def _refuse(self, why: str) -> None:
        """Keep the step's first refusal, which every rank raises at its end."""
        self.refusal = self.refusal or f"{why}. This step ran on the moved values"

    def take_output(self) -> Any:
        """The last stage's output in the micro-batch run last, as its layer returned it, let go here."""
        output, self.output = self.output, None
        return output

    def _main_of(self, tensors: Sequence[Tensor]) -> Any:
        """The main value the stage before sent, or the first stage's inputs (one tensor, or a tuple)."""
        if self.received_form is not None:
            return _filled(self.received_form, tensors)
        return tensors[0] if len(tensors) == 1 else tuple(tensors)

    def _sent(self, main: Any, tracker: SkipTracker) -> tuple[Tensor, ...]:
        """The main value's tensors, then the skips', contiguous: the receiver's buffers copy the probe's
        strides and gloo refuses non-contiguous buffers (a slice like ``x[:, :8]``).  The shape probe keeps
        what the receiver's buffers and form are made from; a micro-batch that sends anything else is refused."""
        tensors = self._main_tensors(main)
        sent = tuple(t.contiguous() for t in tensors + tuple(self._skip_out(tracker, key) for key in self.skips_out))
        if self._probing():
            self._sent_metas = [(t.shape, t.dtype, t.requires_grad) for t in sent]
            self.probe_sent = tuple(t.detach().cpu() for t in sent)
            self.probe_trainable = [p.requires_grad for p in self.parameters()]
        else:
            self._check_shapes(sent, len(tensors))
        return sent

    def unfrozen_without_gradient(self) -> list[nn.Parameter]:
        """The parameters that require grad now but did not in the shape probe, where nothing this
        stage sent then needed a gradient: the engine fixed in the probe that none comes back."""
        if self.probe_trainable is None or any(needs for _, _, needs in self._sent_metas):
            return []
        return [p for p, was in zip(self.parameters(), self.probe_trainable) if p.requires_grad and not was]

    def _check_shapes(self, sent: Sequence[Tensor], n_main: int) -> None:
        """Refuse a tensor whose shape or dtype differs from the probe's, which the receiver's buffer has."""
        for i, (tensor, (shape, dtype, _)) in enumerate(zip(sent, self._sent_metas)):
            if tensor.shape != shape or tensor.dtype != dtype:
                raise StageOutputError(
                    f"stage {self.index} sends {self._what_sent(i, n_main)} with shape "
                    f"{_shape(tensor.shape, tensor.dtype)} in micro-batch {self.micro_batch} but "
                    f"{_shape(shape, dtype)} in the first step's shape probe; torch.distributed.pipelining fixes "
                    "the shape and dtype of each tensor sent between stages at the first step and would read this "
                    "one into a buffer of the probe's (wrong values, no error). Fix: give every micro-batch the same "
                    "shapes (pad to a fixed length rather than trimming to the longest), or build a new "
                    "DistributedPipeline on every rank for each new shape")

    def _what_sent(self, position: int, n_main: int) -> str:
        """The sent tensor at ``position``, named for the user: part of the last layer's value, or a skip."""
        if position >= n_main:
            return f"the skip '{self.skips_out[position - n_main]}'"
        whose = f"the value its last layer '{self.layer_names[-1]}' returns"
        return whose if n_main == 1 else f"tensor {position} of {whose}"

    def _stand_in(self, received: Sequence[Tensor]) -> tuple[Tensor, ...]:
        """Zeros of the probe's shapes and dtypes, in place of a refused micro-batch's tensors: the receiver runs
        on them and the step ends on every rank.  Those that needed a gradient are on :meth:`_zero`'s graph."""
        zero = self._zero(received)
        device = received[0].device
        return tuple(torch.zeros(shape, dtype=dtype, device=device) + zero if grad
                     else torch.zeros(shape, dtype=dtype, device=device) for shape, dtype, grad in self._sent_metas)

    def _zero(self, received: Sequence[Tensor]) -> Tensor:
        """Zero on the graph of the received tensors and of this stage's parameters that train, whose backward
        gives them zeros as a micro-batch's would: with replicas, DDP's last backward of a step waits for each
        parameter's gradient, and one it finds unused there breaks its next step."""
        return zero_on([*received, *(p for p in self.parameters() if p.requires_grad)])

    def _main_tensors(self, main: Any) -> tuple[Tensor, ...]:
        """The main value's tensors; the shape probe keeps its form for the receiver, which fills that
        form in every micro-batch, so a micro-batch whose value has another form is refused."""
        tensors = self._tensors(main, "stage {index} ends with layer '{layer}', which returns {value}")
        signature = _signature(main)
        if self._probing():
            self.sent_form, self._sent_signature = _form(main), signature
        elif not self.form_sent and not _bare(main):
            raise StageOutputError(
                f"stage {self.index} ends with layer '{self.layer_names[-1]}', which returns {_describe(main)}, and "
                f"this torch ({torch.__version__}) did not pass its form to the next stage, which would read it as "
                "a tensor or a plain tuple of tensors. Fix: make that layer return a tensor or a tuple of tensors, "
                "split the model at another layer, or use the torch this package is tested with (2.14)")
        elif signature != self._sent_signature:
            raise StageOutputError(
                f"stage {self.index} ends with layer '{self.layer_names[-1]}', which returns {_describe(main)} in "
                f"micro-batch {self.micro_batch} unlike in the first step's shape probe; the engine sends the tensors "
                "and fixes the rest (container types, keys, non-tensor items) at the first step. Fix: return the "
                "same containers and plain values whatever the input, or split the model at another layer")
        return tuple(tensors)

    def _output(self, main: Any, received: Sequence[Tensor]) -> Tensor:
        """The last stage's output stays here for ``loss_fn`` (:meth:`take_output`, right after this
        forward), and the engine gets one of its tensors: the engine takes tensors only and fixes their
        count at the first step, which a dict whose keys vary between steps would not keep.  An output
        without tensors is put in :attr:`refusal` and :meth:`_zero` stands in, so the step ends on
        every rank (the received tensors' and parameters' gradients are zeros) and then raises on all."""
        try:
            tensors = [main] if isinstance(main, Tensor) else self._tensors(
                main, "the last stage ends with layer '{layer}', which returns {value}")
        except StageOutputError as error:
            self.refusal = f"{error}. This step ran with a zero loss in its place"
            return self._zero(received)
        if self.micro_batch is not None and not is_recomputing():  # the probe and a recomputation feed no loss
            self.output = main
        return tensors[0]

    def _tensors(self, value: Any, what: str) -> list[Tensor]:
        """The tensors in a stage's main value: at least one (the engine sends and differentiates
        tensors, and has nothing to send for a value of none), none hidden in an object's attributes."""
        said = what.format(index=self.index, layer=self.layer_names[-1], value=_describe(value))
        try:
            tensors = tensors_of(value)
        except TypeError as error:
            raise StageOutputError(f"{said}: {error}") from None
        if not tensors:
            raise StageOutputError(
                f"{said}, with no tensor in it; torch.distributed.pipelining sends and differentiates tensors "
                "only. Fix: make that layer return its tensors (numbers as tensors), or split the model at "
                "another layer (change the plan's balance)")
        return tensors

    def _skip_out(self, tracker: SkipTracker, key: Any) -> Tensor:
        """The engine sends tensors only (``.contiguous()`` on anything else fails inside it)."""
        value = tracker.tensors.pop(key)
        if isinstance(value, Tensor):
            return value
        raise StageOutputError(
            f"the skip '{key}' holds {_describe(value)} and crosses from stage {self.index} to a later rank; "
            "torch.distributed.pipelining sends tensors only, so a skip between stages must be one tensor. "
            "Fix: stash each tensor under its own name, split the model so the stash and its pop share a "
            "stage (change the plan's balance), or use the in-process runtime (autopipe.Pipeline)")


def _bare(value: Value) -> bool:
    """Whether the next stage reads ``value`` right without its form: a tensor, or a plain tuple
    of two or more tensors."""
    return isinstance(value, Tensor) or (type(value) is tuple and len(value) > 1
                                         and all(isinstance(t, Tensor) for t in value))


def _form(value: Value) -> Value:
    """``value`` with each tensor replaced by an empty meta tensor: what the receiver fills, small to send."""
    return map_tensors(value, lambda tensor: torch.empty(0, device="meta"))


def _filled(form: Value, tensors: Sequence[Tensor]) -> Value:
    """``form`` with its placeholders replaced by ``tensors``, in the walk's order (the order sent)."""
    queue = iter(tensors)
    return map_tensors(form, lambda placeholder: next(queue))


def _signature(value: Value) -> Hashable:
    """What a value's form is made of, comparable across micro-batches: container types, keys (a
    dict's in walk order, whatever its insertion order) and the non-tensor items' reprs."""
    if isinstance(value, Tensor):
        return "tensor"
    items = items_of(value)
    if items is None:
        return type(value), repr(value)
    return type(value), tuple((key, _signature(item)) for key, item in items)


def zero_on(value: Value) -> Tensor:
    """Zero, computed from the value's tensors that need a gradient (its backward gives them zeros),
    or a zero of its own when none does (nothing before the loss trains)."""
    parts = [t.sum() * 0 for t in tensors_of(value) if t.requires_grad]
    return torch.stack(parts).sum() if parts else torch.zeros((), requires_grad=True)


def _equals(named: Sequence[tuple[str, Tensor]]) -> list[tuple[str, Tensor, frozenset[str]]]:
    """Each received tensor equal to others received (same shape, dtype and values), with what
    those are.  The engine sends every tensor on its own, so a stash that was the very tensor
    the stage before returned (or that another name stashed) arrives as a separate copy; the
    values tell (a distinct tensor of equal values is refused too, if written into, which
    costs the user a clone)."""
    others: list[set[str]] = [set() for _ in named]
    for i, j in itertools.combinations(range(len(named)), 2):  # each pair compared once
        (what, tensor), (other, twin) = named[i], named[j]
        if twin is tensor:  # one tensor passed twice (step(x, x), copied once): a write reaches both, as planned
            continue
        if twin.shape == tensor.shape and twin.dtype == tensor.dtype and torch.equal(twin, tensor):
            others[i].add(other)
            others[j].add(what)
    return [(what, tensor, frozenset(names)) for (what, tensor), names in zip(named, others) if names]


def _non_leaf(tensor: Tensor) -> Tensor:
    return _Received.apply(tensor) if tensor.is_leaf and tensor.requires_grad else tensor


class _Received(torch.autograd.Function):
    """A copy of a received tensor for the layers, whose gradient goes back contiguous: gloo
    sends only contiguous tensors, and a layer's backward may give a view (``torch.cat``'s
    gives slices of the output's gradient)."""

    @staticmethod
    def forward(ctx: Any, tensor: Tensor) -> Tensor:  # type: ignore[override]
        return tensor.clone()

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Tensor:  # type: ignore[override]
        return grad.contiguous()


def _shape(shape: Sequence[int], dtype: torch.dtype) -> str:
    return f"{tuple(shape)} {str(dtype).removeprefix('torch.')}"


def _describe(value: Any) -> str:
    if isinstance(value, (tuple, list)):
        inner = ", ".join(type(v).__name__ for v in value)
        return f"a {type(value).__name__} of ({inner})"
    return f"a {type(value).__name__}"
