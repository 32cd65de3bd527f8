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
    "profile": "profiler",
    "Profile": "profiles",
    "LayerProfile": "profiles",
    "CopyFit": "profiles",
    "layer_chain": "layers",
    "Layer": "layers",
    "chain": "capture",
    # plan
    "plan": "solver",
    "Plan": "plans",
    "partition": "partition",
    # run
    "Pipeline": "runtime",
    "skippable": "skip",
    "stash": "skip",
    "pop": "skip",
    "verify_skippables": "skip",
    "Namespace": "skip",
    "is_recomputing": "checkpoint",
    "DeferredBatchNorm": "batchnorm",
    "DistributedPipeline": "distributed",
    # errors
    "FormatError": "jsonio",
    "DeviceError": "device",
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
    from .batchnorm import DeferredBatchNorm
    from .capture import chain
    from .checkpoint import is_recomputing
    from .device import DeviceError
    from .distributed import DistributedPipeline
    from .jsonio import FormatError
    from .layers import Layer, layer_chain
    from .partition import partition
    from .plans import Plan
    from .profiler import profile
    from .profiles import CopyFit, LayerProfile, Profile
    from .runtime import Pipeline
    from .skip import Namespace, pop, skippable, stash, verify_skippables
    from .solver import plan
