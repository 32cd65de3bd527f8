"""Capture a non-Sequential model as a layer chain, its long-lived values routed as stash/pop skips.

:func:`chain` traces the forward (torch.fx, else torch.export on a sample), groups the graph's
nodes into one layer per leaf module call, and builds each layer as a :class:`CapturedLayer`
holding the model's own tensors at their paths.  Hugging Face ``transformers`` models are
captured through torch.export with their sample's keyword arguments, caches off.
"""
from __future__ import annotations

from contextlib import nullcontext
from dataclasses import replace
from typing import Any, Iterable

from torch import nn

from ..layers import Chain, Layer
from ..skip import Namespace
from ._building import build
from ._hf import HF_OUTPUT_FLAGS, caches_off, check_sample, is_hf_model
from ._grouping import group
from ._layer import CapturedCallError, CapturedLayer, autocast_state
from ._checking import difference_on_sample
from ._state import Watched, descendants, reads
from ._tracing import CaptureError, Granularity, LeafRule, LeafSpec, Traced, split_sample, trace

__all__ = ["chain", "CapturedLayer", "CaptureError", "CapturedCallError", "Watched", "autocast_state"]


def chain(
    model: nn.Module,
    sample_input: Any = None,
    granularity: Granularity = "module",
    *,
    leaf_modules: Iterable[LeafSpec] = (),
) -> Chain:
    """The layers of ``model`` in forward order, with every long-lived value routed as a skip.

    The model is traced with torch.fx (symbolically: no batch size is baked in), or, where fx
    cannot and a ``sample_input`` is given, exported with torch.export (only the batch dimension
    stays dynamic; Python branches, other sizes and the train/eval mode are the sample's; a sample
    of batch 1 fixes the batch too, so its layers refuse other micro-batch sizes).  A forward that
    changes grad mode or autocast (``with torch.no_grad():``), which fx does not record, is exported.
    A traced forward that reads ``self.training`` keeps the capture's mode, and its layers refuse
    the other (modules such as ``nn.Dropout`` are calls, free of it).  fx's inputs are the forward's
    arguments, by position or name, except those with defaults that the sample does not give as
    tensors, which are fixed (a call may pass one with its fixed value, or leave it out where that
    is its default; another value is refused), as the numbers and flags of an export's sample are.
    The plain values the captured code may read (``self.temperature``, a config's, a child's;
    :mod:`~autopipe.model.capture._state`) are constants of the graph: a call after one changed
    is refused, and code that assigns an attribute or writes into a tensor that is no buffer is
    refused at the capture, the model left as it was.  Given a sample
    the model runs on, an fx chain is run against the model on it, and exported instead where the
    two differ (Python fx does not follow, such as ``isinstance(arg, torch.Tensor)`` on a proxy).  The
    nodes of a leaf module's call make one layer; functional glue joins the layer of its latest
    input (so ``x + identity`` or ``torch.cat`` runs where its last operand is made), but never
    above an operation that may write in place, which stays where it is; a value that the next
    layer reads is part of the main value (a tensor or a tuple) and one that a later layer reads
    is a stash/pop skip.  A buffer the forward reads or updates (``self.center.mul_(0.9)``) is
    part of the graph, updated at every call, and the layers reading it become one; a buffer
    assigned anew (``self.count = self.count + 1``), which neither fx nor torch.export records, is
    refused: update it in place (``self.count += 1``, ``self.count.add_(1)``).  Each layer is a
    :class:`CapturedLayer` holding the original modules (fx) or the original parameters and buffers
    (export) at their original paths, so state-dict keys are the model's own (``Layer.prefix ==
    ""``) and nothing is copied.
    A parameter used by two layers far apart (tied embedding and output weights) lives in the
    first and travels to the other as a skip, so its gradients from both add up.

    A transformers ``PreTrainedModel`` is exported straight away on its sample batch given as
    keyword arguments, with ``use_cache`` off meanwhile (a warning says so; the configs are
    restored).  The first layer then takes those arguments (:meth:`CapturedLayer.bind`, which
    :class:`~autopipe.Pipeline` applies to ``pipe(**batch)``) and the last layer's flat outputs
    make the model's output type again (:meth:`CapturedLayer.structure`).

    ``granularity="module"`` makes each top-level child a layer, except that containers
    (``Sequential``, ``ModuleList``, ``ModuleDict``) and top-level children leading to one are
    opened down to their blocks (``layer1.0``, ``features.3``, ``encoder.layers.2``,
    ``bert.encoder.layer.0``); ``"finer"`` opens each such block one level more.

    Args:
        model: the model to capture.
        sample_input: one batch: a tensor, a tuple of positional arguments, or a mapping of
            keyword arguments (``{"input_ids": ids, "attention_mask": mask, "labels": ids}``).
            Needed for torch.export: models fx cannot trace, and every transformers model.
        granularity: ``"module"`` or ``"finer"``, as above.
        leaf_modules: dotted paths or classes kept whole: the way around a submodule whose
            forward cannot be traced.

    Returns:
        The layers, each a :class:`~autopipe.Layer` holding a :class:`CapturedLayer`.

    Raises:
        CaptureError: neither fx nor export can capture the forward (the message names where and
            the way out; a buffer assigned names the buffer), fx's graph differs from the model on
            the sample and export fails, or a transformers model comes without a sample batch.
        ValueError: ``granularity`` is not one of the two.
        Exception: the model's own exception, as its own type, when neither fx nor export can capture
            it and the model itself fails on ``sample_input`` (a note says so).

    The layers raise :class:`CapturedCallError` when called in a way their graph does not cover
    (the other train/eval mode, a batch size the export fixed).
    """
    if not isinstance(model, nn.Module):
        raise CaptureError(f"the model must be a torch.nn.Module, got {type(model).__name__}; build it first "
                           "(e.g. torchvision.models.resnet50())")
    hf = is_hf_model(model)
    if hf:
        check_sample(model, sample_input)
    if isinstance(leaf_modules, (str, type)):
        leaf_modules = [leaf_modules]  # one path or class given alone
    leaves = LeafRule(model, granularity, tuple(leaf_modules))
    with caches_off(model) if hf else nullcontext():
        traced = trace(model, leaves, sample_input, fx_first=not hf)
    layers = _built(model, leaves, traced, hf)
    difference = None if traced.mode is not None or sample_input is None else difference_on_sample(
        model, layers, *split_sample(sample_input))
    if difference is not None:  # fx did not follow the forward: torch.export runs it on the sample
        why = (f"torch.fx's graph computes other values than the model on the sample ({difference}): the "
               "forward has Python that fx does not follow (an isinstance test on an input, which fx passes as "
               "a proxy; a value a hook stores), so ")
        layers = _built(model, leaves, trace(model, leaves, sample_input, fx_first=False, why=why), hf)
    return Chain.of(model, layers)


def _built(model: nn.Module, leaves: LeafRule, traced: Traced, hf: bool) -> list[Layer]:
    """The layers of ``traced``, with the plain values its code may read as the model holds them
    now: the code of every module torch.export ran, of those torch.fx traced through (not its
    leaves, whose code runs at every call); a transformers model's ``use_cache`` aside (captured
    off, whatever the config says)."""
    exported = traced.mode is not None
    ran = list(descendants(model, None if exported else lambda module, path: not leaves.is_leaf(module, path)))
    watched = [read for read in reads(ran) if not (hf and read[1][-1] == "use_cache")]
    if hf:  # what transformers reads by name (getattr), which no code names: the outputs it returns
        watched += [(path, ("config", flag), vars(module.config)[flag]) for path, module in ran
                    if hasattr(module.__dict__.get("config"), "__dict__")
                    for flag in HF_OUTPUT_FLAGS if flag in vars(module.config)]
    return build(replace(traced, reads=watched), group(traced), Namespace(type(model).__name__))


