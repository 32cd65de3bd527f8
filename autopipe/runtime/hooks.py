"""Parameter hooks fired once per pipeline backward, as on the plain model.

Each stage runs ``torch.autograd.backward`` per micro-batch (and each replica its own), so a
parameter's ``AccumulateGrad`` runs once per micro-batch: left alone, a tensor hook
(``p.register_hook``) would be applied to each micro-batch's gradient and the results summed (a
clamp or a normalisation then gives another ``.grad``), and a post-accumulate hook
(``p.register_post_accumulate_grad_hook``, the "optimizer in backward" recipe) would fire on
partial gradients, stepping several times per backward.

So a backward phase (a caller's ``loss.backward()`` through the pipeline, or ``train_step``)
holds such parameters' hooks aside (:meth:`HeldHooks.hold`: torch keeps them in the dicts
``_backward_hooks`` and ``_post_accumulate_grad_hooks``, which autograd reads at each call, so
emptying them in place silences them) and their ``.grad`` aside too, so that the stages
accumulate the phase's gradient alone.  When every stage is done, on the caller's thread,
:meth:`HeldHooks.release` puts the hooks back and does what one ``AccumulateGrad`` does on the
plain model: the tensor hooks in turn on the phase's whole gradient (each may replace it), its
sum into ``.grad``, then the post-accumulate hooks.  A failed phase puts its partial gradient
into ``.grad`` and fires nothing: an optimizer in backward steps on no partial gradient.

Where the tie's backward cannot wait for the stages (:mod:`autopipe.runtime.function`: a CUDA
output gradient, no input needing one), the hooks fire in the callback it queues at the end of
the caller's backward; should that backward fail first, the callback never runs and the hooks
stay held aside (that CUDA path is unverified).  Several calls backwarded by one loss fire the
hooks once per call, each on its own gradient.

Parameters without such hooks (the common case) are only looked at.  A backward into named
inputs (``autograd.grad(loss, x)``) runs no parameter's ``AccumulateGrad``, as on the plain
model, so it holds nothing (:class:`~autopipe.runtime.replicas.Replicas` asks).
"""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Iterable, Iterator

import torch
from torch import Tensor

__all__ = ["HeldHooks", "fired_after"]

_Hooks = list[tuple[Any, Any]]  # a hook dict's (handle id, hook) items, in registration order


@dataclass
class _Held:
    """One parameter's hooks and ``.grad`` as they were before the phase."""

    param: Tensor
    grad: Tensor | None
    tensor_hooks: _Hooks
    post_hooks: _Hooks

    @classmethod
    def take(cls, param: Tensor) -> _Held:
        """Empty ``param``'s hook dicts and ``.grad``, keeping what they held."""
        held = cls(param, param.grad, _emptied(param._backward_hooks), _emptied(param._post_accumulate_grad_hooks))
        param.grad = None
        return held

    def put_back_hooks(self) -> None:
        _refilled(self.param._backward_hooks, self.tensor_hooks)
        _refilled(self.param._post_accumulate_grad_hooks, self.post_hooks)

    def accumulate(self, fire: bool) -> None:
        """Add the phase's gradient into ``.grad`` as it was, through the hooks if ``fire``.

        The old ``.grad`` goes back first: a tensor hook that raises leaves it without the
        phase's gradient, as it would on the plain model."""
        step, self.param.grad = self.param.grad, self.grad
        if step is None:  # the parameter took no part: its AccumulateGrad would not have run
            return
        for _, hook in self.tensor_hooks if fire else ():
            replaced = hook(step)
            step = step if replaced is None else replaced
        if self.grad is None:
            self.param.grad = step
        else:
            self.grad.add_(step)
        for _, hook in self.post_hooks if fire else ():
            hook(self.param)


class HeldHooks:
    """The hooks of a backward phase's parameters, held aside until :meth:`release`."""

    def __init__(self, held: list[_Held]) -> None:
        self._held = held

    @classmethod
    def hold(cls, params: Iterable[Tensor]) -> HeldHooks | None:
        """Hold the hooks of those ``params`` that have any; ``None`` where none has."""
        held = [_Held.take(p) for p in _unique(params) if p._backward_hooks or p._post_accumulate_grad_hooks]
        return cls(held) if held else None

    @torch.no_grad()  # as autograd runs hooks (no create_graph: the tie refuses it)
    def release(self, fire: bool) -> None:
        """Put the hooks back, then accumulate each parameter's gradient of the phase, firing
        its hooks once if ``fire`` (the phase succeeded).  The hooks are back before any fires,
        so a hook that removes itself (``handle.remove()``) stays removed.  A hook that raises
        stops the firing; every later parameter still gets its gradient."""
        for held in self._held:
            held.put_back_hooks()
        pending = list(reversed(self._held))  # the last stage's first, as a backward reaches them
        try:
            while pending:
                pending.pop(0).accumulate(fire)
        finally:
            for held in pending:
                held.accumulate(fire=False)


def _unique(params: Iterable[Tensor]) -> list[Tensor]:
    """``params`` once each (a module at two positions lists its parameters twice)."""
    return list({id(p): p for p in params}.values())


def _emptied(hooks: dict[Any, Any] | None) -> _Hooks:
    """``hooks``'s items, the dict emptied in place (autograd holds the dict itself)."""
    if not hooks:
        return []
    items = list(hooks.items())
    hooks.clear()
    return items


def _refilled(hooks: dict[Any, Any] | None, items: _Hooks) -> None:
    """``items`` back into ``hooks`` ahead of any hook registered while they were held."""
    if hooks is None or not items:
        return
    added = list(hooks.items())
    hooks.clear()
    hooks.update(items)
    hooks.update(added)


@contextmanager
def fired_after(held: HeldHooks | None) -> Iterator[None]:
    """Run the rest of a backward phase; then fire ``held``'s hooks once, or where the phase
    failed put them back unfired (its partial gradient goes into ``.grad`` as it is)."""
    try:
        yield
    except BaseException:
        if held is not None:
            held.release(fire=False)
        raise
    if held is not None:
        held.release(fire=True)
