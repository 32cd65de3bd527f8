"""``autopipe._partition``: profile → plan → run in one call."""
from __future__ import annotations

import os
from typing import Any, Sequence

import torch
from torch import nn

from .device import resolve_devices
from .model.fingerprint import check_made_for
from .model import Layer, layer_chain
from .profiling.profiler import profile as measure
from .profiling.profiles import Profile
from .runtime import Pipeline
from .runtime.pipeline import undeferrable
from .planning.replicas import plan as choose_plan

__all__ = ["partition"]


def partition(
    model: nn.Module,
    sample_input: Any,
    devices: Sequence[torch.device | str | int] | int | None = None,
    *,
    profile: Profile | str | os.PathLike[str] | None = None,
    deferred_batch_norm: bool = False,
    quiet: bool = True,
    **plan_options: Any,
) -> Pipeline:
    """Partition ``model`` over ``devices`` and return the ready :class:`~autopipe.Pipeline`.

    Args:
        model: the model, read as a chain of layers (:func:`autopipe.layer_chain`).
        sample_input: one full training batch (a tensor, a tuple of tensors, or a mapping of
            keyword arguments: a transformers model's ``{"input_ids": ids, "labels": ids}``,
            the pipeline then called ``pipe(**batch)``); its batch size is what the plan is
            made for.
        devices: devices, a device count, or ``None`` for every CUDA device (else two CPU devices).
        profile: a :class:`~autopipe.Profile` or its JSON path, made for this model, instead of
            measuring one.
        deferred_batch_norm: swap batch norms for :class:`~autopipe.DeferredBatchNorm`.
        quiet: no progress bar while profiling.
        **plan_options: passed to :func:`autopipe.plan` (``memory_limit``, ``checkpoint``,
            ``chunks``, ``replicas``, ...); replicas default to ``"auto"``: data parallel,
            pipeline or both, whichever is predicted fastest (one replica where torch.export
            captured training batch norms, which replicas could not defer).

    Returns:
        The pipeline; the plan it runs is ``pipe.plan``.

    Raises:
        ChainError: the model cannot be read as a chain of layers.
        ProfileError: the model cannot be profiled with ``sample_input``.
        FormatError: the ``profile`` file is corrupt or of another schema.
        PlanningError: no plan fits the memory limits.
        ValueError: ``profile`` was made for another model, or an option is invalid.
        DeviceError: a device does not exist.
    """
    resolved = resolve_devices(devices)
    layers = layer_chain(model, sample_input)  # once: capturing a non-Sequential model traces it
    measured = _profile_for(layers, sample_input, resolved, profile, quiet)
    if plan_options.get("replicas", "auto") == "auto" and undeferrable(layers):
        plan_options["replicas"] = 1  # replicas defer batch norm, which an exported graph's cannot
    chosen = choose_plan(measured, resolved, **plan_options)
    return Pipeline(layers, chosen, deferred_batch_norm=deferred_batch_norm)


def _profile_for(
    layers: list[Layer],
    sample_input: Any,
    devices: list[torch.device],
    given: Profile | str | os.PathLike[str] | None,
    quiet: bool,
) -> Profile:
    if given is None:
        return measure(layers, sample_input, devices, quiet=quiet)
    loaded = given if isinstance(given, Profile) else Profile.load(given)
    check_made_for(loaded.model, layers, "profile",
                   "profile this model again (autopipe.profile or python -m autopipe profile)")
    return loaded
