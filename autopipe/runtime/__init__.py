"""Step 4, the runtime: takes a model and a :class:`~autopipe.planning.Plan` (or a manual balance);
gives a :class:`Pipeline`.

A :class:`Pipeline` is an ``nn.Module`` that runs the plan's stages on worker threads (one per
stage), splits batches into micro-batches, checkpoints, defers batch norm, sends skips straight
to the stage that pops them, and ties the stages into the caller's autograd so that
``loss.backward()`` gives the plain model's gradients.
"""
from .batchnorm import DeferredBatchNorm
from .checkpoint import is_recomputing
from .pipeline import Pipeline
from .run import StageError

__all__ = ["DeferredBatchNorm", "Pipeline", "StageError", "is_recomputing"]
