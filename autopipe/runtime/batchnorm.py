"""``DeferredBatchNorm``: batch norm whose running statistics see the whole mini-batch.

In a pipeline a batch norm layer sees one micro-batch at a time.  Normalising per micro-batch
is what the model's gradients expect (each micro-batch is a forward of the plain model), but
updating the running statistics per micro-batch gives ``m`` updates of small-batch statistics
per step instead of one update of the mini-batch's.  ``DeferredBatchNorm`` normalises per
micro-batch and merges each micro-batch's mean and variance into the step's statistics
(Chan's parallel algorithm, so no cancellation), then updates ``running_mean`` and the
**unbiased** ``running_var`` once, exactly as ``nn.BatchNorm`` would on the whole mini-batch.
A module called several times in one forward (at two positions of the chain, or twice by one
layer) updates them once per call, as the plain model does, in call order: the ``k``-th call
of every micro-batch's forward is merged into the step's ``k``-th statistics.  Calls are
numbered per thread within :func:`micro_batch_forward`, which the stage puts around each
micro-batch's forward (replicas run one module on several threads at once).

The pipeline brackets a step with :meth:`begin_step` and :meth:`end_step` (after the last
micro-batch that actually ran: a small batch may give fewer than ``chunks``); with replicas,
whose threads merge into one module at once, the call brackets all of them once.  Each step has
its own key (the call's), which :func:`micro_batch_forward` tells the module: calls from several
threads overlap, and with replicas their steps are under way in one module at once, each
collecting its own statistics; a failed step updates nothing.  Recomputation
for checkpointing is skipped (:func:`~autopipe.is_recomputing`).  Outside a step (the layer
used on its own) it behaves exactly like ``nn.BatchNorm``.
"""
from __future__ import annotations

import contextlib
import threading
from typing import Iterator

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.modules.batchnorm import _BatchNorm

from .checkpoint import is_recomputing

__all__ = ["DeferredBatchNorm", "micro_batch_forward", "subclassed"]

# Replicas of a pipeline run one module's micro-batches on several threads at once.
_MERGING = threading.Lock()

#: A micro-batch's count, mean and M2 (sum of squared deviations) at one call, or several merged.
Statistics = tuple[float, Tensor, Tensor]

# ``step``: the key of the step this thread's micro-batch forward belongs to; ``calls``: how often
# each deferred batch norm (by id) was called in it
_forward = threading.local()


@contextlib.contextmanager
def micro_batch_forward(step: object) -> Iterator[None]:
    """One micro-batch's forward of the step ``step`` on this thread: a deferred batch norm's
    calls in it are its first, second, ... call of that step (module docstring)."""
    _forward.step, _forward.calls = step, {}
    try:
        yield
    finally:
        del _forward.step, _forward.calls


class DeferredBatchNorm(_BatchNorm):
    """Batch norm over micro-batches with one running-statistics update per mini-batch (and
    per call, for a module a forward calls more than once).

    Its parameters and buffers have the names of ``nn.BatchNorm*``'s, so ``state_dict`` keys
    are unchanged.
    """

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        # by the key of each step under way: its statistics of each call, in call order
        self._steps: dict[object, list[Statistics]] = {}

    def __setstate__(self, state: dict[str, object]) -> None:
        """Unpickled (``torch.save`` of a whole module) with no step under way, also from a file
        written when the module kept one step's statistics (``_step``, ``_stepping``)."""
        super().__setstate__({key: value for key, value in state.items() if key not in ("_step", "_stepping")})
        self._steps = {}

    def _check_input_dim(self, input: Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(f"expected at least 2D input (got {input.dim()}D input)")

    @classmethod
    def convert(cls, module: nn.Module) -> nn.Module:
        """``module`` with every ``nn.BatchNorm1d/2d/3d`` in it (tracking running statistics),
        itself included, made a ``DeferredBatchNorm`` in place: the same objects, so the model,
        its hooks, ``train()``/``eval()`` and ``.to()`` still reach them (a new module at a
        top-level layer was the pipeline's alone: ``model.eval()`` left it training)."""
        for child in module.modules():
            if _convertible(child):
                child.__class__ = cls
                child._steps = {}
        return module

    def begin_step(self, key: object) -> None:
        """Start collecting the statistics of step ``key``: the micro-batches of one mini-batch
        follow (their forwards under :func:`micro_batch_forward` with that key)."""
        with _MERGING:
            self._steps[key] = []

    def end_step(self, key: object, update: bool = True) -> None:
        """End step ``key``: if ``update`` (it succeeded), update the running statistics once per
        call of a forward, in call order, from its micro-batches."""
        with _MERGING:
            step = self._steps.pop(key, [])
        for statistics in step if update else ():
            self._update(*statistics)

    @torch.no_grad()
    def _update(self, count: float, mean: Tensor, m2: Tensor) -> None:
        """What ``nn.BatchNorm``'s training forward does to the buffers on a batch of ``count``
        with ``mean`` and ``m2``."""
        assert self.running_mean is not None and self.running_var is not None
        assert self.num_batches_tracked is not None
        self.num_batches_tracked.add_(1)
        factor = 1.0 / float(self.num_batches_tracked) if self.momentum is None else self.momentum
        variance = m2 / max(count - 1.0, 1.0)
        self.running_mean.mul_(1.0 - factor).add_(mean, alpha=factor)
        self.running_var.mul_(1.0 - factor).add_(variance, alpha=factor)

    def forward(self, input: Tensor) -> Tensor:
        if not self.training:
            return super().forward(input)
        self._check_input_dim(input)
        if is_recomputing():  # the step's statistics already have this micro-batch
            return self._normalise(input, None, None)
        step = getattr(_forward, "step", None)
        if step is None or step not in self._steps:  # used on its own, not by a stage's forward
            return super().forward(input)
        calls = _forward.calls
        call = calls.get(id(self), 0)
        calls[id(self)] = call + 1
        assert self.running_mean is not None
        mean = torch.zeros_like(self.running_mean)
        variance = torch.ones_like(mean)
        # momentum 1 turns the "running" buffers into this micro-batch's mean and unbiased
        # variance, computed by batch_norm itself in the same pass that normalises.
        output = self._normalise(input, mean, variance)
        self._merge(step, call, float(input.numel() // self.num_features), mean, variance)
        return output

    def _normalise(self, input: Tensor, mean: Tensor | None, variance: Tensor | None) -> Tensor:
        return F.batch_norm(input, mean, variance, self.weight, self.bias, True, 1.0, self.eps)

    def _merge(self, key: object, call: int, count: float, mean: Tensor, variance: Tensor) -> None:
        """Merge a micro-batch's statistics at its ``call``-th call into step ``key``'s at that
        call (a thread reaches call ``k`` only after its call ``k - 1`` made the entry ``k - 1``)."""
        statistics = (count, mean, variance * max(count - 1.0, 0.0))
        with _MERGING:
            step = self._steps[key]
            if call == len(step):
                step.append(statistics)
            else:
                step[call] = _merged(step[call], statistics)


def _merged(seen: Statistics, new: Statistics) -> Statistics:
    """Two batches' statistics as one batch's (Chan et al.)."""
    seen_count, seen_mean, seen_m2 = seen
    count, mean, m2 = new
    total = seen_count + count
    delta = mean - seen_mean
    return total, seen_mean + delta * (count / total), seen_m2 + m2 + delta * delta * (seen_count * count / total)


#: The batch norms a DeferredBatchNorm takes over: these classes exactly (a subclass's own
#: forward, or a @skippable one's stash and pop, would be lost in the class swap).
_PLAIN = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d)


def _convertible(module: nn.Module) -> bool:
    return type(module) in _PLAIN and module.track_running_stats


def subclassed(module: nn.Module) -> list[str]:
    """The names of ``module``'s training batch norms that deferral cannot take over: subclasses
    of ``nn.BatchNorm*`` (their forward is their own)."""
    return [name or type(child).__name__ for name, child in module.named_modules()
            if isinstance(child, _PLAIN) and type(child) not in _PLAIN and child.track_running_stats and child.training]
