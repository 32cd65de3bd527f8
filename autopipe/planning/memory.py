"""The memory of one stage, term by term: what a run of the stage measures at its peak.

Stage ``s`` holds layers ``[a, c)``; ``n`` micro-batches of ``b`` samples are in flight at
once (all ``m`` under fill-drain); ``P`` is its parameter bytes, ``opt`` the optimizer-state
factor (:data:`OPTIMIZER_STATE`); per micro-batch ``S`` is its layers' saved bytes, ``O`` its
output unless among them (``output_saved``), ``H = S + O`` what it holds from forward to
backward (checkpointed: ``O`` only, plus its output ``out``).

The peak is in a backward.  While layer ``l`` runs its backward, the micro-batch still holds
the saved bytes of layers ``a..l`` (autograd frees each layer's as it finishes), plus the
layer's workspace ``w_l`` (measured by the profiler: temporaries, its input gradient, a new
parameter gradient before it is added to ``.grad``) and the gradient of its output, which the
layer after it made (``out_l``; for the stage's last layer it comes from the next stage)::

    backward(a, c) = max over l in [a, c) of  S(a..l) + w_l + out_l [l < c-1 or own copies]  + O

Once a micro-batch's backward is done its bytes are freed, and the gradient of its input
``g`` may be all that is left of it (the previous stage still holds it), so::

    never        state + (n-1)·H + backward(a, c) + max(0, g - H)    (0 for one micro-batch)
    checkpointed state + n·out + backward(a, c) + g                   (one micro-batch recomputed)

with ``state = P + P + opt·P + buffers`` and, on devices with memory of their own, ``n`` copies
of the input and of the skips received.  :class:`MemoryTerms` splits that sum: ``activations``
(the saved bytes of the micro-batches in flight), ``outputs``, ``inputs``, ``input_grad``,
``skips`` and ``transient`` (``backward(a, c) - S - O``: what the backward holds beyond one
micro-batch's bytes).

What is a stage's memory where devices share memory?  CPU "devices" share one address space
and a tensor sent from one CPU stage to the next is the same memory, so the measurement
(:mod:`autopipe.runtime.memory`) charges each tensor to the stage that allocated it: a stage's
output, the gradient of its input and the skips it stashes are its own; the input, output
gradient and skips it receives are its neighbours'.  On separate devices (CUDA) the receiver
holds a copy, and ``inputs``, received skips and the last layer's output gradient count.  A
stage's output is held for every micro-batch in flight even when checkpointed (by the next
stage, as its input), and a recomputed output is a second tensor beside it.

Profiles made before the workspace was measured have none; it is then estimated as the layer's
parameter bytes (a new gradient) plus the bytes of its input (its gradient), and
``output_saved`` as ``False`` (the output counted once more): bounds, not measurements.

This module is the one place where these terms live: the schedule decides ``n``, replicas
would change ``b`` — extend :func:`stage_memory`'s arguments, not its callers' arithmetic.
"""
from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, Mapping, Sequence

import numpy as np

from ..profiling.profiles import LayerProfile

__all__ = ["MemoryTerms", "stage_memory", "OPTIMIZER_STATE", "optimizer_factor", "backward_peaks",
           "backward_peak", "estimated_workspace", "output_saved_flags"]

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
                 input_bytes: Any, first: Any, skips: Any, backward: Any, in_flight: int,
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
        backward: ``backward(a, c)`` of the module docstring, without ``O``.
        in_flight: micro-batches whose activations it holds at once.
        checkpointed: whether the micro-batches in flight keep only their inputs.
        optimizer: optimizer-state bytes per parameter byte.
        own_copies: whether a received tensor is a copy in this device's memory.
        received: bytes per micro-batch of the distributed engine's receive buffer.
    """
    extra = output * (1 - output_saved)  # O: the output, unless among the saved bytes
    gradient = input_bytes * (1 - np.asarray(first, dtype=float))  # g: the first stage's input needs none
    if checkpointed:
        activations, outputs = saved, output * in_flight + extra
        input_grad = gradient
    else:
        activations, outputs = saved * in_flight, extra * in_flight
        input_grad = np.maximum(gradient - saved - extra, 0.0) if in_flight > 1 else gradient * 0.0
    return MemoryTerms(
        parameters=params,
        gradients=params,
        optimizer=optimizer * params,
        buffers=buffers,
        activations=activations,
        outputs=outputs,
        inputs=(input_bytes if own_copies else 0.0) * in_flight + received * in_flight,
        input_grad=input_grad,
        skips=skips * in_flight,
        transient=backward - saved,
    )


def range_max(values: Sequence[float]) -> np.ndarray:
    """``table[a, c]`` = the largest of ``values[a:c]`` (-inf for an empty range), for index arrays."""
    count = len(values)
    table = np.full((count + 1, count + 1), -np.inf)
    for start in range(count):
        table[start, start + 1:] = np.maximum.accumulate(np.asarray(values[start:], dtype=float))
    return table


def backward_peaks(saved_prefix: np.ndarray, workspace: np.ndarray, outputs: np.ndarray,
                   own_copies: bool) -> tuple[np.ndarray, np.ndarray]:
    """What :meth:`backward_peak` needs: the range maximum over inner layers and the last layer's
    own value, both before subtracting the stage's saved prefix."""
    inner = saved_prefix[1:] + workspace + outputs
    last = saved_prefix[1:] + workspace + (outputs if own_copies else 0.0)
    return range_max(inner), last


def backward_peak(table: np.ndarray, last: np.ndarray, saved_prefix: np.ndarray, start: Any, stop: Any) -> Any:
    """``backward(a, c)`` without ``O`` for stages ``[start, stop)`` (index arrays allowed)."""
    stop = np.asarray(stop)
    return np.maximum(table[start, stop - 1], last[stop - 1]) - saved_prefix[start]


def estimated_workspace(layer: LayerProfile, input_bytes: float) -> float:
    """A layer's workspace when the profile has none measured: a new gradient of its
    parameters and the gradient of its input."""
    return layer.param_bytes + input_bytes


def output_saved_flags(layers: Sequence[LayerProfile]) -> np.ndarray:
    """Per layer 1 if its output is among the saved bytes, 0 if not or not known."""
    return np.asarray([1.0 if layer.output_saved else 0.0 for layer in layers])
