"""Reading a model into its layer chain: a ready list, a Sequential, a torchvision ResNet, or a capture."""
from __future__ import annotations

from typing import Sequence

from torch import nn

from .capture import chain
from .layers import (ChainError, Layer, is_torchvision_resnet, merge_shared_state, resnet_layers,
                     sequential_layers, sequential_units)
from .skip import verify_skippables

__all__ = ["layer_chain", "balance_units"]


def layer_chain(model: nn.Module | Sequence[Layer]) -> list[Layer]:
    """The layers of ``model`` in forward order.

    A list of :class:`Layer` (e.g. from ``autopipe.chain(model, granularity="finer")``) is taken
    as it is, so every step accepts a chain made with non-default options.

    Accepts an ``nn.Sequential`` (nested Sequentials are flattened; their names join with dots,
    matching ``model.named_parameters()``; a module called at several positions runs at each,
    and positions sharing a parameter or buffer form one layer with the layers between them, so
    that no plan puts one tensor on two stages) and a torchvision ResNet (its children in forward
    order, with the ``flatten`` that its ``forward`` applies before ``fc``).  Any other model
    is captured with :func:`autopipe.chain` (torch.fx).
    """
    if isinstance(model, (list, tuple)):
        layers = list(model)
    elif isinstance(model, nn.Sequential):
        verify_skippables(model)
        layers = merge_shared_state(sequential_layers(model, ""))
    elif is_torchvision_resnet(model):
        layers = resnet_layers(model)
    else:
        layers = chain(model)
    if not layers:
        raise ChainError(f"{type(model).__name__} has no layers to partition")
    return layers


def balance_units(model: nn.Module | Sequence[Layer]) -> list[Layer]:
    """The units a manual ``balance`` counts: an ``nn.Sequential``'s top-level children (a
    nested Sequential is one unit, as in torchgpipe), otherwise :func:`layer_chain`'s layers."""
    if isinstance(model, nn.Sequential):
        verify_skippables(model)
        if not len(model):
            raise ChainError("the Sequential has no layers to partition")
        return sequential_units(model)
    return layer_chain(model)
