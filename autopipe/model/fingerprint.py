"""Fingerprints that let a later step refuse a profile or plan made for another model or machine."""
from __future__ import annotations

import os
import platform
from typing import Any, Sequence

import torch

from .._jsonio import digest
from ..errors import OptionError
from .layers import Layer

__all__ = ["model_fingerprint", "environment_fingerprint", "first_difference", "check_made_for"]


def model_fingerprint(layers: Sequence[Layer]) -> dict[str, Any]:
    """Layer names and types, each parameter's and buffer's name, shape and dtype, and a digest."""
    entries = [
        {
            "name": layer.name,
            "type": type(layer.module).__name__,
            "tensors": [
                [name, list(tensor.shape), str(tensor.dtype).removeprefix("torch.")]
                for name, tensor in _state_tensors(layer)
            ],
        }
        for layer in layers
    ]
    return {"layers": entries, "digest": digest(entries)}


def _state_tensors(layer: Layer) -> list[tuple[str, torch.Tensor]]:
    named = list(layer.module.named_parameters()) + list(layer.module.named_buffers())
    return sorted(named, key=lambda item: item[0])


def first_difference(expected: dict[str, Any], actual: dict[str, Any]) -> str | None:
    """Describe the first layer where two model fingerprints differ, or ``None`` if equal."""
    if expected.get("digest") == actual.get("digest"):
        return None
    want, have = expected["layers"], actual["layers"]
    for index, (a, b) in enumerate(zip(want, have)):
        if a != b:
            return (
                f"layer {index} differs: expected {a['name']} ({a['type']}, {_tensors(a)}), "
                f"found {b['name']} ({b['type']}, {_tensors(b)})"
            )
    if len(have) != len(want):
        return f"the model has {len(have)} layers, expected {len(want)}"
    return ("the layers listed match but the fingerprints differ (the file's model digest was edited, or "
            "written by another version of autopipe)")


def check_made_for(recorded: dict[str, Any], layers: Sequence[Layer], what: str, fix: str,
                   error: type[Exception] = OptionError) -> None:
    """Raise ``error`` naming the first difference if the model fingerprint ``recorded`` in a
    ``what`` (a profile, a plan) is not that of ``layers``; ``fix`` says what to do instead."""
    difference = first_difference(recorded, model_fingerprint(layers))
    if difference is not None:
        raise error(f"the {what} was made for another model: {difference}; {fix}")


def _tensors(entry: dict[str, Any]) -> str:
    shown = [f"{name} {tuple(shape)} {dtype}" for name, shape, dtype in entry["tensors"][:3]]
    more = len(entry["tensors"]) - len(shown)
    return ", ".join(shown) + (f", +{more} more" if more > 0 else "") if shown else "no tensors"


def environment_fingerprint(devices: Sequence[torch.device]) -> dict[str, Any]:
    """Torch version, device names, CPU model and thread count: what makes timings comparable."""
    return {
        "torch": torch.__version__,
        "python": platform.python_version(),
        "devices": [_device_name(d) for d in devices],
        "cpu": _cpu_model(),
        "threads": torch.get_num_threads(),
        "cores": os.cpu_count(),
    }


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return str(device)


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as handle:
            for line in handle:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()
