"""Micro-batches: split a call's arguments along dim 0, and join the outputs back.

A pipeline call ``pipe(*args)`` becomes ``m`` calls ``first_layer(*args_j)``: every tensor
argument (also inside tuple, list, dict and dataclass arguments, a dict split by key) is split with
:func:`torch.tensor_split`, so micro-batch sizes differ by at most one (the first ``batch % m``
are one sample larger, the planner's rule); non-tensor arguments are passed to every micro-batch
unchanged.  A batch of ``n < m`` samples yields ``n`` micro-batches of one sample each (never an
empty micro-batch), so callers must not assume exactly ``m``.
"""
from __future__ import annotations

from typing import Any, Sequence

import torch
from torch import Tensor

from ..model._tensors import Value, items_of, map_tensors, rebuilt, tensors_of

__all__ = ["scatter", "gather", "split_sizes", "items_of", "map_tensors", "rebuilt", "tensors_of", "Value"]


def split_sizes(batch: int, chunks: int) -> list[int]:
    """Sizes of ``torch.tensor_split(range(batch), min(chunks, batch))``."""
    count = max(1, min(chunks, batch))
    small, extra = divmod(batch, count)
    return [small + 1 if j < extra else small for j in range(count)]


def scatter(args: tuple[Any, ...], chunks: int) -> list[tuple[Any, ...]]:
    """``args`` as micro-batches: tensors (also inside tuples, lists, dicts and dataclasses) split along dim 0,
    other values repeated."""
    tensors = tensors_of(args)
    if not tensors:
        raise TypeError("a pipeline needs at least one tensor argument to split into micro-batches")
    batch = tensors[0].shape[0] if tensors[0].dim() else 0
    for tensor in tensors:
        if tensor.dim() == 0 or tensor.shape[0] != batch:
            raise ValueError(
                "every tensor argument is split along dim 0, so all need the same batch size; got "
                f"shapes {[tuple(t.shape) for t in tensors]}"
            )
    sizes = split_sizes(batch, chunks)
    pieces = {id(t): torch.split(t, sizes) for t in tensors}
    return [map_tensors(args, lambda t, j=j: pieces[id(t)][j]) for j in range(len(sizes))]


def gather(outputs: Sequence[Value]) -> Value:
    """Concatenate micro-batch outputs (a tensor or a tuple of tensors each, a namedtuple kept)
    along dim 0; :func:`~autopipe.runtime._model_calls.join_outputs` joins nested ones."""
    first = outputs[0]
    if isinstance(first, Tensor):
        return torch.cat(list(outputs))
    if isinstance(first, (tuple, list)) and all(isinstance(v, Tensor) for v in first):
        return rebuilt(first, {i: torch.cat([out[i] for out in outputs]) for i in range(len(first))})
    raise TypeError(
        f"the last stage returned {type(first).__name__}; a pipeline's output must be a tensor or "
        "a tuple of tensors (or lists, dicts, namedtuples and dataclasses of them) so that "
        "micro-batches can be concatenated"
    )
