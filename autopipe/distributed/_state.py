"""State dicts under the original model's keys: a layer's prefix and the merge of the ranks' parts."""
from __future__ import annotations

from typing import Sequence

from torch import Tensor

from ..errors import DistributedError
from ..model import Layer

__all__ = ["merge_state_dicts", "state_prefix"]


def state_prefix(layer: Layer) -> str:
    return f"{layer.state_prefix}." if layer.state_prefix else ""


def merge_state_dicts(parts: Sequence[dict[str, Tensor]]) -> dict[str, Tensor]:
    """One state dict from the ranks' parts; a key on two ranks means the stages share a tensor."""
    merged: dict[str, Tensor] = {}
    for part in parts:
        shared = merged.keys() & part.keys()
        if shared:
            raise DistributedError(
                f"{sorted(shared)[:3]} appear in more than one stage; tied weights across stages "
                "are not supported by this engine — put the layers that share them in one stage"
            )
        merged.update(part)
    return merged
