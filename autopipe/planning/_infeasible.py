"""When no plan fits in memory: the smallest per-device memory limit that would fit, for the error."""
from __future__ import annotations

import math
from typing import Sequence

import numpy as np

from .._vocab import CheckpointMode
from ._options import Options
from .cost import CostModel, SizeCosts, effective_mode

__all__ = ["infeasible", "smallest_memory"]


def infeasible(model: CostModel, options: Options) -> str:
    """Why no plan fits: the memory limits given and the smallest limit that would fit."""
    need, chunks, mode = smallest_memory(model, options.candidates, options.modes, len(options.limits))
    limits = ", ".join("none" if math.isinf(v) else f"{int(v)}" for v in options.limits)
    return (f"no plan fits the memory limits ({limits} bytes per device); the smallest per-device "
            f"memory limit that would fit is {int(math.ceil(need))} bytes ({need / 2**30:.3f} GiB, "
            f"with chunks={chunks}, checkpoint={mode}); raise memory_limit, add devices or allow "
            "checkpointing")


def smallest_memory(model: CostModel, candidates: Sequence[int], modes: Sequence[CheckpointMode],
                    devices: int) -> tuple[float, int, str]:
    """Min over plans of the largest stage memory (a min-max DP per ``(chunks, mode)``)."""
    best = (math.inf, 0, "")
    for chunks in candidates:
        costs = model.at(model.micro_batch_size(chunks))
        for mode in modes:
            answer = _min_max_memory(model, costs, chunks, effective_mode(mode, chunks), devices)
            if answer < best[0]:
                best = (answer, chunks, mode)
    return best


def _min_max_memory(model: CostModel, costs: SizeCosts, chunks: int, mode: CheckpointMode, devices: int) -> float:
    """``min over k ≤ devices and splits of max stage memory``: ``reach[c]`` is the best over
    the first ``c`` layers with one more stage each round."""
    layers = model.layers
    starts = np.arange(layers)
    reach = np.full(layers + 1, math.inf)
    reach[0] = 0.0
    answer = math.inf
    for _ in range(devices):
        grown = np.full(layers + 1, math.inf)
        for stop in range(1, layers + 1):
            head = starts[:stop]
            row = model.memory(costs, head, stop, chunks, mode, model.held_bytes(costs, head, stop))
            grown[stop] = np.min(np.maximum(reach[:stop], row))
        reach = grown
        answer = min(answer, float(reach[layers]))
    return answer
