"""Keeping a stage's inputs as they arrived when its first layer writes into them in place.

Three computations must not change the tensors they read: a checkpointed micro-batch's no-grad
forward (its backward recomputes from the same saved inputs), its recomputation (on one device a
received tensor can be the sender's own saved input, passed on as output or skip, which the
sender's recomputation reads after it) and stage 0's (its inputs are views of the caller's
batch).  A first layer such as ``LeakyReLU(inplace=True)``, ``Dropout(inplace=True)`` or
``x.add_(1)`` does exactly that, so such a stage must compute on copies.  Whether it does is
measured, not guessed, from the tensors' version counters: the first guarded computation in each
training mode runs on copies and looks whether they were written; if not, later ones run on the
originals and are still checked, so a stage that writes only on some inputs is reported as an
error rather than giving a wrong result.  Inputs that are one tensor (``pipe(x, x)``: each
micro-batch's two arguments are views of the same rows) get one copy, so a write into one still
reaches the other, as in the plain model.
"""
from __future__ import annotations

import contextlib
from typing import Iterator

from torch import Tensor

from ..model._tensors import Value, map_distinct, tensors_of

__all__ = ["InputGuard", "aliased_copies"]


class InputGuard:
    """One stage's knowledge of whether its layers write into their inputs, per training mode."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.writes: dict[bool, bool] = {}

    @contextlib.contextmanager
    def kept(self, inputs: Value, training: bool) -> Iterator[Value]:
        """Yield what to compute on instead of ``inputs`` so that ``inputs`` stay unchanged."""
        known = self.writes.get(training)
        if known is not False:
            copies = aliased_copies(inputs)
            yield copies
            if known is None:
                self.writes[training] = any(t._version for t in tensors_of(copies))
            return
        before = [t._version for t in tensors_of(inputs)]
        yield inputs
        if [t._version for t in tensors_of(inputs)] != before:
            self.writes[training] = True
            raise RuntimeError(
                f"{self.name}: its layers wrote into their input in place on this call but not on "
                "the first one, so this call's recomputation or the caller's batch would be wrong; "
                "autopipe now copies this stage's inputs first: run the step again"
            )


def aliased_copies(inputs: Value) -> Value:
    """``inputs`` with each tensor cloned, one clone for tensors that are one: the same object,
    or, needing no gradient, views of the same memory alike (storage, offset, shape, strides,
    dtype, class, and a conjugate's or a negation's lazy flag: ``z.conj()`` shares ``z``'s
    memory, not its values).  Two views needing gradients may have their own autograd histories,
    so only the same object shares a clone (the stage's inputs make one leaf of one tensor)."""
    return map_distinct(inputs, Tensor.clone, _memory)


def _memory(t: Tensor) -> tuple[object, ...]:
    """What :func:`aliased_copies` copies once: the tensor object, or its view of memory."""
    pointer = t.untyped_storage().data_ptr()
    if t.requires_grad or not pointer:
        return (id(t),)
    return pointer, t.device, t.storage_offset(), tuple(t.shape), t.stride(), t.dtype, t.is_conj(), t.is_neg(), type(t)
