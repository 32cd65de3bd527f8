"""A persistent worker thread per stage: it executes the actions of each phase it is given.

One thread per stage, not per device: the CPU autograd engine runs a backward on the thread
that calls it, so two stages on the same device type run their backwards in parallel only if
each has its own thread.
"""
from __future__ import annotations

import contextlib
import queue
import threading
from typing import TYPE_CHECKING

import torch

from .run import Aborted, Run
from .schedule import Action

if TYPE_CHECKING:
    from .stage import Stage

__all__ = ["Worker"]

_Job = tuple[Run, list[Action]]


class Worker:
    """Runs one stage's jobs, one phase of one call at a time, on a daemon thread."""

    def __init__(self, stage: Stage) -> None:
        self._jobs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._thread = threading.Thread(
            target=_serve, args=(stage, self._jobs), name=f"autopipe-stage-{stage.index}", daemon=True
        )
        self._thread.start()

    def submit(self, run: Run, actions: list[Action]) -> None:
        self._jobs.put((run, actions))

    def close(self) -> None:
        """Stop the thread after the jobs already submitted."""
        self._jobs.put(None)

    def join(self, timeout: float | None = None) -> None:
        self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()


def _serve(stage: Stage, jobs: queue.SimpleQueue[_Job | None]) -> None:
    # Takes the stage, never the pipeline, so that a dropped pipeline can be collected; for the
    # same reason nothing of a job outlives it while the thread waits for the next: a failed
    # run holds its error, whose traceback holds the caller's frames (the pipeline's forward).
    while (job := jobs.get()) is not None:
        _execute(stage, *job)
        job = None


def _execute(stage: Stage, run: Run, actions: list[Action]) -> None:
    """One job: ``stage`` runs ``actions`` of ``run``; a failure is the run's, not the worker's."""
    try:
        if torch.get_num_threads() != run.threads:
            torch.set_num_threads(run.threads)
        with run.meter.track(stage) if run.meter is not None else contextlib.nullcontext():
            stage.execute(run, actions)
    except Aborted:
        pass
    except BaseException as error:  # reported to the caller, the worker lives on
        run.fail(error)
    finally:
        run.stage_done()
