"""A pipeline called like the model it came from: keyword arguments in, the model's output type out.

A captured chain's first layer takes the model's arguments positionally
(:func:`autopipe.model.call_arguments` binds a call to them) and its last layer returns flat
outputs (what stages can hand on), which :func:`model_output` makes the model's output again.
A scalar output (a loss) joins over micro-batches as the mean weighted by micro-batch size:
the whole batch's mean when the model's loss is a mean over samples, or over tokens with
equally many counted per sample.  Every other output tensor is concatenated along dim 0, so
its dim 0 must be the batch; one that is not is refused when there is more than one
micro-batch (with one, nothing is joined and it comes back as the model returned it).
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor, nn

from ..model import CapturedLayer
from .microbatch import Value, gather

__all__: list[str] = []


def model_output(last: nn.Module, output: Value) -> Any:
    """The model's own output type (``out.logits`` works) when the capture recorded it."""
    return last.structure(output) if isinstance(last, CapturedLayer) else output


def join_outputs(outputs: Sequence[Value], sizes: Sequence[int], where: str = "") -> Value:
    """Micro-batch outputs joined: tensors concatenated along dim 0, scalars averaged by size,
    through tuples, lists (joined as tuples) and dicts (joined key by key, as plain dicts).

    ``where`` is the position inside the output (``[1]['hidden']``), for the error naming an
    output that is not batch-first.
    """
    first = outputs[0]
    if isinstance(first, (tuple, list)):
        return tuple(join_outputs([out[i] for out in outputs], sizes, f"{where}[{i}]") for i in range(len(first)))
    if isinstance(first, dict):
        return {key: join_outputs([out[key] for out in outputs], sizes, f"{where}[{key!r}]") for key in first}
    if isinstance(first, Tensor) and first.dim() == 0:
        return sum(out * size for out, size in zip(outputs, sizes)) / sum(sizes)
    if len(outputs) > 1:  # one micro-batch joins nothing, so any dim 0 comes back as it is
        _check_batch_first(outputs, sizes, where)
    return gather(outputs)


def _check_batch_first(outputs: Sequence[Value], sizes: Sequence[int], where: str) -> None:
    """Refuse an output whose dim 0 is not its micro-batch's size: concatenating it along dim 0
    would return a tensor of another shape (an aux ``(4, 3)`` as ``(12, 3)``), silently."""
    for out, size in zip(outputs, sizes):
        if isinstance(out, Tensor) and (out.dim() == 0 or out.shape[0] != size):
            name = f"output {where}" if where else "output"
            raise ValueError(
                f"the pipeline's {name} has shape {tuple(out.shape)} in a micro-batch of {size} samples, but "
                "a pipeline joins its micro-batches' outputs along dim 0, which must be the batch; return "
                "batch-first tensors (e.g. an RNN's (layers, batch, hidden) state transposed to batch first, or "
                "logits.view(-1, V) returned as they are and flattened after the pipeline), a scalar (a mean "
                "over samples, joined as the batch's mean), or compute batch-independent values outside the "
                "pipeline (or run it with chunks=1)"
            )


def split_output_grad(grad: Tensor | None, sizes: Sequence[int]) -> Sequence[Tensor | None]:
    """An output gradient per micro-batch: the inverse of :func:`join_outputs` (none for an
    output the loss does not use)."""
    if grad is None:
        return [None] * len(sizes)
    if grad.dim() == 0:
        return [grad * size / sum(sizes) for size in sizes]
    return torch.split(grad, list(sizes))
