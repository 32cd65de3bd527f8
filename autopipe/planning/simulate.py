"""An event simulator of the fill-drain schedule: the per-stage timeline the cost model predicts.

Each lane (a stage's compute, or its incoming copy) serves micro-batches in order; a
micro-batch starts on a lane when the lane's resource is free and the micro-batch has left the
previous lane.  A copy lane is a resource of its own; a compute lane uses its device, which
stages placed on one device (an interleaved plan) share, one task at a time.  When a device
falls free, the earliest task to be ready starts, and among tasks ready at once the one
furthest along its phase's chain (the runtime's rule, :class:`~autopipe.runtime.turns.Turns`)::

    device 0:  s0 F0  s0 F1  s2 F0  s2 F1        stages 0 and 2 on device 0,
    device 1:         s1 F0  s1 F1  s3 F0 ...    1 and 3 on device 1

With one stage per device this is the permutation flow shop of :mod:`autopipe.planning.cost`, whose
closed form it shares no code with, so tests can hold one against the other.
"""
from __future__ import annotations

import heapq
import math
from dataclasses import dataclass
from typing import Sequence

from .._vocab import CheckpointMode, EventKind, Lane
from .cost import StageLanes
from .plans import Plan
from ..timeline import Event

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


@dataclass(frozen=True)
class _Lane:
    """A stage's compute or copy lane: the resource it uses and each job's duration."""

    stage: int
    lane: Lane
    kind: EventKind
    resource: int
    durations: list[float]


def simulate(stages: Sequence[StageLanes], chunks: int, checkpoint: CheckpointMode,
             placement: Sequence[int] | None = None) -> Simulation:
    """Run one iteration: all forwards (micro-batches 0..m-1), then all backwards (m-1..0).

    ``placement[s]`` is stage ``s``'s device (default: stage ``s`` on device ``s``)."""
    where = list(range(len(stages))) if placement is None else list(placement)
    forward_events, forward_end = _run(_forward_lanes(stages, chunks, where), list(range(chunks)), 0.0)
    backward_events, backward_end = _run(_backward_lanes(stages, chunks, checkpoint, where),
                                         list(reversed(range(chunks))), forward_end)
    return Simulation(forward_events + backward_events, forward_end, backward_end - forward_end)


def _forward_lanes(stages: Sequence[StageLanes], chunks: int, where: list[int]) -> list[_Lane]:
    lanes: list[_Lane] = []
    for index, stage in enumerate(stages):
        if index > 0:
            lanes.append(_Lane(index, "copy", "C", -len(lanes) - 1, [stage.copy_in] * chunks))
        lanes.append(_Lane(index, "compute", "F", where[index], [stage.forward] * chunks))
    return lanes


def _backward_lanes(stages: Sequence[StageLanes], chunks: int, checkpoint: CheckpointMode,
                    where: list[int]) -> list[_Lane]:
    """Backward lanes in execution order; job 0 is the last micro-batch, which ``except_last``
    does not recompute."""
    lanes: list[_Lane] = []
    for index in reversed(range(len(stages))):
        stage = stages[index]
        if index < len(stages) - 1:
            lanes.append(_Lane(index, "copy", "G", -len(lanes) - 1, [stage.copy_grad] * chunks))
        durations = [stage.backward + stage.recompute] * chunks
        if checkpoint == "except_last":
            durations[0] = stage.backward
        lanes.append(_Lane(index, "compute", "B", where[index], durations))
    return lanes


def _run(lanes: list[_Lane], order: list[int], start: float) -> tuple[list[Event], float]:
    """List-schedule ``order``'s micro-batches through ``lanes`` (a chain); returns the events
    and the end time.

    The next task to start is the one of least key ``(start time, copy before compute, later
    lane first)``.  A lane waits in the heap once its next job has left the previous lane;
    a key only grows (when another lane takes the resource), so a stale key is recomputed on
    pop and pushed back."""
    jobs = len(order)
    done = [0] * len(lanes)  # jobs finished per lane
    left = [[start] * jobs] + [[math.nan] * jobs for _ in lanes[1:]]  # when job j left lane i-1
    free = {lane.resource: start for lane in lanes}
    heap = [_key(lanes, 0, free, start)]
    events: list[Event] = []
    end = start
    while heap:
        key = heapq.heappop(heap)
        i = -key[2]
        lane, job = lanes[i], done[i]
        fresh = _key(lanes, i, free, left[i][job])
        if fresh > key:
            heapq.heappush(heap, fresh)
            continue
        finish = fresh[0] + lane.durations[job]
        free[lane.resource] = finish
        end = max(end, finish)
        if lane.durations[job] > 0:
            events.append(Event(lane.stage, lane.lane, lane.kind, order[job], fresh[0], finish))
        done[i] += 1
        if done[i] < jobs and not math.isnan(left[i][done[i]]):
            heapq.heappush(heap, _key(lanes, i, free, left[i][done[i]]))
        if i + 1 < len(lanes):
            left[i + 1][job] = finish
            if done[i + 1] == job:
                heapq.heappush(heap, _key(lanes, i + 1, free, finish))
    return events, end


def _key(lanes: list[_Lane], i: int, free: dict[int, float], ready: float) -> tuple[float, bool, int]:
    return max(free[lanes[i].resource], ready), lanes[i].resource >= 0, -i


def simulate_plan(plan: Plan) -> Simulation:
    """The simulator run on the plan's predicted per-stage lane times and placement."""
    lanes = [StageLanes(s.forward_ms, s.backward_ms, s.recompute_ms, s.copy_in_ms, s.copy_grad_ms,
                        float(s.memory_bytes)) for s in plan.stages]
    return simulate(lanes, plan.chunks, plan.checkpoint, plan.placement)
