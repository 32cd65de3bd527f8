"""One rank's layers as the engine's stage module; the engine only talks to neighbours, so a skip
is relayed by every stage between its producer and its consumer."""
from __future__ import annotations

import itertools
from typing import Any, Sequence

import torch
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint as checkpoint_fn

from .._vocab import CheckpointMode
from ..errors import StageOutputError
from ..model import Layer
from ..model.skip import SkipTracker, use_skip_tracker
from ..runtime.aliases import Watch
from ..runtime.checkpoint import (buffer_slots, buffers_kept, buffers_replayed, buffers_restored, checkpointed,
                                  recomputing)
from ..runtime.skips import SkipSpan

__all__ = ["StageModule"]


class StageModule(nn.Module):
    """One rank's layers as the engine's stage: ``(main, *skips_in) -> (main, *skips_out)``.

    The engine passes a stage's outputs as the next stage's positional arguments, so a tuple main
    value travels flattened; the receiver knows how many trailing arguments are skips and packs
    the rest back into the tuple the next layer expects.
    """

    def __init__(self, layers: Sequence[Layer], index: int, num_stages: int,
                 routes: Sequence[SkipSpan], checkpoint: CheckpointMode = "never", chunks: int = 1) -> None:
        super().__init__()
        self.layers = nn.ModuleList(layer.module for layer in layers)
        self.layer_names = [layer.name for layer in layers]
        self.index = index
        self.is_last = index == num_stages - 1
        self.skips_in = [route.key for route in routes if route.crosses_into(index)]
        self.skips_out = [route.key for route in routes if route.crosses_out_of(index)]
        self.checkpoint = checkpoint
        self.chunks = chunks
        #: The micro-batch being run, set by :class:`_Stage`; ``None`` in the engine's shape probe.
        self.micro_batch: int | None = None

    def forward(self, *received: Tensor) -> Any:
        if self.micro_batch is None:  # the engine's shape probe, which the plain model never ran
            with buffers_restored(buffer_slots([self])):
                return self._run(*received)
        if self._checkpointing():
            return self._checkpointed(*received)
        return self._run(*received)

    def _run(self, *received: Tensor) -> Any:
        # Received activations are autograd leaves; an in-place first op (ReLU(inplace=True))
        # on a leaf that requires grad fails, so the layers work on a copy (which also leaves
        # a checkpoint's saved inputs intact for the recomputation).
        received = tuple(_non_leaf(t) for t in received)
        n_main = len(received) - len(self.skips_in)
        main: Any = received[0] if n_main == 1 else tuple(received[:n_main])
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
            return main
        sent = self._flat_main(main) + tuple(self._skip_out(tracker, key) for key in self.skips_out)
        # The receiver's buffers copy the first micro-batch's strides and gloo refuses
        # non-contiguous buffers (a slice like x[:, :8]), so send contiguous tensors only.
        return tuple(t.contiguous() for t in sent)

    def _checkpointing(self) -> bool:
        """As the in-process runtime: ``except_last`` keeps the last micro-batch's activations."""
        if not torch.is_grad_enabled() or self.micro_batch is None:
            return False
        return checkpointed(self.checkpoint, self.micro_batch, self.chunks)

    def _checkpointed(self, *received: Tensor) -> Any:
        """Recompute the stage in backward on its buffers as the forward found them (the later
        micro-batches' forwards update them: a spectral norm's vectors), and put back what the
        recomputation writes (``nn.BatchNorm`` does not ask :func:`is_recomputing`)."""
        buffers = buffer_slots([self])
        kept = buffers_kept(buffers)
        calls = 0

        def run(*args: Tensor) -> Any:
            nonlocal calls
            calls += 1
            if calls == 1:
                return self._run(*args)
            with recomputing(), buffers_replayed(buffers, kept):
                return self._run(*args)

        return checkpoint_fn(run, *received, use_reentrant=False)

    def _flat_main(self, main: Any) -> tuple[Tensor, ...]:
        if isinstance(main, Tensor):
            return (main,)
        if isinstance(main, (tuple, list)) and len(main) > 1 and all(isinstance(t, Tensor) for t in main):
            return tuple(main)
        raise StageOutputError(
            f"stage {self.index} ends with layer '{self.layer_names[-1]}', which returns "
            f"{_describe(main)}; torch.distributed.pipelining can only send a tensor or a flat "
            "tuple of two or more tensors to the next rank. Fix: split the model at another layer "
            "(change the plan's balance) or make that layer return tensors only"
        )

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


def _equals(named: Sequence[tuple[str, Tensor]]) -> list[tuple[str, Tensor, frozenset[str]]]:
    """Each received tensor equal to others received (same shape, dtype and values), with what
    those are.  The engine sends every tensor on its own, so a stash that was the very tensor
    the stage before returned (or that another name stashed) arrives as a separate copy; the
    values tell (a distinct tensor of equal values is refused too, if written into, which
    costs the user a clone)."""
    others: list[set[str]] = [set() for _ in named]
    for i, j in itertools.combinations(range(len(named)), 2):  # each pair compared once
        (what, tensor), (other, twin) = named[i], named[j]
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


def _describe(value: Any) -> str:
    if isinstance(value, (tuple, list)):
        inner = ", ".join(type(v).__name__ for v in value)
        return f"a {type(value).__name__} of ({inner})"
    return f"a {type(value).__name__}"
