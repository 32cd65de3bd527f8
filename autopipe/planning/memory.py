"""The memory of one stage, term by term: what a run of the stage measures at its peak.

Stage ``s`` holds layers ``[a, c)``; ``n`` micro-batches of ``b`` samples are in flight at
once (all ``m`` under fill-drain); ``P`` is its parameter bytes, ``G`` those of the parameters
that get gradients (frozen ones, ``requires_grad=False``, get no gradient nor optimizer state),
``opt`` the optimizer-state factor (:data:`OPTIMIZER_STATE`); per micro-batch ``S`` is its
layers' saved bytes, ``O`` its output ``out`` unless among them (``output_saved``): ``H = S + O`` is what it holds from
forward to backward (checkpointed, only ``out``: the saved bytes come back one micro-batch at a
time, in its recomputation).

The peak is in a backward.  While layer ``l`` runs its backward, the micro-batch still holds
the saved bytes of layers ``a..l`` (autograd frees each layer's as it finishes) and the stage's
output (kept for the whole backward; once among the saved bytes of ``p..l``, where ``p`` is the
layer that made it — the last one not in place), plus the layer's workspace ``w_l`` (measured
by the profiler: temporaries, its input gradient, a new parameter gradient before it is added
to ``.grad``) and the gradient of its output, which the layer after it made (``out_l``; for the
stage's last layer it comes from the next stage)::

    backward_l = S(a..l) + (out if l < p else O) + w_l + out_l [l < c-1 or own copies]

In the first micro-batch's backward the gradients do not all exist yet: those of layers after
``l`` and ``l``'s own.  After it, every gradient exists and each finished micro-batch has freed
its bytes, leaving gradients of its input ``g`` with the previous stage: ``W - 1`` of them
(:data:`~autopipe.planning.schedules.GRADIENT_WINDOW` ``W``, the runtime's backpressure: one the
stage before is using, one on its way).  So the peak is the larger of::

    first  P + opt·G + buffers + G(l..c) + (n-1)·H + max_l backward_l
    later  P + G + opt·G + buffers + (n-2)·H + (W-1)·g + max_l backward_l       (n ≥ 2)

and, checkpointed, ``n·out`` (the outputs in flight) in place of ``(n-1)·H`` and ``(n-2)·H``.
On devices with memory of their own, ``n`` copies of the input and of the skips received are
added.  A skip stashed and popped inside the stage is held like saved bytes (``n`` times, once
checkpointed), since the pop layer's saved bytes leave popped tensors out.

Or the peak is in the optimizer's step, after the last backward has freed the activations,
outputs, inputs and skips of every micro-batch: the parameters, their gradients and state and
what the step allocates while it runs (``step`` per parameter byte, :data:`OPTIMIZER_STEP`:
Adam's square root of its second moment, for every parameter at once or twice over one tensor
at a time), with the distributed engine's receive buffers (``r`` per micro-batch), which
outlive a step::

    step   P + G + opt·G + buffers + step·G + n·r

A stage whose parameters outweigh its activations peaks there under Adam (a one-stage plan of
two 1024-wide Linears measured 11% over its prediction before the step was counted).

:class:`MemoryTerms` splits the larger sum: ``activations`` (the saved bytes of the
micro-batches in flight), ``outputs``, ``inputs``, ``input_grad``, ``skips``, ``transient``:
the rest of the backward's peak, what it holds beyond the steady terms (negative when the peak
comes in the first backward, before every gradient exists), and ``step``: what the optimizer
step's peak adds beyond the backward's (0 when the backward's is the larger).

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

import numbers
from dataclasses import dataclass, fields
from typing import Any, Mapping, Sequence

import numpy as np

from ..errors import OptionError
from ..profiling.profiles import LayerProfile
from ._arrays import power_spans
from .schedules import GRADIENT_WINDOW

__all__ = ["MemoryTerms", "stage_memory", "OPTIMIZER_STATE", "OPTIMIZER_STEP", "optimizer_factor", "step_factor",
           "BackwardTables", "RangeMax", "estimated_workspace", "output_saved_flags", "producers"]

#: Optimizer-state bytes per parameter byte for the optimizers a plan can name: plain SGD keeps
#: none, SGD with momentum a momentum buffer, Adam two moments.
OPTIMIZER_STATE: Mapping[str, float] = {"sgd": 0.0, "momentum": 1.0, "adam": 2.0}

#: Bytes ``optimizer.step()`` allocates and frees while it runs, per trainable parameter byte,
#: for the optimizers a plan can name: upper bounds over torch's for-loop implementation (CPU's
#: default) and its foreach one (CUDA's).  Measured (torch 2.14.1, CPU, float32, default
#: settings) as the peak of the project's allocation counter during a step, less the state the
#: step created:
#:
#: * Adam and AdamW, foreach: 1.00 (``_foreach_sqrt`` of every second moment at once); for-loop:
#:   twice the largest parameter tensor (``exp_avg_sq.sqrt() / bias_correction2_sqrt``, one
#:   tensor at a time), 2.00 for a stage of one tensor, 1.33 for Linear(1024, 1024) beside a
#:   Linear(1024, 512); fused: 0.
#: * SGD with momentum 0.9 or without: 0 (every update in place), foreach or not.
OPTIMIZER_STEP: Mapping[str, float] = {"sgd": 0.0, "momentum": 0.0, "adam": 2.0}

#: The step's temporaries for a nonzero optimizer-state factor given as a number, which names no
#: optimizer: the largest measured of torch's optimizers (as :data:`OPTIMIZER_STEP`, defaults):
#: 2.00 for Adam, AdamW, NAdam, RAdam and Adam(amsgrad) on one tensor and for Adagrad's foreach
#: step (state 1, so no rule from the state holds); RMSprop and Adamax at most 1.00.  A factor
#: of 0 (no state) is plain SGD's, which updates in place.
MAX_STEP_FACTOR = 2.0


#: The largest optimizer-state factor taken: far above any optimizer's (Adam keeps 2), and far
#: below where the state's bytes stop being finite (``1e308`` times the parameters overflowed).
MAX_OPTIMIZER_FACTOR = 1000.0


def optimizer_factor(state: str | float) -> float:
    """The factor of an optimizer name or a given factor (bytes of state per parameter byte)."""
    if isinstance(state, str):
        if state not in OPTIMIZER_STATE:
            raise OptionError(f"optimizer_state '{state}' is not one of {list(OPTIMIZER_STATE)} "
                              "nor a number (state bytes per parameter byte)")
        return OPTIMIZER_STATE[state]
    if isinstance(state, bool) or not isinstance(state, numbers.Real) or not 0 <= state <= MAX_OPTIMIZER_FACTOR:
        raise OptionError(f"optimizer_state must be one of {list(OPTIMIZER_STATE)} or a number from 0 to "
                          f"{MAX_OPTIMIZER_FACTOR:g} (state bytes per parameter byte: 1 for SGD with momentum, "
                          f"2 for Adam), got {state!r}")
    return float(state)


def step_factor(state: str | float) -> float:
    """The step's temporaries (bytes per trainable parameter byte) of an optimizer name, or for a
    given state factor :data:`MAX_STEP_FACTOR` (0 for no state)."""
    factor = optimizer_factor(state)  # the same check, the same error
    if isinstance(state, str):
        return OPTIMIZER_STEP[state]
    return MAX_STEP_FACTOR if factor > 0 else 0.0


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
    step: Any

    @property
    def total(self) -> Any:
        return sum(getattr(self, f.name) for f in fields(self))

    def dominant(self) -> str:
        """The largest term's name (for one stage)."""
        return max((f.name for f in fields(self)), key=lambda name: float(getattr(self, name)))

    def to_json(self) -> dict[str, int]:
        return {f.name: int(np.ceil(getattr(self, f.name))) for f in fields(self)}

    def rows(self, count: int) -> list[dict[str, int]]:
        """:meth:`to_json` of each of ``count`` stages whose terms are arrays."""
        table = np.ceil(np.array([np.broadcast_to(getattr(self, f.name), (count,)) for f in fields(self)]))
        return [dict(zip((f.name for f in fields(self)), map(int, column))) for column in table.T]


def stage_memory(*, params: Any, buffers: Any, saved: Any, output: Any, output_saved: Any,
                 input_bytes: Any, first: Any, skips: Any, backward: tuple[Any, Any], in_flight: Any,
                 checkpointed: bool, optimizer: float, step: float, own_copies: bool,
                 received: Any = 0.0, refilled: bool = False, grads: Any = None,
                 inner_skips: Any = 0.0, extra_sets: Any = 0) -> MemoryTerms:
    """The terms for a stage (or arrays of candidate stages), every byte count at size ``b``.

    Args:
        params, buffers: the stage's parameter and buffer bytes.
        saved: its layers' saved bytes; ``output``: its output's bytes; ``output_saved``
            whether the output is among ``saved`` (1/0).
        input_bytes: its main input's bytes; ``first``: whether it is the first stage (whose
            input needs no gradient).
        skips: bytes of the skip tensors it holds per micro-batch (sends on or receives).
        inner_skips: bytes per micro-batch of the skips stashed and popped inside it, held as
            its saved bytes are: for every micro-batch in flight, or only the one recomputed
            when checkpointed (an over-count where the pop layer does not save the skip).
        backward: ``max_l backward_l`` of the module docstring, in the first micro-batch's
            backward (with the gradients ``P(l..c)`` that exist then) and in a later one.
        in_flight: micro-batches whose activations it holds at once.
        checkpointed: whether the micro-batches in flight keep only their inputs.
        optimizer: optimizer-state bytes per parameter byte; ``step``: the bytes its step
            allocates while it runs, per parameter byte (:func:`step_factor`).
        own_copies: whether a received tensor is a copy in this device's memory.
        received: bytes per micro-batch of the distributed engine's receive buffer.
        refilled: whether a forward runs between two backwards (1F1B), so a later backward
            still finds ``in_flight`` micro-batches held, not one fewer.
        grads: bytes of its parameters that get gradients (default all ``params``): what the
            gradients and optimizer state are charged for; ``backward`` counts the same ones.
        extra_sets: sets of saved bytes (and inner skips) held beyond those of the micro-batches
            in flight (1F1B with ``except_last`` may hold two where fill-drain holds one).
    """
    grads = params if grads is None else grads
    extra = output * (1 - output_saved)  # O: the output, unless among the saved bytes
    # (W-1)·g: the first stage's input needs none
    gradient = input_bytes * (1 - np.asarray(first, dtype=float)) * (GRADIENT_WINDOW - 1)
    in_first, in_later = backward
    if checkpointed:
        activations, outputs, input_grad = saved, output * in_flight, gradient
        before, after = outputs, outputs + gradient
    else:
        activations, outputs, input_grad = saved * in_flight, extra * in_flight, gradient * 0.0
        before = (saved + extra) * (in_flight - 1)
        after = (saved + extra) * (in_flight - 2 + refilled) + gradient
    peak = in_first + before - grads  # the gradients of the first backward are in in_first
    later = (np.asarray(in_flight) > 1) | checkpointed | refilled
    peak = np.where(later, np.maximum(peak, in_later + after), peak)
    # a checkpointed micro-batch keeps a copy of the stage's buffers for its recomputation (run as
    # its forward ran, though later forwards update them: runtime/checkpoint.py), until its backward,
    # and the recomputation one more, of the buffers it restores after
    kept = buffers * (in_flight + 1) if checkpointed else 0.0
    terms = dict(parameters=params, gradients=grads, optimizer=optimizer * grads, buffers=buffers + kept,
                 activations=activations + extra_sets * saved, outputs=outputs,
                 inputs=(input_bytes if own_copies else 0.0) * in_flight + received * in_flight,
                 input_grad=input_grad,
                 skips=skips * in_flight + inner_skips * ((1 if checkpointed else in_flight) + extra_sets))
    weights = params + grads * (1 + optimizer)  # held throughout, the step's peak too
    steady = weights + terms["buffers"] + terms["inputs"] + terms["skips"]
    backward_total = steady + peak + extra_sets * saved
    step_total = weights + grads * step + buffers + received * in_flight
    total = np.maximum(backward_total, step_total)
    return MemoryTerms(**terms, transient=backward_total - sum(terms.values()), step=total - backward_total)


class RangeMax:
    """``table[a, c]`` = the largest of ``values[a:c]`` (-inf for an empty range), for index
    arrays: maxima over power-of-two spans (``O(L log L)`` to build), each range answered as
    the two overlapping spans of the largest length that fits in it."""

    def __init__(self, values: Sequence[float]) -> None:
        self.spans = power_spans(np.append(np.asarray(values, dtype=float), -np.inf), np.maximum, -np.inf)
        self.empty = len(values)  # the last -inf: empty ranges

    def __getitem__(self, index: tuple[Any, Any]) -> Any:
        start, stop = (np.asarray(i) for i in index)
        width = stop - start
        level = np.floor(np.log2(np.maximum(width, 1))).astype(np.intp)
        left = np.where(width > 0, start, self.empty)
        right = np.where(width > 0, stop - (1 << level), self.empty)
        return np.maximum(self.spans[level, left], self.spans[level, right])


@dataclass(frozen=True)
class BackwardTables:
    """Per micro-batch size, what ``max_l backward_l`` needs for any stage ``[a, c)`` at once:
    range maxima (:class:`RangeMax`) of ``S(0..l) + w_l + out_l`` for inner layers, the last
    layer's own value, and where each stage's output was made."""

    later: RangeMax
    later_last: np.ndarray
    first: RangeMax  # the same less P(0..l): the first backward adds the gradients P(l..c)
    first_last: np.ndarray
    producer: np.ndarray  # [c]: the last layer before c that is not in place
    saved_prefix: np.ndarray
    param_prefix: np.ndarray
    output: np.ndarray  # [c]: the output of layer c - 1
    extra: np.ndarray  # [c]: that output, unless among the saved bytes

    @staticmethod
    def build(saved_prefix: np.ndarray, param_prefix: np.ndarray, workspace: np.ndarray, outputs: np.ndarray,
              output_saved: np.ndarray, producer: np.ndarray, own_copies: bool) -> BackwardTables:
        """The tables at one size; ``producer`` as :func:`producers` gives it."""
        inner = saved_prefix[1:] + workspace + outputs
        last = saved_prefix[1:] + workspace + (outputs if own_copies else 0.0)
        pad = np.concatenate(([0.0], outputs))
        return BackwardTables(RangeMax(inner), last, RangeMax(inner - param_prefix[:-1]),
                              last - param_prefix[:-1], producer, saved_prefix, param_prefix, pad,
                              pad * np.concatenate(([0.0], 1 - output_saved)))

    def peaks(self, start: Any, stop: Any) -> tuple[Any, Any]:
        """``max_l backward_l`` of stages ``[start, stop)`` in the first backward (with the
        gradients that exist then) and a later one (index arrays allowed)."""
        stop = np.asarray(stop)
        made = np.maximum(self.producer[stop], start)
        first, later = ((np.maximum(np.maximum(table[start, made] + self.output[stop] - self.extra[stop],
                                               table[made, stop - 1]), last[stop - 1])
                         + self.extra[stop] - self.saved_prefix[start])
                        for table, last in ((self.first, self.first_last), (self.later, self.later_last)))
        return first + self.param_prefix[stop], later


def producers(aliases: Sequence[bool]) -> np.ndarray:
    """``[c]``: the last layer before cut ``c`` whose output is not a view of its input (layer
    0 where all are), which made the tensor a stage ending at ``c`` sends."""
    index = np.arange(len(aliases))
    made = np.maximum.accumulate(np.where(np.asarray(aliases, dtype=bool) & (index > 0), 0, index))
    return np.concatenate(([0], made)).astype(int)


def estimated_workspace(trainable_bytes: Any, input_bytes: Any) -> Any:
    """A layer's workspace when the profile has none measured: a new gradient of its
    parameters (those that get one) and the gradient of its input (arrays allowed)."""
    return trainable_bytes + input_bytes


def output_saved_flags(layers: Sequence[LayerProfile]) -> np.ndarray:
    """Per layer 1 if its output is among the saved bytes, 0 if not or not known."""
    return np.asarray([1.0 if layer.output_saved else 0.0 for layer in layers])
