"""The Python state a capture fixes: plain values its graph holds as constants, and what it changed.

torch.fx and torch.export run the Python of the forwards they trace once, at the capture.  A
plain value such code reads (``self.temperature``, ``self.config.scale``, a child's ``alpha``, a
class attribute) becomes a constant of the graph, so a call after it changed would compute with
the old one: :func:`reads` lists the values it may read, which the pipeline compares at every
call (:class:`Watched`).  What the code assigns (``self.calls += 1``, ``self.cache.mul_(2)``
on a tensor that is no buffer) happens at the capture only: :class:`Snapshot` finds it, and puts
the model back as it was.

Which values code may read is read off the code, not watched while it runs: the attribute names
a module's ``forward`` loads (``co_names``) and those of the methods it reaches by name, looked up
on the module, its children and the plain objects it holds.  A name loaded for something else
finds a value that need not be read (a false refusal once it changes, never a silent answer); a
value reached otherwise (through a dict, a global, a container's blocks, ``getattr(self, name)``)
is not seen.
"""
from __future__ import annotations

import copy
import functools
import re
import types
from typing import Any, Iterable, Iterator

import torch
from torch import nn

__all__ = ["Read", "Snapshot", "Watched", "descendants", "reads", "same_value"]

#: A value code may read: the path of a module, the attribute names from it, and the value (a
#: plain value, or a tensor that is no parameter or buffer, compared by identity).
Read = tuple[str, tuple[str, ...], Any]

#: Values code reads that a graph holds as constants.
_PLAIN = (bool, int, float, complex, str, type(None), torch.dtype, torch.device)
#: nn.Module's own attributes (the machinery's, not the model's settings).
_MODULE_OWN = frozenset(dir(nn.Module)) | frozenset(nn.Module().__dict__)
#: Attributes fx sets on the model itself to hold a graph's constants (``_tensor_constant0``).
_FX_CONSTANT = re.compile(r"_(tensor_constant|torchbind_obj|tree_spec_constant|opaque_obj)\d+|_\w+_constant_\d+")
_ABSENT = object()


def same_value(a: Any, b: Any) -> bool:
    """Whether a value is still the one read: the same object, or of the same type and equal
    (``nan`` equal to itself); a tensor only as the same object."""
    if a is b:
        return True
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor) or type(a) is not type(b):
        return False
    try:
        return bool(a == b) or (a != a and b != b)
    except Exception:  # noqa: BLE001 - a value that cannot be compared counts as changed
        return False


def reads(modules: Iterable[tuple[str, nn.Module]]) -> list[Read]:
    """The values the code of ``modules`` (path, module: those whose forwards the capture ran as
    Python) may read from them, their children and the plain objects they hold."""
    found: dict[tuple[str, tuple[str, ...]], Any] = {}
    for path, module in modules:
        names = _loaded_names(type(module))
        owners = [((), module)] + [((name,), child) for name, child in module.named_children()]
        owners += [((name,), held) for name, held in vars(module).items() if _holds_settings(held)]
        for chain, owner in owners:
            for name in names:
                value = _lookup(owner, name)
                if _constant(value) and name not in _MODULE_OWN and not name.startswith("__"):
                    # a list as it is now (the model's own list may be changed in place)
                    found.setdefault((path, (*chain, name)), list(value) if isinstance(value, list) else value)
    return [(path, chain, value) for (path, chain), value in found.items()]


class Watched:
    """``values`` of ``model`` to compare at every call (:meth:`first_change`), each module found
    once (one replaced is refused before, by the pipeline's structure check)."""

    def __init__(self, model: nn.Module, values: list[Read]) -> None:
        modules = dict(model.named_modules(remove_duplicate=False))
        self.values = [(modules[path], chain, value, path) for path, chain, value in values if path in modules]

    def first_change(self) -> tuple[str, str, str] | None:
        """The first value no longer as read: its dotted path from the model, and what it was
        and is, as a message says them (a few microseconds per hundred values)."""
        for owner, chain, value, path in self.values:
            for name in chain:
                owner = _lookup(owner, name)
            if owner is not value and not same_value(owner, value):
                return ".".join(filter(None, ("model", path, *chain))), _described(value), _described(owner)
        return None


def _lookup(owner: Any, name: str) -> Any:
    """``owner.name`` as stored: a module's child, an instance's attribute, else its class's (a
    property or ``__getattr__`` not run); dictionary lookups, as every call checks hundreds."""
    attributes = getattr(owner, "__dict__", {})
    children = attributes.get("_modules") if isinstance(owner, nn.Module) else None
    if children is not None and name in children:
        return children[name]
    if name in attributes:
        return attributes[name]
    for klass in type(owner).__mro__:
        if name in vars(klass):
            return vars(klass)[name]
    return _ABSENT


def _described(value: Any) -> str:
    if value is _ABSENT:
        return "gone"
    if isinstance(value, torch.Tensor):
        return f"a tensor of shape {tuple(value.shape)} (compared as that very object)"
    return repr(value)


class Snapshot:
    """The attributes of some modules as they were (tensors that are no buffers with a copy, lists,
    dicts and sets with their items), to find what a capture's run of their code changed and put
    them back.  A module whose class changed meanwhile (a lazy module materialised on the sample)
    is left as it is: that cannot be undone."""

    def __init__(self, modules: Iterable[tuple[str, nn.Module]]) -> None:
        self.kept = [(path, module, type(module), dict(vars(module))) for path, module in modules]
        self.tensors = [(value, value._version, value.detach().clone()) for *_, attributes in self.kept
                        for value in attributes.values() if isinstance(value, torch.Tensor)]
        self.items = [(value, copy.copy(value)) for *_, attributes in self.kept for name, value in attributes.items()
                      if isinstance(value, (list, dict, set)) and name not in _MODULE_OWN]

    def changed(self) -> list[str]:
        """The paths of the attributes assigned, added or removed, of the tensors written into and
        of the lists, dicts and sets whose items changed."""
        paths = []
        for path, module, kind, before in self.kept:
            now = vars(module)
            for name in sorted(before.keys() | now.keys()) if type(module) is kind else ():
                if name in _MODULE_OWN or _FX_CONSTANT.fullmatch(name):
                    continue
                was, value = before.get(name, _ABSENT), now.get(name, _ABSENT)
                written = was is value and self._written(was)
                if written or not same_value(was, value):  # an equal value assigned again changes nothing
                    paths.append(".".join(filter(None, (path, name))))
        return paths

    def put_back(self) -> None:
        """Every attribute as it was (those added removed), every tensor and container with its values."""
        for _, module, kind, before in self.kept:
            if type(module) is not kind:
                continue
            attributes = vars(module)
            for name in [name for name in attributes if name not in before and not _FX_CONSTANT.fullmatch(name)]:
                del attributes[name]
            attributes.update(before)
        with torch.no_grad():
            for tensor, version, copied in self.tensors:
                if tensor._version != version:
                    tensor.copy_(copied)
        for container, copied in self.items:
            if _differ(container, copied):
                container.clear()
                if isinstance(container, list):
                    container.extend(copied)
                else:
                    container.update(copied)

    def _written(self, value: Any) -> bool:
        """Whether a tensor was written into, or a container's items changed."""
        if isinstance(value, torch.Tensor):
            return any(kept is value and kept._version != version for kept, version, _ in self.tensors)
        return any(kept is value and _differ(kept, copied) for kept, copied in self.items)


def _differ(container: Any, copied: Any) -> bool:
    try:
        return bool(container != copied)
    except Exception:  # noqa: BLE001 - items that cannot be compared (tensors): changed where not the same
        return len(container) != len(copied) or any(a is not b for a, b in zip(container, copied))


def descendants(module: nn.Module, keep: Any = None, path: str = "") -> Iterator[tuple[str, nn.Module]]:
    """``module`` and the modules in it (each once, by its first path), not descending into those
    ``keep(module, path)`` stops at (an fx capture's leaves: their code runs at every call)."""
    seen: set[int] = set()

    def walk(current: nn.Module, at: str) -> Iterator[tuple[str, nn.Module]]:
        if id(current) in seen:
            return
        seen.add(id(current))
        yield at, current
        for name, child in current.named_children():
            inner = f"{at}.{name}" if at else name
            if keep is None or keep(child, inner):
                yield from walk(child, inner)

    return walk(module, path)


@functools.cache
def _loaded_names(cls: type) -> frozenset[str]:
    """The names ``cls.forward`` loads (attributes, globals), and those of the methods of ``cls``
    it reaches by name (``self.attend(...)``, a property), transitively: what a forward may read
    off a module.  Not the other methods (a transformers model's ``save_pretrained`` and
    ``generate`` load a hundred names no forward reads)."""
    members = {name: member for klass in reversed(cls.__mro__) if klass not in (object, nn.Module)
               for name, member in vars(klass).items()}
    names: set[str] = set()
    waiting = ["forward"]
    while waiting:
        member = members.get(waiting.pop())
        for function in _functions(member):
            found = _code_names(function.__code__) - names
            names |= found
            waiting += [name for name in found if name in members]
    return frozenset(names)


def _functions(member: Any) -> list[types.FunctionType]:
    """The functions a class member runs: itself, a static or class method's, a property's."""
    if isinstance(member, (staticmethod, classmethod)):
        member = member.__func__
    if isinstance(member, property):
        return [f for f in (member.fget, member.fset, member.fdel) if isinstance(f, types.FunctionType)]
    return [member] if isinstance(member, types.FunctionType) else []


def _code_names(code: types.CodeType) -> set[str]:
    names = set(code.co_names)
    for constant in code.co_consts:
        if isinstance(constant, types.CodeType):
            names |= _code_names(constant)
    return names


def _constant(value: Any) -> bool:
    """A value a graph would hold as a constant: plain, a tuple or list of plain values, or a tensor."""
    if isinstance(value, _PLAIN) or isinstance(value, torch.Tensor) and not isinstance(value, nn.Parameter):
        return True
    return isinstance(value, (tuple, list)) and all(isinstance(item, _PLAIN) for item in value)


def _holds_settings(value: Any) -> bool:
    """An object a module holds whose plain attributes code may read (a config), not a module,
    tensor, container or function."""
    if isinstance(value, (nn.Module, torch.Tensor, dict, list, tuple, set, type)) or callable(value):
        return False
    return hasattr(value, "__dict__")
