"""A :class:`Plan` assembled from one split: stages, their costs and the predicted time."""
from __future__ import annotations

import copy
import math
from typing import Any, Sequence

from .._vocab import CheckpointMode, Schedule, TurnRule
from ..profiling.profiles import Profile
from .cost import CostModel, recomputations
from .plans import Plan, Prediction, StagePlan, placement
from .simulate import evaluate

__all__ = ["build_plan"]


def build_plan(profile: Profile, model: CostModel, bounds: Sequence[int], chunks: int,
               mode: CheckpointMode, options: dict[str, Any], interleave: int = 1, schedule: Schedule = "gpipe",
               lower_bound: float | None = None, turns: TurnRule = "depth_first",
               digest: str | None = None, phases: tuple[float, float] | None = None) -> Plan:
    """The :class:`Plan` of one split, costed by ``model`` (simulated when interleaved or not
    fill-drain, unless the search's simulation gave its ``phases``); ``lower_bound`` is what
    the search proved of the optimum (default: this plan's time, i.e. optimal); ``digest`` the
    profile's, if already computed."""
    where = placement(len(bounds) - 1, interleave)
    evaluation = evaluate(model, bounds, chunks, mode, schedule, where, turns, phases)
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
    # rounding can leave the share of a device busy all the time a hair above 1
    bubble = max(1 - busy / (used * evaluation.iteration_ms), 0.0) if evaluation.iteration_ms > 0 else 0.0
    least = evaluation.iteration_ms if lower_bound is None else min(lower_bound, evaluation.iteration_ms)
    predicted = Prediction(evaluation.iteration_ms, evaluation.forward_ms, evaluation.backward_ms, bubble,
                           lower_bound_ms=least)
    return Plan(model=copy.deepcopy(profile.model), profile_digest=profile.digest if digest is None else digest,
                devices=[stage.device for stage in stages],
                batch_size=model.batch_size, chunks=chunks, checkpoint=mode, schedule=schedule,
                stages=stages, predicted=predicted, options=options, interleave=interleave, turns=turns)
