"""Skip connections across pipeline stages: ``@skippable``, ``stash``, ``pop``.

A skippable layer's ``forward`` is a generator.  It hands a tensor to a later layer with
``yield stash(name, tensor)`` and receives one from an earlier layer with
``tensor = yield pop(name)``::

    @skippable(stash=["identity"])
    class Save(nn.Module):
        def forward(self, x):
            yield stash("identity", x)
            return x

    @skippable(pop=["identity"])
    class Add(nn.Module):
        def forward(self, x):
            identity = yield pop("identity")
            return x + identity

Where the tensor goes is decided by the *skip tracker* of the current thread: outside a
pipeline a plain dictionary (so ``nn.Sequential(Save(), ..., Add())`` runs unchanged), inside
one the stage's tracker, which routes the tensor straight from the producing stage to the
consuming stage.  Names live in a :class:`Namespace` so that a reused class (two U-Net levels
built from one ``Save``/``Add`` pair) can be isolated with ``module.isolate(Namespace())``.
"""
from __future__ import annotations

import contextlib
import threading
import uuid
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Callable, Generator, Iterable, Iterator, Mapping, TypeVar

from torch import Tensor, nn

__all__ = [
    "Namespace",
    "SkipKey",
    "SkipTracker",
    "internal_keys",
    "pop",
    "skippable",
    "stash",
    "use_skip_tracker",
    "verify_skippables",
]


class Namespace:
    """An isolated scope for skip names; compares by identity."""

    def __init__(self, label: str | None = None) -> None:
        self.id = uuid.uuid4().hex[:8]
        self.label = label

    def __repr__(self) -> str:
        return f"<Namespace {self.label or self.id}>"

    def __copy__(self) -> Namespace:
        return self

    def __deepcopy__(self, memo: dict[int, Any]) -> Namespace:
        """A copied model keeps its skips' scopes: keys made from it match the original's."""
        return self


#: The namespace of every skippable that was never isolated.
DEFAULT_NAMESPACE = Namespace("default")


@dataclass(frozen=True)
class SkipKey:
    """A skip's identity: its namespace and its name."""

    namespace: Namespace
    name: str

    def __str__(self) -> str:
        if self.namespace is DEFAULT_NAMESPACE:
            return self.name
        return f"{self.name}@{self.namespace.label or self.namespace.id}"


class stash:  # noqa: N801 - lower case reads as a verb at the yield site, as in torchgpipe
    """``yield stash(name, tensor)``: hand ``tensor`` to the layer that pops ``name``."""

    def __init__(self, name: str, tensor: Tensor) -> None:
        self.name = name
        self.tensor = tensor


class pop:  # noqa: N801
    """``tensor = yield pop(name)``: receive the tensor an earlier layer stashed as ``name``."""

    def __init__(self, name: str) -> None:
        self.name = name


class SkipTracker:
    """Holds skip tensors between their stash and their pop.

    The default one is a dictionary; the runtime subclasses it to preload tensors that arrived
    from other stages and to collect the ones that must leave.
    """

    def __init__(self) -> None:
        self.tensors: dict[SkipKey, Tensor] = {}

    def save(self, key: SkipKey, tensor: Tensor) -> None:
        """Keep ``tensor`` until ``key`` is popped."""
        self.tensors[key] = tensor

    def load(self, key: SkipKey) -> Tensor:
        """Take the tensor stashed as ``key``; each stash is popped exactly once."""
        try:
            return self.tensors.pop(key)
        except KeyError:
            raise RuntimeError(
                f"skip '{key}' was popped before it was stashed; a layer that stashes "
                f"'{key}' must run earlier (check the order of layers or call "
                "autopipe.verify_skippables(model))"
            ) from None


_local = threading.local()


def current_skip_tracker() -> SkipTracker:
    """The tracker of this thread: the innermost :func:`use_skip_tracker`, else a default."""
    tracker = getattr(_local, "tracker", None)
    if tracker is None:
        tracker = _local.tracker = SkipTracker()
    return tracker


@contextlib.contextmanager
def use_skip_tracker(tracker: SkipTracker) -> Iterator[SkipTracker]:
    """Route this thread's stashes and pops through ``tracker`` inside the block."""
    previous = getattr(_local, "tracker", None)
    _local.tracker = tracker
    try:
        yield tracker
    finally:
        _local.tracker = previous


T = TypeVar("T", bound=type[nn.Module])


class Skippable(nn.Module):
    """Base of the classes ``@skippable`` makes; drives the generator ``forward``."""

    stash_names: tuple[str, ...] = ()
    pop_names: tuple[str, ...] = ()
    namespace: Namespace = DEFAULT_NAMESPACE
    # names isolated one by one (``isolate(..., only=...)``), over ``namespace``; a new dict per isolation
    _isolated: Mapping[str, Namespace] = MappingProxyType({})

    def isolate(self, namespace: Namespace, *, only: Iterable[str] | None = None) -> Skippable:
        """Give this layer's skip names (or ``only`` those of them) their own scope; returns
        ``self`` for chaining (torchgpipe's ``isolate``).

        Raises:
            ValueError: a name in ``only`` that the layer neither stashes nor pops.
        """
        if only is None:
            self.namespace, self._isolated = namespace, {}
            return self
        names = list(only)
        unknown = [name for name in names if name not in (*self.stash_names, *self.pop_names)]
        if unknown:
            raise ValueError(f"{type(self).__name__} neither stashes nor pops {unknown}; its skip names are "
                             f"{[*self.stash_names, *self.pop_names]}")
        self._isolated = {**self._isolated, **dict.fromkeys(names, namespace)}
        return self

    def _key(self, name: str) -> SkipKey:
        """The skip ``name`` of this layer, in its scope."""
        return SkipKey(self._isolated.get(name, self.namespace), name)

    def stash_keys(self) -> tuple[SkipKey, ...]:
        return tuple(self._key(n) for n in self.stash_names)

    def pop_keys(self) -> tuple[SkipKey, ...]:
        return tuple(self._key(n) for n in self.pop_names)

    def _drive(self, generator: Generator[Any, Tensor | None, Any]) -> Any:
        tracker = current_skip_tracker()
        stashed: set[str] = set()
        try:
            request = next(generator)
            while True:
                if isinstance(request, stash):
                    self._check(request.name, self.stash_names, "stash")
                    stashed.add(request.name)
                    tracker.save(self._key(request.name), request.tensor)
                    request = generator.send(None)
                elif isinstance(request, pop):
                    self._check(request.name, self.pop_names, "pop")
                    request = generator.send(tracker.load(self._key(request.name)))
                else:
                    raise TypeError(
                        f"{type(self).__name__}.forward yielded {type(request).__name__}; "
                        "a skippable forward may only yield stash(name, tensor) or pop(name)"
                    )
        except StopIteration as done:
            missing = set(self.stash_names) - stashed
            if missing:
                raise RuntimeError(
                    f"{type(self).__name__} declares stash {sorted(missing)} but did not stash "
                    "it in this forward; stash every declared name on every call"
                ) from None
            return done.value

    def _check(self, name: str, declared: tuple[str, ...], verb: str) -> None:
        if name not in declared:
            raise RuntimeError(
                f"{type(self).__name__} tried to {verb} '{name}' but declares {verb}="
                f"{list(declared)}; add it to @skippable({verb}=[...])"
            )




def skippable(stash: Iterable[str] = (), pop: Iterable[str] = ()) -> Callable[[T], T]:
    """Class decorator: the module's generator ``forward`` may stash and pop these names."""
    stash_names, pop_names = tuple(stash), tuple(pop)

    def decorate(cls: T) -> T:
        original = cls.forward

        def forward(self: Skippable, *args: Any, **kwargs: Any) -> Any:
            result = original(self, *args, **kwargs)
            if not isinstance(result, Generator):
                raise TypeError(
                    f"{cls.__name__}.forward must be a generator (use 'yield stash(...)' "
                    "or 'yield pop(...)') because it is decorated with @skippable"
                )
            return self._drive(result)

        namespace = {
            "forward": forward,
            "stash_names": stash_names,
            "pop_names": pop_names,
            "__doc__": cls.__doc__,
            "__module__": cls.__module__,
            "__qualname__": cls.__qualname__,
        }
        return type(cls.__name__, (cls, Skippable), namespace)  # type: ignore[return-value]

    return decorate


def skip_keys(module: nn.Module) -> tuple[tuple[SkipKey, ...], tuple[SkipKey, ...]]:
    """Every (stash, pop) key declared by ``module`` and its submodules, in module order."""
    stashes: list[SkipKey] = []
    pops: list[SkipKey] = []
    for sub in module.modules():
        if isinstance(sub, Skippable):
            stashes.extend(sub.stash_keys())
            pops.extend(sub.pop_keys())
    return tuple(stashes), tuple(pops)


def internal_keys(stashes: Iterable[SkipKey], pops: Iterable[SkipKey], open_keys: Iterable[SkipKey]) -> set[SkipKey]:
    """Keys one layer both stashes and pops without an earlier layer's stash being open: the
    layer pairs them inside itself (a nested block with its own skip), so they never leave it."""
    return set(stashes) & set(pops) - set(open_keys)


def verify_skippables(module: nn.Sequential) -> None:
    """Raise one ``TypeError`` listing every stash without a pop, pop without an earlier
    stash, and name stashed or popped twice in ``module``'s layers."""
    problems: list[str] = []
    open_keys: dict[SkipKey, str] = {}
    seen_stash: set[SkipKey] = set()
    seen_pop: set[SkipKey] = set()
    for layer_name, layer in module._modules.items():  # a repeated layer stashes at each position
        if layer is None:
            continue
        stashes, pops = skip_keys(layer)
        inside = internal_keys(stashes, pops, open_keys)
        stashes = tuple(k for k in stashes if k not in inside)
        pops = tuple(k for k in pops if k not in inside)
        for key in pops:
            if key in seen_pop:
                problems.append(f"'{key}' is popped more than once (again by layer '{layer_name}')")
            elif key not in open_keys:
                problems.append(f"'{key}' is popped by layer '{layer_name}' but no earlier layer stashes it")
            seen_pop.add(key)
            open_keys.pop(key, None)
        for key in stashes:
            if key in seen_stash:
                problems.append(f"'{key}' is stashed more than once (again by layer '{layer_name}')")
            seen_stash.add(key)
            open_keys[key] = layer_name
    problems.extend(
        f"'{key}' is stashed by layer '{owner}' but never popped" for key, owner in open_keys.items()
    )
    if problems:
        raise TypeError(
            "mismatched skip connections:\n  - " + "\n  - ".join(problems)
            + "\nfix: pair every stash(name) with exactly one later pop(name), or isolate reused "
            "layers with layer.isolate(autopipe.Namespace())"
        )
