"""A pipeline called like the model it came from: keyword arguments in, the model's output type out.

A captured chain's first layer takes the model's arguments positionally
(:func:`autopipe.model.call_arguments` binds a call to them) and its last layer returns flat
outputs (what stages can hand on), which :func:`model_output` makes the model's output again.
A scalar output (a loss) joins over micro-batches as the mean weighted by micro-batch size: the
whole batch's mean when the model's loss is a mean over samples, or over tokens with equally many
counted per sample; an integer or boolean scalar only where all are equal. Every other output tensor
is concatenated along dim 0, so its dim 0 must be the batch; one that is not is refused when there
is more than one micro-batch (with one, nothing is joined and it comes back as the model returned
it).
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Hashable

import torch
from torch import Tensor, nn

from ..model import CapturedLayer
from .microbatch import Value, gather, items_of, rebuilt

__all__: list[str] = []


def model_output(last: nn.Module, output: Value) -> Any:
    """The model's own output type (``out.logits`` works) when the capture recorded it."""
    return last.structure(output) if isinstance(last, CapturedLayer) else output


#: Plain values an output may hold, joined when every micro-batch's is equal.
_CONSTANTS = (type(None), bool, int, float, str, torch.dtype, torch.device)


def join_outputs(outputs: Sequence[Value], sizes: Sequence[int], where: str = "") -> Value:
    """Micro-batch outputs joined: tensors concatenated along dim 0, scalars averaged by size,
    item by item through tuples, lists, dicts (as plain dicts), namedtuples and dataclasses, each
    of its own type.

    ``where`` is the position inside the output (``[1]['hidden']``), for the errors naming an
    output that is not batch-first or not alike in every micro-batch.
    """
    first = outputs[0]
    items = items_of(first)
    if items is not None:
        parts = _alike(outputs, dict(items), where)
        return rebuilt(first, {key: join_outputs([part[key] for part in parts], sizes, f"{where}[{key!r}]")
                               for key in parts[0]})
    if isinstance(first, Tensor) and first.dim() == 0:
        return _joined_scalar(outputs, sizes, where)
    if isinstance(first, _CONSTANTS) and all(type(out) is type(first) and out == first for out in outputs):
        return first  # a plain value every micro-batch returned alike (None, a flag, a scale): the model's
    if not isinstance(first, Tensor):
        _refuse_unjoinable(outputs, where)
    if len(outputs) > 1:  # one micro-batch joins nothing, so any dim 0 comes back as it is
        _check_batch_first(outputs, sizes, where)
    return gather(outputs)


def _joined_scalar(outputs: Sequence[Tensor], sizes: Sequence[int], where: str) -> Tensor:
    """Scalars, one per micro-batch, as the batch's: the mean weighted by size (a loss) where
    they are floating point; an integer or boolean scalar (a count, a flag) has no such mean in
    its type, and the mean of counts is not their total, so it is refused unless every
    micro-batch gave the same (then that is the batch's, as for plain values)."""
    first = outputs[0]
    if first.is_floating_point() or first.is_complex():
        return sum(out * size for out, size in zip(outputs, sizes)) / sum(sizes)
    if all(torch.equal(out, first) for out in outputs[1:]):
        return first
    name = f"output {where}" if where else "output"
    raise ValueError(
        f"the pipeline's {name} is a {first.dtype} scalar that differs between micro-batches "
        f"({', '.join(str(out.item()) for out in outputs)}); a pipeline joins a scalar output as the mean of its "
        "micro-batches' weighted by their sizes (a loss), which a count or flag is not: return it per sample "
        "(shape [batch]) and reduce it after the pipeline, or run the pipeline with chunks=1")


def _alike(outputs: Sequence[Value], first: dict[Hashable, Value], where: str) -> list[dict[Hashable, Value]]:
    """Each micro-batch's output container as its items by key (``first``: the first's, in walk
    order), refused unless all have the first's type and keys: joined by key, a key only some
    have would be dropped, and the gradients of the rest paired with other outputs."""
    parts = [first]
    for j, out in enumerate(outputs[1:], start=1):
        items = items_of(out) if type(out) is type(outputs[0]) else None
        if items is None or {key for key, _ in items} != first.keys():
            name = f"output {where}" if where else "output"
            raise ValueError(
                f"the pipeline's {name} is {_layout(outputs[0])} in micro-batch 0 but {_layout(out)} in micro-batch "
                f"{j}; a pipeline joins its micro-batches' outputs item by item, so each must hold the same "
                "items: return the same keys (or length) whatever the input (e.g. zeros where there is nothing), "
                "or run the pipeline with chunks=1")
        parts.append(dict(items))
    return parts


def _layout(value: Value) -> str:
    """A container's type and keys (or length), for an error."""
    items = items_of(value)
    if items is None:
        return f"a {type(value).__name__}"
    if isinstance(value, (tuple, list)):
        return f"a {type(value).__name__} of {len(items)}"
    return f"a {type(value).__name__} with keys {[key for key, _ in items]}"


def _refuse_unjoinable(outputs: Sequence[Value], where: str) -> None:
    """Refuse an output item that is neither a tensor nor a plain value alike in every micro-batch:
    there is no batch's value to make of the micro-batches' (a string, an object, a count that
    differs), so the error names the item and what may stand there."""
    name = f"output {where}" if where else "output"
    kinds = sorted({type(out).__name__ for out in outputs})
    raise TypeError(
        f"the pipeline's {name} is {' or '.join(kinds)} ({', '.join(repr(out)[:40] for out in outputs[:3])}"
        f"{', ...' if len(outputs) > 3 else ''} in its micro-batches), which cannot be joined into the batch's: "
        "the last stage may return tensors (concatenated along dim 0, scalars averaged), plain values "
        f"({', '.join(t.__name__ for t in _CONSTANTS[1:])} or None) equal in every micro-batch, and tuples, "
        "lists, dicts, namedtuples and dataclasses of them; return other values from outside the pipeline"
    )


def _check_batch_first(outputs: Sequence[Value], sizes: Sequence[int], where: str) -> None:
    """Refuse an output whose dim 0 is not its micro-batch's size: concatenating it along dim 0
    would return a tensor of another shape (an aux ``(4, 3)`` as ``(12, 3)``), silently."""
    for out, size in zip(outputs, sizes):
        if isinstance(out, Tensor) and (out.dim() == 0 or out.shape[0] != size):
            name = f"output {where}" if where else "output"
            raise ValueError(
                f"the pipeline's {name} has shape {tuple(out.shape)} in a micro-batch of {size} samples, but "
                "a pipeline joins its micro-batches' outputs along dim 0, which must be the batch; return "
                "batch-first tensors (e.g. an RNN's (layers, batch, hidden) state transposed to batch first, or "
                "logits.view(-1, V) returned as they are and flattened after the pipeline), a scalar (a mean "
                "over samples, joined as the batch's mean), or compute batch-independent values outside the "
                "pipeline (or run it with chunks=1)"
            )


def split_output_grad(grad: Tensor | None, sizes: Sequence[int]) -> Sequence[Tensor | None]:
    """An output gradient per micro-batch: the inverse of :func:`join_outputs` (none for an
    output the loss does not use)."""
    if grad is None:
        return [None] * len(sizes)
    if len(sizes) == 1:  # one micro-batch: its output came back unjoined, whatever its dim 0
        return [grad]
    if grad.dim() == 0:
        return [grad * size / sum(sizes) for size in sizes]
    return torch.split(grad, list(sizes))
