"""Steady CPU memory for measurements: huge pages for PyTorch, one glibc arena for all threads.

A CPU pipeline runs its stages on worker threads while the plain model runs on the main thread.
By default glibc gives each thread its own arena and returns large blocks to the system, so every
large tensor is fresh ``mmap`` memory whose page faults cost 3-10% of a ResNet step, more on a
worker's arena than on the main one, and vary from run to run.  Measurements (profiles,
benchmarks) then compare allocators rather than schedules.  :func:`steady_memory` makes every
thread allocate alike: PyTorch's CPU allocator backs large tensors with transparent huge pages
(``THP_MEM_ALLOC_ENABLE``, read when torch is imported, so call this first) and glibc serves
all threads from one arena that keeps freed memory (``mallopt``).  It changes speed, never
results, and only for this process; the ``autopipe`` command and the benchmark scripts call it.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys

__all__ = ["steady_memory"]

_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD, _M_ARENA_MAX = -1, -3, -8
_SETTINGS = ((_M_ARENA_MAX, 1), (_M_TRIM_THRESHOLD, 2**30), (_M_MMAP_THRESHOLD, 32 * 2**20))


def steady_memory() -> str:
    """Apply both settings where they can be; say what holds, for a benchmark's header."""
    if "torch" not in sys.modules:
        os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")
    huge = os.environ.get("THP_MEM_ALLOC_ENABLE") == "1"
    return (f"huge pages {'on' if huge else 'off (set THP_MEM_ALLOC_ENABLE=1 before torch is imported)'}, "
            f"one malloc arena {'on' if _one_arena() else 'off (not glibc)'}")


def _one_arena() -> bool:
    """One glibc arena, no trimming, no ``mmap`` below 32 MiB; ``False`` without glibc."""
    try:
        mallopt = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").mallopt
    except (OSError, AttributeError):
        return False
    return all(mallopt(option, value) == 1 for option, value in _SETTINGS)
