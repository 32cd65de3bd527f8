"""The one walk over the tensors inside a value (a tensor, or nested tuples, lists and dicts).

Layer arguments and outputs, micro-batches, skips and profiler runs all hold tensors in such
values; :func:`tensors_of` and :func:`map_tensors` visit them in the same order, so a list
from one lines up with the calls of the other.
"""
from __future__ import annotations

from typing import Any, Callable

from torch import Tensor

__all__: list[str] = []

#: A tensor, or nested tuples, lists and dicts of tensors and plain values.
Value = Any


def map_tensors(value: Value, fn: Callable[[Tensor], Any]) -> Value:
    """``value`` with ``fn`` applied to each tensor in it (through nested tuples, lists and dicts)."""
    if isinstance(value, Tensor):
        return fn(value)
    if isinstance(value, (tuple, list)):
        return type(value)(map_tensors(item, fn) for item in value)
    if isinstance(value, dict):
        return {key: map_tensors(item, fn) for key, item in value.items()}
    return value


def tensors_of(value: Value) -> list[Tensor]:
    """The tensors in ``value``, in the order :func:`map_tensors` visits them."""
    if isinstance(value, Tensor):
        return [value]
    if isinstance(value, (tuple, list)):
        return [t for item in value for t in tensors_of(item)]
    if isinstance(value, dict):
        return [t for item in value.values() for t in tensors_of(item)]
    return []
