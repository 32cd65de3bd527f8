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

The stages add into the parameters' ``.grad`` only where the caller's backward does: in
``loss.backward()``, not in ``torch.autograd.grad(loss, x)`` or ``loss.backward(inputs=[x])``,
which give ``x`` its gradient and leave every other ``.grad`` alone (the stages then
differentiate with respect to their received tensors only).  The tie tells them apart by
whether autograd will run the node of its ``dummy`` (a view of a leaf that nothing else uses),
asked through ``torch._C._will_engine_execute_node``, private but what
``torch.autograd.graph.register_multi_grad_hook`` is built on.

A caller's backward with ``retain_graph=True`` has the stages keep their graphs and saved state
too, so a second backward through the output (two losses on it, backwarded in turn) runs as on
the plain model; without it the state is freed and a second backward refused, as autograd
refuses it.  The tie asks autograd which through ``_get_current_graph_task_keep_graph``, private.

The parameters are not in the caller's graph, so ``torch.autograd.grad(loss, params)`` and
``loss.backward(inputs=[param])`` give them nothing, and the tie cannot even tell (autograd does
not run a node that leads to none of the tensors asked for).  Tying them in as inputs would
make every ``loss.backward()`` call their ``AccumulateGrad`` with no gradient (their tensor
hooks see ``None``, their post-accumulate hooks fire once more) unless the tie returned their
gradients, which the stages cannot compute without firing those hooks themselves.

The tie's backward waits for the stages before it returns, so that the phase is over, and its
failure raised, before the caller's backward goes on: a caller whose backward then fails
elsewhere finds no stage still adding into ``.grad``.  One case cannot wait: a gradient of the
output on a GPU, while no input needs a gradient (``x`` is data).  Autograd then runs the
tie's backward on that GPU's device thread, and a stage backward on that GPU needs that same
thread, so blocking there would deadlock; the tie only starts the backward phase and a callback
queued on the autograd engine waits for the stages at the end of the caller's ``backward()``
(if the caller's backward fails first, that callback never runs and the stages finish on their
own).  When an input does need its gradient the tie must wait inside its backward; with CUDA
outputs that case is unverified and may deadlock if a stage shares the output's GPU.
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
# private; without it (no torch this package supports) the stages add into every .grad, as
# loss.backward() does
_will_execute = getattr(torch._C, "_will_engine_execute_node", lambda node: True)

# private; whether the caller's backward keeps its graph (retain_graph=True), so the stages keep theirs;
# without it (no torch this package supports) a second backward is refused
_keeps_graph = getattr(torch._C._autograd, "_get_current_graph_task_keep_graph", lambda: False)

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
        # a view: autograd can tell whether a view's node will run, under autograd.grad too (not a leaf's)
        flat = super().apply(replicas, dummy.view_as(dummy), joined, *inputs)
        tied = iter(flat if isinstance(flat, tuple) else (flat,))
        return map_tensors(joined[0], lambda _: next(tied))

    @staticmethod
    def forward(ctx: Any, replicas: Replicas, dummy: Tensor, joined: list[Value],  # type: ignore[override]
                *inputs: Tensor) -> tuple[Tensor, ...]:
        ctx.replicas = replicas
        ctx.dummy = dummy.grad_fn  # runs in a backward into every leaf's .grad, not in one naming its inputs
        ctx.input_devices = [t.device for t in inputs]
        ctx.set_materialize_grads(False)  # an output the loss does not use gets no gradient to run
        replicas.run_phase("forward")
        joined.append(replicas.take_outputs())
        return tuple(tensors_of(joined[0]))

    @staticmethod
    def backward(ctx: Any, *grads: Tensor | None) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        if torch.is_grad_enabled():  # create_graph=True: a graph of this backward is asked for
            raise RuntimeError(
                "double backward through a pipeline is not supported (create_graph=True): the stages "
                "differentiate on their own threads and their gradients come back without a graph, so "
                "what is built on them (a gradient penalty) would lose its second-order terms; compute "
                "that term with the plain model, or backward without create_graph=True")
        replicas: Replicas = ctx.replicas
        runs = replicas.runs
        if any(run.freed for run in runs):
            raise RuntimeError(
                "Trying to backward through a pipeline output a second time: the pipeline freed its saved state "
                "(each stage's graph) after the first backward. Specify retain_graph=True in the first backward "
                "(as for any graph) to backward through it again")
        parts = [list(micro) for micro in zip(*(split_output_grad(g, replicas.sizes) for g in grads))]
        named_inputs = not _will_execute(ctx.dummy)  # autograd.grad(loss, x), loss.backward(inputs=[x])
        retain = _keeps_graph()
        for run in runs:
            run.output_grads, parts = parts[:run.chunks], parts[run.chunks:]
            run.inputs_only = named_inputs
            run.retain_graph, run.freed = retain, not retain
        if not any(ctx.needs_input_grad[3:]) and _on_a_device_thread(grads):
            # Nothing to return: let the caller's backward go on and wait at its very end.
            replicas.start_phase("backward")
            _execution_engine.queue_callback(lambda: replicas.finish_phase("backward"))
            return (None,) * (3 + len(ctx.input_devices))
        replicas.run_phase("backward")
        per_input = zip(*(run.input_grads.pop(j) for run in runs for j in range(run.chunks)))
        joined = (_join(parts, replicas.sizes, device) for parts, device in zip(per_input, ctx.input_devices))
        return (None, None, None, *joined)


def _on_a_device_thread(grads: tuple[Tensor | None, ...]) -> bool:
    """Whether autograd runs this backward on a device's own thread, not the caller's: it does
    where a gradient arrives on a device other than the CPU."""
    return any(g is not None and g.device.type != "cpu" for g in grads)


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
