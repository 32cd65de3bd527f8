"""A :class:`Plan` assembled from one split: stages, their costs and the predicted time."""
from __future__ import annotations

import math
from typing import Any, Sequence

from .._vocab import CheckpointMode
from ..profiling.profiles import Profile
from .cost import CostModel, Evaluation, recomputations
from .plans import Plan, Prediction, StagePlan, placement
from .simulate import simulate

__all__ = ["build_plan"]


def build_plan(profile: Profile, model: CostModel, bounds: Sequence[int], chunks: int, mode: CheckpointMode,
               options: dict[str, Any], interleave: int = 1) -> Plan:
    """The :class:`Plan` of one split, costed by ``model`` (simulated when interleaved)."""
    where = placement(len(bounds) - 1, interleave)
    if interleave == 1:
        evaluation = model.evaluate(bounds, chunks, mode)
    else:
        lanes = model.stage_lanes(bounds, chunks, mode, where)
        simulation = simulate(lanes, chunks, mode, where)
        evaluation = Evaluation(lanes, simulation.forward_ms, simulation.backward_ms)
    layers = profile.layers
    stages = [
        StagePlan(index=s, device=model.devices[where[s]], start=bounds[s], stop=bounds[s + 1],
                  first_layer=layers[bounds[s]].name, last_layer=layers[bounds[s + 1] - 1].name,
                  forward_ms=lanes.forward, backward_ms=lanes.backward, recompute_ms=lanes.recompute,
                  copy_in_ms=lanes.copy_in, copy_grad_ms=lanes.copy_grad,
                  memory_bytes=int(math.ceil(lanes.memory)), memory_terms=lanes.memory_terms)
        for s, lanes in enumerate(evaluation.stages)
    ]
    recomputed = recomputations(mode, chunks)
    busy = sum(chunks * (s.forward + s.backward) + recomputed * s.recompute for s in evaluation.stages)
    used = len(stages) // interleave
    bubble = 1 - busy / (used * evaluation.iteration_ms) if evaluation.iteration_ms > 0 else 0.0
    predicted = Prediction(evaluation.iteration_ms, evaluation.forward_ms, evaluation.backward_ms, bubble)
    return Plan(model=profile.model, profile_digest=profile.digest, devices=[stage.device for stage in stages],
                batch_size=model.batch_size, chunks=chunks, checkpoint=mode, schedule="gpipe",
                stages=stages, predicted=predicted, options=options, interleave=interleave)
