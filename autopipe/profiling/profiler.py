"""``autopipe.profile``: measure each layer's forward and backward time and bytes, and copy costs.

Each layer is timed alone on ``devices[0]`` with its real input, so the planner can price any
split at any micro-batch size.  Forward and backward are timed separately because a pipeline
balances them separately; timings are medians after warm-up, with min and max kept so noise is
visible.

Layers are timed in training order — one pass runs every layer forward in chain order, then
every layer backward in reverse order — not each layer over and over alone: a layer then meets
the caches as it does in training, its weights cold after the layers before it and, in backward,
its saved tensors long evicted.  Repeated alone, a layer finds its weights and activations hot;
ResNet-18's ``layer3``/``layer4`` (large weights, small activations) then ran about 20% faster
than in a training step, which led the planner to a split 5% slower than the one it would
have picked.

On two or more CPU devices the passes are timed *under load*: a twin of the chain trains in a
loop on another thread meanwhile.  Such devices are cores that share caches and memory
bandwidth, and a pipeline's stages run side by side nearly all the time; timed on an idle
machine, ResNet-18's ``layer4`` backward at micro-batch 4 looked 15-20% faster than it ran
beside the other stage, which made the planner pick micro-batches too small.

The sizes take turns, pass by pass (and the twin follows), rather than each being timed in one
stretch: on a shared machine the speed drifts by 10% and more over minutes, and timed one after
the other, sizes 8 and 16 of ResNet-18 once came out 4% apart per sample where whole training
steps measured 7-11% apart in the same hour (18% in the team's field notes), leaving the planner a coin toss between 4 and 8
micro-batches.
"""
from __future__ import annotations

import contextlib
import copy
import dataclasses
import math
import statistics
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Sequence

import numpy as np
import torch
from scipy.optimize import nnls
from torch import Tensor, nn

from ..device import DeviceOps, ops_for, resolve_devices
from ..model.fingerprint import environment_fingerprint, model_fingerprint
from ..model import Layer, layer_chain
from .profiles import CopyFit, LayerProfile, Profile, Stat
from ._progress import Progress
from ..model.skip import SkipKey, SkipTracker, use_skip_tracker

__all__ = ["profile", "ProfileError", "fit_copy", "measure_copies", "DEFAULT_COPY_SIZES"]

KiB = 1024
MiB = 1024 * KiB

#: Copy sizes timed per device pair: from latency-bound to bandwidth-bound.
DEFAULT_COPY_SIZES: tuple[int, ...] = (4 * KiB, 64 * KiB, 1 * MiB, 16 * MiB)


class ProfileError(ValueError):
    """The model or its sample input cannot be profiled as given."""


def profile(
    model: nn.Module | Sequence[Layer],
    sample_input: Tensor | Sequence[Tensor],
    devices: Sequence[torch.device | str | int] | int | None = None,
    batch_sizes: Sequence[int] | None = None,
    *,
    warmup: int = 2,
    repeats: int = 5,
    copy_sizes: Sequence[int] = DEFAULT_COPY_SIZES,
    quiet: bool = False,
    under_load: bool | None = None,
) -> Profile:
    """Profile ``model``'s layer chain (or a given list of layers) on ``devices[0]`` and the
    copies between ``devices``.

    ``sample_input`` is one full batch (a tensor, or a tuple of tensors passed as the first
    layer's arguments), batch dimension first; its batch is ``Profile.batch_size``.
    ``batch_sizes`` defaults to the powers of two below that batch, and the batch itself.
    The chain makes ``warmup`` untimed then ``repeats`` timed training passes per size, in
    train mode (forward in order, backward in reverse; each layer timed alone), the sizes
    taking turns pass by pass so that a drift in machine speed hits every size alike.
    ``under_load`` times them while a twin of the chain trains on another thread (default: when
    ``devices`` are two or more CPU devices, which run pipeline stages side by side on shared
    caches); the profile's ``environment["timed_under_load"]`` records which.
    The model comes back as it was: same mode, parameters, buffers (BatchNorm running
    statistics), ``.grad`` and random-number state.
    """
    inputs = _as_inputs(sample_input)
    batch = inputs[0].shape[0]
    sizes = _batch_sizes(batch_sizes, batch)
    if warmup < 0 or repeats < 1:
        raise ValueError(f"need warmup >= 0 and repeats >= 1, got warmup={warmup}, repeats={repeats}")
    resolved = resolve_devices(devices)
    if under_load is None:
        under_load = len(resolved) > 1 and all(d.type == "cpu" for d in resolved)
    layers = layer_chain(model)
    root = model if isinstance(model, nn.Module) else nn.ModuleList(layer.module for layer in layers)
    pairs = [(i, j) for i in range(len(resolved)) for j in range(len(resolved)) if i != j]
    progress = Progress(len(sizes) * (len(layers) + warmup + repeats) + len(pairs) * len(copy_sizes),
                        "profiling", not quiet)
    try:
        ops = ops_for(resolved[0])
        with _untouched(root, resolved[0], resolved):
            by_size = _profile_sizes(layers, inputs, sizes, batch_sizes is None, ops,
                                     _Timing(warmup, repeats, under_load), progress)
        copies = measure_copies(resolved, copy_sizes, repeats, warmup, progress)
    finally:
        progress.close()
    saved = {b: _attribute(measures) for b, measures in by_size.items()}
    return Profile(
        model=model_fingerprint(layers),
        environment={**environment_fingerprint(resolved), "timed_under_load": under_load},
        devices=[str(d) for d in resolved],
        input_shape=list(inputs[0].shape[1:]),
        input_dtype=str(inputs[0].dtype).removeprefix("torch."),
        input_bytes=sum(_per_sample(_nbytes(t), batch) for t in inputs),
        batch_size=batch,
        batch_sizes=list(by_size),
        layers=[_layer_profile(layer, i, by_size, saved) for i, layer in enumerate(layers)],
        copies=copies,
    )


@dataclass(frozen=True)
class _Timing:
    """How layers are timed: untimed and timed passes per size, and whether under load."""

    warmup: int
    repeats: int
    under_load: bool


def _profile_sizes(layers: list[Layer], inputs: tuple[Tensor, ...], sizes: list[int], defaulted: bool,
                   ops: DeviceOps, timing: _Timing, progress: Progress) -> dict[int, list[_Measure]]:
    """Measure every size.  With the default sizes, a small size that a layer cannot train at
    (batch norm needs more than one value per channel) is left out rather than failing the
    whole profile; the planner then never chooses micro-batches that small."""
    recorded: dict[int, tuple[list[_LayerRun], list[_Measure]]] = {}
    for b in sizes:
        try:
            recorded[b] = _record_size(layers, _first(inputs, b, ops.device), ops, progress)
        except ProfileError:
            if not defaulted or b == sizes[-1]:
                raise
    runs = {b: size_runs for b, (size_runs, _) in recorded.items()}
    with _Load(runs) if timing.under_load else contextlib.nullcontext() as load:
        timed = _time_passes(runs, timing.warmup, timing.repeats, progress, load)
    for b, (_, measures) in recorded.items():
        for measure, forward_ms, backward_ms in zip(measures, *timed[b]):
            measure.forward, measure.backward = _stat(forward_ms), _stat(backward_ms)
    return {b: measures for b, (_, measures) in recorded.items()}


# --- input checks ---------------------------------------------------------------------------

def _as_inputs(sample_input: Any) -> tuple[Tensor, ...]:
    inputs = (sample_input,) if isinstance(sample_input, Tensor) else sample_input
    if not isinstance(inputs, (tuple, list)) or not inputs or not all(isinstance(t, Tensor) for t in inputs):
        raise TypeError(
            f"sample_input must be a tensor or a tuple of tensors, got {type(sample_input).__name__}; "
            "pass one full batch, e.g. torch.randn(32, 3, 128, 128)"
        )
    batches = {t.shape[0] if t.dim() > 0 else 0 for t in inputs}
    if len(batches) != 1 or 0 in batches:
        raise ValueError(
            f"every sample_input tensor needs the same batch size (dimension 0) of at least 1, got "
            f"shapes {[tuple(t.shape) for t in inputs]}"
        )
    return tuple(inputs)


def _batch_sizes(requested: Sequence[int] | None, batch: int) -> list[int]:
    if requested is None:
        powers = [1 << k for k in range(batch.bit_length()) if (1 << k) < batch]
        return powers + [batch]
    sizes = sorted(set(requested))
    bad = [b for b in sizes if not isinstance(b, int) or isinstance(b, bool) or not 1 <= b <= batch]
    if bad or not sizes:
        raise ValueError(
            f"batch_sizes must be integers from 1 to the sample's batch size {batch}, got {list(requested)}"
        )
    return sizes


def _first(inputs: tuple[Tensor, ...], size: int, device: torch.device) -> tuple[Tensor, ...]:
    return tuple(t[:size].to(device) for t in inputs)


# --- keeping the model as it was ------------------------------------------------------------

@contextlib.contextmanager
def _untouched(model: nn.Module, device: torch.device, devices: list[torch.device]) -> Iterator[None]:
    """Train mode on ``device`` inside; afterwards the model's mode, values, device, ``.grad``
    and the random state are what they were (profiling runs BatchNorm in training mode, which
    updates running statistics, and runs backward, which sets ``.grad``)."""
    modes = [(m, m.training) for m in model.modules()]
    params = list(model.parameters())
    tensors = params + list(model.buffers())
    values = [t.detach().clone() for t in tensors]
    grads = [p.grad for p in params]
    home = next((t.device for t in tensors), device)
    cuda = sorted({d.index for d in devices if d.type == "cuda"})
    try:
        for p in params:
            p.grad = None
        with torch.random.fork_rng(devices=cuda):
            model.to(device)
            model.train()
            yield
    finally:
        model.to(home)
        with torch.no_grad():
            for tensor, value in zip(tensors, values):
                tensor.copy_(value)
        for p, grad in zip(params, grads):
            p.grad = grad
        for module, mode in modes:
            module.training = mode


# --- one layer at one micro-batch size -------------------------------------------------------

@dataclass
class _Measure:
    """What one layer did at one micro-batch size.

    The ``saves_*``/``aliases_input`` flags and ``new_output_storage`` let :func:`_attribute`
    count each tensor on a layer boundary once, with the layer that produced it.
    """

    forward: Stat
    backward: Stat
    output_bytes: int
    stash_bytes: dict[str, int]
    internal_saved: int
    saves_input: bool
    saves_output: bool
    aliases_input: bool
    new_output_storage: int
    output: Any = None
    stashed: dict[SkipKey, Tensor] = field(default_factory=dict)


def _record_size(layers: list[Layer], inputs: tuple[Tensor, ...], ops: DeviceOps,
                 progress: Progress) -> tuple[list["_LayerRun"], list[_Measure]]:
    """At one micro-batch size: record each layer once in chain order (its bytes, and the input
    of the next); the runs then time it."""
    size = inputs[0].shape[0]
    args: tuple[Any, ...] = inputs
    skips: dict[SkipKey, Tensor] = {}
    runs: list[_LayerRun] = []
    measures: list[_Measure] = []
    for index, layer in enumerate(layers):
        popped = {key: skips.pop(key) for key in layer.pop}
        with _naming(layer, size):
            run = _LayerRun(layer, args, popped, index > 0, ops)
            measure = run.record()
        progress.step(f"{layer.name} b={size}")
        skips.update(measure.stashed)
        args = (measure.output,)
        measure.output, measure.stashed = None, {}
        runs.append(run)
        measures.append(measure)
    return runs, measures


_Times = tuple[list[list[float]], list[list[float]]]  # per layer: forward ms, backward ms of each pass


def _time_passes(runs: dict[int, list["_LayerRun"]], warmup: int, repeats: int, progress: Progress,
                 load: "_Load | None") -> dict[int, _Times]:
    """Per size, each layer's forward and backward ms in ``repeats`` training passes after
    ``warmup``; each round makes one pass of every size (and sets the load to that size)."""
    times: dict[int, _Times] = {b: ([[] for _ in chain], [[] for _ in chain]) for b, chain in runs.items()}
    for count in range(warmup + repeats):
        for size, chain in runs.items():
            if load is not None:
                load.size = size
            measured = _train_pass(chain, size)
            if count >= warmup:
                for index, (forward_ms, backward_ms) in enumerate(measured):
                    times[size][0][index].append(forward_ms)
                    times[size][1][index].append(backward_ms)
            progress.step(f"pass {count + 1} b={size}")
    return times


def _train_pass(runs: list["_LayerRun"], size: int) -> list[tuple[float, float]]:
    """One training pass — every layer forward in chain order, then every layer backward in
    reverse order — and each layer's (forward ms, backward ms).  A layer's graph is dropped
    after its backward, as autograd does in training."""
    forward_ms: list[float] = []
    pending: list[_Run] = []
    for run in runs:
        with _naming(run.layer, size):
            pending.append(run.forward())
        forward_ms.append(pending[-1].forward_ms)
    backward_ms = [0.0] * len(runs)
    for index in reversed(range(len(runs))):
        with _naming(runs[index].layer, size):
            backward_ms[index] = runs[index].backward(pending.pop())
    return list(zip(forward_ms, backward_ms))


class _Load:
    """A twin of the chain (deep copies of the layers, its own input leaves) training in a loop
    on another thread, for as long as the ``with`` block lasts, at the micro-batch size last set
    in ``size``; its error, if any, is raised on exit rather than lost."""

    def __init__(self, runs: dict[int, list["_LayerRun"]]) -> None:
        first = next(iter(runs.values()))
        modules = [copy.deepcopy(run.layer.module) for run in first]
        self.twins = {b: [run.twin(module) for run, module in zip(chain, modules)] for b, chain in runs.items()}
        self.size = next(iter(runs))
        self.stop = threading.Event()
        self.error: Exception | None = None
        self.thread = threading.Thread(target=self._loop, name="autopipe-profile-load", daemon=True)

    def __enter__(self) -> "_Load":
        self.thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop.set()
        self.thread.join()
        if self.error is not None and exc_info[0] is None:
            raise self.error

    def _loop(self) -> None:
        try:
            while True:  # at least one pass, however short the block
                size = self.size
                _train_pass(self.twins[size], size)
                if self.stop.is_set():
                    break
        except Exception as error:  # handed to the profiling thread by __exit__
            self.error = error


@contextlib.contextmanager
def _naming(layer: Layer, size: int) -> Iterator[None]:
    """Name the layer in any failure: a bare shape error deep in a chain is opaque."""
    try:
        yield
    except ProfileError:
        raise
    except Exception as error:
        raise ProfileError(
            f"profiling layer '{layer.name}' ({type(layer.module).__name__}) at micro-batch size "
            f"{size} failed: {error}"
        ) from error


@dataclass
class _Run:
    """One forward of a layer: its time and the tensors it saw and made."""

    forward_ms: float
    args: Any
    popped: dict[SkipKey, Tensor]
    output: Any
    stashed: dict[SkipKey, Tensor]

    @property
    def results(self) -> list[Tensor]:
        """What backward starts from: the outputs and the tensors stashed for later layers."""
        return _tensors(self.output) + list(self.stashed.values())


class _LayerRun:
    """Runs one layer forward and backward on fresh copies of its inputs.

    Inputs are detached leaves (requiring grad except for the chain's first layer, whose input
    needs no gradient in a pipeline either) and each run feeds the layer a *clone* of them: an
    in-place first op (``ReLU(inplace=True)``) would otherwise modify a leaf that requires grad
    (an autograd error) or corrupt the input of the next run.  The clone is made before the
    timer starts; its backward passes the gradient through unchanged.
    """

    def __init__(self, layer: Layer, args: tuple[Any, ...], popped: dict[SkipKey, Tensor],
                 input_grad: bool, ops: DeviceOps) -> None:
        self.layer = layer
        self.ops = ops
        self.input_grad = input_grad
        self.leaves = _map_tensors(args, lambda t: _leaf(t, input_grad))
        self.pop_leaves = {key: _leaf(t, True) for key, t in popped.items()}
        params = [p for p in layer.module.parameters() if p.requires_grad]
        self.grad_inputs = [t for t in _tensors(self.leaves) + list(self.pop_leaves.values())
                            if t.requires_grad] + params
        state = [*layer.module.parameters(), *layer.module.buffers()]
        self.state_storages = {_storage(t)[0] for t in state}
        self.grads: list[Tensor] | None = None

    def twin(self, module: nn.Module) -> "_LayerRun":
        """The same layer on ``module``, a deep copy of its module, with leaves of its own
        (gradients land in ``.grad`` of the leaves and parameters, so another thread needs its
        own)."""
        layer = dataclasses.replace(self.layer, module=module)
        return _LayerRun(layer, self.leaves, self.pop_leaves, self.input_grad, self.ops)

    def forward(self, pack: Callable[[Tensor], Any] | None = None) -> _Run:
        """The layer's forward on clones of its inputs, timed (``pack`` sees what it saves)."""
        args = _map_tensors(self.leaves, lambda t: t.clone())
        popped = {key: t.clone() for key, t in self.pop_leaves.items()}
        tracker = SkipTracker()
        for key, tensor in popped.items():
            tracker.save(key, tensor)
        hooks = (torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t) if pack is not None
                 else contextlib.nullcontext())
        self.ops.synchronize()
        timer = self.ops.timer()
        with use_skip_tracker(tracker), hooks:
            timer.start()
            output = self.layer.module(*args)
            forward_ms = timer.stop()
        stashed = {k: t for k, t in tracker.tensors.items() if k not in self.pop_leaves}
        return _Run(forward_ms, args, popped, output, stashed)

    def backward(self, run: _Run) -> float:
        """The backward of ``run`` down to the layer's inputs and parameters, timed; the same
        random output gradients every time."""
        roots = [t for t in run.results if t.requires_grad]
        if not roots:
            return 0.0
        if self.grads is None:
            self.grads = [torch.randn_like(t) for t in roots]
        timer = self.ops.timer()
        timer.start()
        torch.autograd.backward(roots, self.grads, inputs=self.grad_inputs or None)
        backward_ms = timer.stop()
        for tensor in self.grad_inputs:
            tensor.grad = None
        return backward_ms

    def record(self) -> _Measure:
        """One untimed forward and backward under ``saved_tensors_hooks``: what is saved, what
        the output is."""
        saved: dict[int, int] = {}

        def pack(tensor: Tensor) -> Tensor:
            ptr, nbytes = _storage(tensor)
            saved[ptr] = max(saved.get(ptr, 0), nbytes)
            return tensor

        run = self.forward(pack)
        self.backward(run)
        output, stashed = run.output, run.stashed
        inputs = {_storage(t)[0] for t in _tensors(run.args)}
        pops = {_storage(t)[0] for t in run.popped.values()}
        outputs = dict(map(_storage, _tensors(output)))
        new_outputs = set(outputs) - inputs
        return _Measure(
            forward=Stat(0.0, 0.0, 0.0, 0), backward=Stat(0.0, 0.0, 0.0, 0),
            output_bytes=sum(_nbytes(t) for t in _tensors(output)),
            stash_bytes={str(k): _nbytes(t) for k, t in stashed.items()},
            internal_saved=sum(n for ptr, n in saved.items()
                               if ptr not in self.state_storages | inputs | pops | set(outputs)),
            saves_input=bool(inputs & set(saved)),
            saves_output=bool(new_outputs & set(saved)),
            aliases_input=bool(inputs & set(outputs)),
            new_output_storage=sum(outputs[ptr] for ptr in new_outputs),
            output=_map_tensors(output, lambda t: t.detach()),
            stashed={k: t.detach() for k, t in stashed.items()},
        )


def _leaf(tensor: Tensor, requires_grad: bool) -> Tensor:
    return tensor.detach().requires_grad_(requires_grad and tensor.is_floating_point())


def _stat(times: Sequence[float]) -> Stat:
    return Stat(float(statistics.median(times)), float(min(times)), float(max(times)), len(times))


def _tensors(value: Any) -> list[Tensor]:
    """The tensors in a layer's output or arguments (a tensor, or nested tuples/lists/dicts)."""
    if isinstance(value, Tensor):
        return [value]
    if isinstance(value, (tuple, list)):
        return [t for item in value for t in _tensors(item)]
    if isinstance(value, dict):
        return [t for item in value.values() for t in _tensors(item)]
    return []


def _map_tensors(value: Any, fn: Callable[[Tensor], Tensor]) -> Any:
    if isinstance(value, Tensor):
        return fn(value)
    if isinstance(value, (tuple, list)):
        return type(value)(_map_tensors(item, fn) for item in value)
    if isinstance(value, dict):
        return {key: _map_tensors(item, fn) for key, item in value.items()}
    return value


def _storage(tensor: Tensor) -> tuple[int, int]:
    storage = tensor.untyped_storage()
    return storage.data_ptr(), storage.nbytes()


def _nbytes(tensor: Tensor) -> int:
    return tensor.nelement() * tensor.element_size()


def _per_sample(nbytes: int, size: int) -> int:
    return math.ceil(nbytes / size)


# --- from measurements to LayerProfiles ------------------------------------------------------

def _attribute(measures: list[_Measure]) -> list[int]:
    """Saved bytes per layer, each boundary tensor counted once, with the layer that made it.

    A tensor between layers i and i+1 may be saved by i (ReLU saves its output), by i+1 (a
    Linear saves its input) or both; in-place and view layers pass the same storage on.  The
    profiler ran each layer on its own copy of its input, so the sharing is rebuilt here from
    each layer's flags.  The chain's own input belongs to nobody (the planner adds stage inputs).
    """
    saved = [m.internal_saved for m in measures]
    counted = [False] * len(measures)
    producer: int | None = None
    for index, measure in enumerate(measures):
        if measure.saves_input and producer is not None:
            counted[producer] = True
        if not measure.aliases_input:
            producer = index
            counted[index] = counted[index] or measure.saves_output
    return [n + (measures[i].new_output_storage if counted[i] else 0) for i, n in enumerate(saved)]


def _layer_profile(layer: Layer, index: int, by_size: dict[int, list[_Measure]],
                   saved: dict[int, list[int]]) -> LayerProfile:
    largest = max(by_size)
    top = by_size[largest][index]
    params = _unique(layer.module.parameters())
    return LayerProfile(
        name=layer.name,
        type=type(layer.module).__name__,
        forward={b: m[index].forward for b, m in by_size.items()},
        backward={b: m[index].backward for b, m in by_size.items()},
        output_bytes=_per_sample(top.output_bytes, largest),
        saved_bytes={b: counts[index] for b, counts in saved.items()},
        param_bytes=sum(_nbytes(p) for p in params),
        buffer_bytes=sum(_nbytes(t) for t in _unique(layer.module.buffers())),
        param_count=sum(p.nelement() for p in params),
        stash=[str(k) for k in layer.stash],
        pop=[str(k) for k in layer.pop],
        stash_bytes={name: _per_sample(n, largest) for name, n in top.stash_bytes.items()},
    )


def _unique(tensors: Iterator[Tensor]) -> list[Tensor]:
    return list({id(t): t for t in tensors}.values())


# --- copies between devices ------------------------------------------------------------------

def measure_copies(devices: Sequence[torch.device], sizes: Sequence[int] = DEFAULT_COPY_SIZES,
                   repeats: int = 5, warmup: int = 2, progress: Progress | None = None) -> list[CopyFit]:
    """Time ``tensor.to(dst)`` for every ordered pair of distinct device entries and fit each.

    Two ``cpu`` entries are different pipeline devices sharing one memory: the runtime does
    not copy between them, and the fit measured here is about zero, as it should be.
    """
    fits = []
    for i, src in enumerate(devices):
        for j, dst in enumerate(devices):
            if i == j:
                continue
            points = []
            for nbytes in sizes:
                points.extend((nbytes, ms) for ms in _time_copy(src, dst, nbytes, repeats, warmup))
                if progress is not None:
                    progress.step(f"copy {i}->{j} {nbytes} B")
            fits.append(fit_copy(i, j, points))
    return fits


def _time_copy(src: torch.device, dst: torch.device, nbytes: int, repeats: int, warmup: int) -> list[float]:
    source, target = ops_for(src), ops_for(dst)
    tensor = torch.empty(nbytes, dtype=torch.uint8, device=src)
    clock = target if dst.type == "cuda" else source
    times = []
    for run in range(warmup + repeats):
        source.synchronize()
        timer = clock.timer()
        timer.start()
        source.copy_to(tensor, target, None)
        target.synchronize()
        elapsed = timer.stop()
        if run >= warmup:
            times.append(elapsed)
    return times


def fit_copy(src: int, dst: int, points: Sequence[tuple[int, float]]) -> CopyFit:
    """Least-squares fit of ``ms = latency_ms + bytes * ms_per_byte`` with both terms >= 0.

    Bytes are scaled to MiB for the solve so the two columns are of similar magnitude.
    """
    if len({b for b, _ in points}) < 2:
        raise ValueError(f"a copy fit needs points at two or more sizes, got {list(points)}")
    design = np.array([[1.0, b / MiB] for b, _ in points])
    times = np.array([ms for _, ms in points])
    (latency, per_mib), _ = nnls(design, times)
    return CopyFit(src, dst, float(latency), float(per_mib) / MiB, [(int(b), float(ms)) for b, ms in points])
