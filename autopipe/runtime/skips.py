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

__all__ = ["SkipRoutes", "SkipSpan", "StageTracker", "skip_spans", "stage_routes"]


@dataclass(frozen=True)
class SkipSpan:
    """A skip stashed in stage ``src`` and popped in stage ``dst`` (``src <= dst``)."""

    key: SkipKey
    src: int
    dst: int

    def crosses_into(self, stage: int) -> bool:
        """Whether the skip passes the boundary into ``stage`` (relayed, it arrives there)."""
        return self.src < stage <= self.dst

    def crosses_out_of(self, stage: int) -> bool:
        """Whether the skip passes the boundary out of ``stage`` (relayed, it leaves from there)."""
        return self.src <= stage < self.dst


def skip_spans(layers: Sequence[Layer], stage_of_layer: Sequence[int]) -> list[SkipSpan]:
    """Every skip's producing and consuming stage, in stash order (the same on every rank); a
    skip a layer pairs inside itself is none.  Raises ``TypeError`` for a pop without an earlier
    stash."""
    spans: list[SkipSpan | None] = []
    open_keys: dict[SkipKey, tuple[int, int]] = {}  # key → (its slot in spans, producer stage)
    for layer, stage in zip(layers, stage_of_layer):
        inside = internal_keys(layer.stash, layer.pop, open_keys)
        for key in layer.pop:
            if key in inside:
                continue
            if key not in open_keys:
                raise TypeError(f"layer '{layer.name}' pops skip '{key}' that no earlier layer stashes")
            slot, source = open_keys.pop(key)
            spans[slot] = SkipSpan(key, source, stage)
        for key in layer.stash:
            if key not in inside:
                open_keys[key] = (len(spans), stage)
                spans.append(None)
    return [span for span in spans if span is not None]


@dataclass(frozen=True)
class SkipRoutes:
    """For one stage: skips arriving (key → producer stage) and leaving (key → consumer)."""

    arriving: dict[SkipKey, int]
    leaving: dict[SkipKey, int]


def stage_routes(spans: Sequence[SkipSpan], stages: int) -> list[SkipRoutes]:
    """The routes of every stage of the in-process runtime, which sends each skip straight from
    its producer to its consumer."""
    routes = [SkipRoutes({}, {}) for _ in range(stages)]
    for span in spans:
        if span.src != span.dst:
            routes[span.dst].arriving[span.key] = span.src
            routes[span.src].leaving[span.key] = span.dst
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
