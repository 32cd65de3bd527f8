"""Fingerprints: equal for the same architecture, different when one parameter's shape differs."""
from __future__ import annotations

import torch
from torch import nn

from autopipe.model.fingerprint import environment_fingerprint, first_difference, model_fingerprint
from autopipe.model import layer_chain


def fingerprint(model: nn.Module) -> dict:
    return model_fingerprint(layer_chain(model))


def test_same_architecture_same_fingerprint_whatever_the_weights() -> None:
    torch.manual_seed(1)
    a = fingerprint(nn.Sequential(nn.Linear(4, 5), nn.ReLU(), nn.Linear(5, 2)))
    torch.manual_seed(2)
    b = fingerprint(nn.Sequential(nn.Linear(4, 5), nn.ReLU(), nn.Linear(5, 2)))
    assert a == b and first_difference(a, b) is None
    assert a["layers"][0]["tensors"] == [["bias", [5], "float32"], ["weight", [5, 4], "float32"]]


def test_one_parameter_shape_changes_the_fingerprint() -> None:
    a = fingerprint(nn.Sequential(nn.Linear(4, 5), nn.ReLU(), nn.Linear(5, 2)))
    b = fingerprint(nn.Sequential(nn.Linear(4, 5), nn.ReLU(), nn.Linear(5, 2, bias=False)))
    c = fingerprint(nn.Sequential(nn.Linear(4, 5), nn.ReLU(), nn.Linear(5, 3)))
    assert len({a["digest"], b["digest"], c["digest"]}) == 3
    assert first_difference(a, c).startswith("layer 2 differs: expected 2 (Linear, bias (2,) float32")
    assert "found 2 (Linear, bias (3,) float32" in first_difference(a, c)


def test_dtype_and_layer_count_change_the_fingerprint() -> None:
    a = fingerprint(nn.Sequential(nn.Linear(4, 5)))
    assert a["digest"] != fingerprint(nn.Sequential(nn.Linear(4, 5).double()))["digest"]
    longer = fingerprint(nn.Sequential(nn.Linear(4, 5), nn.ReLU()))
    assert first_difference(a, longer) == "the model has 2 layers, expected 1"


def test_environment_fingerprint() -> None:
    env = environment_fingerprint([torch.device("cpu"), torch.device("cpu")])
    assert env["torch"] == torch.__version__ and env["devices"] == ["cpu", "cpu"]
    assert env["threads"] == torch.get_num_threads() == 1
    assert isinstance(env["cpu"], str) and env["cpu"]
