"""Checkpointing support: the recomputation flag, replayable random number generators and buffers.

A checkpointed micro-batch runs its forward without keeping activations and runs it again
(with grad) just before its backward.  Three things must then hold:

* layers with side effects can tell the two runs apart: :func:`is_recomputing` is ``True``
  on the thread that recomputes (``DeferredBatchNorm`` does not count the batch twice);
* the recomputation draws the same random numbers (dropout masks) as the forward did;
* it reads the buffers the forward read, which the forwards of later micro-batches may have
  updated since (a spectral norm's power-iteration vectors), and what it writes into them
  (batch norm statistics, counters: the forward wrote them already) is undone
  (:func:`buffers_replayed`); a parameter the forward writes into is left as the
  recomputation found it, and refused where the recomputation moves it (:func:`writes_undone`).

Random numbers come from process-global generators (one for the CPU, one per CUDA device),
and stages run on concurrent threads.  Saving a generator's state before a forward and
restoring it before the recomputation only replays the same numbers if no other stage drew
from that generator in between.  So every stage that draws random numbers holds the
generator's lock around each forward and each recomputation (:class:`RandomGuard`); stages
that never draw do not lock, and so keep running in parallel.  Whether a stage draws is
measured, not guessed: its first guarded forward of each call compares the generator states
before and after (a call's modules may draw where the last call's did not: dropout turned on
by a schedule, or ``train()`` after ``eval()``), and a recomputation replays every forward
whose states were saved.  A stage that draws only on some inputs of one call (data-dependent
randomness) would be misclassified by that test; such a stage breaks the replay and is not
supported.
"""
from __future__ import annotations

import contextlib
import threading
from typing import Callable, Container, Iterable, Iterator, Sequence

import torch
from torch import nn

from ..planning.schedules import checkpointed

__all__ = ["BufferSlot", "buffer_slots", "buffers_kept", "buffers_replayed", "buffers_restored", "checkpointed",
           "is_recomputing", "put", "recomputing", "slot_tensor", "writes_undone", "RandomGuard"]

_local = threading.local()


#: Where a buffer lives, ``module._buffers[name]``: a forward may assign its buffer a new tensor
#: (``self.count = self.count + 1``) rather than write into it, and the tensor found before is
#: then no longer the module's; so buffers are kept and put back through their slots.
BufferSlot = tuple[nn.Module, str]


def buffer_slots(modules: Iterable[nn.Module], skip: Container[int] = ()) -> list[BufferSlot]:
    """The buffer slots of ``modules`` and their submodules (each module once), but for the
    modules whose ``id`` is in ``skip``."""
    slots: list[BufferSlot] = []
    seen: set[int] = set()
    for top in modules:
        for module in top.modules():
            if id(module) not in seen and id(module) not in skip:
                seen.add(id(module))
                slots += [(module, name) for name, buffer in module._buffers.items() if buffer is not None]
    return slots


def slot_tensor(slot: BufferSlot) -> torch.Tensor:
    """The tensor in ``slot`` now."""
    module, name = slot
    tensor = module._buffers[name]
    assert tensor is not None, f"buffer '{name}' was set to None"
    return tensor


def buffers_kept(slots: Sequence[BufferSlot]) -> list[torch.Tensor]:
    """A copy of each slot's tensor now (slots holding one tensor share one copy)."""
    return _copies([slot_tensor(slot) for slot in slots])


def _copies(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    copies: dict[int, torch.Tensor] = {}
    for tensor in tensors:
        copies.setdefault(id(tensor), tensor.detach().clone())
    return [copies[id(tensor)] for tensor in tensors]


def put(slot: BufferSlot, value: torch.Tensor) -> None:
    """``value`` into the tensor in ``slot``, through ``.data``, which does not bump its autograd
    version (see :func:`buffers_restored`); where the slot holds a tensor of another shape or
    dtype by now, a copy of ``value`` takes its place."""
    tensor = slot_tensor(slot)
    if tensor.shape == value.shape and tensor.dtype == value.dtype:
        tensor.data.copy_(value)
    else:
        module, name = slot
        module._buffers[name] = value.detach().to(tensor.device, copy=True)


@contextlib.contextmanager
def buffers_restored(slots: Sequence[BufferSlot]) -> Iterator[None]:
    """The buffers of ``slots`` back as they were on entry, the same tensors with the same
    values, for a recomputation must not update running statistics twice.  Written through
    ``.data``, which does not bump their autograd version: the recomputed graph, or a
    micro-batch that was not checkpointed (whose backward comes later under 1F1B), saved them
    for backward, and a visible in-place write would fail its version check."""
    tensors = [slot_tensor(slot) for slot in slots]
    values = _copies(tensors)
    try:
        yield
    finally:
        for (module, name), tensor, value in zip(slots, tensors, values):
            module._buffers[name] = tensor
            tensor.data.copy_(value)


@contextlib.contextmanager
def buffers_replayed(slots: Sequence[BufferSlot], values: Sequence[torch.Tensor]) -> Iterator[None]:
    """The buffers of ``slots`` hold ``values`` (:func:`buffers_kept` before a checkpointed
    forward) inside the block, and are as on entry after it (:func:`buffers_restored`).  The
    block is the recomputation and its backward: the recomputed graph may have saved a buffer
    itself (``x * scale``), so the backward must see the forward's values too."""
    with buffers_restored(slots):
        for slot, value in zip(slots, values):
            put(slot, value)
        yield


@contextlib.contextmanager
def writes_undone(written: Sequence[tuple[str, torch.Tensor]], where: str,
                  refuse: Callable[[str], None]) -> Iterator[None]:
    """Put back the parameters a forward wrote into (``written``, named) as its recomputation found
    them, and pass ``refuse`` why the recomputation is refused (naming the stage and micro-batch,
    ``where``) if it changed one: a write that gives the same values again (``max_norm``'s
    renormalisation, a clamp) recomputes the forward, but one that moves them each time (a running
    average kept in a frozen ``nn.Parameter``) would apply twice and recompute from other values
    than the forward read.  Buffers, unlike parameters, are kept and replayed as the forward found
    them.  Also where the recomputation ends early (``torch.utils.checkpoint`` stops it once it has
    what the backward needs)."""
    kept = [(name, param, param.detach().clone()) for name, param in written]
    try:
        yield
    finally:
        moved = []
        with torch.no_grad():
            for name, param, value in kept:
                if not torch.equal(param, value):
                    param.copy_(value)
                    moved.append(repr(name))
        if moved:
            refuse(f"{where} wrote into parameter(s) {', '.join(moved)} in its forward, and its recomputation "
                   "moved them again (a running statistic kept in an nn.Parameter?): it would apply the update "
                   "twice and recompute from other values than its forward read, giving other gradients than the "
                   "plain model. Fix: keep such state in a buffer (module.register_buffer(name, tensor)), which "
                   "checkpointing keeps and replays as the forward found it, or use checkpoint='never'")


def is_recomputing() -> bool:
    """``True`` while this thread recomputes a checkpointed forward for its backward."""
    return getattr(_local, "recomputing", False)


@contextlib.contextmanager
def recomputing() -> Iterator[None]:
    """Mark this thread as recomputing inside the block."""
    previous = is_recomputing()
    _local.recomputing = True
    try:
        yield
    finally:
        _local.recomputing = previous


_locks: dict[str, threading.Lock] = {}
_locks_guard = threading.Lock()


def _generator_lock(name: str) -> threading.Lock:
    with _locks_guard:
        return _locks.setdefault(name, threading.Lock())


RngStates = list[torch.Tensor]


class RandomGuard:
    """Serialises and replays one stage's random draws on its device's generators.

    ``(forward)``::

        stage A  ──lock──[F0 draws]──unlock──        ──lock──[F1]──unlock──
        stage B               ──lock──[F0 draws]──unlock──
                  states saved under the lock, so each forward's draws are its own

    ``(backward)``: lock, set the saved states, recompute, restore the current states, unlock.
    """

    def __init__(self, device: torch.device) -> None:
        self.cuda = device if device.type == "cuda" else None
        names = ["cpu"] + ([str(device)] if self.cuda is not None else [])
        self.locks = [_generator_lock(name) for name in names]
        self.draws: bool | None = None  # unknown until the first guarded forward of a call

    def measure_again(self) -> None:
        """Forget whether the stage draws, at the start of a call: the next guarded forward
        measures it (the modules may have changed since the last call)."""
        self.draws = None

    def _states(self) -> RngStates:
        states = [torch.get_rng_state()]
        if self.cuda is not None:
            states.append(torch.cuda.get_rng_state(self.cuda))
        return states

    def _set_states(self, states: RngStates) -> None:
        torch.set_rng_state(states[0])
        if self.cuda is not None:
            torch.cuda.set_rng_state(states[1], self.cuda)

    @contextlib.contextmanager
    def _held(self) -> Iterator[None]:
        with contextlib.ExitStack() as stack:
            for lock in self.locks:
                stack.enter_context(lock)
            yield

    @contextlib.contextmanager
    def forward(self) -> Iterator[RngStates | None]:
        """Run a forward; yields the generator states to replay it (``None``: no draws)."""
        if self.draws is False:
            yield None
            return
        with self._held():
            before = self._states()
            yield before
            if self.draws is None:
                after = self._states()
                self.draws = any(not torch.equal(a, b) for a, b in zip(before, after))

    @contextlib.contextmanager
    def replay(self, states: RngStates | None) -> Iterator[None]:
        """Recompute with the generators as they were at the forward that saved ``states``."""
        with recomputing():
            if states is None:  # its forward was not guarded: the stage did not draw then
                yield
                return
            with self._held():
                current = self._states()
                self._set_states(states)
                try:
                    yield
                finally:
                    self._set_states(current)
