"""Schedules in the runtime: each stage's actions for one phase of one call, and nothing else.

A schedule knows neither modules nor devices; a stage executes the actions it is given,
blocking on its inbox until each action's inputs have arrived.  The orders are
:func:`autopipe.planning.schedules.order` (the same the simulator prices).  Two ways to drive
a pipeline:

* ``pipe(x)`` runs the ``"forward"`` phase and the caller's ``loss.backward()`` the
  ``"backward"`` phase — fill-drain (GPipe), the caller's loss existing only after the whole
  forward::

    stage 0:  F0 F1 F2 F3                B3 B2 B1 B0
    stage 1:     F0 F1 F2 F3          B3 B2 B1 B0
    stage 2:        F0 F1 F2 F3    B3 B2 B1 B0

* ``pipe.train_step(x, target=y, loss_fn=f)`` runs one ``"train"`` phase with the loss inside
  the last stage, so a schedule may interleave forwards and backwards (1F1B)::

    stage 0:  F0 F1 F2       B0 F3    B1    B2    B3
    stage 1:     F0 F1    B0 F2    B1 F3    B2    B3
    stage 2:        F0 B0 F1    B1 F2    B2 F3 B3

Stages placed on one device (``interleave``) each keep their order; they take turns on the
device (:mod:`autopipe.runtime.turns`), which decides who goes first when both are ready.
"""
from __future__ import annotations

from typing import NamedTuple

from .._vocab import Phase, Schedule, TaskKind
from ..planning.schedules import order

__all__ = ["Action", "actions"]


class Action(NamedTuple):
    """Run the forward (``"F"``) or backward (``"B"``) of one micro-batch."""

    kind: TaskKind
    micro_batch: int


def actions(schedule: Schedule, phase: Phase, stage: int, stages: int, chunks: int) -> list[Action]:
    """Stage ``stage``'s actions in ``phase``: all of the schedule's order in ``"train"``, or its
    forwards or backwards alone (only fill-drain keeps the phases apart)."""
    tasks = [Action(kind, j) for kind, j in order(schedule, stage, stages, chunks)]
    if phase == "train":
        return tasks
    return [task for task in tasks if task.kind == ("F" if phase == "forward" else "B")]
