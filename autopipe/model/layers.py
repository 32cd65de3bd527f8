"""The layer chain: the ordered, named layers that profiling, planning and running share.

Every later step works on this list.  A layer's ``name`` is the prefix of its parameters in the
original model (``layer1.0`` in a ResNet), so a stage's ``state_dict`` keys are the model's own.
Skippable layers carry the keys they stash and pop, which are the skip edges of the chain.
"""
from __future__ import annotations

from dataclasses import dataclass
from torch import nn

from ..errors import ChainError
from .skip import SkipKey, skip_keys

__all__ = ["Layer", "ChainError", "sequential_layers", "resnet_layers", "is_torchvision_resnet"]


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


def sequential_layers(sequential: nn.Sequential, prefix: str = "") -> list[Layer]:
    layers: list[Layer] = []
    for name, child in sequential.named_children():
        qualified = f"{prefix}{name}"
        stashes, pops = skip_keys(child)
        if isinstance(child, nn.Sequential) and not stashes + pops:
            layers.extend(sequential_layers(child, qualified + "."))
        else:  # a Sequential with skips inside stays one layer, carrying every key declared in it
            layers.append(Layer(qualified, child, stashes, pops))
    return layers


def is_torchvision_resnet(model: nn.Module) -> bool:
    try:
        from torchvision.models import ResNet
    except ImportError:  # pragma: no cover - torchvision is a dependency
        return False
    return isinstance(model, ResNet)


def resnet_layers(model: nn.Module) -> list[Layer]:
    """ResNet.forward: conv1, bn1, relu, maxpool, layer1..4, avgpool, flatten(1), fc."""
    layers: list[Layer] = []
    for name in ("conv1", "bn1", "relu", "maxpool", "layer1", "layer2", "layer3", "layer4", "avgpool"):
        child = getattr(model, name)
        if isinstance(child, nn.Sequential):
            layers.extend(sequential_layers(child, name + "."))
        else:
            layers.append(Layer(name, child))
    layers.append(Layer("flatten", nn.Flatten(1)))
    layers.append(Layer("fc", model.fc))
    return layers
