"""The layer chain: names that match the model's parameters, ResNet order, skip edges, clear refusals."""
from __future__ import annotations

from collections import OrderedDict

import pytest
import torch
import torchvision
from torch import Tensor, nn

from autopipe.model import ChainError, layer_chain
from autopipe.model.skip import DEFAULT_NAMESPACE, Namespace, SkipKey
from models import Add, Save


def chain_parameter_names(model: nn.Module) -> list[str]:
    return [f"{layer.state_prefix}.{name}" for layer in layer_chain(model)
            for name, _ in layer.module.named_parameters()]


def test_nested_sequentials_flatten_with_parameter_names() -> None:
    model = nn.Sequential(OrderedDict([
        ("stem", nn.Linear(3, 4)),
        ("body", nn.Sequential(nn.ReLU(), nn.Sequential(nn.Linear(4, 4), nn.Tanh()), nn.Linear(4, 2))),
    ]))
    assert [layer.name for layer in layer_chain(model)] == ["stem", "body.0", "body.1.0", "body.1.1", "body.2"]
    assert chain_parameter_names(model) == [name for name, _ in model.named_parameters()]


def test_resnet_chain_computes_the_model() -> None:
    model = torchvision.models.resnet18(num_classes=7).eval()
    layers = layer_chain(model)
    assert [layer.name for layer in layers] == [
        "conv1", "bn1", "relu", "maxpool", "layer1.0", "layer1.1", "layer2.0", "layer2.1",
        "layer3.0", "layer3.1", "layer4.0", "layer4.1", "avgpool", "flatten", "fc",
    ]
    assert sorted(chain_parameter_names(model)) == sorted(name for name, _ in model.named_parameters())
    x = torch.randn(2, 3, 32, 32)
    out = x
    with torch.no_grad():
        for layer in layers:
            out = layer.module(out)
        assert torch.equal(out, model(x))


def test_skippable_layers_carry_their_keys() -> None:
    inner = Namespace("inner")
    model = nn.Sequential(
        Save(), nn.Linear(2, 2),
        nn.Sequential(nn.Linear(2, 2), Save().isolate(inner)),
        Add(), Add().isolate(inner),
    )
    layers = layer_chain(model)
    assert [layer.name for layer in layers] == ["0", "1", "2", "3", "4"]  # a Sequential with skips stays whole
    assert layers[0].stash == (SkipKey(DEFAULT_NAMESPACE, "skip"),) and layers[0].pop == ()
    assert layers[2].stash == (SkipKey(inner, "skip"),) and layers[2].pop == ()
    assert layers[3].pop == (SkipKey(DEFAULT_NAMESPACE, "skip"),) and layers[3].stash == ()
    assert layers[4].pop == (SkipKey(inner, "skip"),)
    assert [str(k) for k in layers[2].stash] == ["skip@inner"] and layers[1].stash == layers[1].pop == ()


def test_mismatched_skips_are_refused() -> None:
    with pytest.raises(TypeError, match="'skip' is stashed by layer '0' but never popped"):
        layer_chain(nn.Sequential(Save(), nn.Linear(2, 2)))


class Custom(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(2, 2)

    def forward(self, x: Tensor) -> Tensor:
        return self.a(x)


def test_other_models_are_captured() -> None:
    assert [layer.name for layer in layer_chain(Custom())] == ["a"]
    with pytest.raises(ChainError, match="Sequential has no layers"):
        layer_chain(nn.Sequential())
