"""``autopipe._partition``: profile → plan → run in one call."""
from __future__ import annotations

import inspect
import os
from contextlib import nullcontext
from typing import Any, Sequence

import torch
from torch import Tensor, nn

from ._checks import check_keywords, loaded
from .device import resolve_devices
from .errors import OptionError
from .model.fingerprint import check_made_for
from .model import Layer, layer_chain
from .model.layers import training_modes
from .profiling.profiler import check_sample, profile as measure, sample_tensors
from .profiling.profiles import Profile
from .runtime import Pipeline
from .runtime._structure import Structure
from .runtime.pipeline import undeferrable
from .planning.replicas import plan as choose_plan

__all__ = ["partition"]

#: what ``**plan_options`` may hold: :func:`autopipe.plan`'s keyword options.
_PLAN_OPTIONS = [name for name, parameter in inspect.signature(choose_plan).parameters.items()
                 if parameter.kind is parameter.KEYWORD_ONLY]


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
        model: the model, read as a chain of layers (:func:`autopipe.layer_chain`), captured and
            profiled in the modes it trains with: its modules' own flags (a batch norm frozen
            with ``model.bn.eval()`` stays frozen), or every module in train mode if the model
            is in eval mode (transformers' ``from_pretrained`` returns one); the flags are put
            back after.
        sample_input: one full training batch (a tensor, a tuple of tensors, or a mapping of
            keyword arguments: a transformers model's ``{"input_ids": ids, "labels": ids}``,
            the pipeline then called ``pipe(**batch)``); its batch size is what the plan is
            made for.
        devices: devices, a device count, or ``None`` for every CUDA device (else two CPU devices).
        profile: a :class:`~autopipe.Profile` or its JSON path, made for this model and samples
            like ``sample_input``'s, instead of measuring one; the plan is still for the sample's
            batch size, split into micro-batches of sizes the profile measured.
        deferred_batch_norm: swap batch norms for :class:`~autopipe.DeferredBatchNorm`.
        quiet: no progress bar while profiling.
        **plan_options: passed to :func:`autopipe.plan` (``memory_limit``, ``checkpoint``,
            ``chunks``, ``replicas``, ...); replicas default to ``"auto"``: data parallel,
            pipeline or both, whichever is predicted fastest (one replica where torch.export
            captured training batch norms, which replicas could not defer).

    Returns:
        The pipeline; the plan it runs is ``pipe.plan``.

    Raises:
        ChainError: the model is not an ``nn.Module``, cannot be read as a chain of layers, or has hooks
            on itself (or a container whose layers are split) that the pipeline would not run.
        Exception: a layer's own, as its own type, where it fails on the sample (a note names it).
        FormatError: the ``profile`` file is corrupt or of another schema.
        PlanningError: no plan fits the memory limits.
        OptionError: ``profile`` was made for another model or other samples, an option is
            unknown or invalid, or ``batch_size`` is not the sample's.
        DeviceError: a device does not exist.
    """
    check_keywords("partition", plan_options, _PLAN_OPTIONS)
    resolved = resolve_devices(devices)
    # a partition plans training: the chain is captured (torch.export keeps the modes it sees) and
    # profiled in the modes it trains with
    with training_modes(model) if isinstance(model, nn.Module) else nullcontext():
        layers = layer_chain(model, sample_input)  # once: capturing a non-Sequential model traces it
        Structure.of(None, [], layers).check_hooks()  # refused now, not after profiling
        inputs = sample_tensors(layers, sample_input)
        plan_options["batch_size"] = _sample_batch(inputs, plan_options.get("batch_size"))
        measured = _profile_for(layers, sample_input, inputs, resolved, profile, quiet)
    if plan_options.get("replicas", "auto") == "auto" and undeferrable(layers):
        plan_options["replicas"] = 1  # replicas defer batch norm, which an exported graph's cannot
    chosen = choose_plan(measured, resolved, **plan_options)
    return Pipeline(layers, chosen, deferred_batch_norm=deferred_batch_norm)


def _sample_batch(inputs: tuple[Tensor, ...], asked: object) -> int:
    """The batch size to plan for: the sample's, which ``batch_size`` may only repeat (the
    pipeline is made for batches like the sample)."""
    batch = inputs[0].shape[0]
    if asked is not None and asked != batch:
        raise OptionError(f"batch_size={asked!r} is not the sample_input's batch of {batch}; partition plans for "
                          "the sample's batch size: pass one full training batch as sample_input")
    return batch


def _profile_for(
    layers: list[Layer],
    sample_input: Any,
    inputs: tuple[Tensor, ...],
    devices: list[torch.device],
    given: Profile | str | os.PathLike[str] | None,
    quiet: bool,
) -> Profile:
    """A fresh profile, or ``given`` after checking it measured this model on such samples."""
    if given is None:
        return measure(layers, sample_input, devices, quiet=quiet)
    found = loaded(given, Profile, "profile")
    check_made_for(found.model, layers, "profile",
                   "profile this model again (autopipe.profile or python -m autopipe profile)")
    check_sample(found, inputs)
    return found
