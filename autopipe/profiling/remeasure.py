"""Measure a saved profile's bytes again, keeping its times.

A profile's times take many passes per size; its bytes (saved, workspace, whether each output
is saved) take one untimed forward and backward per layer and size.  A profile made before
workspace (or any later field) was measured gets it here without timing anything again.
"""
from __future__ import annotations

import dataclasses

import torch
from torch import Tensor, nn

from ..device import ops_for
from ..model import layer_chain
from ..model.fingerprint import first_difference, model_fingerprint
from ._attribution import layer_profiles
from ._layer_runs import record_size
from ._progress import Progress
from .profiler import _untouched, first_samples
from .profiles import Profile

__all__ = ["remeasure_memory"]


def remeasure_memory(profile: Profile, model: nn.Module, sample_input: Tensor, *,
                     quiet: bool = False) -> Profile:
    """``profile`` with every layer's bytes and flags measured on ``model`` at the profile's sizes
    on its first device; times and copies kept.  Each layer is what :func:`~autopipe.profile`
    makes of the same measurements but its times, so no field is left as the old profile had it
    (``stash_params``, ``grad_param_bytes`` and any other recorded since).

    Args:
        profile: the profile to complete; its model fingerprint must match ``model``'s.
        model: the profiled model (its state comes back unchanged).
        sample_input: a batch of at least the profile's largest size.

    Raises:
        ValueError: ``model`` is not the profiled model, or the batch is too small.
    """
    layers = layer_chain(model)
    difference = first_difference(profile.model, model_fingerprint(layers))
    if difference is not None:
        raise ValueError(f"the profile is of another model: {difference}")
    if sample_input.shape[0] < max(profile.batch_sizes):
        raise ValueError(f"need a batch of at least {max(profile.batch_sizes)} samples, got {sample_input.shape[0]}")
    device = torch.device(profile.devices[0])
    ops = ops_for(device)
    progress = Progress(len(profile.batch_sizes) * len(layers), "measuring bytes", not quiet)
    try:
        with _untouched(model, device, [device]):
            by_size = {b: record_size(layers, first_samples((sample_input,), b, device), ops, progress)[1]
                       for b in profile.batch_sizes}
    finally:
        progress.close()
    return dataclasses.replace(profile, layers=[
        dataclasses.replace(measured, forward=old.forward, backward=old.backward)
        for measured, old in zip(layer_profiles(layers, by_size), profile.layers)])
