"""The device seam: everything that differs between a CPU "device" and a CUDA device.

Timing, synchronisation, memory capacity and peak, compute streams and copies go through a
:class:`DeviceOps`.  The CPU side is what runs and is tested here; the CUDA side follows the
CUDA semantics (events for timing, one stream per stage, copies ordered by events and guarded
with ``record_stream``) and is exercised only by tests that skip without a GPU.
"""
from __future__ import annotations

import contextlib
import time
from abc import ABC, abstractmethod
from typing import ContextManager, Iterable, Iterator, Sequence

import torch
from torch import Tensor

from ._vocab import check_device_name
from ._checks import check_device_list
from .errors import DeviceError

__all__ = ["DeviceOps", "check_not_meta", "meta_tensor", "MATERIALIZE", "ops_for", "resolve_devices",
           "default_devices", "DeviceError"]


class Timer(ABC):
    """Measures one interval on a device, in milliseconds."""

    @abstractmethod
    def start(self) -> None: ...

    @abstractmethod
    def stop(self) -> float:
        """End the interval and return its length in ms (waits for the device)."""


class DeviceOps(ABC):
    """What autopipe needs from one device."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    @abstractmethod
    def timer(self) -> Timer: ...

    @abstractmethod
    def synchronize(self) -> None: ...

    @abstractmethod
    def reset_peak_memory(self) -> None:
        """Start the device's peak statistic again (where it keeps one)."""

    @abstractmethod
    def peak_memory(self) -> int | None:
        """Bytes allocated at the peak since :meth:`reset_peak_memory`, or ``None`` where the
        device keeps no statistic (CPU: :mod:`autopipe.runtime.memory` counts per stage instead)."""

    @abstractmethod
    def capacity(self) -> int | None:
        """Total memory in bytes, or ``None`` where there is no meaningful limit (CPU)."""

    @abstractmethod
    def new_stream(self) -> object | None:
        """A stream for one stage's compute (``None`` where the device has no streams)."""

    @abstractmethod
    def use_stream(self, stream: object | None) -> ContextManager[None]: ...

    @abstractmethod
    def copy_to(self, tensor: Tensor, target: DeviceOps, stream: object | None) -> Tensor:
        """``tensor`` on ``target``'s device, safe to use on ``stream`` of ``target``."""


class _WallTimer(Timer):
    def start(self) -> None:
        self._t0 = time.perf_counter()

    def stop(self) -> float:
        return (time.perf_counter() - self._t0) * 1e3


class CPUOps(DeviceOps):
    """A CPU "device": synchronous, timed with ``perf_counter``, no memory limit."""

    def timer(self) -> Timer:
        return _WallTimer()

    def synchronize(self) -> None:
        pass

    def reset_peak_memory(self) -> None:
        pass

    def peak_memory(self) -> int | None:
        return None

    def capacity(self) -> int | None:
        return None

    def new_stream(self) -> object | None:
        return None

    def use_stream(self, stream: object | None) -> ContextManager[None]:
        return contextlib.nullcontext()

    def copy_to(self, tensor: Tensor, target: DeviceOps, stream: object | None) -> Tensor:
        if isinstance(target, CUDAOps):
            return target.copy_to(tensor, target, stream)
        return tensor.to(target.device)


class _CUDATimer(Timer):
    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._begin = torch.cuda.Event(enable_timing=True)
        self._end = torch.cuda.Event(enable_timing=True)

    def start(self) -> None:
        self._begin.record(torch.cuda.current_stream(self.device))

    def stop(self) -> float:
        self._end.record(torch.cuda.current_stream(self.device))
        self._end.synchronize()
        return float(self._begin.elapsed_time(self._end))


class CUDAOps(DeviceOps):
    """A CUDA device.  Written to the CUDA semantics; not verified on this project's machines."""

    def timer(self) -> Timer:
        return _CUDATimer(self.device)

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.device)

    def reset_peak_memory(self) -> None:
        torch.cuda.reset_peak_memory_stats(self.device)

    def peak_memory(self) -> int | None:
        return int(torch.cuda.max_memory_allocated(self.device))

    def capacity(self) -> int | None:
        return int(torch.cuda.get_device_properties(self.device).total_memory)

    def new_stream(self) -> object | None:
        return torch.cuda.Stream(self.device)

    def use_stream(self, stream: object | None) -> ContextManager[None]:
        if stream is None:
            return contextlib.nullcontext()
        return torch.cuda.stream(stream)  # type: ignore[arg-type]

    def copy_to(self, tensor: Tensor, target: DeviceOps, stream: object | None) -> Tensor:
        """Copy on the destination's stream after the source's current work is done.

        The source tensor's producer stream is waited on by an event, the copy runs on
        ``stream`` (the consumer's), and ``record_stream`` tells each caching allocator that
        the memory is in use on the other stream, so neither block is reused too early.  To a
        CPU (or meta) target the copy is synchronous on the source's current stream.
        """
        if not isinstance(target, CUDAOps):
            return tensor.to(target.device)
        dst_stream = stream if stream is not None else torch.cuda.current_stream(target.device)
        if tensor.is_cuda:
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(tensor.device))
            dst_stream.wait_event(ready)  # type: ignore[attr-defined]
        with _maybe_cuda_stream(dst_stream):
            moved = tensor.to(target.device, non_blocking=True)
        if tensor.is_cuda:
            tensor.record_stream(dst_stream)  # type: ignore[arg-type]
        if moved.is_cuda:
            moved.record_stream(dst_stream)  # type: ignore[arg-type]
        return moved


@contextlib.contextmanager
def _maybe_cuda_stream(stream: object) -> Iterator[None]:
    with torch.cuda.stream(stream):  # type: ignore[arg-type]
        yield


class MetaOps(CPUOps):
    """The ``meta`` device: shapes without data, used in tests to catch misrouted tensors.

    A meta tensor has no values to copy out, so a copy to another device is zeros of its
    shape there: devices and shapes stay checkable end to end, values do not.  That is for
    messages between stages; a caller's meta tensor bound for a device with data is refused
    before (:func:`check_not_meta`), as the plain model refuses it.
    """

    def copy_to(self, tensor: Tensor, target: DeviceOps, stream: object | None) -> Tensor:
        if tensor.is_meta and target.device.type != "meta":
            return torch.zeros(tensor.shape, dtype=tensor.dtype, device=target.device)
        return super().copy_to(tensor, target, stream)


#: The way out for a model built on the meta device (shapes without values) before it computes.
MATERIALIZE = ("materialize it first (model.to_empty(device='cpu'), then load its weights with "
               "model.load_state_dict(...))")


def meta_tensor(module: torch.nn.Module) -> str | None:
    """The name of ``module``'s first parameter or buffer on the meta device, or ``None``."""
    return next((name for name, t in (*module.named_parameters(), *module.named_buffers()) if t.is_meta), None)


def check_not_meta(tensors: Iterable[Tensor], device: torch.device, what: str) -> None:
    """Refuse ``what`` (the caller's tensors) if one is a meta tensor bound for ``device`` with
    data: it holds no values, and :class:`MetaOps` would copy it there as zeros."""
    if device.type != "meta" and any(t.is_meta for t in tensors):
        raise DeviceError(f"{what} is a meta tensor (a shape without values) but goes to a stage on {device}, "
                          "which computes on values; give it as a real tensor (the plain model refuses it too)")


def ops_for(device: torch.device | str) -> DeviceOps:
    """The :class:`DeviceOps` of ``device``; raises :class:`DeviceError` if it does not exist."""
    device = torch.device(device)
    if device.type == "cpu":
        return CPUOps(device)
    if device.type == "meta":
        return MetaOps(device)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise DeviceError(f"device '{device}' requested but CUDA is not available; use 'cpu'")
        index = device.index if device.index is not None else torch.cuda.current_device()
        if index >= torch.cuda.device_count():
            raise DeviceError(
                f"device '{device}' does not exist: this machine has "
                f"{torch.cuda.device_count()} CUDA device(s) (cuda:0..cuda:{torch.cuda.device_count() - 1})"
            )
        return CUDAOps(torch.device("cuda", index))
    raise DeviceError(f"device type '{device.type}' is not supported; use 'cpu' or 'cuda:N'")


def default_devices() -> list[torch.device]:
    """All CUDA devices if there are any, else two CPU devices (one core each)."""
    if torch.cuda.is_available():
        return [torch.device("cuda", i) for i in range(torch.cuda.device_count())]
    return [torch.device("cpu"), torch.device("cpu")]


def resolve_devices(devices: Sequence[torch.device | str | int] | int | None) -> list[torch.device]:
    """Normalise a user's device list (names, indices or a count) and check each exists."""
    check_device_list(devices)
    if devices is None:
        resolved = default_devices()
    elif isinstance(devices, int):
        resolved = _count_of_devices(devices)
    else:
        resolved = [_device(d) for d in devices]
    if not resolved:
        raise DeviceError("no devices given; pass e.g. devices=['cpu', 'cpu'] or devices=['cuda:0', 'cuda:1']")
    for device in resolved:
        ops_for(device)
    return resolved


def _device(given: torch.device | str | int) -> torch.device:
    if isinstance(given, torch.device):
        return given
    if isinstance(given, int) and not isinstance(given, bool):
        if given < 0:
            raise DeviceError(f"device index {given} is negative; CUDA devices are numbered 0, 1, ...")
        return torch.device("cuda", given)
    return torch.device(check_device_name(given))


def _count_of_devices(count: int) -> list[torch.device]:
    if count < 1:
        raise DeviceError(f"device count must be at least 1, got {count}")
    if torch.cuda.is_available():
        if count > torch.cuda.device_count():
            raise DeviceError(f"{count} devices requested but only {torch.cuda.device_count()} CUDA devices exist")
        return [torch.device("cuda", i) for i in range(count)]
    return [torch.device("cpu")] * count
