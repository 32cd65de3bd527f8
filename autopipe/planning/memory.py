"""The memory of one stage, term by term: what a run of the stage measures at its peak.

Stage ``s`` holds layers ``[a, c)``; ``n`` micro-batches of ``b`` samples are in flight at
once (all ``m`` under fill-drain); ``P`` is its parameter bytes, ``opt`` the optimizer-state
factor (:data:`OPTIMIZER_STATE`).  Every term is an upper bound on what is live at the stage's
peak, so their sum is one on the peak::

    parameters   P                     gradients   P             optimizer   opt · P
    buffers      Σ buffer_bytes
    activations  saved(b) · n          (checkpointed: saved(b) once, one micro-batch recomputes at a time)
    outputs      out(b) · n, less those among the saved bytes (``output_saved``, without checkpoints)
    inputs       in(b) · n             only on a device with memory of its own (see below)
    input grad   in(b)                 the gradient of the stage's input on its way back (stages > 0)
    skips        skip(b) · n           the skip tensors it sends (and receives, see below)
    transient    max workspace(b)      of its layers (``LayerProfile.workspace_bytes``)

What is a stage's memory where devices share memory?  CPU "devices" share one address space
and a tensor sent from one CPU stage to the next is the same memory, so the measurement
(:mod:`autopipe.runtime.memory`) charges each tensor to the stage that allocated it: a stage's
output and the skips it stashes are its own, the input and skips it receives are its
predecessor's.  On separate devices (CUDA) the receiver holds a copy, and ``inputs`` and
received skips count.  The stage's output is held for every micro-batch in flight even when
checkpointed: by the stage itself, or by the next stage as its input — and then a micro-batch's
recomputed output is a second tensor beside the one the next stage may still hold, so the
output is counted apart from the saved bytes even where they include it.

The ``transient`` term is the largest layer's workspace (temporaries, a gradient before it is
accumulated into ``.grad``) measured by the profiler.  Profiles made before it was measured
have none; it is then estimated as the layer's parameter bytes (a new gradient) plus the
bytes of its input and output at ``b`` (their gradients), and ``output_saved`` as ``False``
(the output counted once more), both bounds rather than measurements.

This module is the one place where these terms live; the schedule decides ``n`` and
replicas would change ``P``'s copies and ``b`` — extend :func:`stage_memory`'s arguments, not
its callers' arithmetic.
"""
from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, Mapping, Sequence

import numpy as np

from ..profiling.profiles import LayerProfile

__all__ = ["MemoryTerms", "stage_memory", "OPTIMIZER_STATE", "optimizer_factor", "workspace_table",
           "output_saved_flags"]

#: Optimizer-state bytes per parameter byte for the optimizers a plan can name: plain SGD keeps
#: none, SGD with momentum a momentum buffer, Adam two moments.
OPTIMIZER_STATE: Mapping[str, float] = {"sgd": 0.0, "momentum": 1.0, "adam": 2.0}


def optimizer_factor(state: str | float) -> float:
    """The factor of an optimizer name or a given factor (bytes of state per parameter byte)."""
    if isinstance(state, str):
        if state not in OPTIMIZER_STATE:
            raise ValueError(f"optimizer_state '{state}' is not one of {list(OPTIMIZER_STATE)} "
                             "nor a number (state bytes per parameter byte)")
        return OPTIMIZER_STATE[state]
    if isinstance(state, bool) or not isinstance(state, (int, float)) or not state >= 0:
        raise ValueError(f"optimizer_state must be one of {list(OPTIMIZER_STATE)} or a number ≥ 0 "
                         f"(state bytes per parameter byte: 1 for SGD with momentum, 2 for Adam), got {state!r}")
    return float(state)


@dataclass(frozen=True)
class MemoryTerms:
    """One stage's predicted peak bytes by term (each a number, or an array over candidate
    stages); the module docstring defines them."""

    parameters: Any
    gradients: Any
    optimizer: Any
    buffers: Any
    activations: Any
    outputs: Any
    inputs: Any
    input_grad: Any
    skips: Any
    transient: Any

    @property
    def total(self) -> Any:
        return sum(getattr(self, f.name) for f in fields(self))

    def dominant(self) -> str:
        """The largest term's name (for one stage)."""
        return max((f.name for f in fields(self)), key=lambda name: float(getattr(self, name)))

    def to_json(self) -> dict[str, int]:
        return {f.name: int(np.ceil(getattr(self, f.name))) for f in fields(self)}


def stage_memory(*, params: Any, buffers: Any, saved: Any, output: Any, output_saved: Any,
                 input_bytes: Any, first: Any, skips: Any, transient: Any, in_flight: int,
                 checkpointed: bool, optimizer: float, own_copies: bool,
                 received: Any = 0.0) -> MemoryTerms:
    """The terms for a stage (or arrays of candidate stages), every byte count at size ``b``.

    Args:
        params, buffers: the stage's parameter and buffer bytes.
        saved: its layers' saved bytes; ``output``: its output's bytes; ``output_saved``
            whether the output is among ``saved`` (1/0).
        input_bytes: its main input's bytes; ``first``: whether it is the first stage (whose
            input needs no gradient).
        skips: bytes of the skip tensors it holds per micro-batch.
        transient: its largest layer workspace.
        in_flight: micro-batches whose activations it holds at once.
        checkpointed: whether the micro-batches in flight keep only their inputs.
        optimizer: optimizer-state bytes per parameter byte.
        own_copies: whether a received tensor is a copy in this device's memory.
        received: bytes per micro-batch of the distributed engine's receive buffer.
    """
    kept = 1 if checkpointed else in_flight  # micro-batches whose saved tensors are live
    return MemoryTerms(
        parameters=params,
        gradients=params,
        optimizer=optimizer * params,
        buffers=buffers,
        activations=saved * kept,
        outputs=output * (in_flight - (0 if checkpointed else in_flight * output_saved)),
        inputs=(input_bytes if own_copies else 0.0) * in_flight + received * in_flight,
        input_grad=input_bytes * (1 - np.asarray(first, dtype=float)),
        skips=skips * in_flight,
        transient=transient,
    )


def workspace_table(layers: Sequence[LayerProfile], workspace: Sequence[float]) -> np.ndarray:
    """``table[a, c]`` = the largest of ``workspace[a:c]`` (0 for an empty range), for index arrays."""
    count = len(layers)
    table = np.zeros((count + 1, count + 1))
    for start in range(count):
        table[start, start + 1:] = np.maximum.accumulate(np.asarray(workspace[start:], dtype=float))
    return table


def estimated_workspace(layer: LayerProfile, input_bytes: float, output_bytes: float) -> float:
    """A layer's workspace when the profile has none measured: a new gradient of its
    parameters and the gradients of its input and output."""
    return layer.param_bytes + input_bytes + output_bytes


def output_saved_flags(layers: Sequence[LayerProfile]) -> np.ndarray:
    """Per layer 1 if its output is among the saved bytes, 0 if not or not known."""
    return np.asarray([1.0 if layer.output_saved else 0.0 for layer in layers])
