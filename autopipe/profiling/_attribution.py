"""From per-size measurements to :class:`LayerProfile` s: saved bytes attributed to one layer
each, sizes per sample."""
from __future__ import annotations

import math
from typing import Iterator

from torch import Tensor

from ..model import Layer
from ._layer_runs import Measure, nbytes
from .profiles import LayerProfile

__all__: list[str] = []


def per_sample(count: int, size: int) -> int:
    """Bytes per sample of ``count`` bytes measured at micro-batch ``size``, rounded up."""
    return math.ceil(count / size)


def attribute(measures: list[Measure]) -> list[int]:
    """Saved bytes per layer, each boundary tensor counted once, with the layer that made it.

    A tensor between layers i and i+1 may be saved by i (ReLU saves its output), by i+1 (a
    Linear saves its input) or both; in-place and view layers pass the same storage on.  The
    profiler ran each layer on its own copy of its input, so the sharing is rebuilt here from
    each layer's flags.  The chain's own input belongs to nobody (the planner adds stage inputs).
    """
    counted, _ = _boundaries(measures)
    return [m.internal_saved + (m.new_output_storage if counted[i] else 0) for i, m in enumerate(measures)]


def outputs_saved(measures: list[Measure]) -> list[bool]:
    """Per layer: whether its output's storage is in the saved bytes of the layer that made it
    (itself, or the layer before an in-place or view layer)."""
    counted, producers = _boundaries(measures)
    return [producer is not None and counted[producer] for producer in producers]


def _boundaries(measures: list[Measure]) -> tuple[list[bool], list[int | None]]:
    """Which layers' new outputs some layer saves, and which layer made each layer's output."""
    counted = [False] * len(measures)
    producers: list[int | None] = []
    producer: int | None = None
    for index, measure in enumerate(measures):
        if measure.saves_input and producer is not None:
            counted[producer] = True
        if not measure.aliases_input:
            producer = index
            counted[index] = counted[index] or measure.saves_output
        producers.append(producer)
    return counted, producers


def layer_profile(layer: Layer, index: int, by_size: dict[int, list[Measure]],
                   saved: dict[int, list[int]]) -> LayerProfile:
    largest = max(by_size)
    top = by_size[largest][index]
    params = _unique(layer.module.parameters())
    return LayerProfile(
        name=layer.name,
        type=type(layer.module).__name__,
        forward={b: m[index].forward for b, m in by_size.items()},
        backward={b: m[index].backward for b, m in by_size.items()},
        output_bytes=per_sample(top.output_bytes, largest),
        saved_bytes={b: counts[index] for b, counts in saved.items()},
        workspace_bytes={b: m[index].workspace for b, m in by_size.items()},
        output_saved=outputs_saved(by_size[largest])[index],
        aliases_input=top.aliases_input,
        param_bytes=sum(nbytes(p) for p in params),
        buffer_bytes=sum(nbytes(t) for t in _unique(layer.module.buffers())),
        param_count=sum(p.nelement() for p in params),
        stash=[str(k) for k in layer.stash],
        pop=[str(k) for k in layer.pop],
        stash_bytes={name: per_sample(n, largest) for name, n in top.stash_bytes.items()},
    )


def _unique(tensors: Iterator[Tensor]) -> list[Tensor]:
    return list({id(t): t for t in tensors}.values())
