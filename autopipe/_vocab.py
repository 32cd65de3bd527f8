"""The words the steps pass each other, defined once as ``Literal`` types with their values.

They stay plain strings, so plans and profiles keep their JSON as it is; the types let a checker
catch a misspelt mode, and the tuples are what option checks and error messages list.
"""
from __future__ import annotations

from typing import Literal, get_args

__all__ = [
    "CHECKPOINT_MODES", "CHECKPOINT_CHOICES", "ENGINES", "PHASES", "SCHEDULES",
    "CheckpointChoice", "CheckpointMode", "EngineName", "EventKind", "Lane", "Phase", "Schedule", "TaskKind",
]

#: What a stage keeps for backward: every activation, none (recompute every micro-batch) or all
#: but the last micro-batch's (whose backward comes at once).
CheckpointMode = Literal["never", "except_last", "always"]
#: A checkpoint mode to plan for, or ``"auto"``: the planner chooses.
CheckpointChoice = Literal["auto", "never", "except_last", "always"]
#: The order of micro-batches: fill-drain, or one forward one backward.
Schedule = Literal["gpipe", "1f1b"]
#: What runs a plan: the in-process runtime or ``torch.distributed.pipelining``.
EngineName = Literal["local", "distributed"]
#: The two halves of a training step that a pipeline runs one after the other.
Phase = Literal["forward", "backward"]
#: A stage's task: forward (``F``) or backward (``B``) of one micro-batch.
TaskKind = Literal["F", "B"]
#: What a timeline event shows: a task, a recomputation (``R``) or a copy of activations (``C``) or
#: gradients (``G``) into a stage.
EventKind = Literal["F", "B", "R", "C", "G"]
#: A stage's lane in a timeline.
Lane = Literal["compute", "copy"]

CHECKPOINT_MODES: tuple[CheckpointMode, ...] = get_args(CheckpointMode)
CHECKPOINT_CHOICES: tuple[CheckpointChoice, ...] = get_args(CheckpointChoice)
SCHEDULES: tuple[Schedule, ...] = get_args(Schedule)
ENGINES: tuple[EngineName, ...] = get_args(EngineName)
PHASES: tuple[Phase, ...] = get_args(Phase)
