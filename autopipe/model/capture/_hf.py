"""Hugging Face ``transformers`` models: exported on their keyword arguments with caches off.

fx cannot trace a ``PreTrainedModel`` and an exported forward with ``use_cache=True`` returns a
``DynamicCache``, which is an inference object no pipeline stage can hand on.  Capture therefore
exports straight away, with ``config.use_cache`` off for the duration (said in a warning; the
user's config is restored), on the sample batch given as keyword arguments
(``{"input_ids": ids, "attention_mask": mask, "labels": ids}``).  ``transformers`` is optional:
it is never imported here, only recognised when the user has imported it.
"""
from __future__ import annotations

import sys
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from torch import nn

from ._tracing import CaptureError

__all__: list[str] = []

#: Config flags that choose what a transformers model returns, which its forward reads by name
#: (``getattr``): the captured graph returns what they were at the capture.
#: (``output_attentions`` is a property over ``_output_attentions``: the value is watched.)
HF_OUTPUT_FLAGS = ("_output_attentions", "output_attentions", "output_hidden_states", "return_dict")


def is_hf_model(model: nn.Module) -> bool:
    transformers = sys.modules.get("transformers")
    return transformers is not None and isinstance(model, transformers.PreTrainedModel)


def check_sample(model: nn.Module, sample_input: Any) -> None:
    if sample_input is None:
        raise CaptureError(
            f"{type(model).__name__} is a transformers model, captured with torch.export on a sample "
            "batch: give one, e.g. autopipe.chain(model, {'input_ids': ids, 'labels': ids})"
        )


@contextmanager
def caches_off(model: nn.Module) -> Iterator[None]:
    """``use_cache`` off in the model's config and its submodules' own (a T5 decoder keeps a
    copy), the user's values back after."""
    configs = {id(config): config for config in _configs(model)}.values()
    saved = [(config, config.use_cache) for config in configs]
    if any(value for _, value in saved):
        warnings.warn(
            f"autopipe captures {type(model).__name__} for training with use_cache=False (a "
            "key/value cache serves generation, which a pipeline does not run); your config is "
            "left as it was",
            stacklevel=4,
        )
    for config, _ in saved:
        config.use_cache = False
    try:
        yield
    finally:
        for config, value in saved:
            config.use_cache = value


def _configs(model: nn.Module) -> Iterator[Any]:
    for module in model.modules():
        config = getattr(module, "config", None)
        if config is not None and hasattr(config, "use_cache"):
            yield config
