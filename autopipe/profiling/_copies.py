"""Copy timing between devices and its fit ``ms = latency_ms + bytes * ms_per_byte``."""
from __future__ import annotations

from typing import Sequence

import numpy as np
import torch
from scipy.optimize import nnls

from ..device import ops_for
from ._progress import Progress
from .profiles import CopyFit

__all__ = ["DEFAULT_COPY_SIZES", "fit_copy", "measure_copies"]

KiB = 1024
MiB = 1024 * KiB

#: Copy sizes timed per device pair: from latency-bound to bandwidth-bound.
DEFAULT_COPY_SIZES: tuple[int, ...] = (4 * KiB, 64 * KiB, 1 * MiB, 16 * MiB)


def measure_copies(devices: Sequence[torch.device], sizes: Sequence[int] = DEFAULT_COPY_SIZES,
                   repeats: int = 5, warmup: int = 2, progress: Progress | None = None) -> list[CopyFit]:
    """Time ``tensor.to(dst)`` for every ordered pair of distinct device entries and fit each.

    Two ``cpu`` entries are different pipeline devices sharing one memory: the runtime does
    not copy between them, and the fit measured here is about zero, as it should be.
    """
    fits = []
    for i, src in enumerate(devices):
        for j, dst in enumerate(devices):
            if i == j:
                continue
            points = []
            for nbytes in sizes:
                points.extend((nbytes, ms) for ms in _time_copy(src, dst, nbytes, repeats, warmup))
                if progress is not None:
                    progress.step(f"copy {i}->{j} {nbytes} B")
            fits.append(fit_copy(i, j, points))
    return fits


def _time_copy(src: torch.device, dst: torch.device, nbytes: int, repeats: int, warmup: int) -> list[float]:
    source, target = ops_for(src), ops_for(dst)
    tensor = torch.empty(nbytes, dtype=torch.uint8, device=src)
    clock = target if dst.type == "cuda" else source
    times = []
    for run in range(warmup + repeats):
        source.synchronize()
        timer = clock.timer()
        timer.start()
        source.copy_to(tensor, target, None)
        target.synchronize()
        elapsed = timer.stop()
        if run >= warmup:
            times.append(elapsed)
    return times


def fit_copy(src: int, dst: int, points: Sequence[tuple[int, float]]) -> CopyFit:
    """Least-squares fit of ``ms = latency_ms + bytes * ms_per_byte`` with both terms >= 0.

    Bytes are scaled to MiB for the solve so the two columns are of similar magnitude.
    """
    if len({b for b, _ in points}) < 2:
        raise ValueError(f"a copy fit needs points at two or more sizes, got {list(points)}")
    design = np.array([[1.0, b / MiB] for b, _ in points])
    times = np.array([ms for _, ms in points])
    (latency, per_mib), _ = nnls(design, times)
    return CopyFit(src, dst, float(latency), float(per_mib) / MiB, [(int(b), float(ms)) for b, ms in points])
