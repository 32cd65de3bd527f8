"""A torch.fx capture run against the model on the sample: where they differ, fx did not see the forward.

fx traces a forward with proxies in place of its inputs, so Python that looks at the values
rather than passing them on takes another branch than the model does: ``isinstance(bias,
torch.Tensor)`` is false for a proxy, and the branch that adds ``bias`` is left out of the graph
without an error.  Where a sample is given, the chain runs on it once beside the model (the same
random seed, without grad, buffers put back after each), and the capture is refused where the
two disagree.
"""
from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator, Sequence

import torch
from torch import nn

from .._tensors import tensors_of
from ..layers import Layer
from ..skip import SkipTracker, use_skip_tracker
from ._state import Snapshot, descendants

__all__: list[str] = []

#: Relative and absolute tolerance of the comparison: the chain runs the model's own operations
#: in the model's order, so only a different computation exceeds them.
_RTOL, _ATOL = 1e-4, 1e-5


def difference_on_sample(model: nn.Module, layers: Sequence[Layer], args: tuple[Any, ...],
                         kwargs: dict[str, Any]) -> str | None:
    """How the chain's output on the sample differs from the model's, or ``None`` where they agree,
    where the model fails on the sample (a float model captured on the float64 batch it will
    train on once converted: fx's graph holds no dtype) or gives two answers under one seed:
    nothing to compare against."""
    try:
        expected = tensors_of(_seeded(model, lambda: model(*args, **kwargs)))
    except Exception:  # noqa: BLE001 - the model's own failure on this sample: the chain is not checked
        return None
    try:
        got = tensors_of(_seeded(model, lambda: _run(layers, args, kwargs)))
    except Exception as error:  # noqa: BLE001 - a chain that fails where the model runs is a capture gone wrong
        return f"the chain raised {type(error).__name__}: {str(error).strip().splitlines()[0] if str(error) else ''}"
    difference = _compared(expected, got)
    if difference is None or _compared(expected, tensors_of(_seeded(model, lambda: model(*args, **kwargs)))):
        return None
    return difference


def _run(layers: Sequence[Layer], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """The chain end to end, as one stage runs its layers: the first on the bound arguments, each
    next on the value before, skips through a tracker; the model's output structure at the end."""
    first, last = layers[0].module, layers[-1].module
    with use_skip_tracker(SkipTracker()):
        value = first(*first.bind(args, kwargs))
        for layer in layers[1:]:
            value = layer.module(value)
    return last.structure(value)


def assignments_on_sample(model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[str]:
    """The attributes the model's forward assigns (and the tensors that are no buffers it writes
    into) when it runs on the sample, put back after: torch.export puts back what its tracing
    assigns, so its capture alone does not show a counter it drops.  None where the model fails
    on the sample (its capture would not have worked)."""
    changed: list[str] = []
    try:
        _seeded(model, lambda: model(*args, **kwargs), changed)
    except Exception:  # noqa: BLE001 - the model's own failure: nothing to tell from it
        return []
    return changed


def _seeded(model: nn.Module, run: Callable[[], Any], changed: list[str] | None = None) -> Any:
    """``run()`` from seed 0 of the CPU generator (dropout draws the same masks in both runs),
    the random state as it was after, and the model :func:`left_as_is`."""
    with left_as_is(model, changed), torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return run()


@contextlib.contextmanager
def left_as_is(model: nn.Module, changed: list[str] | None = None) -> Iterator[None]:
    """The block without grad, the model's buffers and its modules' attributes (a counter) put back
    as they were after it, even where it fails; ``changed`` gets the paths of the attributes it
    changed."""
    buffers = [(buffer, buffer.clone()) for buffer in model.buffers()]
    snapshot = Snapshot(descendants(model))
    try:
        with torch.no_grad():
            yield
    finally:
        if changed is not None:
            changed += snapshot.changed()
        snapshot.put_back()
        with torch.no_grad():
            for buffer, saved in buffers:
                buffer.copy_(saved)


def _compared(expected: list[torch.Tensor], got: list[torch.Tensor]) -> str | None:
    """Where two lists of output tensors differ (count, shape, dtype or values), or ``None``."""
    if len(expected) != len(got):
        return f"the model returns {len(expected)} tensors, the chain {len(got)}"
    for index, (a, b) in enumerate(zip(expected, got)):
        if a.shape != b.shape or a.dtype != b.dtype:
            return (f"output tensor {index} is {tuple(a.shape)} {a.dtype} from the model, {tuple(b.shape)} "
                    f"{b.dtype} from the chain")
        exact = not (a.is_floating_point() or a.is_complex())
        if not (torch.equal(a, b) if exact else torch.allclose(a, b, rtol=_RTOL, atol=_ATOL, equal_nan=True)):
            largest = (a.double() - b.double()).abs().nan_to_num().max().item() if a.numel() else 0.0
            return f"output tensor {index} differs by up to {largest:.3g}"
    return None
