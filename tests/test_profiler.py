"""The profiler: exact byte counts against hand computation, in-place layers, state kept, copy fit."""
from __future__ import annotations

import argparse
import dataclasses
import json
import threading

import pytest
import torch
import torchvision
from torch import Tensor, nn

import autopipe
from autopipe.cli import profile as profile_cli
from autopipe.model import Layer, layer_chain
from autopipe.profiling.profiler import fit_copy, profile
from autopipe.profiling.profiles import Profile
from autopipe.profiling.remeasure import remeasure_memory
from autopipe.model.skip import SkipTracker, skippable, stash, use_skip_tracker
from models import Add, TiedHead

FAST = {"warmup": 0, "repeats": 1, "copy_sizes": (4096, 65536), "quiet": True}
F32 = 4


def run(model: nn.Module, sample: Tensor | tuple[Tensor, ...], sizes: list[int] | None = None, **options):
    return profile(model, sample, ["cpu", "cpu"], sizes, **{**FAST, **options})


def saved(result: Profile) -> list[dict[int, int]]:
    return [layer.saved_bytes for layer in result.layers]


# --- bytes --------------------------------------------------------------------------------------

def test_linear_bytes_by_hand() -> None:
    # Linear(5, 7) makes a (b, 7) output that the next Linear saves (for its weight gradient):
    # counted with the layer that made it.  The second Linear's input is excluded there, and its
    # own output is saved by nobody.  Parameters: (5*7 + 7) and (7*3 + 3) floats.
    result = run(nn.Sequential(nn.Linear(5, 7), nn.Linear(7, 3)), torch.randn(4, 5), [1, 4])
    first, second = result.layers
    assert (first.output_bytes, second.output_bytes) == (7 * F32, 3 * F32)
    assert saved(result) == [{1: 7 * F32, 4: 4 * 7 * F32}, {1: 0, 4: 0}]
    assert (first.param_bytes, first.param_count, first.buffer_bytes) == (42 * F32, 42, 0)
    assert (second.param_bytes, second.param_count) == (24 * F32, 24)
    assert result.input_bytes == 5 * F32 and result.input_shape == [5]


def test_conv_batchnorm_relu_bytes_by_hand() -> None:
    # Conv2d(3, 4, 3) on 8x8 → 4x6x6 = 144 floats per sample, saved by BatchNorm (its input).
    # BatchNorm saves its input (the conv's output, counted there), and creates a mean and an
    # inverse std per channel: 2 * 4 floats, whatever the batch.  ReLU saves its own output.
    result = run(nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU()), torch.randn(4, 3, 8, 8), [1, 2, 4])
    per_sample = 4 * 6 * 6 * F32
    assert [layer.output_bytes for layer in result.layers] == [per_sample] * 3
    assert saved(result) == [
        {b: b * per_sample for b in (1, 2, 4)},
        {b: 2 * 4 * F32 for b in (1, 2, 4)},
        {b: b * per_sample for b in (1, 2, 4)},
    ]
    conv, norm, _ = result.layers
    assert conv.param_bytes == (4 * 3 * 3 * 3 + 4) * F32
    assert norm.param_bytes == 2 * 4 * F32
    assert norm.buffer_bytes == 2 * 4 * F32 + 8  # running mean and var, num_batches_tracked (int64)


@skippable(stash=["skip"])
class Stash(nn.Module):
    """Stashes a new tensor: twice its input."""

    def forward(self, x: Tensor):  # type: ignore[override]
        yield stash("skip", x * 2)
        return x


def test_skip_stash_bytes_by_hand() -> None:
    result = run(nn.Sequential(nn.Linear(6, 6), Stash(), nn.Linear(6, 6), Add()), torch.randn(3, 6), [3])
    _, stasher, _, popper = result.layers
    assert (stasher.stash, stasher.stash_bytes, stasher.pop) == (["skip"], {"skip": 6 * F32}, [])
    assert (popper.pop, popper.stash_bytes) == (["skip"], {})
    # x * 2 saves nothing (a constant factor); the add saves nothing; the first Linear's output
    # passes through Stash unchanged (same storage) and is saved by the second Linear: counted
    # once, with the first Linear.
    assert saved(result) == [{3: 3 * 6 * F32}, {3: 0}, {3: 0}, {3: 0}]
    assert popper.backward[3].median_ms > 0  # the popped skip tensor's gradient is computed


class _CastsBack(nn.Module):
    """Computes in float64 and casts back to the input's dtype, which the last layer reads: a skip
    holding a ``torch.dtype``, no tensor."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(7, 7), nn.Linear(7, 7), nn.Linear(7, 3)

    def forward(self, x: Tensor) -> Tensor:
        dtype = x.dtype
        return self.c(self.b(self.a(x.double()))).to(dtype)


def test_a_skip_holding_no_tensor_profiles_with_no_bytes_and_partitions() -> None:
    """The profiler took every skip for a tensor (an AttributeError reported as the layer's
    failure): a skip holding ``x.dtype`` has no bytes and no gradient, and partition gives the
    model's output and gradients."""
    torch.manual_seed(0)
    model = _CastsBack().double()
    x = torch.randn(8, 7)
    result = run(model, x, [8])
    assert [layer.stash_bytes for layer in result.layers] == [{"getattr_1->c@_CastsBack": 0}, {}, {}]
    pipe = autopipe.partition(model, x, ["cpu", "cpu"], chunks=2, replicas=1, quiet=True)
    out = pipe(x)
    out.square().sum().backward()
    grads = {name: p.grad for name, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    want = model(x)
    want.square().sum().backward()
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, want)
    for name, param in model.named_parameters():
        torch.testing.assert_close(grads[name], param.grad, msg=name)


def whole_chain_saved_bytes(model: nn.Sequential, x: Tensor) -> int:
    """Reference: run the whole model once and count distinct saved storages, minus parameters,
    buffers and the input."""
    excluded = {t.untyped_storage().data_ptr() for t in [*model.parameters(), *model.buffers(), x]}
    storages: dict[int, int] = {}

    def pack(t: Tensor) -> Tensor:
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(x)
    return sum(n for ptr, n in storages.items() if ptr not in excluded)


def test_saved_bytes_add_up_to_the_whole_chain() -> None:
    model = nn.Sequential(
        nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU(inplace=True), nn.MaxPool2d(2),
        nn.Conv2d(4, 4, 1), nn.ReLU(), nn.Flatten(), nn.Linear(36, 5), nn.ReLU(inplace=True),
        nn.Linear(5, 2),
    )
    x = torch.randn(4, 3, 8, 8)
    result = run(model, x, [4])
    assert sum(layer.saved_bytes[4] for layer in result.layers) == whole_chain_saved_bytes(model, x.clone())


class Residual(nn.Module):
    """Captured as a (stashes x), b (passes a's output on beside a new one), c (pops x), d."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c, self.d = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 4)

    def forward(self, x: Tensor) -> Tensor:
        h = self.a(x)
        return self.d(self.c(torch.relu(self.b(h))) + h + x)


class Concat(nn.Module):
    """Captured with layers passing earlier outputs on to a final concatenation."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c, self.d = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(32, 4)

    def forward(self, x: Tensor) -> Tensor:
        a = self.a(x)
        b = self.b(a)
        return self.d(torch.cat([x, a, b, self.c(b)], dim=1))


class TwoNewOutputs(nn.Module):
    """Captured as a, b, c: b returns two new tensors (y, h), and only h is saved (by c)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x: Tensor) -> Tensor:
        h = self.a(x)
        y = self.b(h)
        h = h * 1
        h += y
        return self.c(h) + y


class RelayedInput(nn.Module):
    """The second input needs no gradient and is passed on by the first layer: ``b * y`` then
    keeps ``y`` only, not ``b``."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 3)

    def forward(self, x: Tensor, y: Tensor) -> Tensor:
        return self.c(self.b(self.a(x)) * y)


def chain_saved_bytes(layers: list[Layer], inputs: tuple[Tensor, ...]) -> int:
    """Reference: run the chain as one graph (skips through a tracker) and count the distinct
    storages autograd saves, minus parameters, buffers, the chain's inputs and popped skips
    (the profile counts those with ``stash_bytes``)."""
    state = [t for layer in layers for t in [*layer.module.parameters(), *layer.module.buffers()]]
    excluded = {t.untyped_storage().data_ptr() for t in [*state, *inputs]}
    storages: dict[int, int] = {}

    def pack(t: Tensor) -> Tensor:
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    tracker, args = SkipTracker(), inputs
    with use_skip_tracker(tracker), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        for layer in layers:
            excluded |= {tracker.tensors[key].untyped_storage().data_ptr() for key in layer.pop}
            args = (layer.module(*args),)
    return sum(n for ptr, n in storages.items() if ptr not in excluded)


@pytest.mark.parametrize("make, shape", [
    (lambda: nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 3)), [(8,)]),
    (lambda: torchvision.models.resnet18(num_classes=3), [(3, 32, 32)]),
    (Residual, [(8,)]),
    (Concat, [(8,)]),
    (TwoNewOutputs, [(8,)]),
    (RelayedInput, [(8,), (8,)]),
], ids=["sequential", "resnet18", "residual", "cat", "two-new-outputs", "relayed-input"])
def test_saved_bytes_add_up_to_what_autograd_saves_over_the_chain(make, shape) -> None:
    torch.manual_seed(0)
    model = make()
    inputs = tuple(torch.randn(4, *s) for s in shape)
    layers = autopipe.chain(model, inputs if len(inputs) > 1 else inputs[0])
    result = run(layers, inputs if len(inputs) > 1 else inputs[0], [2, 4])
    for b in (2, 4):
        truth = chain_saved_bytes(layers, tuple(t[:b].clone() for t in inputs))
        assert sum(layer.saved_bytes[b] for layer in result.layers) == truth


def test_a_value_passed_on_beside_new_ones_is_counted_once_with_its_maker() -> None:
    # Residual: a makes h (saved by b's Linear); b makes relu(y) (saved by ReLU and c's Linear)
    # and passes h on; c makes c(relu(y)) + h + x (saved by d's Linear); d's output is saved by
    # nobody.  Each is 8 floats per sample.
    result = run(autopipe.chain(Residual(), torch.randn(4, 8)), torch.randn(4, 8), [1, 4])
    assert [layer.name for layer in result.layers] == ["a", "b", "c", "d"]
    assert saved(result) == [{b: b * 8 * F32 for b in (1, 4)}] * 3 + [{1: 0, 4: 0}]


def test_of_two_new_outputs_only_the_saved_one_is_counted() -> None:
    # a makes h (saved by b's Linear); b makes y (saved by nobody: the adds keep nothing) and
    # h * 1 + y (saved by c's Linear); c keeps nothing.  8 floats per sample each.
    result = run(autopipe.chain(TwoNewOutputs(), torch.randn(4, 8)), torch.randn(4, 8), [1, 4])
    assert [layer.name for layer in result.layers] == ["a", "b", "c"]
    assert saved(result) == [{b: b * 8 * F32 for b in (1, 4)}] * 2 + [{1: 0, 4: 0}]
    # b's output is half saved: not "among the saved bytes" as a whole
    assert [layer.output_saved for layer in result.layers] == [True, False, False]


# --- in-place layers ----------------------------------------------------------------------------

def test_inplace_relu_first_middle_and_last() -> None:
    model = nn.Sequential(nn.ReLU(inplace=True), nn.Linear(4, 6), nn.ReLU(inplace=True), nn.Linear(6, 3),
                          nn.ReLU(inplace=True))
    x = torch.randn(2, 4)
    before = x.clone()
    result = run(model, x, [1, 2], repeats=2)
    assert torch.equal(x, before)  # the in-place first layer did not touch the caller's input
    # Each in-place ReLU saves its result, which is its input's storage: the Linear before it.
    assert saved(result) == [{1: 0, 2: 0}, {1: 6 * F32, 2: 12 * F32}, {1: 0, 2: 0}, {1: 3 * F32, 2: 6 * F32},
                             {1: 0, 2: 0}]
    relu_first, _, relu_middle, _, relu_last = result.layers
    assert relu_first.backward[2].median_ms == 0.0  # nothing upstream needs a gradient
    assert relu_middle.backward[2].median_ms > 0 and relu_last.backward[2].median_ms > 0
    assert all(layer.forward[2].repeats == 2 for layer in result.layers)


# --- timings, sizes, inputs -----------------------------------------------------------------------

def test_default_batch_sizes_and_stats() -> None:
    result = run(nn.Sequential(nn.Linear(3, 3)), torch.randn(6, 3), repeats=3)
    assert result.batch_size == 6 and result.batch_sizes == [1, 2, 4, 6]
    for stat in result.layers[0].forward.values():
        assert 0 < stat.min_ms <= stat.median_ms <= stat.max_ms and stat.repeats == 3
    assert run(nn.Sequential(nn.Linear(3, 3)), torch.randn(8, 3)).batch_sizes == [1, 2, 4, 8]


@pytest.mark.parametrize("sizes", [[0, 2], [9], [2.0]])
def test_bad_batch_sizes_are_named(sizes: list) -> None:
    with pytest.raises(ValueError, match="batch_sizes must be integers from 1 to the sample's batch size 8"):
        run(nn.Sequential(nn.Linear(3, 3)), torch.randn(8, 3), sizes)


class Pair(nn.Module):
    def forward(self, a: Tensor, b: Tensor) -> Tensor:
        return a * b


def test_tuple_input_goes_to_the_first_layer() -> None:
    result = run(nn.Sequential(Pair(), nn.Linear(3, 2)), (torch.randn(4, 3), torch.randn(4, 3)), [4])
    assert result.input_bytes == 2 * 3 * F32 and result.layers[0].output_bytes == 3 * F32


def test_failing_layer_is_named() -> None:
    with pytest.raises(RuntimeError, match="mat1 and mat2 shapes cannot be multiplied") as failed:
        run(nn.Sequential(nn.Linear(3, 4), nn.Linear(5, 2)), torch.randn(2, 3))
    assert failed.value.__notes__ == [
        "autopipe: raised by layer '1' (Linear) in forward at micro-batch size 2, while profiling it"]
    with pytest.raises(TypeError, match="sample_input must be a tensor or a tuple of tensors"):
        run(nn.Sequential(nn.Linear(3, 4)), [[1.0, 2.0]])


class Boom(Exception):
    """A model's own exception class."""


class Raises(nn.Module):
    """Raises ``error`` (the very object) in its forward, or in its backward if ``in_backward``."""

    def __init__(self, error: Exception, in_backward: bool = False) -> None:
        super().__init__()
        self.error, self.in_backward = error, in_backward

    def forward(self, x: Tensor) -> Tensor:
        if not self.in_backward:
            raise self.error
        y = x * 2
        y.register_hook(self._raise)
        return y

    def _raise(self, grad: Tensor) -> Tensor:
        raise self.error


@pytest.mark.parametrize("make", [lambda: Boom("no"), lambda: KeyError("missing"),
                                  lambda: torch.OutOfMemoryError("out of memory")])
@pytest.mark.parametrize("phase", ["forward", "backward"])
def test_a_layers_own_exception_reaches_the_caller_as_itself(make, phase: str) -> None:
    """``except torch.OutOfMemoryError`` around profiling catches a layer's OOM: the layer's
    exception is raised as itself, a note naming the layer, the phase and the size."""
    error = make()
    model = nn.Sequential(nn.Linear(3, 3), Raises(error, in_backward=phase == "backward"), nn.Linear(3, 2))
    with pytest.raises(type(error)) as failed:
        run(model, torch.randn(4, 3), [2, 4])
    assert failed.value is error
    assert error.__notes__ == [f"autopipe: raised by layer '1' (Raises) in {phase} at micro-batch size 2, "
                               "while profiling it"]


class OffMainThread(nn.Module):
    """Fails where the twin chain of the load runs it: on another thread."""

    def forward(self, x: Tensor) -> Tensor:
        if threading.current_thread() is not threading.main_thread():
            raise Boom("not on the main thread")
        return x * 2


def test_a_layer_failing_in_the_load_reaches_the_caller_as_itself() -> None:
    model = nn.Sequential(nn.Linear(3, 3), OffMainThread())
    with pytest.raises(Boom, match="not on the main thread") as failed:
        run(model, torch.randn(2, 3), [2])
    assert failed.value.__notes__ == [
        "autopipe: raised by layer '1' (OffMainThread) in forward at micro-batch size 2, while profiling it"]


def test_torchvision_resnet_profiles() -> None:
    model = torchvision.models.resnet18(num_classes=10)
    result = run(model, torch.randn(2, 3, 32, 32), [2])
    assert [layer.name for layer in result.layers][-3:] == ["avgpool", "flatten", "fc"]
    assert result.layers[-1].output_bytes == 10 * F32
    assert sum(layer.param_count for layer in result.layers) == sum(p.numel() for p in model.parameters())


# --- the model is left as it was ------------------------------------------------------------------

def test_profiling_leaves_model_state_unchanged() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Dropout(0.5), nn.Linear(4, 2))
    model.eval()
    model[1].train()  # a mixed mode must come back as it was
    model(torch.randn(8, 4)).sum().backward()
    grads = [p.grad for p in model.parameters()]
    grad_values = [g.clone() for g in grads]
    state = {k: v.clone() for k, v in model.state_dict().items()}
    sample = torch.randn(8, 4)
    rng = torch.get_rng_state()
    run(model, sample, [4, 8], repeats=2)
    assert [m.training for m in model.modules()] == [False, False, True, False, False]
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in state.items())
    assert all(p.grad is g and torch.equal(g, v) for p, g, v in zip(model.parameters(), grads, grad_values))
    assert torch.equal(torch.get_rng_state(), rng)


@pytest.mark.parametrize("devices", [["meta"], ["cpu", "meta"], ["meta", "cpu"]])
def test_the_meta_device_is_refused_and_the_model_kept(devices: list[str]) -> None:
    """Profiling times layers and counts bytes on devices with data; a model moved to the meta
    device could not come back (its weights were lost)."""
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    state = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(autopipe.DeviceError, match=r"cannot profile on the meta device .*profile on devices with "
                                                   r"data .*the meta device is for building a Pipeline"):
        profile(model, torch.randn(4, 4), devices, **FAST)
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in state.items())
    with pytest.raises(autopipe.DeviceError, match="cannot profile on the meta device"):
        autopipe.partition(model, torch.randn(4, 4), devices=devices)
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in state.items())


def test_a_model_with_meta_weights_is_refused_and_its_other_weights_kept() -> None:
    model = nn.Sequential(nn.Linear(4, 4, device="meta"), nn.Linear(4, 2))
    weight = model[1].weight.detach().clone()
    with pytest.raises(autopipe.DeviceError, match=r"the model's '0.weight' is on the meta device .*"
                                                   r"materialize it first \(model.to_empty"):
        run(model, torch.randn(4, 4))
    assert torch.equal(model[1].weight, weight)


def test_measuring_bytes_again_on_the_meta_device_is_refused_and_the_model_kept() -> None:
    """A profile file naming the meta device (edited by hand) does not move the model there."""
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    measured = profile(model, torch.randn(4, 4), ["cpu"], [4], **FAST)
    weight = model[0].weight.detach().clone()
    with pytest.raises(autopipe.DeviceError, match="cannot profile on the meta device"):
        remeasure_memory(dataclasses.replace(measured, devices=["meta"]), model, torch.randn(4, 4), quiet=True)
    assert torch.equal(model[0].weight, weight)


class ReentrantCheckpointed(nn.Module):
    """A linear layer under ``checkpoint(..., use_reentrant=True)``, which refuses a backward
    limited by ``inputs=``."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.linear = nn.Linear(width, width)

    def forward(self, x: Tensor) -> Tensor:
        return torch.utils.checkpoint.checkpoint(lambda t: torch.tanh(self.linear(t)), x, use_reentrant=True)


def test_a_reentrant_checkpoint_layer_profiles_and_leaves_no_grad() -> None:
    model = nn.Sequential(nn.Linear(8, 8), ReentrantCheckpointed(8), nn.Linear(8, 2))
    result = run(model, torch.randn(8, 8), [4, 8])  # two CPU devices: timed under a twin's load too
    assert all(layer.backward[b].median_ms > 0 for layer in result.layers for b in (4, 8))
    assert all(p.grad is None for p in model.parameters())


@pytest.mark.parametrize("as_list", [False, True])
def test_profiling_runs_each_module_in_the_mode_it_trains_with(as_list: bool) -> None:
    """A batch norm frozen in a training model (``model.bn.eval()``) is profiled in eval mode, as
    it trains; a model in eval mode (or a list of layers all in eval mode) is profiled as
    ``model.train()`` sets it."""
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Linear(4, 2))
    seen: list[bool] = []
    model[1].register_forward_hook(lambda module, args, out: seen.append(module.training))
    for frozen, expected in ((model[1], False), (model, True)):
        frozen.eval()
        seen.clear()
        run(layer_chain(model) if as_list else model, torch.randn(8, 4), [8], repeats=1)
        assert seen and set(seen) == {expected}
        assert not model[1].training


def test_a_spectral_norm_a_forward_has_run_profiles_under_load() -> None:
    """The load's twin chain is a deep copy of the layers: a spectral norm already run holds
    its computed ``weight`` (an autograd non-leaf), which ``copy.deepcopy`` refuses."""
    model = nn.Sequential(nn.utils.spectral_norm(nn.Linear(4, 8)), nn.Tanh(), nn.Linear(8, 2))
    model(torch.randn(2, 4))
    result = run(model, torch.randn(4, 4), [2])
    assert [layer.name for layer in result.layers] == ["0", "1", "2"]
    assert result.layers[0].param_bytes == (4 * 8 + 8) * F32


def test_a_layer_list_profiles_like_its_model_and_comes_back_unchanged() -> None:
    model = nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6), nn.Linear(6, 2))
    state = {k: v.clone() for k, v in model.state_dict().items()}
    from_model = run(model, torch.randn(8, 4), [8], repeats=1)
    from_list = run(layer_chain(model), torch.randn(8, 4), [8], repeats=1)
    assert [x.name for x in from_list.layers] == [x.name for x in from_model.layers] == ["0", "1", "2"]
    assert from_list.model == from_model.model
    assert saved(from_list) == saved(from_model)
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in state.items())


# --- copies -----------------------------------------------------------------------------------------

def test_copy_fit_recovers_known_latency_and_bandwidth() -> None:
    latency_ms, gib_per_s = 0.02, 12.0
    ms_per_byte = 1e3 / (gib_per_s * 2**30)
    sizes = [2**12, 2**16, 2**20, 2**24]
    exact = fit_copy(0, 1, [(n, latency_ms + n * ms_per_byte) for n in sizes])
    assert exact.latency_ms == pytest.approx(latency_ms, rel=1e-9)
    assert exact.ms_per_byte == pytest.approx(ms_per_byte, rel=1e-9)
    noisy = [(n, (latency_ms + n * ms_per_byte) * (1 + e)) for n in sizes for e in (-0.02, 0.02)]
    fit = fit_copy(0, 1, noisy)
    assert fit.latency_ms == pytest.approx(latency_ms, rel=0.05)
    assert fit.ms_per_byte == pytest.approx(ms_per_byte, rel=0.05)
    assert fit.points == noisy


def test_copy_fit_is_never_negative() -> None:
    # A line with a negative intercept: the constrained fit clamps latency to 0.
    fit = fit_copy(1, 0, [(1000, 0.5), (2000, 1.5), (3000, 2.5)])
    assert fit.latency_ms == 0.0 and fit.ms_per_byte > 0
    with pytest.raises(ValueError, match="two or more sizes"):
        fit_copy(0, 1, [(1000, 0.5), (1000, 0.6)])


def test_profile_measures_every_ordered_device_pair() -> None:
    result = run(nn.Sequential(nn.Linear(2, 2)), torch.randn(1, 2), repeats=3)
    assert result.devices == ["cpu", "cpu"]
    assert [(fit.src, fit.dst) for fit in result.copies] == [(0, 1), (1, 0)]
    assert all(sorted({n for n, _ in fit.points}) == [4096, 65536] and len(fit.points) == 6
               for fit in result.copies)
    assert result.model["layers"][0]["name"] == "0" and result.environment["threads"] == 1


def test_progress_bar_only_when_not_quiet(capsys: pytest.CaptureFixture[str]) -> None:
    run(nn.Sequential(nn.Linear(2, 2)), torch.randn(2, 2))
    assert capsys.readouterr().err == ""
    run(nn.Sequential(nn.Linear(2, 2)), torch.randn(2, 2), quiet=False)
    assert "profiling [" in capsys.readouterr().err


# --- the command line -------------------------------------------------------------------------------

def tiny_model() -> nn.Module:
    """A factory for the ``package.module:factory`` form of MODEL."""
    return nn.Sequential(nn.Flatten(), nn.Linear(12, 5), nn.ReLU(inplace=True), nn.Linear(5, 2))


def cli(*argv: str) -> int:
    parser = argparse.ArgumentParser()
    profile_cli.add_arguments(parser)
    return profile_cli.run(parser.parse_args(list(argv)))


def test_cli_profiles_a_factory_and_saves(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "tiny.json"
    assert cli("test_profiler:tiny_model", "--input-shape", "3,2,2", "--batch-size", "6", "--batch-sizes",
               "2,6", "--warmup", "0", "--repeats", "1", "--quiet", "-o", str(out)) == 0
    printed = capsys.readouterr().out
    assert "micro-batch 6 of batch 6" in printed and f"saved {out}" in printed
    assert [line.split()[0] for line in printed.splitlines()[3:7]] == ["0", "1", "2", "3"]
    loaded = Profile.load(out)
    assert loaded.batch_sizes == [2, 6] and loaded.input_shape == [3, 2, 2]
    assert json.loads(out.read_text())["kind"] == "profile"


@pytest.mark.parametrize(("argv", "message"), [
    (["resnet18"], "MODEL must be torchvision:NAME or package.module:factory"),
    (["torchvision:nonet"], "torchvision has no model 'nonet'"),
    (["no_such_pkg_xyz.mod:f"], "cannot import 'no_such_pkg_xyz.mod'"),
    (["test_profiler:missing"], "has no callable 'missing'"),
    (["test_profiler:F32"], "has no callable 'F32'"),
    (["torchvision:resnet18", "--input-shape", "3,x"], "--input-shape expects comma-separated positive"),
    (["torchvision:resnet18", "--batch-sizes", "0,2"], "--batch-sizes expects comma-separated positive"),
])
def test_cli_bad_input_is_one_clear_error(argv: list[str], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        cli(*argv, "--quiet")


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_profile_times_on_the_gpu_and_returns_the_model() -> None:
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(inplace=True), nn.Linear(8, 2))
    result = profile(model, torch.randn(4, 8), ["cuda:0", "cuda:0"], **FAST)
    assert result.devices == ["cuda:0", "cuda:0"] and len(result.copies) == 2
    assert all(layer.forward[4].median_ms > 0 for layer in result.layers)
    assert all(p.device.type == "cpu" for p in model.parameters())


def test_default_sizes_leave_out_a_size_batch_norm_cannot_train_at() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
    assert run(model, torch.randn(4, 4)).batch_sizes == [2, 4]
    with pytest.raises(ValueError, match="Expected more than 1 value per channel") as failed:
        run(model, torch.randn(4, 4), [1, 4])
    assert failed.value.__notes__ == [
        "autopipe: raised by layer '1' (BatchNorm1d) in forward at micro-batch size 1, while profiling it"]


class WholeBatch(nn.Module):
    """Runs on batches of 8, or of 1 (which broadcasts), only: a constant shaped like the sample."""

    def forward(self, x: Tensor) -> Tensor:
        return x * torch.ones(8, 8)


def test_default_sizes_leave_out_every_size_below_one_that_failed() -> None:
    """Sizes 2 and 4 fail where 1 runs: keeping 1 would let the planner price micro-batches of
    2 to 7 between 1 and 8, which fail; only 8 is kept."""
    model = nn.Sequential(nn.Linear(8, 8), WholeBatch(), nn.Linear(8, 8))
    assert run(model, torch.randn(8, 8)).batch_sizes == [8]


# --- how layers are timed -------------------------------------------------------------------------

class Logged(nn.Module):
    """A linear layer that logs its forward and its backward (``forwards`` counts every copy's)."""

    forwards = 0

    def __init__(self, name: str, log: list[str]) -> None:
        super().__init__()
        self.name, self.log = name, log
        self.linear = nn.Linear(3, 3)

    def forward(self, x: Tensor) -> Tensor:
        type(self).forwards += 1
        self.log.append(f"F{self.name}")
        y = self.linear(x)
        y.register_hook(lambda grad: self.log.append(f"B{self.name}"))
        return y


def test_layers_are_timed_in_training_order() -> None:
    log: list[str] = []
    model = nn.Sequential(*(Logged(name, log) for name in "abc"))
    profile(model, torch.randn(2, 3), ["cpu"], [2], **FAST)
    # recorded one layer at a time, then one timed pass: all forwards, then backwards reversed
    assert log == ["Fa", "Ba", "Fb", "Bb", "Fc", "Bc", "Fa", "Fb", "Fc", "Bc", "Bb", "Ba"]


def test_several_cpu_devices_time_under_load_of_a_twin_chain() -> None:
    log: list[str] = []
    model = nn.Sequential(Logged("a", log))
    Logged.forwards = 0
    alone = profile(model, torch.randn(2, 3), ["cpu"], [2], **FAST)
    assert Logged.forwards == 2 and alone.environment["timed_under_load"] is False
    Logged.forwards = 0
    loaded = profile(model, torch.randn(2, 3), ["cpu", "cpu"], [2], **FAST)
    assert Logged.forwards >= 3 and loaded.environment["timed_under_load"] is True
    assert log.count("Fa") == 4  # the twin logs to its own copy of the list
    Logged.forwards = 0
    profile(model, torch.randn(2, 3), ["cpu", "cpu"], [2], **FAST, under_load=False)
    assert Logged.forwards == 2


def test_a_skip_that_does_not_grow_with_the_batch_is_priced_per_micro_batch(tmp_path) -> None:
    """A weight stashed for a tied head measures the same bytes at every size: it is recorded as
    fixed bytes per micro-batch (per sample it was 1/b of the weight, so every micro-batch's copy
    was priced at a fraction of it), and the planner's skip is the weight's bytes at any size."""
    from autopipe.planning.cost import CostModel

    measured = profile(TiedHead(), torch.randint(0, 10, (8, 5)), ["cpu", "cpu"], batch_sizes=[2, 8],
                       warmup=0, repeats=1, quiet=True)
    weight = 10 * 8 * 4
    emb = measured.layers[0]
    assert list(emb.stash_fixed_bytes.values()) == [weight] and list(emb.stash_bytes.values()) == [0]
    loaded = Profile.load(measured.save(tmp_path / "p.json"))
    assert loaded.layers[0].stash_fixed_bytes == emb.stash_fixed_bytes
    model = CostModel(loaded, loaded.devices, [1.0, 1.0], 8, "momentum", "local")
    assert [list(model.at(b).skip_bytes) for b in (2, 8)] == [[weight], [weight]]
    document = json.loads((tmp_path / "p.json").read_text())
    del document["layers"][0]["stash_fixed_bytes"]  # a profile from before the field: per sample only
    (tmp_path / "old.json").write_text(json.dumps(document))
    assert Profile.load(tmp_path / "old.json").layers[0].stash_fixed_bytes == {}


# --- views: the storage a tensor keeps alive, each storage once ----------------------------------

class Narrow(nn.Module):
    """Returns the first 2 of 8 columns of a new (b, 8) tensor: a view keeping all 8 alive."""

    def forward(self, x: Tensor) -> Tensor:
        return (x * 2)[:, :2]


class Broadcast(nn.Module):
    """Returns a new (b, 1) column expanded to (b, 8): 8 elements per sample on 1 float's storage."""

    def forward(self, x: Tensor) -> Tensor:
        return (x[:, :1] * 2).expand(-1, 8)


class Transposed(nn.Module):
    """Passes its input on as a view: what it holds is whatever storage its input has."""

    def forward(self, x: Tensor) -> Tensor:
        return x.t().t()


class Halves(nn.Module):
    """``torch.split`` of one new (b, 8) tensor, and that tensor again transposed: three views of
    one storage."""

    def forward(self, x: Tensor) -> tuple[Tensor, ...]:
        y = x * 2
        return (*torch.split(y, 4, dim=1), y.t())


class Joined(nn.Module):
    def forward(self, halves: tuple[Tensor, ...]) -> Tensor:  # type: ignore[override]
        a, b, _ = halves
        return torch.cat([a, b], dim=1)


def test_a_view_counts_the_whole_storage_it_keeps_alive() -> None:
    # (x * 2) is 8 floats per sample; its [:, :2] view shows 2 of them and keeps all 8. Transposed
    # passes its input on: a storage the layer before holds, so its elements only (2 floats).
    result = run(nn.Sequential(nn.Linear(8, 8), Narrow(), Transposed(), nn.Linear(2, 3)), torch.randn(4, 8), [2, 4])
    assert [layer.output_bytes for layer in result.layers] == [8 * F32, 8 * F32, 2 * F32, 3 * F32]
    assert saved(result)[1] == {2: 2 * 8 * F32, 4: 4 * 8 * F32}


def test_an_expanded_output_counts_its_elements_and_holds_what_it_was_expanded_from() -> None:
    # One float per sample, seen as 8: its gradient (and a copy to another device) takes 8, so the
    # output counts 8, passed on by Transposed as it is; the Linear(8, 3) after it saves one float
    # per sample (the storage it keeps), counted with Broadcast.
    result = run(nn.Sequential(nn.Linear(8, 8), Broadcast(), Transposed(), nn.Linear(8, 3)), torch.randn(4, 8), [2, 4])
    assert [layer.output_bytes for layer in result.layers] == [8 * F32, 8 * F32, 8 * F32, 3 * F32]
    assert saved(result)[1] == {2: 2 * F32, 4: 4 * F32}


def test_tensors_sharing_a_storage_count_their_elements() -> None:
    # split's two halves and the transpose are one (b, 8) storage, but three gradients of 4, 4 and
    # 8 floats per sample (and three copies to another device): 16 floats, the larger figure.
    result = run(nn.Sequential(nn.Linear(8, 8), Halves(), Joined()), torch.randn(4, 8), [2, 4])
    assert [layer.output_bytes for layer in result.layers] == [8 * F32, 16 * F32, 8 * F32]


@skippable(stash=["skip"])
class StashNarrow(nn.Module):
    """Stashes a 2-column view of a new (b, 8) tensor: the skip keeps 8 floats per sample."""

    def forward(self, x: Tensor):  # type: ignore[override]
        yield stash("skip", (x * 2)[:, :2])
        return x


def test_a_stashed_view_counts_its_whole_storage() -> None:
    result = run(nn.Sequential(nn.Linear(8, 8), StashNarrow(), nn.Linear(8, 2), Add()), torch.randn(4, 8), [2, 4])
    assert result.layers[1].stash_bytes == {"skip": 8 * F32}


# --- outputs that do not grow with the batch -----------------------------------------------------

class WithMean(nn.Module):
    """Returns its input and the mean over the batch: 8 floats per sample plus 8 floats at any size."""

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        return x * 2, x.mean(dim=0)


class Shifted(nn.Module):
    def forward(self, pair: tuple[Tensor, Tensor]) -> Tensor:  # type: ignore[override]
        x, mean = pair
        return x - mean


class BatchMean(nn.Module):
    """Returns 8 floats whatever the batch."""

    def forward(self, x: Tensor) -> Tensor:
        return x.mean(dim=0)


def test_an_output_that_does_not_grow_with_the_batch_is_fixed_bytes(tmp_path) -> None:
    """Measured at sizes 2, 4 and 8, WithMean's output is 8 * b + 8 floats: 8 per sample and 8
    per micro-batch (per sample at 8 alone it was 9, too little at 2 or 4); BatchMean's is 8
    floats at every size, none per sample (it was 1 per sample)."""
    result = run(nn.Sequential(nn.Linear(8, 8), WithMean(), Shifted(), BatchMean()), torch.randn(8, 8), [2, 4, 8])
    assert [(layer.output_bytes, layer.output_fixed_bytes) for layer in result.layers] == \
        [(8 * F32, 0), (8 * F32, 8 * F32), (8 * F32, 0), (0, 8 * F32)]
    path = result.save(tmp_path / "p.json")
    assert Profile.load(path) == result
    document = json.loads(path.read_text())
    assert [("output_fixed_bytes" in layer) for layer in document["layers"]] == [False, True, False, True]
    for layer in document["layers"]:
        layer.pop("output_fixed_bytes", None)  # a profile from before the field
    (tmp_path / "old.json").write_text(json.dumps(document))
    assert [layer.output_fixed_bytes for layer in Profile.load(tmp_path / "old.json").layers] == [0] * 4


def test_one_size_keeps_outputs_per_sample() -> None:
    result = run(nn.Sequential(nn.Linear(8, 8), BatchMean()), torch.randn(8, 8), [8])
    assert [(layer.output_bytes, layer.output_fixed_bytes) for layer in result.layers] == [(8 * F32, 0), (F32, 0)]



class CachedTable(nn.Module):
    """Passes on a slice of its own large buffer beside its output (a rotary table's rows)."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("table", torch.randn(1000, 16))

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        return x * 2, self.table[:8]


class UsesTable(nn.Module):
    def forward(self, pair: tuple[Tensor, Tensor]) -> Tensor:  # type: ignore[override]
        x, table = pair
        return x + table.sum()


def test_a_slice_of_the_layers_own_buffer_counts_its_elements_not_the_buffer() -> None:
    """The buffer is the layer's (counted with its buffers, held once): the slice passed on adds
    its 8 x 16 floats at any micro-batch size, not the 1000-row table per micro-batch."""
    result = run(nn.Sequential(nn.Linear(8, 8), CachedTable(), UsesTable()), torch.randn(4, 8), [2, 4])
    assert (result.layers[1].output_bytes, result.layers[1].output_fixed_bytes) == (8 * F32, 8 * 16 * F32)


def test_the_profile_table_shows_output_bytes_that_do_not_grow_with_the_batch() -> None:
    result = run(nn.Sequential(nn.Linear(8, 8), WithMean(), Shifted()), torch.randn(4, 8), [2, 4])
    row = next(line for line in profile_cli.format_table(result).splitlines() if line.startswith("1 "))
    assert "32 B+32 B" in row  # 8 floats per sample, and the batch mean's 8 at any size
