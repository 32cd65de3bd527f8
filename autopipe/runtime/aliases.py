"""Tensors that are one tensor in the plain model but travel between stages apart.

A layer may return the very tensor it stashes (``yield stash("x", x); return x``) or stash one
tensor under two names.  In the plain model a later in-place write (``ReLU(inplace=True)``,
``x.add_(...)``) into either changes both, and autograd sends the gradient of both through the
write.  A pipeline sends the output and each skip as messages of their own: on another device,
or on a checkpointed micro-batch's copies, the write reaches one of them only, and where they
still share memory the other's gradient misses the write.  Nothing fails; the output or the
gradients differ.

So the stage that sends marks each tensor whose memory overlaps another it sends apart, or a
marked tensor it received and passes on (through ``nn.Identity`` or a view), with what else it
is; the stage that receives it refuses to write into a marked tensor::

    stage 0: x ──┬── output ────────▶ stage 1: ReLU(inplace=True)(x)   marked: "the skip 'x'"
                 └── stash 'x' ─────▶ stage k: pop 'x'                marked: "the output of stage 0"

Writing into a marked tensor raises :class:`~autopipe.ChainError`, which names the fixes.

A tensor whose memory is a buffer's of the sending stage (``self.count.add_(1)`` returns the
buffer, ``self.table[:n]`` is a view of it) travels as a copy (:func:`unshared`), marked as that
buffer: the sender updates the buffer for its next micro-batches while the receiver reads this
one's, and a write the receiver made into the copy would miss the buffer.
"""
from __future__ import annotations

from typing import Hashable, Iterable, Sequence

import torch
from torch import Tensor

from ..errors import ChainError
from .microbatch import Value, map_tensors, tensors_of

__all__ = ["Marks", "Watch", "buffer_spans", "mark", "unshared"]

#: Per tensor of a message (its position in ``tensors_of``): what else it is in the plain model.
Marks = dict[int, frozenset[str]]
#: A tensor's device and the range of addresses its elements lie in.
_Span = tuple[torch.device, int, int]


class Watch:
    """The marked tensors a stage computes on for one micro-batch, with their versions then."""

    def __init__(self, received: Sequence[tuple[str, Value, Marks]], by_value: bool = False) -> None:
        """``received``: per message, what it is ("their input", "the skip 'x'"), the value the
        layers compute on and its marks; ``by_value``: the marks say only that the tensors are
        equal (the distributed engine, which sends each tensor on its own), not that they are
        one tensor in the plain model."""
        self.by_value = by_value
        self.watched = [(name, tensor, marks[i], tensor._version, _span(tensor)) for what, value, marks in received
                        if marks for i, (name, tensor) in enumerate(_named(what, value))
                        if i in marks and tensor.numel()]

    def check(self, stage: str, j: int | None) -> None:
        """Raise :class:`ChainError` if the layers wrote into a watched tensor (``j``: the
        micro-batch, if known)."""
        for what, tensor, others, version, _ in self.watched:
            if tensor._version != version and self.by_value:
                raise ChainError(
                    f"{stage}: its layers write in place into {what}{'' if j is None else f' (micro-batch {j})'}, "
                    f"which arrives equal to {' and '.join(sorted(others))}: the torch.distributed engine sends "
                    "each tensor on its own and cannot tell whether they are one tensor in the plain model (the "
                    "write would then change both), so it refuses. Make the writing layer out of place (e.g. "
                    "ReLU(inplace=False)), split the model elsewhere so that the stash and the write are in one "
                    "stage, or run the plan in-process (autopipe.Pipeline), which tells copies apart")
            if tensor._version != version:
                raise ChainError(
                    f"{stage}: its layers write in place into {what}{'' if j is None else f' (micro-batch {j})'}, "
                    f"which in the plain model is the same tensor as {' and '.join(sorted(others))}, sent here as "
                    "a tensor of its own: the write would change both there, and a pipeline cannot do that. Make "
                    "the writing layer out of place (e.g. ReLU(inplace=False)), stash a copy "
                    "(stash(name, x.clone())), or split the model elsewhere so that the stash and the write are in "
                    "one stage")

    def carried(self, span: _Span) -> frozenset[str]:
        """What else the tensor at ``span`` (:func:`_span`) is, through the watched tensors its
        memory overlaps."""
        return frozenset().union(*(others for _, _, others, _, there in self.watched if _overlap(span, there)))


def mark(messages: dict[Hashable, tuple[str, Value]], watch: Watch,
         buffers: Sequence[tuple[str, _Span]]) -> dict[Hashable, Marks]:
    """The marks of the messages a stage sends (key → (what it is, value)): each tensor whose
    memory overlaps another tensor sent (of another message, or of the same one: ``(y, y)``),
    a watched tensor (:meth:`Watch.carried`) or one of the stage's ``buffers``
    (:func:`buffer_spans`)."""
    spans = [((key, i), name, _span(tensor)) for key, (what, value) in messages.items()
             for i, (name, tensor) in enumerate(_named(what, value)) if tensor.numel()]
    marks: dict[Hashable, Marks] = {}
    for (key, i), _, span in spans:
        others = {name for place, name, there in spans if place != (key, i) and _overlap(span, there)}
        others |= watch.carried(span) | {name for name, there in buffers if _overlap(span, there)}
        if others:
            marks.setdefault(key, {})[i] = frozenset(others)
    return marks


def buffer_spans(buffers: dict[str, Tensor]) -> list[tuple[str, _Span]]:
    """Each buffer (by its path in the model) as what it is and the addresses it lies in, taken
    once for all the messages of a micro-batch."""
    return tensor_spans((f"the buffer '{path}'", b) for path, b in buffers.items())


def tensor_spans(named: Iterable[tuple[str, Tensor]]) -> list[tuple[str, _Span]]:
    """Each of the ``(what, tensor)`` given as what it is and the addresses it lies in."""
    return [(what, _span(tensor)) for what, tensor in named if tensor.numel()]


def unshared(value: Value, buffers: Sequence[tuple[str, _Span]]) -> Value:
    """``value`` with a copy of each tensor whose memory overlaps one of ``buffers``
    (:func:`buffer_spans`, :func:`tensor_spans`)."""
    return map_tensors(value, lambda t: t.clone() if t.numel() and any(_overlap(_span(t), there)
                                                                        for _, there in buffers) else t)


def _named(what: str, value: Value) -> list[tuple[str, Tensor]]:
    """``value``'s tensors, each named by ``what`` (and its place, if ``value`` holds several)."""
    tensors = tensors_of(value)
    return [(what if len(tensors) == 1 else f"{what} (tensor {i})", t) for i, t in enumerate(tensors)]


def _span(tensor: Tensor) -> _Span:
    """The device and the range of addresses ``tensor``'s elements lie in."""
    last = sum((size - 1) * stride for size, stride in zip(tensor.shape, tensor.stride()))
    start = tensor.data_ptr()
    return tensor.device, start, start + (last + 1) * tensor.element_size()


def _overlap(a: _Span, b: _Span) -> bool:
    """Whether two address ranges on one device overlap (two interleaved views of one tensor
    do, though no element is in both: a mark too many only refuses a write)."""
    return a[0] == b[0] and a[1] < b[2] and b[1] < a[2]
