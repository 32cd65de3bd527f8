"""Synthetic :class:`Profile` objects for planner tests and benchmarks (no model is measured)."""
from __future__ import annotations

import random
from typing import Sequence

from autopipe._jsonio import digest
from autopipe.profiling.profiles import CopyFit, LayerProfile, Profile, Stat

__all__ = ["make_profile", "random_profile", "scale", "small_chain", "small_hard"]

Copies = tuple[float, float] | dict[tuple[int, int], tuple[float, float]]


def scale(b: int, top: int) -> float:
    """Time at micro-batch size ``b`` relative to size ``top``: a fixed overhead plus a linear
    part, so small micro-batches are less efficient, as measured."""
    return 0.25 + 0.75 * b / top


def make_profile(
    forward: Sequence[float],
    backward: Sequence[float] | None = None,
    *,
    sizes: Sequence[int] = (1, 2, 4, 8),
    batch_size: int | None = None,
    devices: int | Sequence[str] = 2,
    output_bytes: Sequence[int] | int = 0,
    saved_bytes: Sequence[int] | int = 0,
    param_bytes: Sequence[int] | int = 0,
    skips: Sequence[tuple[str, int, int, int]] = (),
    copies: Copies = (0.0, 0.0),
    input_bytes: int = 0,
    linear: bool = False,
    workspace_bytes: Sequence[int] | None = None,
    output_saved: Sequence[bool] | None = None,
) -> Profile:
    """A profile whose layer ``l`` takes ``forward[l]`` (``backward[l]``, default twice that) ms
    at the largest size, scaled by :func:`scale` (or proportional to the size with ``linear``).

    Bytes are per sample (saved and workspace: per sample times ``b``); ``skips`` are ``(name, stash, pop,
    bytes per sample)``; ``copies`` is one ``(latency_ms, ms_per_byte)`` for every device pair
    or one per ordered pair.
    """
    count = len(forward)
    backward = [2 * f for f in forward] if backward is None else list(backward)
    names = ["cpu"] * devices if isinstance(devices, int) else list(devices)
    top = max(sizes)
    factor = (lambda b: b / top) if linear else (lambda b: scale(b, top))
    per_layer = lambda v, i: v[i] if isinstance(v, (list, tuple)) else v  # noqa: E731
    layers = []
    for i in range(count):
        stash = [s for s in skips if s[1] == i]
        layers.append(LayerProfile(
            name=f"layer{i}", type="Synthetic",
            forward={b: _stat(forward[i] * factor(b)) for b in sizes},
            backward={b: _stat(backward[i] * factor(b)) for b in sizes},
            output_bytes=per_layer(output_bytes, i),
            saved_bytes={b: per_layer(saved_bytes, i) * b for b in sizes},
            param_bytes=per_layer(param_bytes, i), buffer_bytes=0, param_count=per_layer(param_bytes, i) // 4,
            stash=[s[0] for s in stash], pop=[s[0] for s in skips if s[2] == i],
            stash_bytes={s[0]: s[3] for s in stash},
            workspace_bytes={} if workspace_bytes is None else {b: workspace_bytes[i] * b for b in sizes},
            output_saved=None if output_saved is None else output_saved[i],
        ))
    entries = [{"name": layer.name, "type": layer.type, "tensors": []} for layer in layers]
    return Profile(
        model={"layers": entries, "digest": digest(entries)}, environment={"synthetic": True},
        devices=names, input_shape=[3], input_dtype="float32", input_bytes=input_bytes,
        batch_size=top if batch_size is None else batch_size, batch_sizes=list(sizes),
        layers=layers, copies=_copies(copies, len(names)),
    )


def _stat(ms: float) -> Stat:
    return Stat(ms, ms, ms, 1)


def _copies(copies: Copies, count: int) -> list[CopyFit]:
    fits = []
    for i in range(count):
        for j in range(count):
            if i != j:
                latency, per_byte = copies[(i, j)] if isinstance(copies, dict) else copies
                fits.append(CopyFit(i, j, latency, per_byte, []))
    return fits


def random_profile(rng: random.Random, layers: int, devices: int, *, skips: int = 0,
                   per_pair: bool = True, sizes: Sequence[int] = (1, 2, 4, 8)) -> Profile:
    """A random chain: uneven layer times, random bytes, ``skips`` random skip edges and copy
    fits that differ per device pair (or one for all with ``per_pair=False``)."""
    forward = [rng.uniform(0.1, 10.0) for _ in range(layers)]
    backward = [f * rng.uniform(1.0, 3.0) for f in forward]
    edges = []
    for k in range(skips if layers > 1 else 0):
        stash = rng.randrange(layers - 1)
        edges.append((f"skip{k}", stash, rng.randrange(stash + 1, layers), rng.randrange(0, 4000)))
    shared = (rng.uniform(0, 2.0), rng.uniform(0, 1e-3))
    copies: Copies = ({(i, j): (rng.uniform(0, 2.0), rng.uniform(0, 1e-3))
                       for i in range(devices) for j in range(devices) if i != j} if per_pair else shared)
    return make_profile(
        forward, backward, sizes=sizes, devices=devices,
        output_bytes=[rng.randrange(0, 4000) for _ in range(layers)],
        saved_bytes=[rng.randrange(0, 10_000) for _ in range(layers)],
        param_bytes=[rng.randrange(0, 50_000) for _ in range(layers)],
        skips=edges, copies=copies, input_bytes=rng.randrange(0, 4000),
    )


def small_hard(rng: random.Random, count: int = 10) -> list[tuple[Profile, list[float]]]:
    """``count`` random chains of at most 12 layers on at most 4 devices, with per-pair copies,
    1-3 skips and device speeds of 1, 1.5 or 2: the small hard cases the planner must solve
    exactly (profile, speeds)."""
    return [small_chain(rng, least_skips=1) for _ in range(count)]


def small_chain(rng: random.Random, least_skips: int) -> tuple[Profile, list[float]]:
    """One chain of :func:`small_hard`, with ``least_skips`` to 3 skips."""
    layers, devices = rng.randint(2, 12), rng.randint(2, 4)
    profile = random_profile(rng, layers, devices, skips=rng.randint(least_skips, 3), per_pair=True)
    return profile, [rng.choice([1.0, 1.5, 2.0]) for _ in range(devices)]
