"""autopipe: automatic, copy- and memory-aware pipeline parallelism for PyTorch.

The flow is profile → plan → run::

    pipe = autopipe.partition(model, sample_input, devices=["cuda:0", "cuda:1"])
    loss_fn(pipe(x), y).backward()

Names are imported lazily so that ``python -m autopipe --help`` starts fast.
"""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

_EXPORTS: dict[str, str] = {
    # profile
    "profile": "profiling",
    "Profile": "profiling",
    "LayerProfile": "profiling",
    "CopyFit": "profiling",
    "layer_chain": "model",
    "Layer": "model",
    "chain": "model",
    # plan
    "plan": "planning",
    "Plan": "planning",
    "partition": "_partition",
    # run
    "Pipeline": "runtime",
    "skippable": "model",
    "stash": "model",
    "pop": "model",
    "verify_skippables": "model",
    "Namespace": "model",
    "is_recomputing": "runtime",
    "DeferredBatchNorm": "runtime",
    "DistributedPipeline": "distributed",
    # errors: one base, each keeping its built-in base too
    "AutopipeError": "errors",
    "CaptureError": "model",
    "ChainError": "errors",
    "DeviceError": "errors",
    "DistributedError": "errors",
    "FormatError": "errors",
    "LaunchError": "errors",
    "OptionError": "errors",
    "PlanningError": "errors",
    "StageOutputError": "errors",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'autopipe' has no attribute '{name}'")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


if TYPE_CHECKING:  # pragma: no cover - for type checkers and IDEs only
    from .runtime.batchnorm import DeferredBatchNorm
    from .model.capture import chain
    from .runtime.checkpoint import is_recomputing
    from .distributed import DistributedPipeline
    from .errors import (AutopipeError, ChainError, DeviceError, DistributedError, FormatError, LaunchError,
                         OptionError, PlanningError, StageOutputError)
    from .model import CaptureError
    from .model import Layer, layer_chain
    from ._partition import partition
    from .planning.plans import Plan
    from .profiling.profiler import profile
    from .profiling.profiles import CopyFit, LayerProfile, Profile
    from .runtime import Pipeline
    from .model.skip import Namespace, pop, skippable, stash, verify_skippables
    from .planning.replicas import plan
