"""The words the steps pass each other, defined once as ``Literal`` types with their values.

They stay plain strings, so plans and profiles keep their JSON as it is; the types let a checker
catch a misspelt mode, and the tuples are what option checks and error messages list.  Device
names are checked here too, without torch: the planner must not import it, and every step refuses
a name torch would not know (or that would name a device that cannot exist) with one line.

"""
from __future__ import annotations

import re
from typing import Literal, get_args

from .errors import DeviceError

__all__ = [
    "check_device_name",
    "CHECKPOINT_MODES", "CHECKPOINT_CHOICES", "ENGINES", "PHASES", "SCHEDULES", "TURN_RULES", "TurnRule",
    "CheckpointChoice", "CheckpointMode", "EngineName", "EventKind", "Lane", "Phase", "Schedule", "TaskKind",
    "Reduction", "REDUCTIONS",
]

#: What a stage keeps for backward: every activation, none (recompute every micro-batch) or all
#: but the last micro-batch's (whose backward comes at once).
CheckpointMode = Literal["never", "except_last", "always"]
#: A checkpoint mode to plan for, or ``"auto"``: the planner chooses.
CheckpointChoice = Literal["auto", "never", "except_last", "always"]
#: The order of micro-batches: fill-drain, or one forward one backward.
Schedule = Literal["gpipe", "1f1b"]
#: How a device shared by several stages picks among their ready tasks: the task furthest along
#: its phase first (``depth_first``), or the earliest micro-batch first (``breadth_first``).
TurnRule = Literal["depth_first", "breadth_first"]
#: What runs a plan: the in-process runtime or ``torch.distributed.pipelining``.
EngineName = Literal["local", "distributed"]
#: What one call of the runtime's engine runs: the forwards, the backwards, or a whole training
#: iteration with the loss inside (``"train"``, how 1F1B interleaves them).
Phase = Literal["forward", "backward", "train"]
#: A stage's task: forward (``F``) or backward (``B``) of one micro-batch.
TaskKind = Literal["F", "B"]
#: What a timeline event shows: a task, a recomputation (``R``) or a copy of activations (``C``) or
#: gradients (``G``) into a stage.
EventKind = Literal["F", "B", "R", "C", "G"]
#: A stage's lane in a timeline.
Lane = Literal["compute", "copy"]
#: How a loss function reduces its samples: their mean or their sum.
Reduction = Literal["mean", "sum"]

CHECKPOINT_MODES: tuple[CheckpointMode, ...] = get_args(CheckpointMode)
CHECKPOINT_CHOICES: tuple[CheckpointChoice, ...] = get_args(CheckpointChoice)
SCHEDULES: tuple[Schedule, ...] = get_args(Schedule)
TURN_RULES: tuple[TurnRule, ...] = get_args(TurnRule)
ENGINES: tuple[EngineName, ...] = get_args(EngineName)
PHASES: tuple[Phase, ...] = get_args(Phase)
REDUCTIONS: tuple[Reduction, ...] = get_args(Reduction)

#: Device names every step accepts: ``type`` or ``type:index``.
_NAME = re.compile(r"(cpu|cuda|meta)(:\d+)?")


def check_device_name(name: object) -> str:
    """``name`` as a device name (``cpu``, ``cuda``, ``cuda:N``); raises :class:`DeviceError`."""
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise DeviceError(f"'{name}' is not a device autopipe can use; name devices 'cpu', 'cuda' or "
                          "'cuda:N' (N = 0, 1, ...), e.g. cpu,cpu or cuda:0,cuda:1")
    return name
