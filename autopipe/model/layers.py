"""The layer chain: the ordered, named layers that profiling, planning and running share.

Every later step works on this list.  A layer's ``name`` is the prefix of its parameters in the
original model (``layer1.0`` in a ResNet), so a stage's ``state_dict`` keys are the model's own.
Skippable layers carry the keys they stash and pop, which are the skip edges of the chain.
"""
from __future__ import annotations

from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Sequence

from torch import nn

from ..errors import ChainError
from .skip import SkipKey, skip_keys

__all__ = [
    "Chain", "Hooks", "Layer", "UNCALLED", "ChainError", "Span", "attach", "call_hooks", "merge_shared_state",
    "run_modules", "module_at", "runs_as_sequential", "sequential_forward", "sequential_layers", "sequential_units",
    "positions", "resnet_layers", "is_torchvision_resnet", "training_flags", "training_modes",
]

#: The hook dicts a module's call runs around its forward (``register_forward_pre_hook``,
#: ``register_forward_hook``, ``register_full_backward_pre_hook``, ``register_full_backward_hook``).
_CALL_HOOKS = ("_forward_pre_hooks", "_forward_hooks", "_backward_pre_hooks", "_backward_hooks")


@dataclass(frozen=True, eq=False)
class Layer:
    """One link of the chain: a module, where its parameters live, and its skip edges.

    ``module``'s ``state_dict`` keys, prefixed with :attr:`state_prefix`, are the original
    model's keys.  That prefix is ``name`` unless ``prefix`` says otherwise (a captured layer
    that rebuilds the original paths itself has ``prefix=""``).
    """

    name: str
    module: nn.Module
    stash: tuple[SkipKey, ...] = ()
    pop: tuple[SkipKey, ...] = ()
    prefix: str | None = None

    @property
    def state_prefix(self) -> str:
        return self.name if self.prefix is None else self.prefix

    def path(self, name: str) -> str:
        """The original model's path of ``module``'s own ``name`` (a parameter, buffer or
        submodule; ``""`` for the module itself)."""
        return ".".join(part for part in (self.state_prefix, name) if part)


class Chain(list):  # type: ignore[type-arg]
    """A model's layers in forward order (a list of :class:`Layer`) that also knows the paths of
    the model's modules in the model's own order (``named_modules``): the pipeline lists
    parameters in that order, as ``model.parameters()`` does, so that an optimizer state saved
    with the plain model (indexed by position) loads onto the same tensors; and the model itself,
    whose containers (``layer1``, a block) the pipeline shows in its module tree as they are."""

    def __init__(self, layers: Sequence[Layer] = (), module_order: Sequence[str] = (),
                 model: nn.Module | None = None) -> None:
        super().__init__(layers)
        self.module_order = tuple(module_order)
        self.model = model

    @staticmethod
    def of(model: nn.Module, layers: Sequence[Layer]) -> Chain:
        """``layers`` of ``model``, with its modules' order."""
        return Chain(layers, [path for path, _ in model.named_modules(remove_duplicate=False)], model)


@contextmanager
def training_flags(model: nn.Module, new: Callable[[bool], bool]) -> Iterator[None]:
    """Every module's own ``training`` flag set to ``new(flag)`` inside the block and each put back
    after (not ``train()``: a frozen submodule in eval mode keeps its place in the model's modes)."""
    flags = [(module, module.training) for module in model.modules()]
    for module, flag in flags:
        module.training = new(flag)
    try:
        yield
    finally:
        for module, flag in flags:
            module.training = flag


@contextmanager
def training_modes(model: nn.Module) -> Iterator[None]:
    """``model`` in the modes it trains with inside the block, every flag put back after.

    A model in train mode keeps each module's own flag: a batch norm frozen with
    ``model.bn.eval()`` trains in eval mode, and torch.export bakes the mode it sees into the
    graph.  A model in eval mode (transformers' ``from_pretrained`` returns one) has every module
    in train mode, as ``model.train()`` sets them before training."""
    with nullcontext() if model.training else training_flags(model, lambda _: True):
        yield


def positions(sequential: nn.Sequential) -> list[tuple[str, nn.Module]]:
    """Every child of ``sequential`` in call order, a repeated instance at each of its positions.

    ``named_children`` yields a module once however often it is called; ``Sequential.forward``
    calls it at every position, so the chain must too (the positions share its parameters)."""
    return [(name, child) for name, child in sequential._modules.items() if child is not None]


#: Containers a forward indexes but never calls: their hooks never run, on the plain model either.
UNCALLED = (nn.ModuleList, nn.ModuleDict)

#: The handles of a module's call hooks, by kind (:func:`call_hooks`).
Hooks = tuple[tuple[int, ...], ...]


def call_hooks(module: nn.Module) -> Hooks:
    """The handles of the hooks ``module``'s call runs around its forward, by kind (none: all empty)."""
    return tuple(tuple(getattr(module, kind)) for kind in _CALL_HOOKS)


def run_modules(module: nn.Module) -> list[nn.Module]:
    """The modules a layer's call runs: ``module`` and those in it, but the bare ``nn.Module``
    containers a captured layer holds the model's paths with (their forwards are traced away)."""
    return [inner for inner in module.modules() if type(inner) is not nn.Module]


def sequential_forward(module: nn.Module) -> bool:
    """Whether ``module`` is an ``nn.Sequential`` whose forward is ``Sequential.forward`` (a
    subclass may have its own)."""
    return isinstance(module, nn.Sequential) and type(module).forward is nn.Sequential.forward


def runs_as_sequential(module: nn.Module) -> bool:
    """Whether ``module``'s call is its children in turn and nothing more: a
    :func:`sequential_forward` without hooks on it."""
    return sequential_forward(module) and not any(call_hooks(module))


def sequential_layers(sequential: nn.Sequential, prefix: str = "") -> list[Layer]:
    """The finest layers: nested Sequentials flattened, unless they hold skips or do more than
    call their children (:func:`runs_as_sequential`): those stay one layer, whose call runs them."""
    layers: list[Layer] = []
    for name, child in positions(sequential):
        qualified = f"{prefix}{name}"
        stashes, pops = skip_keys(child)
        if runs_as_sequential(child) and not stashes + pops:
            layers.extend(sequential_layers(child, qualified + "."))
        else:  # a Sequential with skips inside stays one layer, carrying every key declared in it
            layers.append(Layer(qualified, child, stashes, pops))
    return layers


def sequential_units(sequential: nn.Sequential) -> list[Layer]:
    """The top-level children as layers, the units a manual ``balance`` counts (as torchgpipe)."""
    return [Layer(name, child, *skip_keys(child)) for name, child in positions(sequential)]


def attach(root: nn.Module, path: str, module: nn.Module) -> None:
    """Register ``module`` under ``root`` at the dotted ``path``, making empty parents as needed;
    refuses a path that another module (not containing ``module``) already holds."""
    parent, _, leaf = path.rpartition(".")
    node = module_at(root, parent)
    existing = node._modules.get(leaf)
    if existing is None:
        node.add_module(leaf, module)
    elif existing is not module and not any(sub is module for sub in existing.modules()):
        raise ValueError(f"two different modules claim the state path '{path}'")


def module_at(root: nn.Module, path: str) -> nn.Module:
    """The module at the dotted ``path`` under ``root`` (``root`` itself for ``""``), empty ones
    made where none is."""
    node = root
    for part in filter(None, path.split(".")):
        child = node._modules.get(part)
        if child is None:
            child = nn.Module()
            node.add_module(part, child)
        node = child
    return node


class Span(nn.Module):
    """Consecutive layers run as one, each module held at its path in the original model (so
    ``state_dict`` keys are the model's with ``prefix=""``)."""

    def __init__(self, members: Sequence[Layer]) -> None:
        super().__init__()
        # Called by path, so a module the model is given at that path later is the one run.
        self.paths = [layer.state_prefix for layer in members]
        for layer in members:
            attach(self, layer.state_prefix, layer.module)

    def forward(self, *args: Any) -> Any:
        value = self.get_submodule(self.paths[0])(*args)
        for path in self.paths[1:]:
            value = self.get_submodule(path)(value)
        return value


def merge_shared_state(layers: Sequence[Layer]) -> list[Layer]:
    """Layers that use one parameter or buffer (a module at several positions, tied weights)
    become one :class:`Span`, with every layer between them, so a plan can never put one
    tensor on two stages (as :func:`autopipe.chain` does for captured models)."""
    reach = list(range(len(layers)))  # the last layer each layer shares a tensor with
    first: dict[int, int] = {}
    for index, layer in enumerate(layers):
        for tensor in [*layer.module.parameters(), *layer.module.buffers()]:
            start = first.setdefault(id(tensor), index)
            reach[start] = max(reach[start], index)
    merged: list[Layer] = []
    start = 0
    while start < len(layers):
        stop, end = start, reach[start]
        while stop < end:
            stop += 1
            end = max(end, reach[stop])
        group = layers[start:end + 1]
        merged.append(group[0] if len(group) == 1 else Layer(
            group[0].name, Span(group), sum((m.stash for m in group), ()), sum((m.pop for m in group), ()), ""))
        start = end + 1
    return merged


def is_torchvision_resnet(model: nn.Module) -> bool:
    """Whether ``model`` is a torchvision ResNet whose forward is ResNet's own (a subclass may
    have its own, which :func:`resnet_layers` would not run)."""
    try:
        from torchvision.models import ResNet
    except ImportError:  # pragma: no cover - torchvision is a dependency
        return False
    kind = type(model)
    return isinstance(model, ResNet) and kind.forward is ResNet.forward and kind._forward_impl is ResNet._forward_impl


def resnet_layers(model: nn.Module) -> list[Layer]:
    """ResNet.forward: conv1, bn1, relu, maxpool, layer1..4, avgpool, flatten(1), fc."""
    layers: list[Layer] = []
    for name in ("conv1", "bn1", "relu", "maxpool", "layer1", "layer2", "layer3", "layer4", "avgpool"):
        child = getattr(model, name)
        if runs_as_sequential(child):
            layers.extend(sequential_layers(child, name + "."))
        else:
            layers.append(Layer(name, child))
    layers.append(Layer("flatten", nn.Flatten(1)))
    layers.append(Layer("fc", model.fc))
    return layers
