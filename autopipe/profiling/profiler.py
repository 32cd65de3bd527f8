"""``autopipe.profile``: measure each layer's forward and backward time and bytes, and copy costs.

Each layer is timed alone on ``devices[0]`` with its real input, so the planner can price any
split at any micro-batch size.  Forward and backward are timed separately because a pipeline
balances them separately; timings are medians after warm-up, with min and max kept so noise is
visible.  How a pass is timed follows how a pipeline trains:

- in training order: one pass runs every layer forward in chain order, then every layer
  backward in reverse order, so a layer meets the caches as in training (its weights cold after
  the layers before it; in backward, its saved tensors long evicted);
- under load on two or more CPU devices: a twin of the chain trains on another thread meanwhile
  (:mod:`._load`), because such devices are cores sharing caches and memory bandwidth and a
  pipeline's stages run side by side nearly all the time;
- sizes in turns, pass by pass (the twin follows), so that a drift in machine speed over minutes
  hits every size alike.

What each of these changed in measured profiles and plans is in ``profiles/README.md``.  This
module keeps the entry and the model's state; the layer runs, the load, the byte attribution and
the copy timing are in the private modules beside it.
"""
from __future__ import annotations

import contextlib
import statistics
from dataclasses import dataclass
from typing import Any, Iterator, Sequence

import torch
from torch import Tensor, nn

from ..device import MATERIALIZE, DeviceOps, meta_tensor, ops_for, resolve_devices
from .._checks import is_positive_int
from ..errors import DeviceError, OptionError, raised_by_model
from ..model import Layer, layer_chain, sample_arguments
from ..model.fingerprint import environment_fingerprint, model_fingerprint
from ..model.layers import training_modes
from ._attribution import layer_profiles, per_sample
from ._copies import DEFAULT_COPY_SIZES, fit_copy, measure_copies
from ._layer_runs import LayerRun, Measure, nbytes, record_size
from ._load import Load, time_passes
from ._progress import Progress
from ._reduction import measure_reduction
from .profiles import Profile, Stat

__all__ = ["profile", "sample_tensors", "check_sample", "fit_copy", "measure_copies",
           "DEFAULT_COPY_SIZES"]


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
    """Profile ``model``'s layer chain (or a given list of layers) on ``devices[0]``, the
    copies between ``devices`` and the gradient reduction between replicas on them.

    The chain makes ``warmup`` untimed then ``repeats`` timed training passes per size, in
    the modes it trains with (forward in order, backward in reverse; each layer timed alone),
    the sizes taking turns pass by pass: a model in train mode keeps each module's own flag (a
    frozen batch norm stays in eval), one in eval mode (or a list of layers all in eval mode)
    runs every module in train mode.  The model comes back as it was: same mode, parameters, buffers
    (BatchNorm running statistics), ``.grad`` and random-number state.

    Args:
        model: a model :func:`autopipe.layer_chain` reads, or a list of layers.
        sample_input: one full batch (a tensor, a tuple of tensors passed as the first
            layer's arguments, or a mapping of keyword arguments for a model captured with
            them, e.g. a transformers model's ``{"input_ids": ids}``), batch dimension first;
            its batch is ``Profile.batch_size``.
        devices: devices, a count, or ``None`` for every CUDA device (else two CPU devices);
            layers are timed on the first.
        batch_sizes: micro-batch sizes to measure; default: the powers of two below the batch,
            and the batch itself (a default size a layer cannot train at is left out).
        warmup: untimed passes per size.
        repeats: timed passes per size (the median is kept).
        copy_sizes: bytes per copy timed between every pair of devices.
        quiet: no progress bar.
        under_load: time the passes while a twin of the chain trains on another thread;
            default: when ``devices`` are two or more CPU devices.  The profile's
            ``environment["timed_under_load"]`` records which.

    Returns:
        The :class:`Profile`.

    Raises:
        Exception: a layer's own exception, as its own type (a ``torch.OutOfMemoryError``
            stays one), when it fails at some micro-batch size; a note names the layer, the
            size and whether in forward or backward.
        ChainError: the model is not an ``nn.Module`` or cannot be read as a chain of layers.
        OptionError: ``sample_input`` is not a tensor or a tuple of tensors of one batch size, or
            ``batch_sizes``, ``copy_sizes``, ``warmup`` or ``repeats`` is out of range.
        DeviceError: a device does not exist or is the ``meta`` device, or the model's parameters
            or buffers are on the ``meta`` device.
    """
    resolved = resolve_devices(devices)
    _check_with_data(resolved)
    layers = layer_chain(model, sample_input)
    inputs = sample_tensors(layers, sample_input)
    batch = inputs[0].shape[0]
    sizes = _batch_sizes(batch_sizes, batch)
    _check_counts(warmup, repeats, copy_sizes, len(resolved))
    if under_load is None:
        under_load = len(resolved) > 1 and all(d.type == "cpu" for d in resolved)
    root = model if isinstance(model, nn.Module) else _holder(layers)
    pairs = [(i, j) for i in range(len(resolved)) for j in range(len(resolved)) if i != j]
    progress = Progress(len(sizes) * (len(layers) + warmup + repeats) + len(pairs) * len(copy_sizes),
                        "profiling", not quiet)
    try:
        ops = ops_for(resolved[0])
        with _untouched(root, resolved[0], resolved):
            by_size = _profile_sizes(layers, inputs, sizes, batch_sizes is None, ops,
                                     _Timing(warmup, repeats, under_load), progress)
        copies = measure_copies(resolved, copy_sizes, repeats, warmup, progress)
        reductions = measure_reduction(resolved, repeats=repeats, warmup=warmup)
    finally:
        progress.close()
    return Profile(
        model=model_fingerprint(layers),
        environment={**environment_fingerprint(resolved), "timed_under_load": under_load},
        devices=[str(d) for d in resolved],
        **_sample_form(inputs),
        input_bytes=sum(per_sample(nbytes(t), batch) for t in inputs),
        batch_size=batch,
        batch_sizes=list(by_size),
        layers=layer_profiles(layers, by_size),
        copies=copies,
        reductions=reductions,
    )


def _holder(layers: Sequence[Layer]) -> nn.Module:
    """One module holding ``layers``, in eval mode only if every layer is: a list is profiled in
    the modes its model would be."""
    holder = nn.ModuleList(layer.module for layer in layers)
    holder.training = any(layer.module.training for layer in layers)
    return holder


@dataclass(frozen=True)
class _Timing:
    """How layers are timed: untimed and timed passes per size, and whether under load."""

    warmup: int
    repeats: int
    under_load: bool


def _profile_sizes(layers: list[Layer], inputs: tuple[Tensor, ...], sizes: list[int], defaulted: bool,
                   ops: DeviceOps, timing: _Timing, progress: Progress) -> dict[int, list[Measure]]:
    """Measure every size.  With the default sizes, a small size that a layer cannot train at
    (batch norm needs more than one value per channel) is left out rather than failing the
    whole profile, and so is every size below it: the planner prices micro-batches between two
    profiled sizes, so one that ran below a size that failed (a size of 1 broadcasting where 2
    and 4 fail) would let it choose micro-batches the model cannot run."""
    recorded: dict[int, tuple[list[LayerRun], list[Measure]]] = {}
    for b in sizes:
        try:
            recorded[b] = record_size(layers, first_samples(inputs, b, ops.device), ops, progress)
        except Exception as error:
            if not raised_by_model(error) or not defaulted or b == sizes[-1]:
                raise
            recorded.clear()
    runs = {b: size_runs for b, (size_runs, _) in recorded.items()}
    with Load(runs) if timing.under_load else contextlib.nullcontext() as load:
        timed = time_passes(runs, timing.warmup, timing.repeats, progress, load)
    for b, (_, measures) in recorded.items():
        for measure, forward_ms, backward_ms in zip(measures, *timed[b]):
            measure.forward, measure.backward = _stat(forward_ms), _stat(backward_ms)
    return {b: measures for b, (_, measures) in recorded.items()}


# --- input checks ---------------------------------------------------------------------------

def sample_tensors(layers: Sequence[Layer], sample_input: Any) -> tuple[Tensor, ...]:
    """``sample_input`` as the first layer's input tensors (one batch size, at least 1)."""
    return _as_inputs(sample_arguments(layers, sample_input))


def check_sample(profile: Profile, inputs: tuple[Tensor, ...]) -> None:
    """Refuse a sample batch whose samples are not of the shape and dtype ``profile`` measured:
    a plan made from it would price other layer times and sizes, and the pipeline then fails
    (or runs slower than planned) on the real batch."""
    form = _sample_form(inputs)
    measured = {"input_shape": profile.input_shape, "input_dtype": profile.input_dtype}
    if form != measured:
        raise OptionError(f"sample_input has samples of shape {form['input_shape']} ({form['input_dtype']}) but the "
                          f"profile measured {profile.input_shape} ({profile.input_dtype}); pass a batch of the "
                          "profiled samples, or profile the model again with this sample")


def _sample_form(inputs: tuple[Tensor, ...]) -> dict[str, Any]:
    """One sample's shape (no batch dimension) and dtype of the first input, as a profile keeps them."""
    return {"input_shape": list(inputs[0].shape[1:]), "input_dtype": str(inputs[0].dtype).removeprefix("torch.")}


def _check_with_data(devices: list[torch.device]) -> None:
    """Refuse the ``meta`` device: profiling times the layers and counts their bytes, which
    takes devices that hold data (and a model moved to ``meta`` could not come back: its values
    would be lost)."""
    if any(d.type == "meta" for d in devices):
        raise DeviceError(f"cannot profile on the meta device (devices {[str(d) for d in devices]}): it holds "
                          "shapes without values, so there is nothing to time; profile on devices with data "
                          "(e.g. ['cpu', 'cpu'] or ['cuda:0', 'cuda:1']); the meta device is for building a "
                          "Pipeline of a model without weights (or for tests), from a profile made on real devices")


def _check_materialized(model: nn.Module) -> None:
    """Refuse a model with parameters or buffers on the ``meta`` device: profiling runs the model
    on values it does not have."""
    name = meta_tensor(model)
    if name is not None:
        raise DeviceError(f"the model's '{name}' is on the meta device (a shape without values), and profiling "
                          f"runs the model; {MATERIALIZE}, then profile it")


def _check_counts(warmup: int, repeats: int, copy_sizes: Sequence[int], devices: int) -> None:
    """Refuse pass counts and copy sizes out of range before any measuring starts: a copy fit
    between ``devices`` needs two or more sizes (a latency and a slope), found wanting only
    after every layer was timed otherwise."""
    if isinstance(warmup, bool) or not isinstance(warmup, int) or warmup < 0 or not is_positive_int(repeats):
        raise OptionError(f"need warmup >= 0 and repeats >= 1 (integers), got warmup={warmup!r}, repeats={repeats!r}")
    if not all(is_positive_int(n) for n in copy_sizes):
        raise OptionError(f"copy_sizes must be positive byte counts, got {list(copy_sizes)}")
    if devices > 1 and len(set(copy_sizes)) < 2:
        raise OptionError(f"copy_sizes needs two or more different byte counts to fit the copy time between "
                          f"{devices} devices (a latency and a cost per byte), got {list(copy_sizes)}")


def _as_inputs(sample_input: Any) -> tuple[Tensor, ...]:
    inputs = (sample_input,) if isinstance(sample_input, Tensor) else sample_input
    if not isinstance(inputs, (tuple, list)) or not inputs or not all(isinstance(t, Tensor) for t in inputs):
        raise OptionError(
            f"sample_input must be a tensor or a tuple of tensors, got {type(sample_input).__name__}; "
            "pass one full batch, e.g. torch.randn(32, 3, 128, 128)"
        )
    batches = {t.shape[0] if t.dim() > 0 else 0 for t in inputs}
    if len(batches) != 1 or 0 in batches:
        raise OptionError(
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
        raise OptionError(
            f"batch_sizes must be integers from 1 to the sample's batch size {batch}, got {list(requested)}"
        )
    return sizes


def first_samples(inputs: tuple[Tensor, ...], size: int, device: torch.device) -> tuple[Tensor, ...]:
    """The first ``size`` samples of each input on ``device``: what profiling and re-measuring
    feed the first layer at that size."""
    return tuple(t[:size].to(device) for t in inputs)


# --- keeping the model as it was ------------------------------------------------------------

@contextlib.contextmanager
def _untouched(model: nn.Module, device: torch.device, devices: list[torch.device]) -> Iterator[None]:
    """The modes it trains with (:func:`~autopipe.model.layers.training_modes`) on ``device``
    inside; afterwards the model's modes, values, device, ``.grad`` and the random state are
    what they were (profiling runs BatchNorm in training mode, which updates running statistics,
    and runs backward, which sets ``.grad``).  A model that could not come back (to be moved to
    the meta device, or from it) is refused before it is touched."""
    _check_with_data([device])
    _check_materialized(model)
    params = list(model.parameters())
    tensors = params + list(model.buffers())
    values = [t.detach().clone() for t in tensors]
    grads = [p.grad for p in params]
    home = next((t.device for t in tensors), device)
    cuda = sorted({d.index for d in devices if d.type == "cuda"})
    try:
        for p in params:
            p.grad = None
        with torch.random.fork_rng(devices=cuda), training_modes(model):
            model.to(device)
            yield
    finally:
        model.to(home)
        with torch.no_grad():
            for tensor, value in zip(tensors, values):
                tensor.copy_(value)
        for p, grad in zip(params, grads):
            p.grad = grad


def _stat(times: Sequence[float]) -> Stat:
    return Stat(float(statistics.median(times)), float(min(times)), float(max(times)), len(times))
