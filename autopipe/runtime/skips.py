"""Skip routing: which skips leave or enter each stage, and the tracker a stage runs under.

A skip stashed and popped in the same stage never leaves it.  One popped in a later stage is
detached when it leaves its producer and sent straight to the consumer (never relayed through
the stages between); its gradient returns the same way::

    stage 0 ──x──▶ stage 1 ──x──▶ stage 2
       │ stash "s"                  ▲ pop "s"
       └────────────── s ───────────┘        (backward: ds from stage 2 to stage 0)
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from torch import Tensor

from ..model.layers import Layer
from ..model.skip import SkipKey, SkipTracker, internal_keys

__all__ = ["SkipRoutes", "skip_routes", "StageTracker"]


@dataclass(frozen=True)
class SkipRoutes:
    """For one stage: skips arriving (key → producer stage) and leaving (key → consumer)."""

    arriving: dict[SkipKey, int]
    leaving: dict[SkipKey, int]


def skip_routes(layers: Sequence[Layer], stage_of_layer: Sequence[int], stages: int) -> list[SkipRoutes]:
    """The routes of every stage; raises ``TypeError`` for a pop without an earlier stash."""
    producer: dict[SkipKey, int] = {}
    routes = [SkipRoutes({}, {}) for _ in range(stages)]
    for layer, stage in zip(layers, stage_of_layer):
        inside = internal_keys(layer.stash, layer.pop, producer)
        for key in layer.pop:
            if key in inside:
                continue
            if key not in producer:
                raise TypeError(f"layer '{layer.name}' pops skip '{key}' that no earlier layer stashes")
            source = producer.pop(key)
            if source != stage:
                routes[stage].arriving[key] = source
                routes[source].leaving[key] = stage
        for key in layer.stash:
            if key not in inside:
                producer[key] = stage
    return routes


class StageTracker(SkipTracker):
    """A stage's skip tracker for one micro-batch: preloaded with the skips that arrived,
    collecting in :attr:`leaving` the stashes that later stages pop."""

    def __init__(self, arrived: dict[SkipKey, Tensor], leaving: dict[SkipKey, int]) -> None:
        super().__init__()
        self.tensors.update(arrived)
        self._leaving_keys = leaving
        self.leaving: dict[SkipKey, Tensor] = {}

    def save(self, key: SkipKey, tensor: Tensor) -> None:
        if key in self._leaving_keys:
            self.leaving[key] = tensor
        else:
            super().save(key, tensor)
