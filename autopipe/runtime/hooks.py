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
stand-ins put in place of their values silence them, and a handle can still remove its hook
meanwhile) and their ``.grad`` aside too, so that the stages
accumulate the phase's gradient alone.  When every stage is done, on the caller's thread,
:meth:`HeldHooks.release` puts the hooks back and does what one ``AccumulateGrad`` does on the
plain model: the tensor hooks in turn on the phase's whole gradient (each may replace it), its
sum into ``.grad``, then the post-accumulate hooks.  A failed phase puts its partial gradient
into ``.grad`` and fires nothing: an optimizer in backward steps on no partial gradient.

Where the tie's backward cannot wait for the stages (:mod:`autopipe.runtime.function`: a CUDA
output gradient, no input needing one), the hooks fire in the callback it queues at the end of
the caller's backward; should that backward fail first, the callback never runs and the hooks
stay held aside (that CUDA path is unverified).  Several calls backwarded by one loss fire the
hooks once per call, each on its own gradient (where the tie cannot wait, their phases overlap,
as below), and so does a loss that also uses the parameters
outside the pipeline (an explicit L2 term: its part accumulates outside the phase, hooks and
all); a hook registered during the phase on a parameter with none before it fires per
micro-batch.

Calls from several threads may overlap too: a phase that starts while another holds a parameter's
hooks joins that hold (the two phases' gradients then sum in one ``.grad``, which cannot be
told apart), and the hooks fire once, on the summed gradient, when the last of them ends (none
fire if one failed).  A call's own hold never takes another's stand-ins for hooks, and one that
would hold a parameter whose hooks are firing waits until they are done; hooks fire outside any
lock, so one may wait for another thread's pipeline.

Parameters without such hooks (the common case) are only looked at.  A backward into named
inputs (``autograd.grad(loss, x)``) runs no parameter's ``AccumulateGrad``, as on the plain
model, so it holds nothing (:class:`~autopipe.runtime.replicas.Replicas` asks).
"""
from __future__ import annotations

import functools
import threading
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Iterable, Iterator

import torch
from torch import Tensor

__all__ = ["HeldHooks", "fired_after"]

_Hooks = list[tuple[Any, Any]]  # a hook dict's (handle id, hook) items, in registration order


@dataclass
class _Held:
    """One parameter's hooks and ``.grad`` as they were before the phases that hold them: how
    many phases under way do, and whether all that ended succeeded."""

    param: Tensor
    grad: Tensor | None
    tensor_hooks: _Hooks
    post_hooks: _Hooks
    phases: int = 1
    fire: bool = True
    releasing: bool = False  # the last phase is putting its hooks back and firing them

    @classmethod
    def take(cls, param: Tensor) -> _Held:
        """Silence ``param``'s hooks and empty its ``.grad``, keeping what they held."""
        held = cls(param, param.grad, _silenced(param._backward_hooks, _keep_gradient),
                   _silenced(param._post_accumulate_grad_hooks, _nothing))
        param.grad = None
        return held

    def put_back_hooks(self) -> None:
        """The hooks back in place of their stand-ins; one removed meanwhile (``handle.remove()``)
        stays removed, and is not fired."""
        self.tensor_hooks = _restored(self.param._backward_hooks, self.tensor_hooks)
        self.post_hooks = _restored(self.param._post_accumulate_grad_hooks, self.post_hooks)

    def accumulate(self, fire: bool) -> None:
        """Add the phase's gradient into ``.grad`` as it was, through the hooks if ``fire``.

        The old ``.grad`` goes back first: a tensor hook that raises leaves it without the
        phase's gradient, as it would on the plain model."""
        step, self.param.grad = self.param.grad, self.grad
        if step is None:  # the parameter took no part: its AccumulateGrad would not have run
            return
        for key, hook in self.tensor_hooks if fire else ():
            if _registered(self.param._backward_hooks, key):  # a hook fired before may remove it
                replaced = hook(step)
                step = step if replaced is None else replaced
        if self.grad is None:
            self.param.grad = step
        else:
            self.grad.add_(step)
        for key, hook in self.post_hooks if fire else ():
            if _registered(self.param._post_accumulate_grad_hooks, key):
                hook(self.param)


# The parameters whose hooks phases under way hold, by id, read and written under the condition's lock.
# Hooks fire outside it (a hook may wait for another thread's pipeline); a phase that would hold a
# parameter whose hooks are firing waits until they are done.
_holding: dict[int, _Held] = {}
_changed = threading.Condition()


class HeldHooks:
    """The hooks of a backward phase's parameters, held aside until :meth:`release`."""

    def __init__(self, held: list[_Held]) -> None:
        self._held = held

    @classmethod
    def hold(cls, params: Iterable[Tensor]) -> HeldHooks | None:
        """Hold the hooks of those ``params`` that have any, or join a phase under way that holds
        them (module docstring); ``None`` where none has."""
        held = []
        with _changed:
            for param in _unique(params):
                _changed.wait_for(functools.partial(_not_firing, id(param)))
                entry = _holding.get(id(param))
                if entry is not None:
                    entry.phases += 1
                elif param._backward_hooks or param._post_accumulate_grad_hooks:
                    entry = _holding[id(param)] = _Held.take(param)
                else:
                    continue
                held.append(entry)
        return cls(held) if held else None

    @torch.no_grad()  # as autograd runs hooks (no create_graph: the tie refuses it)
    def release(self, fire: bool) -> None:
        """End this phase's hold: where no other phase holds a parameter any more, put its hooks
        back, then accumulate its gradient of the phases, firing its hooks once if ``fire``
        (every phase succeeded).  The hooks are back before any fires, so a hook that removes
        itself (``handle.remove()``) stays removed.  A hook that raises stops the firing; every
        later parameter still gets its gradient."""
        with _changed:
            ended = []
            for held in self._held:
                held.phases, held.fire = held.phases - 1, held.fire and fire
                if not held.phases:
                    held.releasing = True
                    ended.append(held)
        pending = list(reversed(ended))  # the last stage's first, as a backward reaches them
        try:
            for held in ended:
                held.put_back_hooks()
            while pending:
                held = pending.pop(0)
                held.accumulate(held.fire)
        finally:
            for held in pending:
                held.accumulate(fire=False)
            with _changed:
                for held in ended:
                    del _holding[id(held.param)]
                _changed.notify_all()


def _not_firing(key: int) -> bool:
    """Whether the parameter of id ``key`` is not having its hooks fired by a phase's end."""
    entry = _holding.get(key)
    return entry is None or not entry.releasing


def _unique(params: Iterable[Tensor]) -> list[Tensor]:
    """``params`` once each (a module at two positions lists its parameters twice)."""
    return list({id(p): p for p in params}.values())


def _silenced(hooks: dict[Any, Any] | None, stand_in: Any) -> _Hooks:
    """``hooks``'s items, each replaced in place by ``stand_in`` (autograd holds the dict itself
    and reads it at each call); the keys stay, so a handle can still remove its hook."""
    if not hooks:
        return []
    items = list(hooks.items())
    for key, _ in items:
        hooks[key] = stand_in
    return items


def _restored(hooks: dict[Any, Any] | None, items: _Hooks) -> _Hooks:
    """Each of ``items`` whose key is still in ``hooks`` put back there; those."""
    if hooks is None:
        return []
    kept = [(key, hook) for key, hook in items if key in hooks]
    for key, hook in kept:
        hooks[key] = hook
    return kept


def _registered(hooks: dict[Any, Any] | None, key: Any) -> bool:
    """Whether the hook of ``key`` is still registered (its handle not removed)."""
    return hooks is not None and key in hooks


def _keep_gradient(grad: Tensor) -> None:
    """A tensor hook's stand-in: leaves the gradient as it is."""


def _nothing(param: Tensor) -> None:
    """A post-accumulate hook's stand-in."""


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
