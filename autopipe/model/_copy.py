"""Deep copies of modules, including those holding a tensor their last forward computed.

``spectral_norm`` and ``weight_norm`` set ``weight`` on their module in a forward pre-hook, as a
tensor of the autograd graph, which ``copy.deepcopy`` refuses ("Only Tensors created explicitly
by the user support the deepcopy protocol").  Every forward computes it again from the
parameters, so a copy may hold it detached.
"""
from __future__ import annotations

import copy
from typing import TypeVar

from torch import Tensor, nn

__all__: list[str] = []

_Module = TypeVar("_Module", bound=nn.Module)


def deep_copy(module: _Module, memo: dict[int, object] | None = None) -> _Module:
    """``copy.deepcopy(module, memo)``, with each tensor a forward left in a module's attributes
    (a non-leaf of autograd) copied detached; ``memo`` shared by several calls keeps a module
    they share one module in the copies."""
    memo = {} if memo is None else memo
    for part in module.modules():
        for value in vars(part).values():
            if isinstance(value, Tensor) and not value.is_leaf and id(value) not in memo:
                memo[id(value)] = value.detach().clone()
    return copy.deepcopy(module, memo)
