"""A stage's input boundary: ``Boundary`` makes a received tensor a non-leaf, so a stage may start
with an in-place layer (``ReLU(inplace=True)`` right after a split point works, as in the plain
model)::

    leaf (requires_grad, .grad collects the input gradient)
      └─ Boundary ─▶ x (non-leaf alias of the leaf) ─▶ stage layers
"""
from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

__all__ = ["Boundary"]


class Boundary(torch.autograd.Function):
    """Identity whose output is a fresh non-leaf alias of its input."""

    @staticmethod
    def forward(ctx: Any, leaf: Tensor) -> Tensor:  # type: ignore[override]
        return leaf.detach()

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Tensor:  # type: ignore[override]
        return grad
