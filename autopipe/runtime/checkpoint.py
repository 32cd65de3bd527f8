"""Checkpointing support: the recomputation flag, replayable random number generators and buffers.

A checkpointed micro-batch runs its forward without keeping activations and runs it again
(with grad) just before its backward.  Three things must then hold:

* layers with side effects can tell the two runs apart: :func:`is_recomputing` is ``True``
  on the thread that recomputes (``DeferredBatchNorm`` does not count the batch twice);
* the recomputation draws the same random numbers (dropout masks) as the forward did;
* it reads the buffers the forward read, which the forwards of later micro-batches may have
  updated since (a spectral norm's power-iteration vectors), and what it writes into them
  (batch norm statistics, counters: the forward wrote them already) is undone
  (:func:`buffers_replayed`).

Random numbers come from process-global generators (one for the CPU, one per CUDA device),
and stages run on concurrent threads.  Saving a generator's state before a forward and
restoring it before the recomputation only replays the same numbers if no other stage drew
from that generator in between.  So every stage that draws random numbers holds the
generator's lock around each forward and each recomputation (:class:`RandomGuard`); stages
that never draw do not lock, and so keep running in parallel.  Whether a stage draws is
measured, not guessed: its first guarded forward compares the generator states before and
after.  A stage that draws only on some inputs (data-dependent randomness) would be
misclassified by that test; such a stage breaks the replay and is not supported.
"""
from __future__ import annotations

import contextlib
import threading
from typing import Iterable, Iterator, Sequence

import torch

from ..planning.schedules import checkpointed

__all__ = ["buffers_replayed", "buffers_restored", "checkpointed", "is_recomputing", "recomputing", "RandomGuard"]

_local = threading.local()


@contextlib.contextmanager
def buffers_restored(buffers: Iterable[torch.Tensor]) -> Iterator[None]:
    """Put ``buffers`` back as they were on entry, for a recomputation must not update running
    statistics twice.  Written through ``.data``, which does not bump their autograd version:
    the recomputed graph, or a micro-batch that was not checkpointed (whose backward comes
    later under 1F1B), saved them for backward, and a visible in-place write would fail its
    version check."""
    saved = [(buffer, buffer.detach().clone()) for buffer in buffers]
    try:
        yield
    finally:
        for buffer, value in saved:
            buffer.data.copy_(value)


@contextlib.contextmanager
def buffers_replayed(buffers: Sequence[torch.Tensor], values: Sequence[torch.Tensor]) -> Iterator[None]:
    """``buffers`` hold ``values`` (copies taken before a checkpointed forward) inside the block,
    their own values again after it (:func:`buffers_restored`).  The block is the recomputation
    and its backward: the recomputed graph may have saved a buffer itself (``x * scale``), so
    the backward must see the forward's values too."""
    with buffers_restored(buffers):
        for buffer, value in zip(buffers, values):
            buffer.data.copy_(value)
        yield


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
        self.draws: bool | None = None  # unknown until the first guarded forward

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
            if states is None or self.draws is False:
                yield
                return
            with self._held():
                current = self._states()
                self._set_states(states)
                try:
                    yield
                finally:
                    self._set_states(current)
