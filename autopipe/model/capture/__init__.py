"""Capture a non-Sequential model as a layer chain, its long-lived values routed as stash/pop skips.

:func:`chain` traces the forward (torch.fx, else torch.export on a sample), groups the graph's
nodes into one layer per leaf module call, and builds each layer as a :class:`CapturedLayer`
holding the model's own tensors at their paths.  Hugging Face ``transformers`` models are
captured through torch.export with their sample's keyword arguments, caches off.
"""
from __future__ import annotations

from contextlib import nullcontext
from typing import Any, Iterable

from torch import nn

from ..layers import Layer
from ..skip import Namespace
from ._building import build
from ._hf import caches_off, check_sample, is_hf_model
from ._grouping import group
from ._layer import CapturedLayer
from ._tracing import CaptureError, Granularity, LeafRule, LeafSpec, trace

__all__ = ["chain", "CapturedLayer", "CaptureError"]


def chain(
    model: nn.Module,
    sample_input: Any = None,
    granularity: Granularity = "module",
    *,
    leaf_modules: Iterable[LeafSpec] = (),
) -> list[Layer]:
    """The layers of ``model`` in forward order, with every long-lived value routed as a skip.

    The model is traced with torch.fx (symbolically: no batch size is baked in), or, where fx
    cannot and a ``sample_input`` is given, exported with torch.export (only the batch dimension
    stays dynamic; Python branches, other sizes and the train/eval mode are the sample's).  The
    nodes of a leaf module's call make one layer; functional glue joins the layer of its latest
    input (so ``x + identity`` or ``torch.cat`` runs where its last operand is made); a value that
    the next layer reads is part of the main value (a tensor or a tuple) and one that a later
    layer reads is a stash/pop skip.  Each layer is a :class:`CapturedLayer` holding the original
    modules (fx) or the original parameters and buffers (export) at their original paths, so
    state-dict keys are the model's own (``Layer.prefix == ""``) and nothing is copied.

    ``granularity="module"`` makes each top-level child a layer, except that containers
    (``Sequential``, ``ModuleList``, ``ModuleDict``) and top-level children holding one are opened
    into their blocks (``layer1.0``, ``features.3``, ``encoder.layers.2``); ``"finer"`` opens each
    such block one level more.  ``leaf_modules`` (dotted paths or classes) are kept whole: the way
    around a submodule whose forward cannot be traced.
    """
    hf = is_hf_model(model)
    if hf:
        check_sample(model, sample_input)
    leaves = LeafRule(model, granularity, tuple(leaf_modules))
    with caches_off(model) if hf else nullcontext():
        traced = trace(model, leaves, sample_input, fx_first=not hf)
    groups = group(traced)
    return build(traced, groups, Namespace(type(model).__name__))


