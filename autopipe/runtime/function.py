"""The autograd function that ties the caller's graph to the pipeline.

``PipelineTie`` connects the caller's autograd graph to the pipeline.  Its forward runs the
pipeline's forward phase on the stage workers and returns the gathered output; its backward,
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

from .engine import Engine
from .microbatch import gather
from .run import Run

_execution_engine = Variable._execution_engine  # queue_callback, as DDP and FSDP use it

__all__ = ["PipelineTie"]


class PipelineTie(torch.autograd.Function):
    """``out = PipelineTie.apply(engine, run, dummy, *input_tensors)``."""

    @staticmethod
    def forward(ctx: Any, engine: Engine, run: Run, dummy: Tensor, *inputs: Tensor) -> Any:  # type: ignore[override]
        ctx.engine, ctx.run = engine, run
        ctx.input_devices = [t.device for t in inputs]
        engine.run_phase(run, "forward")
        return gather([run.outputs.pop(j) for j in range(run.chunks)])

    @staticmethod
    def backward(ctx: Any, *grads: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        run: Run = ctx.run
        if run.output_grads:
            raise RuntimeError("backward through a pipeline output twice is not supported "
                               "(the pipeline frees its saved state after the first backward)")
        run.output_grads = [list(parts) for parts in zip(*(torch.split(g, run.sizes) for g in grads))]
        if not any(ctx.needs_input_grad[3:]):
            # Nothing to return: let the caller's backward go on and wait at its very end.
            ctx.engine.start_phase(run, "backward")
            _execution_engine.queue_callback(lambda: ctx.engine.finish_phase(run, "backward"))
            return (None,) * (3 + len(ctx.input_devices))
        ctx.engine.run_phase(run, "backward")
        per_input = zip(*(run.input_grads.pop(j) for j in range(run.chunks)))
        joined = (_join(parts, run.sizes, device) for parts, device in zip(per_input, ctx.input_devices))
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
