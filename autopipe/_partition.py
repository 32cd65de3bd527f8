"""``autopipe._partition``: profile → plan → run in one call."""
from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any, Sequence

import torch
from torch import nn

from .device import resolve_devices
from .model.fingerprint import first_difference, model_fingerprint
from .model import Layer, layer_chain
from .profiling.profiler import profile as measure
from .profiling.profiles import Profile
from .runtime import Pipeline
from .runtime._model_calls import call_arguments
from .planning.solver import plan as choose_plan

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

    ``sample_input`` is one full training batch (its batch size is what the plan is made for): a
    tensor, a tuple of tensors, or a mapping of keyword arguments (a transformers model's
    ``{"input_ids": ids, "labels": ids}``; the pipeline is then called ``pipe(**batch)``).
    A ``profile`` (object or JSON path) skips measuring; it must have been made for this model.
    ``plan_options`` go to :func:`autopipe.plan` (``memory_limit``, ``checkpoint``, ``chunks``…);
    the plan is on ``pipe.plan``.
    """
    resolved = resolve_devices(devices)
    layers = layer_chain(model, sample_input)  # once: capturing a non-Sequential model traces it
    if isinstance(sample_input, Mapping):  # keyword arguments, as the captured first layer takes them
        sample_input = call_arguments(layers[0].module, (), dict(sample_input))
    measured = _profile_for(layers, sample_input, resolved, profile, quiet)
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
    difference = first_difference(loaded.model, model_fingerprint(layers))
    if difference is not None:
        raise ValueError(
            f"the profile was made for another model: {difference}; profile this model again "
            "(autopipe.profile or python -m autopipe profile)"
        )
    return loaded
