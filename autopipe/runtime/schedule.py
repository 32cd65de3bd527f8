"""Schedules: the order in which each stage runs its micro-batches, and nothing else.

A schedule knows neither modules nor devices; a stage executes the actions it is given,
blocking on its inbox until each action's inputs have arrived.  The caller drives two phases:
``pipe(x)`` runs the forward phase and ``loss.backward()`` the backward phase, so a schedule
orders each phase separately.  Fill-drain (GPipe) is what the planner models::

    stage 0:  F0 F1 F2 F3                B3 B2 B1 B0
    stage 1:     F0 F1 F2 F3          B3 B2 B1 B0
    stage 2:        F0 F1 F2 F3    B3 B2 B1 B0

Stages placed on one device (``interleave``) each keep this order; they take turns on the
device (:mod:`autopipe.runtime.turns`), which decides who goes first when both are ready.

Interleaving forwards and backwards (1F1B) needs the loss inside the pipeline, because the
caller's loss exists only after the whole forward phase; it would be a schedule whose phases
are not separate, and is not offered by this runtime.
"""
from __future__ import annotations

from typing import NamedTuple

from .._vocab import Phase, TaskKind

__all__ = ["Action", "FillDrain"]


class Action(NamedTuple):
    """Run the forward (``"F"``) or backward (``"B"``) of one micro-batch."""

    kind: TaskKind
    micro_batch: int


class FillDrain:
    """GPipe: all forwards in order, then all backwards in reverse order."""

    def actions(self, phase: Phase, stage: int, chunks: int) -> list[Action]:
        if phase == "forward":
            return [Action("F", j) for j in range(chunks)]
        return [Action("B", j) for j in reversed(range(chunks))]
