"""The schedules' task orders, shared by the runtime (which runs them) and the simulator (which
prices them), and what follows from an order: micro-batches in flight and the turn rule.

A schedule gives each stage the list of its tasks, ``("F", j)`` or ``("B", j)`` for
micro-batch ``j``, in the order its worker runs them.  With ``S`` stages and ``m``
micro-batches::

    gpipe (fill-drain)    every stage:  F0 F1 … F(m-1)  B(m-1) … B1 B0
    1f1b                  stage s:      w = min(S-s-1, m) forwards (warm-up), then F and B
                                        alternate (F(w) B0 F(w+1) B1 …), then the last w B's

    1f1b, S=3, m=4:  stage 0:  F0 F1 F2 B0 F3 B1 B2 B3
                     stage 1:     F0 F1 B0 F2 B1 F3 B2 B3
                     stage 2:        F0 B0 F1 B1 F2 B2 F3 B3

A micro-batch is in flight on a stage from its forward to its backward (its inputs, and its
saved tensors unless checkpointed, are held): ``m`` of them in fill-drain, at most ``S - s``
in 1F1B (:func:`in_flight`).  1F1B needs the loss inside the pipeline (the last stage's
backward of micro-batch 0 precedes its forward of micro-batch 1), so the runtime runs it
through :meth:`autopipe.Pipeline.train_step`.  Stages sharing a device (an interleaved plan)
each keep their own order; the device serves them by :func:`priority` under the plan's turn
rule, whichever the planner predicts faster.

Backwards are also held back by :data:`GRADIENT_WINDOW` ``W``: stage ``s``'s ``k``-th backward
starts only once stage ``s - 1`` has finished its ``(k - W)``-th (every stage runs its backwards
in the same micro-batch order), so at most ``W`` gradients of a stage's input are alive.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from .._vocab import SCHEDULES, TURN_RULES, CheckpointMode, Schedule, TurnRule

__all__ = ["Schedule", "SCHEDULES", "Task", "TURN_RULES", "TurnRule", "GRADIENT_WINDOW", "order", "in_flight",
           "saved_sets", "priority", "checkpointed"]

#: one task of a stage: ``("F" | "B", micro-batch)``.
Task = tuple[str, int]

#: Input gradients of one stage that may be alive at once (the runtime holds backwards to it,
#: :class:`autopipe.runtime.run.Credits`, and the simulator too): the one its previous stage is
#: using, one on its way there and the one its own backward is making.  Three is the least that
#: never delays one stage per device under fill-drain, whatever the copies take: over three
#: micro-batches the wait's loop (``B`` on ``s``, its gradient's copy, ``B`` on ``s - 1``) is no
#: longer than three turns of the slowest of those lanes, so the flow shop of
#: :mod:`autopipe.planning.cost` stays exact (tests/test_simulate.py); with two, a gradient copy
#: longer than the two backwards differ delays every second micro-batch.  The memory model counts
#: ``W - 1`` finished gradients beside a backward (:mod:`autopipe.planning.memory`).
GRADIENT_WINDOW = 3


def order(schedule: str, stage: int, stages: int, chunks: int) -> list[Task]:
    """Stage ``stage``'s tasks (of ``stages``) over ``chunks`` micro-batches, in running order."""
    if schedule == "gpipe":
        return [("F", j) for j in range(chunks)] + [("B", j) for j in reversed(range(chunks))]
    if schedule == "1f1b":
        warm = min(stages - stage - 1, chunks)
        tasks = [("F", j) for j in range(warm)]
        for j in range(chunks - warm):
            tasks += [("F", warm + j), ("B", j)]
        return tasks + [("B", j) for j in range(chunks - warm, chunks)]
    raise ValueError(f"schedule '{schedule}' is not one of {list(SCHEDULES)}")


def in_flight(schedule: str, stage: Any, stages: int, chunks: int) -> Any:
    """Most micro-batches whose forward ran and backward did not yet on ``stage`` (an index,
    or an array of them): what its memory holds activations for (``chunks`` in gpipe,
    ``min(stages - stage, chunks)`` in 1f1b)."""
    if schedule == "gpipe":
        return chunks + 0 * stage
    if schedule == "1f1b":
        return np.minimum(stages - stage, chunks) if isinstance(stage, np.ndarray) else min(stages - stage, chunks)
    raise ValueError(f"schedule '{schedule}' is not one of {list(SCHEDULES)}")


def saved_sets(schedule: str, mode: str, stage: Any, stages: int, chunks: int) -> Any:
    """Most micro-batches whose saved tensors (not only inputs) ``stage`` holds at once under
    checkpoint ``mode``: all in flight with ``never``; one with ``always`` (the one being
    recomputed); with ``except_last`` one, except in 1F1B on a stage with a warm-up, where the
    last micro-batch keeps its saved tensors while earlier ones recompute for their backwards
    (``F(m-1) B(m-1-w) …``): two."""
    if mode == "never":
        return in_flight(schedule, stage, stages, chunks)
    warm = np.minimum(stages - stage - 1, chunks - 1) > 0 if schedule == "1f1b" else 0 * stage > 0
    twice = np.where(warm, 2, 1) if mode == "except_last" else 1 + 0 * stage
    return twice if isinstance(stage, np.ndarray) else int(twice)


def checkpointed(mode: CheckpointMode, micro_batch: int, chunks: int) -> bool:
    """Whether checkpoint ``mode`` reruns micro-batch ``micro_batch``'s forward before its
    backward (dropping its activations until then): never, all but the last (whose backward
    comes at once), or always.  The runtime and the simulator both follow it."""
    return mode == "always" or (mode == "except_last" and micro_batch < chunks - 1)


def priority(stage: int, kind: str, rule: str = "depth_first") -> tuple[int, int]:
    """Rank of a ready task (least goes first) when stages share a device: forwards before
    backwards, then by ``rule`` (:data:`TURN_RULES`)::

        depth_first    the further along its phase's chain the sooner: forwards later stage
                       first (a micro-batch reaches the end sooner), backwards earlier first
        breadth_first  the reverse: forwards earlier stage first (the first stages run all
                       their micro-batches before the later ones start), backwards later first
    """
    along = -stage if kind == "F" else stage
    return (0 if kind == "F" else 1), (along if rule == "depth_first" else -along)
