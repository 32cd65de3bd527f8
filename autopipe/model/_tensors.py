"""The one walk over the tensors inside a value: a tensor, or nested tuples (namedtuples too),
lists, dicts and dataclass instances.

Layer arguments and outputs, micro-batches, skips and profiler runs all hold tensors in such
values; :func:`tensors_of` and :func:`map_tensors` visit them in the same order, so a list
from one lines up with the calls of the other.  A dict's items are visited in the order of its
keys sorted (by type name, then ``repr``), not as inserted: two micro-batches' outputs
``{"a": .., "b": ..}`` and ``{"b": .., "a": ..}`` list their tensors alike, which joining the
outputs and pairing their gradients by position relies on.

Any other object is a leaf, passed on as it is.  One holding tensors in its attributes is
refused (``TypeError``): the walk would pass those tensors on unseen (not split into
micro-batches, detached, moved between devices or differentiated), silently.
"""
from __future__ import annotations

import copy
import dataclasses
from types import ModuleType
from collections.abc import Set
from typing import Any, Callable, Hashable

from torch import Tensor, nn

__all__: list[str] = []

#: A tensor, or nested tuples, lists, dicts and dataclass instances of tensors and plain values.
Value = Any

#: A container's items, by key (a position, a dict key or a dataclass field's name).
Items = list[tuple[Hashable, Value]]


def map_tensors(value: Value, fn: Callable[[Tensor], Any]) -> Value:
    """``value`` with ``fn`` applied to each tensor in it, in :func:`tensors_of` order."""
    if isinstance(value, Tensor):
        return fn(value)
    items = items_of(value)
    if items is None:
        return value
    return rebuilt(value, {key: map_tensors(item, fn) for key, item in items})


def map_distinct(value: Value, fn: Callable[[Tensor], Any], key: Callable[[Tensor], Hashable] = id) -> Value:
    """:func:`map_tensors` with ``fn`` applied once per ``key`` (default: per tensor object) and its
    result given to every tensor of that key: tensors that are one stay one (``pipe(x, x)``)."""
    made: dict[Hashable, Any] = {}

    def once(tensor: Tensor) -> Any:
        found = key(tensor)
        if found not in made:
            made[found] = fn(tensor)
        return made[found]

    return map_tensors(value, once)


def tensors_of(value: Value) -> list[Tensor]:
    """The tensors in ``value``, in the order :func:`map_tensors` visits them."""
    if isinstance(value, Tensor):
        return [value]
    items = items_of(value)
    return [] if items is None else [t for _, item in items for t in tensors_of(item)]


def items_of(value: Value) -> Items | None:
    """A container's items in walk order, or ``None`` for a leaf (a tensor or any other object,
    which must not hold tensors in its attributes)."""
    if isinstance(value, (tuple, list)):
        return list(enumerate(value))
    if isinstance(value, dict):
        return [(key, value[key]) for key in sorted(value, key=_key_order)]
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        names = [field.name for field in dataclasses.fields(value)]
        _refuse_hidden(value, exclude=set(names))
        return [(name, getattr(value, name)) for name in names]
    if not isinstance(value, Tensor):
        _refuse_hidden(value)
    return None


def rebuilt(like: Value, items: dict[Hashable, Value]) -> Value:
    """A container like ``like`` (of its type) holding ``items`` (all of its keys) instead.

    A dict comes back as a plain dict in ``like``'s key order; a dataclass instance as a shallow
    copy with each field set (its ``__init__`` and ``__post_init__`` are not run again, so
    fields that are not ``init`` arguments keep their values, and frozen ones are set too)."""
    if isinstance(like, tuple) and hasattr(type(like), "_fields"):  # a namedtuple
        return type(like)(*items.values())
    if isinstance(like, (tuple, list)):
        return type(like)(list(items.values()))
    if isinstance(like, dict):
        return {key: items[key] for key in like}
    new = copy.copy(like)
    for name, item in items.items():
        object.__setattr__(new, name, item)
    return new


def _key_order(key: Hashable) -> tuple[str, str]:
    """A total order over keys of any types, the same whatever order they were inserted in."""
    return type(key).__qualname__, repr(key)


def _refuse_hidden(value: Value, exclude: Set[str] = frozenset()) -> None:
    """Raise if ``value`` holds tensors in its attributes (directly, or in tuples, lists or dicts
    there, at any depth) other than ``exclude``.  Modules and classes are state, not values:
    passed on."""
    attributes = getattr(value, "__dict__", None)
    if not attributes or isinstance(value, (type, ModuleType, nn.Module)):
        return
    held = [name for name, item in attributes.items() if name not in exclude and _holds_tensors(item)]
    if held:
        kind = type(value).__qualname__
        raise TypeError(
            f"a value of type {kind} holds tensors in its attributes ({', '.join(held)}), which autopipe "
            "cannot see inside: they would pass between micro-batches and stages unsplit, undetached and "
            "without gradients. Pass tensors in tuples (namedtuples too), lists, dicts or dataclasses "
            f"(make {kind} a @dataclass with them as fields), or keep tensors out of the object")


def _holds_tensors(item: Any, seen: set[int] | None = None) -> bool:
    """Whether ``item`` is a tensor or a tuple, list or dict holding one at any depth (``seen``:
    the containers already looked into, as one may hold itself)."""
    if isinstance(item, Tensor):
        return True
    if isinstance(item, dict):
        inner = item.values()
    elif isinstance(item, (tuple, list)):
        inner = item
    else:
        return False
    seen = set() if seen is None else seen
    if id(item) in seen:
        return False
    seen.add(id(item))
    return any(_holds_tensors(value, seen) for value in inner)
