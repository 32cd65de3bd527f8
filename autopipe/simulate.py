"""An event simulator of the fill-drain schedule: the per-stage timeline the cost model predicts.

Each lane (a stage's compute, or its incoming copy) is a resource that serves micro-batches in
order; a micro-batch starts on a lane when the lane is free and the micro-batch has left the
previous lane.  It shares no code with the closed form in :mod:`autopipe.cost`, so tests can
hold one against the other.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from .cost import StageLanes
from .plans import Plan
from .timeline import Event

__all__ = ["Simulation", "simulate", "simulate_plan"]


@dataclass(frozen=True)
class Simulation:
    """The events of one iteration and its phase lengths (ms)."""

    events: list[Event]
    forward_ms: float
    backward_ms: float

    @property
    def iteration_ms(self) -> float:
        return self.forward_ms + self.backward_ms


# A lane of the simulation: stage, lane name, event kind and the duration of each micro-batch.
_Lane = tuple[int, str, str, list[float]]


def simulate(stages: Sequence[StageLanes], chunks: int, checkpoint: str) -> Simulation:
    """Run one iteration: all forwards (micro-batches 0..m-1), then all backwards (m-1..0)."""
    forward_events, forward_end = _run(_forward_lanes(stages, chunks), list(range(chunks)), 0.0)
    backward_events, backward_end = _run(_backward_lanes(stages, chunks, checkpoint),
                                         list(reversed(range(chunks))), forward_end)
    return Simulation(forward_events + backward_events, forward_end, backward_end - forward_end)


def _forward_lanes(stages: Sequence[StageLanes], chunks: int) -> list[_Lane]:
    lanes: list[_Lane] = []
    for index, stage in enumerate(stages):
        if index > 0:
            lanes.append((index, "copy", "C", [stage.copy_in] * chunks))
        lanes.append((index, "compute", "F", [stage.forward] * chunks))
    return lanes


def _backward_lanes(stages: Sequence[StageLanes], chunks: int, checkpoint: str) -> list[_Lane]:
    """Backward lanes in execution order; job 0 is the last micro-batch, which ``except_last``
    does not recompute."""
    lanes: list[_Lane] = []
    for index in reversed(range(len(stages))):
        stage = stages[index]
        if index < len(stages) - 1:
            lanes.append((index, "copy", "G", [stage.copy_grad] * chunks))
        durations = [stage.backward + stage.recompute] * chunks
        if checkpoint == "except_last":
            durations[0] = stage.backward
        lanes.append((index, "compute", "B", durations))
    return lanes


def _run(lanes: list[_Lane], order: list[int], start: float) -> tuple[list[Event], float]:
    """Serve ``order``'s micro-batches on each lane in turn; returns the events and the end time."""
    ready = [start] * len(order)
    events: list[Event] = []
    for stage, lane, kind, durations in lanes:
        free = start
        for job, micro_batch in enumerate(order):
            begin = max(free, ready[job])
            free = ready[job] = begin + durations[job]
            if durations[job] > 0:
                events.append(Event(stage, lane, kind, micro_batch, begin, free))
    return events, max(ready)


def simulate_plan(plan: Plan) -> Simulation:
    """The simulator run on the plan's predicted per-stage lane times."""
    lanes = [StageLanes(s.forward_ms, s.backward_ms, s.recompute_ms, s.copy_in_ms, s.copy_grad_ms,
                        float(s.memory_bytes)) for s in plan.stages]
    return simulate(lanes, plan.chunks, plan.checkpoint)
