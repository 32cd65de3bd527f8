"""``DeferredBatchNorm``: batch norm whose running statistics see the whole mini-batch.

In a pipeline a batch norm layer sees one micro-batch at a time.  Normalising per micro-batch
is what the model's gradients expect (each micro-batch is a forward of the plain model), but
updating the running statistics per micro-batch gives ``m`` updates of small-batch statistics
per step instead of one update of the mini-batch's.  ``DeferredBatchNorm`` normalises per
micro-batch and merges each micro-batch's mean and variance into the step's statistics
(Chan's parallel algorithm, so no cancellation), then updates ``running_mean`` and the
**unbiased** ``running_var`` once, exactly as ``nn.BatchNorm`` would on the whole mini-batch.

The pipeline brackets a step with :meth:`begin_step` and :meth:`end_step` (after the last
micro-batch that actually ran: a small batch may give fewer than ``chunks``); with replicas,
whose threads merge into one module at once, the call brackets all of them once.  Recomputation
for checkpointing is skipped (:func:`~autopipe.is_recomputing`).  Outside a step (the layer
used on its own) it behaves exactly like ``nn.BatchNorm``.
"""
from __future__ import annotations

import threading

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.modules.batchnorm import _BatchNorm

from .checkpoint import is_recomputing

__all__ = ["DeferredBatchNorm"]

# Replicas of a pipeline run one module's micro-batches on several threads at once.
_MERGING = threading.Lock()


class DeferredBatchNorm(_BatchNorm):
    """Batch norm over micro-batches with one running-statistics update per mini-batch.

    Its parameters and buffers have the names of ``nn.BatchNorm*``'s, so ``state_dict`` keys
    are unchanged.
    """

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self._step: tuple[float, Tensor, Tensor] | None = None  # count, mean, M2 (sum of squares)
        self._stepping = False

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
                child._step, child._stepping = None, False
        return module

    def begin_step(self) -> None:
        """Start collecting statistics: the micro-batches of one mini-batch follow."""
        self._stepping = True
        self._step = None

    def end_step(self) -> None:
        """Update the running statistics once from the micro-batches seen since :meth:`begin_step`."""
        step, self._step, self._stepping = self._step, None, False
        if step is None:
            return
        count, mean, m2 = step
        assert self.running_mean is not None and self.running_var is not None
        assert self.num_batches_tracked is not None
        with torch.no_grad():
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
        if not self._stepping:
            return super().forward(input)
        assert self.running_mean is not None
        mean = torch.zeros_like(self.running_mean)
        variance = torch.ones_like(mean)
        # momentum 1 turns the "running" buffers into this micro-batch's mean and unbiased
        # variance, computed by batch_norm itself in the same pass that normalises.
        output = self._normalise(input, mean, variance)
        self._merge(float(input.numel() // self.num_features), mean, variance)
        return output

    def _normalise(self, input: Tensor, mean: Tensor | None, variance: Tensor | None) -> Tensor:
        return F.batch_norm(input, mean, variance, self.weight, self.bias, True, 1.0, self.eps)

    def _merge(self, count: float, mean: Tensor, variance: Tensor) -> None:
        with _MERGING:
            self._merge_locked(count, mean, variance)

    def _merge_locked(self, count: float, mean: Tensor, variance: Tensor) -> None:
        m2 = variance * max(count - 1.0, 0.0)
        if self._step is None:
            self._step = (count, mean, m2)
            return
        seen, seen_mean, seen_m2 = self._step
        total = seen + count
        delta = mean - seen_mean
        self._step = (
            total,
            seen_mean + delta * (count / total),
            seen_m2 + m2 + delta * delta * (seen * count / total),
        )


def _convertible(module: nn.Module) -> bool:
    return (
        isinstance(module, (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d))
        and not isinstance(module, DeferredBatchNorm)
        and module.track_running_stats
    )
