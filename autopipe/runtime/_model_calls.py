"""A pipeline called like the model it came from: keyword arguments in, the model's output type out.

A captured chain's first layer takes the model's arguments positionally
(:func:`autopipe.model.call_arguments` binds a call to them) and its last layer returns flat
outputs (what stages can hand on), which :func:`model_output` makes the model's output again.
A scalar output (a loss) joins over micro-batches as the mean weighted by micro-batch size:
the whole batch's mean when the model's loss is a mean over samples, or over tokens with
equally many counted per sample.
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
