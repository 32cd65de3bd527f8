"""An event simulator of a schedule: the per-stage timeline the cost model predicts.

Each stage's worker runs its tasks in the schedule's order (:func:`~autopipe.planning.schedules.order`);
a task starts when the worker is free, its input has arrived and its device is free; a
backward also waits for the one :data:`~autopipe.planning.schedules.GRADIENT_WINDOW` places
before it on the stage before (the runtime's backpressure on input gradients).  Inputs
arrive on copy lanes, each a resource of its own that serves its copies in order: ``C`` into
stage ``s`` after stage ``s-1``'s forward, ``G`` into stage ``s`` after stage ``s+1``'s
backward (skips are priced into these lanes, :mod:`autopipe.planning.cost`).  Stages placed on
one device (an interleaved plan) share it, one task at a time: when a device falls free, the
earliest task to be ready starts, and among tasks ready at once the one of least
:func:`~autopipe.planning.schedules.priority` (the runtime's rule, :class:`~autopipe.runtime.turns.Turns`)::

    device 0:  s0 F0  s0 F1  s2 F0  s2 F1        stages 0 and 2 on device 0,
    device 1:         s1 F0  s1 F1  s3 F0 ...    1 and 3 on device 1

Fill-drain with one stage per device is the permutation flow shop of
:mod:`autopipe.planning.cost`, whose closed form it shares no code with, so tests can hold one
against the other.
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass, field
from typing import Sequence

from .._vocab import CheckpointMode, Lane, Schedule, TurnRule
from .cost import CostModel, Evaluation, StageLanes
from .plans import Plan
from .schedules import GRADIENT_WINDOW, checkpointed, order, priority
from ..timeline import Event

__all__ = ["Simulation", "simulate", "simulate_plan", "evaluate"]


@dataclass(frozen=True)
class Simulation:
    """The events of one iteration and its phase lengths (ms).

    ``forward_ms`` ends with the last forward; ``backward_ms`` is the rest of the iteration
    (in 1F1B backwards also run before that end)."""

    events: list[Event]
    forward_ms: float
    backward_ms: float

    @property
    def iteration_ms(self) -> float:
        return self.forward_ms + self.backward_ms


# A task of a lane, named by what it makes: ``(kind, stage, micro-batch)``.
_Task = tuple[str, int, int]


@dataclass
class _Lane:
    """A worker or copy lane: its tasks in order, each ``(kind, micro-batch, duration, the
    tasks it waits for)``, and the resource it uses (a device index, or its own negative id)."""

    stage: int
    lane: Lane
    resource: int
    tasks: list[tuple[str, int, float, tuple[_Task, ...]]] = field(default_factory=list)
    done: int = 0


def simulate(stages: Sequence[StageLanes], chunks: int, checkpoint: CheckpointMode,
             placement: Sequence[int] | None = None, schedule: Schedule = "gpipe",
             turns: TurnRule = "depth_first", timeline: bool = True,
             window: int | None = GRADIENT_WINDOW) -> Simulation:
    """Run one iteration of ``schedule`` over ``chunks`` micro-batches.

    ``placement[s]`` is stage ``s``'s device (default: stage ``s`` on device ``s``); ``turns``
    the rule of a shared device (:func:`~autopipe.planning.schedules.priority`); without
    ``timeline`` the simulation keeps no events, only the phase lengths (what pricing a split
    needs: a fifth faster at a thousand layers); ``window``: the input gradients a stage may
    have alive (``None``: any number, the flow shop of :mod:`autopipe.planning.cost`)."""
    where = list(range(len(stages))) if placement is None else list(placement)
    lanes = _lanes(stages, chunks, checkpoint, where, schedule, window)
    events, finished = _run(lanes, turns, timeline)
    forward_end = max((t for (kind, _, _), t in finished.items() if kind in "FC"), default=0.0)
    end = max(finished.values(), default=0.0)
    return Simulation(events, forward_end, end - forward_end)


def _lanes(stages: Sequence[StageLanes], chunks: int, checkpoint: str, where: list[int],
           schedule: str, window: int | None) -> dict[tuple[str, int], _Lane]:
    """Every stage's worker lane (``"compute"``) and copy lanes (``"C"`` and ``"G"``, in the
    order their sender produces), keyed by ``(lane, stage)``; each task names the tasks it
    waits for as ``(kind, stage, micro-batch)``."""
    count = len(stages)
    lanes: dict[tuple[str, int], _Lane] = {}
    for s, stage in enumerate(stages):
        work = lanes[("compute", s)] = _Lane(s, "compute", where[s])
        backwards: list[int] = []  # the micro-batches of its backwards so far
        for kind, j in order(schedule, s, count, chunks):
            if kind == "F":
                work.tasks.append(("F", j, stage.forward, (("C", s, j),) if s > 0 else ()))
            else:
                recompute = stage.recompute if checkpointed(checkpoint, j, chunks) else 0.0
                needs = (("G", s, j),) if s < count - 1 else ()
                if s > 0 and window is not None and len(backwards) >= window:
                    needs += (("B", s - 1, backwards[-window]),)  # the credit the stage before gives back
                backwards.append(j)
                work.tasks.append(("B", j, stage.backward + recompute, needs))
    for s, stage in enumerate(stages):
        for kind, sender, duration in (("C", s - 1, stage.copy_in), ("G", s + 1, stage.copy_grad)):
            if 0 <= sender < count:
                lane = lanes[(kind, s)] = _Lane(s, "copy", -len(lanes) - 1)
                made = "F" if kind == "C" else "B"
                lane.tasks = [(kind, j, duration, ((made, sender, j),))
                              for task, j, _, _ in lanes[("compute", sender)].tasks if task == made]
    return lanes


def _run(lanes: dict[tuple[str, int], _Lane], turns: str,
         timeline: bool = True) -> tuple[list[Event], dict[_Task, float]]:
    """List-schedule the lanes' tasks; returns the events (of tasks that take time; none
    without ``timeline``) and the end of every task.

    The next task to start is the one of least key ``(start time, copy before compute,
    priority)``.  A lane waits in the heap once its next task's input is there; a key only
    grows (when another lane takes the resource), so a stale key is recomputed on pop and
    pushed back."""
    finished: dict[_Task, float] = {}  # (task kind, stage, micro-batch) → end
    waiting: dict[_Task, list[tuple[str, int]]] = {}  # a missing input → the lanes that wait for it
    free = {lane.resource: 0.0 for lane in lanes.values()}
    ends = {name: 0.0 for name in lanes}
    heap: list[tuple[float, bool, tuple[int, int], tuple[str, int]]] = []
    events: list[Event] = []

    def offer(name: tuple[str, int]) -> None:
        lane = lanes[name]
        if lane.done == len(lane.tasks):
            return
        for task in lane.tasks[lane.done][3]:
            if task not in finished:
                waiting.setdefault(task, []).append(name)
                return
        heapq.heappush(heap, _key(lanes, name, free, ends, finished, turns))

    for name in lanes:
        offer(name)
    while heap:
        key = heapq.heappop(heap)
        name = key[3]
        fresh = _key(lanes, name, free, ends, finished, turns)
        if fresh > key:
            heapq.heappush(heap, fresh)
            continue
        lane = lanes[name]
        kind, j, duration, _ = lane.tasks[lane.done]
        finish = fresh[0] + duration
        free[lane.resource] = ends[name] = finish
        if timeline and duration > 0:
            events.append(Event(lane.stage, lane.lane, kind, j, fresh[0], finish))
        lane.done += 1
        made = (kind, lane.stage, j)
        finished[made] = finish
        offer(name)
        for other in waiting.pop(made, []):
            offer(other)
    return events, finished


def _key(lanes: dict[tuple[str, int], _Lane], name: tuple[str, int], free: dict[int, float],
         ends: dict[tuple[str, int], float], finished: dict[_Task, float],
         turns: str) -> tuple[float, bool, tuple[int, int], tuple[str, int]]:
    lane = lanes[name]
    kind, _, _, needs = lane.tasks[lane.done]
    ready = ends[name]
    for task in needs:
        ready = max(ready, finished[task])
    return max(free[lane.resource], ready), lane.resource >= 0, priority(lane.stage, kind, turns), name


def simulate_plan(plan: Plan) -> Simulation:
    """The simulator run on the plan's predicted per-stage lane times, placement and schedule."""
    lanes = [StageLanes(s.forward_ms, s.backward_ms, s.recompute_ms, s.copy_in_ms, s.copy_grad_ms,
                        float(s.memory_bytes)) for s in plan.stages]
    return simulate(lanes, plan.chunks, plan.checkpoint, plan.placement, plan.schedule, plan.turns)


def evaluate(model: CostModel, bounds: Sequence[int], chunks: int, mode: str, schedule: str = "gpipe",
             placement: Sequence[int] | None = None, turns: str = "depth_first",
             phases: tuple[float, float] | None = None) -> Evaluation:
    """Cost a split under ``schedule`` with stage ``s`` on device ``placement[s]`` (default
    ``s``) and shared devices taking ``turns``: fill-drain with one stage per device by the
    closed form (:meth:`CostModel.evaluate`), anything else by simulation, or by the forward
    and backward ``phases`` of the simulation the search already ran."""
    if schedule == "gpipe" and (placement is None or list(placement) == list(range(len(placement)))):
        return model.evaluate(bounds, chunks, mode)
    lanes = model.stage_lanes(bounds, chunks, mode, placement, schedule)
    if phases is None:
        simulation = simulate(lanes, chunks, mode, placement, schedule, turns, timeline=False)
        phases = simulation.forward_ms, simulation.backward_ms
    return Evaluation(lanes, *phases)
