"""When no plan is found: the error, with the smallest per-device memory limit that would fit
when none does."""
from __future__ import annotations

import math
from typing import Sequence

import numpy as np

from .._vocab import CHECKPOINT_MODES, CheckpointMode
from ._budget import Budget
from ._options import Options
from .cost import CostModel, effective_mode

__all__ = ["infeasible", "smallest_memory", "unfound"]


def infeasible(model: CostModel, options: Options, budget: Budget | None = None) -> str:
    """Why no plan fits: the memory limits given and the smallest limit that would fit (the
    least found, if ``budget`` ran out before every micro-batch count and mode was tried)."""
    need, chunks, mode, complete = smallest_memory(model, options.candidates, options.modes, len(options.limits),
                                                   budget)
    plans = "a fill-drain plan " if "1f1b" in options.schedules else ""
    fix = "raise memory_limit, add devices or allow checkpointing"
    if "gpipe" not in options.schedules and complete and np.all(options.limits >= need):
        return (f"no 1F1B plan was found within the memory limits ({_limits(options)}), though a fill-drain plan "
                f"fits them (it needs {int(math.ceil(need))} bytes a device, with chunks={chunks}, checkpoint={mode}; "
                "the 1F1B search is a heuristic): plan with schedule='auto' or 'gpipe'")
    if not math.isfinite(need):
        return (f"no plan fits the memory limits ({_limits(options)}); {fix} (with time_limit=None the error "
                f"also names the smallest per-device limit that would fit {plans.strip() or 'a plan'})")
    found = (f"the smallest per-device memory limit that would fit {plans}is" if complete else
             f"a per-device memory limit that would fit {plans}(the least found within the time limit; "
             "time_limit=None finds the smallest) is")
    return (f"no plan fits the memory limits ({_limits(options)}); {found} {int(math.ceil(need))} bytes "
            f"({need / 2**30:.3f} GiB, with chunks={chunks}, checkpoint={mode}); {fix}")


def unfound(options: Options, time_limit: float | None) -> str:
    """Why no plan was found before the time ran out: where memory limits are given, they may
    be what no plan fits (naming the smallest that would takes longer than the search)."""
    if np.all(np.isinf(options.limits)):
        if time_limit is None:  # only the 1F1B search's cap on its DP work stops it then
            return ("no plan was found within the 1F1B search's cap on its work; plan with schedule='gpipe' "
                    "(its search always finds one) or schedule='auto'")
        return f"no plan was found within time_limit={time_limit} s; allow more time (time_limit=None: no limit)"
    return (f"no plan that fits the memory limits ({_limits(options)}) was found within time_limit={time_limit} s; "
            "they may be too small for any plan: raise memory_limit, or allow more time (with time_limit=None "
            "the error names the smallest limit that fits)")


def _limits(options: Options) -> str:
    """The memory limits given, for an error."""
    named = ["none" if math.isinf(v) else f"{int(v)}" for v in options.limits]
    return f"{named[0]} bytes on every device" if len(set(named)) == 1 else f"{', '.join(named)} bytes per device"


def smallest_memory(model: CostModel, candidates: Sequence[int], modes: Sequence[CheckpointMode], devices: int,
                    budget: Budget | None = None) -> tuple[float, int, str, bool]:
    """Min over plans of the largest stage memory (a min-max DP per ``(chunks, mode)``) with the
    micro-batch count and mode that reach it (``inf`` if none was tried), and whether every
    pair was tried: only while ``budget`` lasts, the likely least first (more checkpointing,
    more micro-batches)."""
    best = (math.inf, 0, "")
    start, stop = np.triu_indices(model.layers + 1, k=1)  # every stage [start, stop)
    frugal = sorted(modes, key=lambda mode: -CHECKPOINT_MODES.index(mode))
    for chunks in sorted(candidates, reverse=True):
        if budget is not None and budget.out():
            return (*best, False)
        costs = model.at(model.micro_batch_size(chunks))
        held = model.held_bytes(costs, start, stop)
        for mode in frugal:
            memory = model.memory(costs, start, stop, chunks, effective_mode(mode, chunks), held)
            answer = _min_max(model.layers, start, stop, memory, devices)
            if answer < best[0]:
                best = (answer, chunks, mode)
    return (*best, True)


def _min_max(layers: int, start: np.ndarray, stop: np.ndarray, memory: np.ndarray, devices: int) -> float:
    """``min over k ≤ devices and splits of max stage memory``, given the ``memory`` of every
    stage ``[start, stop)``: ``reach[c]`` is the best over the first ``c`` layers in at most as
    many stages as rounds so far, one more each round until a round changes nothing."""
    table = np.full((layers + 1, layers + 1), math.inf)
    table[start, stop] = memory
    reach = np.full(layers + 1, math.inf)
    reach[0] = 0.0
    for _ in range(devices):
        grown = np.minimum(reach, np.min(np.maximum(reach[:, None], table), axis=0))
        if np.array_equal(grown, reach):
            break
        reach = grown
    return float(reach[layers])
