"""Our plan next to the splits other systems would choose, all priced by the same cost model.

Baselines are costed for the plan's engine and under its schedule (fill-drain or 1F1B, by the
same simulator), and use every offered device (one stage each), the plan's micro-batch count (or
the ``chunks`` the user fixed) and its checkpoint mode, so each ratio isolates the choice of
split points:

* ``equal layers`` — the same number of layers per stage;
* ``parameter-balanced`` — the least largest per-stage parameter bytes (DeepSpeed's
  ``partition_method="parameters"``, PiPPy's split by parameter count);
* ``time min-max`` — the least largest per-stage forward + backward time at the micro-batch
  size, with no copies and no device speeds (torchgpipe's ``balance_by_time``, made optimal).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from .._vocab import CheckpointMode
from .cost import CostModel
from .plans import Plan
from ..profiling.profiles import Profile
from .candidates import greedy_split, least_largest
from .simulate import evaluate

__all__ = ["Baseline", "compare", "format_comparison", "min_max_split", "equal_split"]


@dataclass(frozen=True)
class Baseline:
    """One split priced by the cost model; ``fits`` is false when a stage exceeds its memory limit."""

    name: str
    balance: list[int]
    chunks: int
    checkpoint: CheckpointMode
    iteration_ms: float
    ratio: float
    fits: bool


def compare(profile: Profile, plan: Plan, chunks: int | None = None) -> list[Baseline]:
    """Our plan first (as it predicts itself, interleaved or not), then each baseline (one
    stage per device), with its iteration time relative to ours."""
    options = plan.options
    devices = list(options.get("devices", plan.devices))
    speeds = options.get("speeds") or [1.0] * len(devices)
    # the optimizer as the plan was asked for it (a name prices the step's temporaries it has)
    optimizer = options.get("optimizer_state", options.get("optimizer_state_factor", "momentum"))
    model = CostModel(profile, devices, speeds, plan.batch_size, optimizer, options.get("engine", "local"))
    limits = [np.inf if v is None else v for v in options.get("memory_limit_bytes", [None] * len(devices))]
    m = chunks or plan.chunks
    parts = min(len(devices), model.layers)
    costs = model.at(model.micro_batch_size(m))
    rows = [Baseline("ours (autopipe)", plan.balance, plan.chunks, plan.checkpoint,
                     plan.predicted.iteration_ms, 1.0, True)]
    splits = [
        ("equal layers", equal_split(model.layers, parts), m),
        ("parameter-balanced", min_max_split([layer.param_bytes for layer in profile.layers], parts), m),
        ("time min-max, no copies", min_max_split(np.diff(costs.forward + costs.backward), parts), m),
    ]
    for name, bounds, count in splits:
        evaluation = evaluate(model, bounds, count, plan.checkpoint, plan.schedule, turns=plan.turns)
        fits = all(stage.memory <= limit for stage, limit in zip(evaluation.stages, limits))
        rows.append(Baseline(name, list(np.diff(bounds)), count, plan.checkpoint, evaluation.iteration_ms,
                             evaluation.iteration_ms / plan.predicted.iteration_ms, fits))
    return rows


def equal_split(layers: int, parts: int) -> list[int]:
    """Bounds of ``parts`` stages whose layer counts differ by at most one (larger first)."""
    sizes = [layers // parts + (1 if i < layers % parts else 0) for i in range(parts)]
    return [0] + list(np.cumsum(sizes).tolist())


def min_max_split(weights: Sequence[float], parts: int) -> list[int]:
    """Bounds of exactly ``parts`` non-empty contiguous stages minimising the largest stage sum.

    The solver's min-max bisection (:func:`~autopipe.planning.candidates.least_largest`, to float precision)
    with each stage taking as many layers as fit; stages are then split to use every part.
    """
    prefix = np.concatenate(([0.0], np.cumsum(np.asarray(weights, dtype=float))))
    speeds = np.ones(parts)
    bounds = sorted({0, *greedy_split(prefix, speeds, least_largest(prefix, speeds, 1e-12)[1])})
    while len(bounds) - 1 < parts:
        widest = int(np.argmax(np.diff(bounds)))
        bounds.insert(widest + 1, bounds[widest] + 1)
    return bounds


def format_comparison(rows: Sequence[Baseline]) -> str:
    """A table: split, balance, micro-batches, predicted iteration time and ratio to ours."""
    lines = [f"{'split':<26} {'iteration':>12} {'vs ours':>8}  {'m':>3}  balance",
             f"{'-' * 26} {'-' * 12} {'-' * 8}  {'-' * 3}  {'-' * 7}"]
    for row in rows:
        note = "" if row.fits else "  (exceeds the memory limit)"
        balance = ",".join(map(str, row.balance))
        lines.append(f"{row.name:<26} {row.iteration_ms:>9.2f} ms {row.ratio:>7.2f}x  {row.chunks:>3}  "
                     f"[{balance}]{note}")
    return "\n".join(lines)
