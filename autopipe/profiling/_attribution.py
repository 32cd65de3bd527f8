"""From per-size measurements to :class:`LayerProfile` s: saved bytes attributed to one layer
each, sizes per sample."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterator

from torch import Tensor

from ..model import Layer
from ..model.skip import SkipKey
from ._layer_runs import Measure, Origin, external_skips, nbytes
from .profiles import LayerProfile

__all__: list[str] = []


def per_sample(count: int, size: int) -> int:
    """Bytes per sample of ``count`` bytes measured at micro-batch ``size``, rounded up."""
    return math.ceil(count / size)


def attribute(measures: list[Measure]) -> list[int]:
    """Saved bytes per layer, each boundary tensor counted once, with the layer that made it.

    A tensor between layers may be saved by the layer that made it (ReLU saves its output), by
    any later layer it reaches (a Linear saves its input), or both; a layer may pass some of its
    inputs on (in place, as views, or as they are beside new outputs).  The profiler ran each
    layer on its own copy of its inputs, so the sharing is rebuilt here tensor by tensor.  The
    chain's own input belongs to nobody (the planner adds stage inputs).
    """
    made, _ = _trace(measures)
    return [m.internal_saved + sum(t.nbytes for t in made[i] if t.saved) for i, m in enumerate(measures)]


def outputs_saved(measures: list[Measure]) -> list[bool]:
    """Per layer: whether every tensor of its output is in the saved bytes of the layer that made
    it (itself, or an earlier layer whose tensor it passes on).  The schema's flag is one bit for
    all of them, so a partly saved output is ``False``: its unsaved part is not lost to the
    planner, which then counts the whole output once more (an upper bound)."""
    _, outputs = _trace(measures)
    return [bool(tensors) and all(t.saved and t.producer is not None for t in tensors) for tensors in outputs]


@dataclass
class _Tensor:
    """One tensor of the chain, the same object wherever it is passed on."""

    producer: int | None  # the layer that made it; None: the chain's input, a skip or state
    nbytes: int
    saved: bool = False


def _trace(measures: list[Measure]) -> tuple[list[list[_Tensor]], list[list[_Tensor]]]:
    """Follow each tensor along the chain: per layer, the tensors it made and its outputs,
    each marked saved if any layer saves it."""
    current = [_Tensor(None, 0) for _ in measures[0].input_saved] if measures else []
    made: list[list[_Tensor]] = []
    outputs: list[list[_Tensor]] = []
    for index, measure in enumerate(measures):
        for tensor, saves in zip(current, measure.input_saved):
            tensor.saved = tensor.saved or saves
        made.append([_Tensor(index, n, saves) for n, saves in zip(measure.new_bytes, measure.new_saved)])
        current = [_pick(origin, current, made[-1]) for origin in measure.output_origins]
        outputs.append(current)
    return made, outputs


def _pick(origin: Origin, inputs: list[_Tensor], made: list[_Tensor]) -> _Tensor:
    """The tensor one output is: an input passed on, one the layer made, or a skip or state
    tensor (counted elsewhere, so a fresh one that no layer owns)."""
    if origin.kind == "input" and origin.index < len(inputs):
        return inputs[origin.index]
    if origin.kind == "new":
        return made[origin.index]
    return _Tensor(None, 0)


def attributed(by_size: dict[int, list[Measure]]) -> tuple[dict[int, list[int]], list[bool]]:
    """Per size, each layer's saved bytes (:func:`attribute`), and each layer's output flag at
    the largest size (:func:`outputs_saved`): the chain's tensors followed once for each."""
    return {b: attribute(measures) for b, measures in by_size.items()}, outputs_saved(by_size[max(by_size)])


def layer_profiles(layers: list[Layer], by_size: dict[int, list[Measure]]) -> list[LayerProfile]:
    """Every layer's profile from its measures at each size."""
    saved, flags = attributed(by_size)
    skips = external_skips(layers)
    return [_layer_profile(layer, i, by_size, saved, flags[i], skips[i]) for i, layer in enumerate(layers)]


def _layer_profile(layer: Layer, index: int, by_size: dict[int, list[Measure]],
                   saved: dict[int, list[int]], output_saved: bool,
                   skips: tuple[list[SkipKey], list[SkipKey]]) -> LayerProfile:
    largest = max(by_size)
    top = by_size[largest][index]
    params = _unique(layer.module.parameters())
    stashes, pops = skips
    return LayerProfile(
        name=layer.name,
        type=type(layer.module).__name__,
        forward={b: m[index].forward for b, m in by_size.items()},
        backward={b: m[index].backward for b, m in by_size.items()},
        **_output_bytes(by_size, index),
        saved_bytes={b: counts[index] for b, counts in saved.items()},
        workspace_bytes={b: m[index].workspace for b, m in by_size.items()},
        output_saved=output_saved,
        aliases_input=top.aliases_input,
        param_bytes=sum(nbytes(p) for p in params),
        grad_param_bytes=sum(nbytes(p) for p in params if p.requires_grad),
        buffer_bytes=sum(nbytes(t) for t in _unique(layer.module.buffers())),
        param_count=sum(p.nelement() for p in params),
        stash=[str(k) for k in stashes],
        pop=[str(k) for k in pops],
        stash_params=top.stash_params,
        **_stash_bytes(by_size, index),
    )


def _output_bytes(by_size: dict[int, list[Measure]], index: int) -> dict[str, int]:
    """The output's bytes as ``output_bytes`` per sample plus ``output_fixed_bytes`` per
    micro-batch, when the profiled sizes (two or more) lie on that line exactly: an output that
    does not grow with the batch (a mean over it, a parameter passed on) is then its own bytes
    at every size, not ``1/b`` of them per sample, too little at any smaller size.  Otherwise,
    and from one size, per sample at the largest size, as before."""
    measured = {b: m[index].output_bytes for b, m in by_size.items()}
    smallest, largest = min(measured), max(measured)
    if smallest < largest:
        slope, rest = divmod(measured[largest] - measured[smallest], largest - smallest)
        fixed = measured[largest] - slope * largest
        if rest == 0 and slope >= 0 and fixed >= 0 and all(n == slope * b + fixed for b, n in measured.items()):
            return {"output_bytes": slope, "output_fixed_bytes": fixed}
    return {"output_bytes": per_sample(measured[largest], largest), "output_fixed_bytes": 0}


def _stash_bytes(by_size: dict[int, list[Measure]], index: int) -> dict[str, dict[str, int]]:
    """Each skip's bytes per sample, or, for one that measured the same bytes at every profiled
    size (more than one: a weight stashed for a tied head), its fixed bytes per micro-batch."""
    largest = max(by_size)
    measured = {name: {b: m[index].stash_bytes[name] for b, m in by_size.items()}
                for name in by_size[largest][index].stash_bytes}
    fixed = {name: sizes[largest] for name, sizes in measured.items()
             if len(sizes) > 1 and len(set(sizes.values())) == 1 and sizes[largest] > 0}
    return {"stash_bytes": {name: 0 if name in fixed else per_sample(sizes[largest], largest)
                            for name, sizes in measured.items()},
            "stash_fixed_bytes": fixed}


def _unique(tensors: Iterator[Tensor]) -> list[Tensor]:
    return list({id(t): t for t in tensors}.values())
