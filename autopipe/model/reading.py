"""Reading a model into its layer chain: a ready list, a Sequential, a torchvision ResNet, or a capture."""
from __future__ import annotations

from typing import Any, Sequence

from torch import nn

from .capture import chain
from .layers import ChainError, Layer, is_torchvision_resnet, resnet_layers, sequential_layers
from .skip import verify_skippables

__all__ = ["layer_chain"]


def layer_chain(model: nn.Module | Sequence[Layer], sample_input: Any = None) -> list[Layer]:
    """The layers of ``model`` in forward order.

    A list of :class:`Layer` (e.g. from ``autopipe.chain(model, granularity="finer")``) is taken
    as it is, so every step accepts a chain made with non-default options.

    Accepts an ``nn.Sequential`` (nested Sequentials are flattened; their names join with dots,
    matching ``model.named_parameters()``) and a torchvision ResNet (its children in forward
    order, with the ``flatten`` that its ``forward`` applies before ``fc``).  Any other model
    is captured with :func:`autopipe.chain` (torch.fx, else torch.export on ``sample_input``;
    a transformers model always on its sample batch).
    """
    if isinstance(model, (list, tuple)):
        layers = list(model)
    elif isinstance(model, nn.Sequential):
        verify_skippables(model)
        layers = sequential_layers(model, "")
    elif is_torchvision_resnet(model):
        layers = resnet_layers(model)
    else:
        layers = chain(model, sample_input)
    if not layers:
        raise ChainError(f"{type(model).__name__} has no layers to partition")
    return layers
