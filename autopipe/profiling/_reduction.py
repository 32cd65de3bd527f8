"""Gradient-reduction timing for replicas in one process, and its fit
``ms = latency_ms + bytes * ms_per_byte``.

The in-process runtime's replicas share their parameters on CPU devices, so reducing a
gradient is what ``AccumulateGrad`` does when a second replica's gradient arrives: an in-place
add into the one ``.grad`` per other replica.  That is what is timed here (float32, on the
first device).  Replicas on CUDA devices are not run in one process, so nothing is measured
for them; the planner then estimates from the copy fits and says so.
"""
from __future__ import annotations

from typing import Sequence

import torch

from ..device import ops_for
from ._copies import MiB, fit_copy
from ._progress import Progress
from .profiles import ReductionFit

__all__ = ["DEFAULT_REDUCTION_SIZES", "measure_reduction"]

#: Gradient bytes timed: from latency-bound to a ResNet-18-sized stage.
DEFAULT_REDUCTION_SIZES: tuple[int, ...] = (64 * 1024, 1 * MiB, 16 * MiB, 64 * MiB)


def measure_reduction(devices: Sequence[torch.device], sizes: Sequence[int] = DEFAULT_REDUCTION_SIZES,
                      repeats: int = 5, warmup: int = 2, progress: Progress | None = None) -> list[ReductionFit]:
    """The local reduction fit for ``len(devices)`` replicas, or none when there is one device
    or a device is not a CPU."""
    if len(devices) < 2 or any(d.type != "cpu" for d in devices):
        return []
    points: list[tuple[int, float]] = []
    for nbytes in sizes:
        points.extend((nbytes, ms) for ms in _time_adds(devices[0], nbytes, len(devices) - 1, repeats, warmup))
        if progress is not None:
            progress.step(f"reduction {nbytes} B")
    fit = fit_copy(0, 0, points)
    return [ReductionFit("local", len(devices), fit.latency_ms, fit.ms_per_byte, fit.points)]


def _time_adds(device: torch.device, nbytes: int, others: int, repeats: int, warmup: int) -> list[float]:
    ops = ops_for(device)
    grad = torch.zeros(nbytes // 4, device=device)
    arriving = [torch.ones_like(grad) for _ in range(others)]
    times = []
    for run in range(warmup + repeats):
        timer = ops.timer()
        timer.start()
        for other in arriving:
            grad.add_(other)
        elapsed = timer.stop()
        if run >= warmup:
            times.append(elapsed)
    return times
