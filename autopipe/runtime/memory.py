"""Each stage's peak memory over one pipeline call (forward and backward), measured.

What counts as a stage's memory depends on its device (the :mod:`autopipe.device` seam):

* a device that keeps statistics (CUDA) reports its own peak, reset when the call starts:
  everything on that device, including what other stages on it hold;
* a CPU stage, whose device shares one address space with every other CPU stage, is charged
  what it holds when the call starts (its parameters, buffers and existing gradients) plus the
  peak of what its worker thread allocates during the call, however long each allocation lives
  and whoever frees it (:class:`~autopipe.profiling._meter.AllocationCounter`).  A tensor passed to the
  next CPU stage is the same memory, so it is charged once, to the stage that made it.

Optimizer state is not the pipeline's: :func:`optimizer_state_bytes` counts it for a caller
that has the optimizer.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import ContextManager, Iterable, Iterator, Protocol, Sequence

import torch
from torch import Tensor, nn

from ..profiling._meter import AllocationCounter
from ..device import DeviceOps

__all__ = ["StagePeak", "StageMeter", "optimizer_state_bytes", "unique_bytes"]


class Stage(Protocol):
    """What the meter needs of a :class:`~autopipe.runtime.stage.Stage`."""

    index: int
    ops: DeviceOps
    modules: list[nn.Module]


@dataclass(frozen=True)
class StagePeak:
    """One stage's measured peak in bytes; ``per_device`` when it is its whole device's (CUDA)."""

    peak_bytes: int
    per_device: bool


class StageMeter:
    """Measures every stage's peak over one call; made when the call starts."""

    def __init__(self, stages: Sequence[Stage]) -> None:
        self.stages = list(stages)
        self.counter = AllocationCounter()
        self.resident = [0 if _tracks_device(s) else unique_bytes(_state_of(s)) for s in self.stages]
        for stage in self.stages:
            if _tracks_device(stage):
                stage.ops.synchronize()
                stage.ops.reset_peak_memory()

    def track(self, stage: Stage) -> ContextManager[None]:
        """Wrap the stage worker's job: its thread's allocations count as the stage's."""
        if _tracks_device(stage):
            return contextlib.nullcontext()
        return self.counter.track(stage.index)

    def peaks(self) -> list[StagePeak]:
        """Each stage's peak since the meter was made."""
        result = []
        for stage, resident in zip(self.stages, self.resident):
            if _tracks_device(stage):
                stage.ops.synchronize()
                result.append(StagePeak(int(stage.ops.peak_memory() or 0), True))
            else:
                result.append(StagePeak(resident + self.counter.peak.get(stage.index, 0), False))
        return result


def _tracks_device(stage: Stage) -> bool:
    """Whether the stage's device reports its own peak (``DeviceOps.peak_memory`` not ``None``)."""
    return stage.ops.peak_memory() is not None


def _state_of(stage: Stage) -> list[Tensor]:
    params = [p for m in stage.modules for p in m.parameters()]
    grads = [p.grad for p in params if p.grad is not None]
    return params + grads + [b for m in stage.modules for b in m.buffers()]


def unique_bytes(tensors: Iterable[Tensor]) -> int:
    """Bytes of the distinct storages behind ``tensors`` (views and repeats counted once); a
    sparse tensor (an ``Embedding(sparse=True)``'s gradient) by the dense tensors it holds."""
    sizes: dict[int, int] = {}
    for tensor in _strided(tensors):
        storage = tensor.untyped_storage()
        sizes[storage.data_ptr()] = storage.nbytes()
    return sum(sizes.values())


def _strided(tensors: Iterable[Tensor]) -> Iterator[Tensor]:
    """``tensors``, each sparse one (COO, what autograd gives sparse layers) as its indices and values."""
    for tensor in tensors:
        if tensor.layout == torch.sparse_coo:
            yield from (tensor._indices(), tensor._values())
        else:
            yield tensor


def optimizer_state_bytes(optimizer: torch.optim.Optimizer, params: Iterable[Tensor]) -> int:
    """Bytes of ``optimizer``'s state tensors for ``params`` (momentum buffers, Adam's moments;
    0 before its first step and for plain SGD)."""
    return unique_bytes(value for p in params for value in optimizer.state.get(p, {}).values()
                        if isinstance(value, Tensor) and value.numel() > 1)
