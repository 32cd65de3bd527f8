"""A pipeline called like the model it came from: keyword arguments in, the model's output type out.

A captured chain's first layer takes the model's arguments positionally and its last layer
returns flat outputs (what stages can hand on); :func:`call_arguments` and :func:`model_output`
translate at the pipeline's edges.  A scalar output (a loss) joins over micro-batches as the
mean weighted by micro-batch size: the whole batch's mean when the model's loss is a mean over
samples, or over tokens with equally many counted per sample.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor, nn

from ..model import CapturedLayer
from .microbatch import Value, gather

__all__: list[str] = []


def call_arguments(first: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, ...]:
    """The pipeline's call as the first layer's positional arguments.

    Raises:
        TypeError: keyword arguments for a first layer that was not captured with them.
    """
    if isinstance(first, CapturedLayer):
        return first.bind(args, kwargs)
    if kwargs:
        raise TypeError(
            f"keyword arguments {list(kwargs)} reach a pipeline only through a model captured with them "
            "(autopipe.chain(model, {name: tensor, ...})); pass tensors positionally"
        )
    return args


def model_output(last: nn.Module, output: Value) -> Any:
    """The model's own output type (``out.logits`` works) when the capture recorded it."""
    return last.structure(output) if isinstance(last, CapturedLayer) else output


def join_outputs(outputs: Sequence[Value], sizes: Sequence[int]) -> Value:
    """Micro-batch outputs joined: tensors concatenated along dim 0, scalars averaged by size."""
    first = outputs[0]
    if isinstance(first, (tuple, list)):
        return tuple(join_outputs([out[i] for out in outputs], sizes) for i in range(len(first)))
    if isinstance(first, Tensor) and first.dim() == 0:
        return sum(out * size for out, size in zip(outputs, sizes)) / sum(sizes)
    return gather(outputs)


def split_output_grad(grad: Tensor, sizes: Sequence[int]) -> Sequence[Tensor]:
    """An output gradient per micro-batch: the inverse of :func:`join_outputs`."""
    if grad.dim() == 0:
        return [grad * size / sum(sizes) for size in sizes]
    return torch.split(grad, list(sizes))
