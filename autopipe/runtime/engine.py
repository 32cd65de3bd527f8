"""The engine of a :class:`~autopipe.runtime.pipeline.Pipeline`: stages, their worker threads and the
schedule, running one phase of one call at a time."""
from __future__ import annotations

import weakref

from .._vocab import Phase
from ..timeline import Event
from .memory import StagePeak
from .run import Run
from .schedule import actions
from .stage import Stage
from .worker import Worker

__all__ = ["Engine"]


class Engine:
    """The stages, their workers and the schedule: runs one phase of one call at a time.

    Kept apart from the ``nn.Module``: the pipeline and every output's autograd graph
    reference the engine, the worker threads only their stages, so the workers stop when the
    engine is collected -- after the pipeline *and* the last output needing them are gone.
    """

    def __init__(self, stages: list[Stage], schedule: str) -> None:
        self.stages = stages
        self.schedule = schedule
        self.workers = [Worker(stage) for stage in stages]
        self.last: list[Event] = []
        self.last_memory: list[StagePeak] | None = None
        self.closed = False
        weakref.finalize(self, _close_workers, self.workers)

    def start_phase(self, run: Run, phase: Phase) -> None:
        """Hand every stage its actions of ``phase`` (:class:`~autopipe.runtime.replicas.Replicas`
        starts and finishes the phases of a call on every replica's engine)."""
        if self.closed:
            raise RuntimeError("this pipeline was closed; its worker threads are gone")
        run.begin_phase()
        for stage, worker in zip(self.stages, self.workers):
            worker.submit(run, actions(self.schedule, phase, stage.index, len(self.stages), run.chunks))

    def finish_phase(self, run: Run, phase: Phase) -> None:
        run.wait_phase()
        if phase != "forward" or not run.grad_enabled:
            self.last = sorted(run.events, key=lambda e: (e.start_ms, e.stage))
            self.last_memory = None if run.meter is None else run.meter.peaks()

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            _close_workers(self.workers)


def _close_workers(workers: list[Worker]) -> None:
    for worker in workers:
        worker.close()
