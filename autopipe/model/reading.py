"""Reading a model into its layer chain (a ready list, a Sequential, a torchvision ResNet, or a
capture), and a call of the model as its first layer's inputs."""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Sequence

from torch import nn

from ..errors import ChainError
from .capture import CapturedLayer, chain
from .layers import (Chain, Layer, is_torchvision_resnet, merge_shared_state, resnet_layers,
                     sequential_forward, sequential_layers, sequential_units)
from .skip import verify_skippables

__all__ = ["layer_chain", "balance_units", "call_arguments", "sample_arguments"]


def layer_chain(model: nn.Module | Sequence[Layer], sample_input: Any = None) -> list[Layer]:
    """The layers of ``model`` in forward order.

    A list of :class:`Layer` (e.g. from ``autopipe.chain(model, granularity="finer")``) is taken
    as it is, so every step accepts a chain made with non-default options.

    Accepts an ``nn.Sequential`` (nested Sequentials are flattened, but one with its own
    ``forward`` or with hooks stays one layer; their names join with dots,
    matching ``model.named_parameters()``; a module called at several positions runs at each,
    and positions sharing a parameter or buffer form one layer with the layers between them, so
    that no plan puts one tensor on two stages) and a torchvision ResNet (its children in forward
    order, with the ``flatten`` that its ``forward`` applies before ``fc``; one of its stages
    with hooks stays one layer).  A subclass of either with its own ``forward``, and any other model,
    is captured with :func:`autopipe.chain` (torch.fx, else torch.export on ``sample_input``;
    a transformers model always on its sample batch).
    """
    if isinstance(model, Chain):
        return model
    if isinstance(model, (list, tuple)):
        layers = list(model)
    elif sequential_forward(model):
        verify_skippables(model)
        layers = merge_shared_state(sequential_layers(model, ""))
    elif is_torchvision_resnet(model):
        layers = resnet_layers(model)
    elif not isinstance(model, nn.Module):
        raise ChainError(f"the model must be a torch.nn.Module (or a list of autopipe layers), got "
                         f"{type(model).__name__}; build it first, e.g. torchvision.models.resnet50()")
    else:
        layers = chain(model, sample_input)
    if not layers:
        raise ChainError(f"{type(model).__name__} has no layers to partition")
    return Chain.of(model, layers) if isinstance(model, nn.Module) else Chain(layers)


def balance_units(model: nn.Module | Sequence[Layer]) -> list[Layer]:
    """The units a manual ``balance`` counts: an ``nn.Sequential``'s top-level children (a
    nested Sequential is one unit, as in torchgpipe), otherwise (a subclass with its own
    ``forward`` too) :func:`layer_chain`'s layers."""
    if sequential_forward(model):
        verify_skippables(model)
        if not len(model):
            raise ChainError("the Sequential has no layers to partition")
        return Chain.of(model, sequential_units(model))
    return layer_chain(model)


def call_arguments(first: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, ...]:
    """A call of the model (positional and keyword arguments) as its first layer's positional
    inputs: keyword arguments reach only a layer captured with them (:meth:`CapturedLayer.bind`).

    Raises:
        TypeError: keyword arguments for a first layer that was not captured with them, or not
            the ones it was captured with.
        ValueError: a size other than the batch's differs from an exported capture's sample.
    """
    if isinstance(first, CapturedLayer):
        return first.bind(args, kwargs)
    if kwargs:
        raise TypeError(
            f"keyword arguments {list(kwargs)} reach a chain only when it was captured with them "
            "(autopipe.chain(model, {name: tensor, ...})); pass tensors positionally"
        )
    return args


def sample_arguments(layers: Sequence[Layer], sample_input: Any) -> Any:
    """A sample batch as the first layer's inputs: a mapping is keyword arguments (a
    transformers model's ``{"input_ids": ids, ...}``), anything else is taken as it is."""
    if isinstance(sample_input, Mapping):
        return call_arguments(layers[0].module, (), dict(sample_input))
    return sample_input
