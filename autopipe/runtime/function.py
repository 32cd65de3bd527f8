"""The autograd function that ties the caller's graph to the pipeline.

``PipelineTie`` connects the caller's autograd graph to the pipeline (or to its replicas, which
run side by side on their shares of the batch).  Its forward runs the
pipeline's forward phase on the stage workers and returns the joined output's tensors (flat:
autograd ties only those; ``apply`` puts them back in the output's structure); its backward,
called from the caller's ``loss.backward()``, hands the output gradient to the last stage, runs
the backward phase on the workers (each stage calls ``torch.autograd.backward`` on its own
thread) and returns the gradient of each input tensor::

    caller:  x ──▶ PipelineTie ──▶ out ──▶ loss          (dummy: always requires grad, so
                        ▲  backward                         the tie's backward always runs)
    workers:  stage 0 ◀─dx─ stage 1 ◀─dx─ ... ◀─dy─ last stage

When no input needs a gradient (the usual case: ``x`` is data) the tie's backward only starts
the backward phase and returns; a callback queued on the autograd engine waits for the
stages at the end of the caller's ``backward()``, so parameter gradients are complete when it
returns.  This matters on CUDA: autograd runs the tie's backward on the device thread of the
output's GPU, and a stage backward on that GPU needs that same thread, so blocking there would
deadlock.  When the input does need its gradient the tie must wait inside its backward; with
CUDA outputs that case is unverified and may deadlock if a stage shares the output's GPU.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import Tensor
from torch.autograd.variable import Variable

from ._model_calls import split_output_grad
from .microbatch import Value, map_tensors, tensors_of
from .replicas import Replicas

_execution_engine = Variable._execution_engine  # queue_callback, as DDP and FSDP use it

__all__ = ["PipelineTie"]


class PipelineTie(torch.autograd.Function):
    """``out = PipelineTie.apply(replicas, dummy, *input_tensors)``: ``replicas`` pairs each
    replica's engine with its run (one pair for a plain pipeline); their phases run at once and
    their outputs are joined in order along dim 0."""

    @classmethod
    def apply(cls, replicas: Replicas, dummy: Tensor, *inputs: Tensor) -> Value:  # type: ignore[override]
        """The joined output in its own structure (nested tuples too), every tensor in it tied.

        Autograd ties only the tensors a Function returns at the top level (nested ones would come
        back detached), so :meth:`forward` returns the output's tensors flat, in
        :func:`tensors_of` order (the order the last stage pairs them with their gradients), and
        this puts them back where they were.
        """
        joined: list[Value] = []
        flat = super().apply(replicas, dummy, joined, *inputs)
        tied = iter(flat if isinstance(flat, tuple) else (flat,))
        return map_tensors(joined[0], lambda _: next(tied))

    @staticmethod
    def forward(ctx: Any, replicas: Replicas, dummy: Tensor, joined: list[Value],  # type: ignore[override]
                *inputs: Tensor) -> tuple[Tensor, ...]:
        ctx.replicas = replicas
        ctx.input_devices = [t.device for t in inputs]
        ctx.set_materialize_grads(False)  # an output the loss does not use gets no gradient to run
        replicas.run_phase("forward")
        joined.append(replicas.take_outputs())
        return tuple(tensors_of(joined[0]))

    @staticmethod
    def backward(ctx: Any, *grads: Tensor | None) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        replicas: Replicas = ctx.replicas
        runs = replicas.runs
        if any(run.output_grads for run in runs):
            raise RuntimeError("backward through a pipeline output twice is not supported "
                               "(the pipeline frees its saved state after the first backward)")
        parts = [list(micro) for micro in zip(*(split_output_grad(g, replicas.sizes) for g in grads))]
        for run in runs:
            run.output_grads, parts = parts[:run.chunks], parts[run.chunks:]
        if not any(ctx.needs_input_grad[3:]):
            # Nothing to return: let the caller's backward go on and wait at its very end.
            replicas.start_phase("backward")
            _execution_engine.queue_callback(lambda: replicas.finish_phase("backward"))
            return (None,) * (3 + len(ctx.input_devices))
        replicas.run_phase("backward")
        per_input = zip(*(run.input_grads.pop(j) for run in runs for j in range(run.chunks)))
        joined = (_join(parts, replicas.sizes, device) for parts, device in zip(per_input, ctx.input_devices))
        return (None, None, None, *joined)


def _join(parts: tuple[Tensor | None, ...], sizes: list[int], device: torch.device) -> Tensor | None:
    """One input's gradient from its micro-batches' (zeros where none flowed)."""
    present = [part for part in parts if part is not None]
    if not present:
        return None
    shape = present[0].shape[1:]
    return torch.cat([
        part if part is not None else present[0].new_zeros(size, *shape)
        for part, size in zip(parts, sizes)
    ]).to(device)
