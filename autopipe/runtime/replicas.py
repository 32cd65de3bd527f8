"""Replicas of one pipeline in one process: data parallel over pipelines.

Each replica is an :class:`~autopipe.runtime.engine.Engine` (its stages and worker threads)
on its own devices.  A call splits the batch with ``torch.tensor_split(batch, replicas)``, each
share into the plan's micro-batches, runs every replica's phase at once (:class:`Replicas`) and
joins the outputs in order, so the caller's loss sees the whole batch as from the plain model.

On CPU devices the replicas run the same layer modules: they share parameter storage, so each
parameter's ``AccumulateGrad`` (thread-safe) sums every replica's gradient into the one
``.grad`` — after ``backward`` it holds the plain model's gradient on the whole batch with no
separate reduction step, the optimizer sees one set of parameters, and the next step computes
with the updated weights everywhere; and what the caller does to the modules (``eval()``, a
hook, an attribute) reaches every replica.

Elsewhere (CUDA) a module lives on one device, so replicas ``1..R-1`` run copies
(:class:`Copies`), as ``torch.nn.parallel`` does: before each forward the first replica's
parameters and buffers are copied to them (with each parameter's ``requires_grad`` and each
module's train/eval mode; hooks and other attributes are the copies' own), and after the
backward their gradients are added into the first replica's and cleared (dropped if the
backward fails, as the first replica's own partial gradient is left for ``zero_grad``; with
two calls' backwards under way at once, when the last ends).  ``parameters()`` stays the first
replica's.  This side runs on CPU in the tests (forced); on CUDA it is written and never ran here.

Batch norm: replicas always use :class:`~autopipe.DeferredBatchNorm` (the pipeline converts),
bracketed here once per call rather than per stage.  Shared, its running statistics are
updated once from the whole batch's statistics, as ``nn.BatchNorm`` on the whole batch would
(plain batch norms would be updated by every replica's thread at once); with copies, from the
first replica's share, as DDP with ``broadcast_buffers``.

Other buffers (a spectral norm's vectors, counters, masks) are shared on CPU too.  A
checkpointed micro-batch recomputes on them as its forward found them, put back into the
buffers for its recomputation and backward (:mod:`autopipe.runtime.checkpoint`), which no other
replica's thread may see, nor move them while its forward reads them.  So in a call that
checkpoints, stage ``i`` of every replica holds one lock around each forward and backward where
it has such buffers (:func:`pair_stages`): those stages run one replica at a time.
"""
from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Sequence, TypeVar

import torch
from torch import Tensor, nn

from .._vocab import Phase
from ..device import ops_for
from ..model import Layer
from ..model._copy import deep_copy
from ._model_calls import join_outputs
from .batchnorm import DeferredBatchNorm
from .checkpoint import BufferSlot, buffer_slots, put, slot_tensor
from .hooks import HeldHooks, fired_after
from .microbatch import Value

if TYPE_CHECKING:
    from .engine import Engine
    from .run import Run

__all__ = ["Copies", "Replicas", "copied_layers", "pair_stages", "shares_parameters"]

_Item = TypeVar("_Item")

#: Held while a phase's jobs go to the workers, so that calls from several threads reach every
#: worker in one order.  In different orders a worker could run one call's job while another
#: waits in the other call's for a message the first worker would send only later: a deadlock.
#: In one order the earliest job not done is every worker's current or next, so it finishes.
_submitting = threading.Lock()


def shares_parameters(devices: Sequence[Sequence[torch.device]]) -> bool:
    """Whether replicas on ``devices`` run the same modules (all CPU) rather than copies."""
    return all(d.type == "cpu" for group in devices for d in group)


def copied_layers(layers: Sequence[Layer]) -> list[Layer]:
    """A replica's own copy of ``layers``: the modules deep-copied together (a module at two
    positions stays one module), placed later with the stages."""
    memo: dict[int, object] = {}
    return [Layer(layer.name, deep_copy(layer.module, memo), layer.stash, layer.pop, layer.prefix)
            for layer in layers]


def pair_stages(engines: Sequence[Engine], shared: bool) -> None:
    """Stage ``i`` of every replica: the call, not the stages, brackets their deferred batch norms;
    and where they run the same modules (``shared``) they share one lock, which they hold while
    they have buffers a recomputation replays (:attr:`Stage.replayed`; the module docstring)."""
    for stages in zip(*(engine.stages for engine in engines)):
        lock = threading.Lock() if shared else None
        for stage in stages:
            stage.brackets_batch_norm = False
            stage.replay_lock = lock


class Copies:
    """The first replica's layers and each copy's, for copying weights out before a forward and
    gradients in after a backward.  Their tensors are paired at each forward: what the caller
    put into the first replica's modules since (``load_state_dict(assign=True)``, ``double()``,
    ``torch.func.functional_call``) is what the copies take, and the copies' gradients go to
    the tensors they were taken from, as autograd's go to the tensors a forward ran on (the
    caller may have put others in place by the backward: ``functional_call`` has returned)."""

    def __init__(self, primary: Sequence[Layer], copies: Sequence[Sequence[Layer]]) -> None:
        self.primary = list(primary)
        self.copies = [list(layers) for layers in copies]
        self._taken: list[list[tuple[Tensor, Tensor]]] | None = None  # the pairs of the latest broadcast
        # backward phases under way: two calls' (two forwards, one loss) run at once, and the
        # copies' gradients are gathered only when the last ends, not while the other adds to them
        self._lock = threading.Lock()
        self._active = 0
        self._failed = False

    @property
    def params(self) -> list[list[tuple[Tensor, Tensor]]]:
        """Each copy's parameters, paired with the first replica's."""
        return [_paired(_params(self.primary), _params(layers)) for layers in self.copies]

    @property
    def buffers(self) -> list[list[tuple[BufferSlot, BufferSlot]]]:
        """Each copy's buffer slots, paired with the first replica's (by where they live, for a
        forward may assign a buffer a new tensor)."""
        return [_paired(_slots(self.primary), _slots(layers)) for layers in self.copies]

    @property
    def modules(self) -> list[list[tuple[nn.Module, nn.Module]]]:
        """Each copy's modules, paired with the first replica's."""
        return [_paired(_modules(self.primary), _modules(layers)) for layers in self.copies]

    @torch.no_grad()
    def broadcast(self) -> None:
        """Every copy takes the first replica's parameters and buffers, written through
        ``.data``, which autograd does not count: a forward whose backward is still pending (two
        forwards, then their backwards) would fail a counted write.  Its saved values change
        only if the first replica's did, whose own backward then fails as the plain model's.
        A tensor of another shape or dtype by now is replaced, on the copy's device.  Each
        parameter's ``requires_grad`` and each module's ``training`` are taken too: a parameter
        frozen or a module put in eval mode since building is so in every replica."""
        self._taken = taken = self.params
        for source, _ in taken[0] if taken else ():
            _check_leaf(source, self.primary)
        for pairs in taken:
            for source, target in pairs:
                if target.shape == source.shape and target.dtype == source.dtype:
                    target.data.copy_(source)
                else:
                    target.data = source.detach().to(target.device, copy=True)
                target.requires_grad_(source.requires_grad)
        for modules in self.modules:
            for first, module in modules:
                module.training = first.training
        for slots in self.buffers:
            for source, target in slots:
                put(target, slot_tensor(source))
        self._synchronize()

    def begin_backward(self) -> None:
        """A backward phase starts adding into the copies' gradients."""
        with self._lock:
            self._active += 1

    def end_backward(self, failed: bool) -> None:
        """A backward phase ended; the last one under way gathers the copies' gradients into the
        first replica's (:meth:`reduce`), or drops them if any of those phases failed."""
        with self._lock:
            self._active -= 1
            self._failed = self._failed or failed
            last, failed = self._active == 0, self._failed
            if last:
                self._failed = False
        if last and failed:
            self.drop_grads()
        elif last:
            self.reduce()

    @torch.no_grad()
    def reduce(self) -> None:
        """Add every copy's gradient into the first replica's, then clear the copy's; none into
        a parameter frozen since the forward (autograd accumulates nothing into a leaf that no
        longer requires grad, and the copies keep the flag they were made with)."""
        self._synchronize()
        for pairs in self._taken or self.params:
            for source, target in pairs:
                if target.grad is None or not source.requires_grad:
                    target.grad = None
                    continue
                grad = target.grad.to(source.device)
                if source.grad is None:
                    source.grad = grad
                else:
                    source.grad.add_(grad)
                target.grad = None

    def drop_grads(self) -> None:
        """Clear every copy's gradient without adding it anywhere: what a failed backward left
        there is not part of any later step's gradient."""
        self._synchronize()
        for pairs in self._taken or self.params:
            for _, target in pairs:
                target.grad = None

    def _synchronize(self) -> None:
        devices = {t.device for pairs in self.params for _, t in pairs}
        devices |= {slot_tensor(slot).device for pairs in self.buffers for _, slot in pairs}
        for device in devices:
            ops_for(device).synchronize()


def _check_leaf(tensor: Tensor, layers: Sequence[Layer]) -> None:
    """Refuse a parameter computed from other tensors (``functional_call`` given ``p * 2``):
    the copies take its value without autograd, so their part of its gradient could not flow
    on to the tensors it was computed from."""
    if tensor.grad_fn is None:
        return
    name = next((layer.path(n) for layer in layers for n, p in layer.module.named_parameters(remove_duplicate=False)
                 if p is tensor), "a parameter")
    raise RuntimeError(
        f"{name} is computed from other tensors (torch.func.functional_call given a tensor made by an operation?), "
        "and replicas on these devices run copies of the parameters, taken without autograd: the copies' part of "
        "its gradient could not reach the tensors it came from. Pass leaf tensors (detach().requires_grad_()) "
        "and read their .grad after backward(), or run the pipeline with replicas=1")


def _paired(first: list[_Item], copy: list[_Item]) -> list[tuple[_Item, _Item]]:
    """The first replica's items paired with a copy's, which were made alike when it was built."""
    if len(first) != len(copy):
        raise RuntimeError("modules, parameters or buffers were added to or removed from the model after the "
                           "pipeline was built, and its replicas run copies of the modules made then (as on CUDA "
                           "devices): build the pipeline after changing the model")
    return list(zip(first, copy))


def _params(layers: Sequence[Layer]) -> list[Tensor]:
    return [p for layer in layers for p in layer.module.parameters()]


def _modules(layers: Sequence[Layer]) -> list[nn.Module]:
    """Layer by layer, as :func:`_slots`."""
    return [module for layer in layers for module in layer.module.modules()]


def _slots(layers: Sequence[Layer]) -> list[BufferSlot]:
    """Layer by layer, so that a module at two positions pairs with each position's copy."""
    return [slot for layer in layers for slot in buffer_slots([layer.module])]


class Replicas:
    """The run of one call on every replica: phases start on all, then wait for all."""

    def __init__(self, engines: Sequence[Engine], runs: Sequence[Run], copies: Copies | None = None) -> None:
        self.pairs = list(zip(engines, runs))
        self.runs = [run for _, run in self.pairs]
        self.copies = copies
        self.held: HeldHooks | None = None  # parameter hooks held during a backward phase (.hooks)
        # with several replicas the call brackets deferred batch norm (module docstring)
        self.deferred: list[DeferredBatchNorm] = []
        if len(self.pairs) > 1:
            stages = [stage for engine, _ in self.pairs for stage in engine.stages]
            self.deferred = list({id(bn): bn for stage in stages for bn in stage.deferred}.values())

    @property
    def sizes(self) -> list[int]:
        """Every micro-batch's size, replica after replica: the batch's order."""
        return [size for run in self.runs for size in run.sizes]

    def take_outputs(self) -> Value:
        """The forward's outputs joined in batch order (:func:`join_outputs`), freed from the runs."""
        return join_outputs([run.outputs.pop(j) for run in self.runs for j in range(run.chunks)], self.sizes)

    def run_phase(self, phase: Phase) -> None:
        self.start_phase(phase)
        self.finish_phase(phase)

    def start_phase(self, phase: Phase) -> None:
        if phase != "backward":  # forward, or a whole training iteration ("train", 1F1B)
            if self.copies is not None:
                self.copies.broadcast()
            for bn in self.deferred:
                bn.begin_step(self.runs[0].step)
        if phase != "forward" and self.copies is not None:
            self.copies.begin_backward()
        held = None if phase == "forward" or self.runs[0].inputs_only else HeldHooks.hold(self._parameters())
        try:
            with _submitting:
                for engine, run in self.pairs:
                    engine.start_phase(run, phase)
        except BaseException:
            if held is not None:
                held.release(fire=False)
            for bn in self.deferred if phase != "backward" else ():
                bn.end_step(self.runs[0].step, update=False)
            raise
        self.held = held

    def finish_phase(self, phase: Phase) -> None:
        """Wait for every replica; then raise the first failure, if any, or fire the
        parameter hooks held since the phase started, once (:mod:`autopipe.runtime.hooks`)."""
        held, self.held = self.held, None
        with fired_after(held):
            self._finish(phase)

    def _finish(self, phase: Phase) -> None:
        failure: BaseException | None = None
        for engine, run in self.pairs:
            try:
                engine.finish_phase(run, phase)
            except BaseException as error:  # every replica must stop before the caller goes on
                failure = failure or error
        if phase != "forward" and self.copies is not None:
            self.copies.end_backward(failure is not None)
        if phase != "backward":
            for bn in self.deferred:
                bn.end_step(self.runs[0].step, update=failure is None)
        if failure is not None:
            raise failure

    def _parameters(self) -> list[Tensor]:
        """The first replica's parameters: every replica's where they share them, and where
        replicas run copies, the ones the copies' gradients are gathered into."""
        return [p for stage in self.pairs[0][0].stages for module in stage.modules for p in module.parameters()]
