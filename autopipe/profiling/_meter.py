"""Bytes of CPU memory allocated per owner (a pipeline stage, a profiled layer), live and at peak.

CPU memory has no per-device statistics, and a pipeline's CPU stages share one address space,
so a stage's memory is defined by who allocates it: every tensor storage created by an operator
that runs on the stage's thread, counted from its creation until the storage is freed (by any
thread).  A :class:`~torch.utils._python_dispatch.TorchDispatchMode` entered on that thread sees
every operator it runs below autograd — forward ops, the backward ops autograd runs on that
thread, gradient accumulation — and a finalizer on each new storage sees its release.

What it cannot see is memory an operator's kernel allocates and frees internally (oneDNN
scratch space, for instance): the profiler's workspace measurement uses this same counter, so
prediction and measurement agree on what they count.
"""
from __future__ import annotations

import contextlib
import threading
import weakref
from typing import Any, Hashable, Iterator

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

__all__: list[str] = []


class AllocationCounter:
    """Live and peak bytes of the storages each owner allocated while :meth:`track` was on.

    Thread-safe: owners allocate on their own threads and any thread may free.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._live: dict[int, tuple[Hashable, int]] = {}  # storage address -> owner, bytes
        self.current: dict[Hashable, int] = {}
        self.peak: dict[Hashable, int] = {}

    @contextlib.contextmanager
    def track(self, owner: Hashable) -> Iterator[None]:
        """Count what the current thread allocates as ``owner``'s until the block ends."""
        with self._lock:
            self.current.setdefault(owner, 0)
            self.peak.setdefault(owner, 0)
        with _Tracking(self, owner):
            yield

    def reset_peak(self, owner: Hashable) -> None:
        """Start ``owner``'s peak again from what it holds now."""
        with self._lock:
            self.peak[owner] = self.current.get(owner, 0)

    def allocated(self, owner: Hashable, tensor: torch.Tensor) -> None:
        """Count ``tensor``'s storage as ``owner``'s if it is a CPU storage not yet counted."""
        if tensor.device.type != "cpu" or tensor.layout != torch.strided:
            return
        storage = tensor.untyped_storage()
        address, size = storage.data_ptr(), storage.nbytes()
        if address == 0 or size == 0:
            return
        with self._lock:
            if address in self._live:
                return
            self._live[address] = (owner, size)
            self.current[owner] += size
            self.peak[owner] = max(self.peak[owner], self.current[owner])
        weakref.finalize(storage, self._freed, address)

    def _freed(self, address: int) -> None:
        with self._lock:
            entry = self._live.pop(address, None)
            if entry is not None:
                self.current[entry[0]] -= entry[1]


class _Tracking(TorchDispatchMode):
    """Reports every new storage an operator returns on this thread to the counter."""

    def __init__(self, counter: AllocationCounter, owner: Hashable) -> None:
        super().__init__()
        self.counter, self.owner = counter, owner

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        result = func(*args, **kwargs)
        given = {_address(t) for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        for leaf in tree_leaves(result):
            if isinstance(leaf, torch.Tensor) and _address(leaf) not in given:  # not a view, not in place
                self.counter.allocated(self.owner, leaf)
        return result


def _address(tensor: torch.Tensor) -> int:
    try:
        return tensor.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):  # a tensor without storage
        return 0
