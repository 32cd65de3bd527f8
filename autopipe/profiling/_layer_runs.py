"""One layer run forward and backward on its own copies of its inputs: the bytes it saves and
makes (recorded once per micro-batch size) and its time in a training pass."""
from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Literal

import torch
from torch import Tensor, nn

from ._meter import AllocationCounter
from ..model._tensors import map_tensors, tensors_of
from ..device import DeviceOps
from ..errors import RAISED_BY, add_note
from ..model import Layer
from ..model.skip import SkipKey, SkipTracker, internal_keys, use_skip_tracker
from ._progress import Progress
from .profiles import Stat

__all__: list[str] = []


@dataclass(frozen=True)
class Origin:
    """Where one output tensor's storage comes from: ``"input"`` (input position ``index``,
    passed on as is or as a view), ``"new"`` (the layer's new storage ``index``) or ``"other"``
    (a popped skip, a parameter or a buffer: counted with ``stash_bytes`` or ``param_bytes``)."""

    kind: Literal["input", "new", "other"]
    index: int = 0


@dataclass
class Measure:
    """What one layer did at one micro-batch size.

    The profiler runs each layer on its own copies of its inputs, so tensors are told apart by
    their position in the flattened main inputs and outputs (``tensors_of`` order; the next
    layer's inputs are this layer's outputs in that order).  ``input_saved``,
    ``output_origins``, ``new_bytes`` and ``new_saved`` let :func:`attribute` follow each
    tensor along the chain and count it once, with the layer that made it.
    """

    forward: Stat
    backward: Stat
    output_bytes: int
    stash_bytes: dict[str, int]
    internal_saved: int
    aliases_input: bool
    input_saved: list[bool]  # per main input position: does this layer save that tensor
    output_origins: list[Origin]  # per main output position
    new_bytes: list[int]  # per new output storage: its bytes
    new_saved: list[bool]  # per new output storage: does this layer save it
    workspace: int = 0
    stash_params: list[str] = field(default_factory=list)  # skips that are the layer's own state
    output: Any = None
    stashed: dict[SkipKey, Any] = field(default_factory=dict)


def record_size(layers: list[Layer], inputs: tuple[Tensor, ...], ops: DeviceOps,
                 progress: Progress) -> tuple[list[LayerRun], list[Measure]]:
    """At one micro-batch size: record each layer once in chain order (its bytes, and the input
    of the next); the runs then time it."""
    size = inputs[0].shape[0]
    args: tuple[Any, ...] = inputs
    skips: dict[SkipKey, Any] = {}
    runs: list[LayerRun] = []
    measures: list[Measure] = []
    for index, (layer, (_, pops)) in enumerate(zip(layers, external_skips(layers))):
        popped = {key: skips.pop(key) for key in pops}
        run = LayerRun(layer, args, popped, index > 0, ops)
        measure = run.record(size)
        progress.step(f"{layer.name} b={size}")
        skips.update(measure.stashed)
        args = (measure.output,)
        measure.output, measure.stashed = None, {}
        runs.append(run)
        measures.append(measure)
    return runs, measures


def external_skips(layers: list[Layer]) -> list[tuple[list[SkipKey], list[SkipKey]]]:
    """Each layer's stashes and pops that cross to other layers: a skip a layer pairs inside
    itself (a nested block with its own skip) is part of that layer, measured with it."""
    open_keys: set[SkipKey] = set()
    result = []
    for layer in layers:
        inside = internal_keys(layer.stash, layer.pop, open_keys)
        stashes = [key for key in layer.stash if key not in inside]
        pops = [key for key in layer.pop if key not in inside]
        open_keys = (open_keys - set(pops)) | set(stashes)
        result.append((stashes, pops))
    return result


def train_pass(runs: list[LayerRun], size: int) -> list[tuple[float, float]]:
    """One training pass — every layer forward in chain order, then every layer backward in
    reverse order — and each layer's (forward ms, backward ms).  A layer's graph is dropped
    after its backward, as autograd does in training."""
    forward_ms: list[float] = []
    pending: list[Run] = []
    for run in runs:
        with naming(run.layer, "forward", size):
            pending.append(run.forward())
        forward_ms.append(pending[-1].forward_ms)
    backward_ms = [0.0] * len(runs)
    for index in reversed(range(len(runs))):
        with naming(runs[index].layer, "backward", size):
            backward_ms[index] = runs[index].backward(pending.pop())
    return list(zip(forward_ms, backward_ms))


@contextlib.contextmanager
def naming(layer: Layer, phase: Literal["forward", "backward"], size: int) -> Iterator[None]:
    """Let any exception of the layer's ``phase`` reach the caller as itself, with a note naming
    the layer, the phase and the micro-batch size: a bare shape error deep in a chain is opaque."""
    try:
        yield
    except Exception as error:
        add_note(error, f"{RAISED_BY}layer '{layer.name}' ({type(layer.module).__name__}) in {phase} "
                        f"at micro-batch size {size}, while profiling it")
        raise


@dataclass
class Run:
    """One forward of a layer: its time and the values it saw and made (a skip holds any value,
    a tensor or not: ``x.dtype``)."""

    forward_ms: float
    args: Any
    popped: dict[SkipKey, Any]
    output: Any
    stashed: dict[SkipKey, Any]

    @property
    def results(self) -> list[Tensor]:
        """What backward starts from: the tensors of the outputs and of the skips stashed for
        later layers."""
        return tensors_of(self.output) + tensors_of(list(self.stashed.values()))


class LayerRun:
    """Runs one layer forward and backward on fresh copies of its inputs.

    Inputs are detached leaves, requiring grad where the tensor did when the layer before made
    it (never for the chain's first layer, whose input needs no gradient in a pipeline either;
    the runtime sets the same flags on what a stage receives), and each run feeds the layer a
    *clone* of them: an in-place first op (``ReLU(inplace=True)``) would otherwise modify a leaf that requires grad
    (an autograd error) or corrupt the input of the next run.  The clone is made before the
    timer starts; its backward passes the gradient through unchanged.
    """

    def __init__(self, layer: Layer, args: tuple[Any, ...], popped: dict[SkipKey, Any],
                 input_grad: bool, ops: DeviceOps) -> None:
        self.layer = layer
        self.ops = ops
        self.input_grad = input_grad
        self.leaves = map_tensors(args, lambda t: _leaf(t, input_grad))
        self.pop_leaves = {key: map_tensors(value, lambda t: _leaf(t, True)) for key, value in popped.items()}
        self.params = [p for p in layer.module.parameters() if p.requires_grad]
        self.grad_inputs = [t for t in tensors_of(self.leaves) + tensors_of(list(self.pop_leaves.values()))
                            if t.requires_grad] + self.params
        state = [*layer.module.parameters(), *layer.module.buffers()]
        self.state_storages = {storage(t)[0] for t in state}
        self.grads: list[Tensor] | None = None
        # False once the layer refuses a backward limited to ``inputs=`` (a reentrant
        # ``torch.utils.checkpoint`` inside it): :meth:`record` finds out, a twin inherits it.
        self.limit_inputs = True

    def twin(self, module: nn.Module) -> LayerRun:
        """The same layer on ``module``, a deep copy of its module, with leaves of its own
        (gradients land in ``.grad`` of the leaves and parameters, so another thread needs its
        own)."""
        layer = dataclasses.replace(self.layer, module=module)
        twin = LayerRun(layer, self.leaves, self.pop_leaves, self.input_grad, self.ops)
        twin.limit_inputs = self.limit_inputs
        return twin

    def forward(self, pack: Callable[[Tensor], Any] | None = None) -> Run:
        """The layer's forward on clones of its inputs, timed (``pack`` sees what it saves)."""
        args = map_tensors(self.leaves, lambda t: t.clone())
        popped = {key: map_tensors(value, lambda t: t.clone()) for key, value in self.pop_leaves.items()}
        tracker = SkipTracker()
        for key, value in popped.items():
            tracker.save(key, value)
        hooks = (torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t) if pack is not None
                 else contextlib.nullcontext())
        self.ops.synchronize()
        timer = self.ops.timer()
        with use_skip_tracker(tracker), hooks:
            timer.start()
            output = self.layer.module(*args)
            forward_ms = timer.stop()
        stashed = {k: t for k, t in tracker.tensors.items() if k not in self.pop_leaves}
        return Run(forward_ms, args, popped, output, stashed)

    def backward(self, run: Run) -> float:
        """The backward of ``run`` down to the layer's inputs and parameters, timed; the same
        random output gradients every time.

        A layer that refuses ``inputs=`` runs its whole backward without it, as in training: its
        graph starts at detached leaves, so gradients land only in ``.grad`` of those leaves and
        of parameters (its own, cleared here; any other, shared one is put back by the profiler,
        which restores every ``.grad`` of the model)."""
        roots = [t for t in run.results if t.requires_grad]
        if not roots:
            return 0.0
        self._output_grads(roots)
        timer = self.ops.timer()
        timer.start()
        torch.autograd.backward(roots, self.grads,
                                inputs=(self.grad_inputs or None) if self.limit_inputs else None)
        backward_ms = timer.stop()
        for tensor in self.grad_inputs:
            tensor.grad = None
        return backward_ms

    def _output_grads(self, roots: list[Tensor]) -> list[Tensor]:
        if self.grads is None:
            self.grads = [torch.randn_like(t) for t in roots]
        return self.grads

    def record(self, size: int) -> Measure:
        """One untimed forward and backward under ``saved_tensors_hooks``: what is saved, what
        the output is, and the workspace (``size``, the micro-batch size, is for the note on a
        failure: :func:`naming`).

        The workspace is the most the layer holds beyond what its forward keeps (output, saved
        and stashed tensors), in its forward or its backward: temporaries, the gradients it
        computes before it passes or accumulates them.  The parameters already hold gradients
        (as for every micro-batch after a step's first), so a new one is a temporary added to
        them; the output gradients arrive from elsewhere and are not counted.  Only CPU
        storages are counted (:mod:`autopipe.profiling._meter`; elsewhere the workspace is 0).

        A layer whose backward refuses ``inputs=`` (a reentrant checkpoint inside it) fails
        partway through its first backward; it is recorded again from a fresh forward, with
        backwards that do not limit their inputs from then on."""
        try:
            return self._record(size)
        except RuntimeError as error:
            if not (self.limit_inputs and _refuses_inputs(error)):
                raise
        self.limit_inputs = False
        for tensor in self.grad_inputs:
            tensor.grad = None
        return self._record(size)

    def _record(self, size: int) -> Measure:
        saved: dict[int, int] = {}

        def pack(tensor: Tensor) -> Tensor:
            ptr, size = storage(tensor)
            saved[ptr] = max(saved.get(ptr, 0), size)
            return tensor

        counter = AllocationCounter()
        with counter.track(self), naming(self.layer, "forward", size):
            run = self.forward(pack)
        kept = counter.current[self]
        forward_extra = counter.peak[self] - kept
        self._output_grads([t for t in run.results if t.requires_grad])
        for param in self.params:
            param.grad = torch.zeros_like(param)
        counter.reset_peak(self)
        with counter.track(self), naming(self.layer, "backward", size):
            self.backward(run)
        workspace = max(forward_extra, counter.peak[self] - kept)
        output, stashed = run.output, run.stashed
        input_ptrs = [storage(t)[0] for t in tensors_of(run.args)]
        others = {storage(t)[0] for t in tensors_of(list(run.popped.values()))} | self.state_storages
        outputs = dict(map(storage, tensors_of(output)))
        origins, new = _origins(input_ptrs, [storage(t)[0] for t in tensors_of(output)], others)
        held = others | set(input_ptrs)  # storages held already, by the layer or whoever sent its inputs
        return Measure(
            forward=Stat(0.0, 0.0, 0.0, 0), backward=Stat(0.0, 0.0, 0.0, 0),
            output_bytes=held_bytes(tensors_of(output), held),
            stash_bytes={str(k): held_bytes(tensors_of(value), held) for k, value in stashed.items()},
            internal_saved=sum(n for ptr, n in saved.items() if ptr not in held | set(outputs)),
            aliases_input=bool(set(input_ptrs) & set(outputs)),
            input_saved=[ptr in saved for ptr in input_ptrs],
            output_origins=origins,
            new_bytes=[outputs[ptr] for ptr in new],
            new_saved=[ptr in saved for ptr in new],
            workspace=workspace,
            stash_params=[str(k) for k, value in stashed.items()
                          if tensors_of(value) and all(storage(t)[0] in self.state_storages
                                                       for t in tensors_of(value))],
            output=map_tensors(output, _detached),
            stashed={k: map_tensors(value, _detached) for k, value in stashed.items()},
        )


def _refuses_inputs(error: RuntimeError) -> bool:
    """Whether ``error`` is autograd refusing ``backward(inputs=...)`` for a reentrant
    checkpoint (``torch.utils.checkpoint(..., use_reentrant=True)``)."""
    message = str(error)
    return "use_reentrant=True" in message and "inputs" in message


def _origins(inputs: list[int], outputs: list[int], others: set[int]) -> tuple[list[Origin], list[int]]:
    """Each output storage's :class:`Origin`, and the new storages in order (a storage that
    several outputs share is one new storage: its bytes exist once)."""
    new: list[int] = []
    origins: list[Origin] = []
    for ptr in outputs:
        if ptr in inputs:
            origins.append(Origin("input", inputs.index(ptr)))
        elif ptr in others:
            origins.append(Origin("other"))
        else:
            if ptr not in new:
                new.append(ptr)
            origins.append(Origin("new", new.index(ptr)))
    return origins, new


def _detached(tensor: Tensor) -> Tensor:
    """``tensor`` cut from its graph, still saying whether it needs a gradient (as the runtime
    tells a stage which received tensors need one)."""
    return tensor.detach().requires_grad_(tensor.requires_grad)


def _leaf(tensor: Tensor, requires_grad: bool) -> Tensor:
    """A leaf of ``tensor`` that requires grad if allowed and the tensor needs a gradient: a
    relayed chain input does not, and autograd saves less for it (``b * y`` keeps no ``b``)."""
    return tensor.detach().requires_grad_(requires_grad and tensor.requires_grad)  # only float and complex can


def storage(tensor: Tensor) -> tuple[int, int]:
    untyped = tensor.untyped_storage()
    return untyped.data_ptr(), untyped.nbytes()


def held_bytes(tensors: list[Tensor], held: set[int]) -> int:
    """What ``tensors`` (an output, or a stash) cost the memory model at most: the larger of the
    new storages they keep alive (each once, whole: a view ``big[:, :10]`` of a new ``big`` keeps
    it) and their elements (what their gradients take, each dense, and what a copy to another
    device moves: an expanded column's gradient is the whole expanded shape, ``torch.split``'s
    pieces each get one).  A tensor on a storage ``held`` already (the layer's own parameters and
    buffers, its inputs, popped skips: a slice of a cached table passed on) counts its elements
    only: that storage is someone else's."""
    own = {ptr: size for ptr, size in map(storage, tensors) if ptr not in held}
    on_held = sum(nbytes(t) for t in tensors if storage(t)[0] in held)
    return max(sum(own.values()) + on_held, sum(map(nbytes, tensors)))


def nbytes(tensor: Tensor) -> int:
    return tensor.nelement() * tensor.element_size()
