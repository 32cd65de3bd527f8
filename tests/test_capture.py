"""Captured chains of non-Sequential models equal the models: run layer by layer and as pipelines."""
from __future__ import annotations

import contextlib
import copy
import operator
import re
from typing import Any, Callable

import pytest
import torch
import torchvision
from torch import Tensor, nn

import autopipe
from autopipe.model.capture import CaptureError, CapturedCallError, CapturedLayer, chain
from autopipe.model.capture._building import _pack, _unpack
from autopipe.errors import ChainError
from autopipe.model import Layer, layer_chain
from autopipe.model.skip import current_skip_tracker, verify_skippables
from autopipe.planning.solver import PlanningError
from helpers import all_splits, assert_training_matches, untimed
from models import BranchesOnBatch, BranchesOnBatchParity, StockEncoder, TiedHead, TinyTransformer, TwoBranch, UNet

VISION = (3, 32, 32)


def _vit() -> nn.Module:
    return torchvision.models.VisionTransformer(32, 8, num_layers=2, num_heads=2, hidden_dim=32, mlp_dim=64,
                                                num_classes=10)


#: name → (model factory, input shape without batch, a layer name the chain must have)
MODELS: dict[str, tuple[Callable[[], nn.Module], tuple[int, ...], str]] = {
    "resnet50": (lambda: torchvision.models.resnet50(num_classes=10), VISION, "layer1.0"),
    "densenet121": (lambda: torchvision.models.densenet121(num_classes=10), VISION,
                    "features.denseblock1.denselayer2"),
    "mobilenet_v3_small": (lambda: torchvision.models.mobilenet_v3_small(num_classes=10), VISION, "features.3"),
    "vit": (_vit, VISION, "encoder.layers.encoder_layer_1"),
    "transformer": (TinyTransformer, (6, 8), "encoder.layers.2"),
    "unet": (UNet, VISION, "up2"),
    "two_branch": (TwoBranch, (16,), "right.0"),
    "two_outputs": (lambda: TwoBranch(merge=False), (16,), "left.2"),
}


def _as_tuple(value: Any) -> tuple[Tensor, ...]:
    return value if isinstance(value, tuple) else (value,)


def _output_and_grads(run: Callable[[Tensor], Any], model: nn.Module, x: Tensor) -> tuple[tuple[Tensor, ...], dict]:
    """Output of ``run(x)`` and the gradient it leaves on each of ``model``'s parameters
    (dropout draws the same masks each time)."""
    model.zero_grad(set_to_none=True)
    torch.manual_seed(0)
    outputs = _as_tuple(run(x))
    sum(o.square().mean() for o in outputs).backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    return tuple(o.detach() for o in outputs), grads


def _assert_same(expected: tuple[tuple[Tensor, ...], dict], actual: tuple[tuple[Tensor, ...], dict]) -> None:
    """Outputs and every gradient equal within 1e-5 of the reference's largest magnitude
    (summing over micro-batches reorders float additions)."""
    (want, want_grads), (have, have_grads) = expected, actual
    assert len(want) == len(have)
    for a, b in zip(want, have):
        _assert_close(b, a, "output")
    assert want_grads.keys() == have_grads.keys() and want_grads
    for name in want_grads:
        _assert_close(have_grads[name], want_grads[name], name)


def _assert_close(actual: Tensor, expected: Tensor, what: str) -> None:
    assert actual.shape == expected.shape, what
    error = (actual - expected).abs().max().item()
    assert error <= 1e-5 * expected.abs().max().item() + 1e-7, f"{what}: max difference {error}"


def _sequential(layers: list[Layer]) -> nn.Sequential:
    return nn.Sequential(*(layer.module for layer in layers))


@pytest.mark.parametrize("name", list(MODELS))
def test_chain_run_in_sequence_equals_model(name: str) -> None:
    factory, shape, expected_layer = MODELS[name]
    model = factory()
    layers = chain(model)
    sequential = _sequential(layers)
    x = torch.randn(3, *shape)
    _assert_same(_output_and_grads(model, model, x), _output_and_grads(sequential, model, x))
    assert not current_skip_tracker().tensors, "every stash is popped"
    verify_skippables(sequential)
    assert expected_layer in [layer.name for layer in layers]
    assert all(isinstance(layer.module, CapturedLayer) and layer.state_prefix == "" for layer in layers)


@pytest.mark.parametrize("name", ["resnet50", "unet", "vit"])
def test_layers_hold_the_original_tensors_under_the_original_keys(name: str) -> None:
    model = MODELS[name][0]()
    original = model.state_dict(keep_vars=True)
    captured = {key: value for layer in chain(model) for key, value in layer.module.state_dict(keep_vars=True).items()}
    assert captured.keys() == original.keys()
    assert all(captured[key] is original[key] for key in original), "no copies of parameters or buffers"


def test_batch_dependent_sizes_follow_the_micro_batch() -> None:
    """The transformer sends its batch and length (taken from x.shape) as a skip to the layer
    that reshapes with them, and builds its causal mask from the length: any size works."""
    model = TinyTransformer()
    layers = chain(model)
    assert [str(key) for key in layers[0].stash] == [
        "getitem_1->encoder.norm@TinyTransformer", "getitem_2->encoder.norm@TinyTransformer"
    ]
    sequential = _sequential(layers)
    for batch, length in [(1, 6), (5, 4)]:
        x = torch.randn(batch, length, 8)
        _assert_same(_output_and_grads(model, model, x), _output_and_grads(sequential, model, x))


def test_encoder_outputs_skip_to_the_decoder() -> None:
    """Each encoder output goes to the pool as its main value; the pool passes it on to the
    decoder level that concatenates it."""
    layers = chain(UNet())
    routes = {(layer.name, str(key)) for layer in layers for key in layer.stash}
    pops = {(layer.name, str(key)) for layer in layers for key in layer.pop}
    assert routes == {("pool", "enc1_2->up1@UNet"), ("pool:2", "enc2_2->up2@UNet")}
    assert pops == {("up1", "enc1_2->up1@UNet"), ("up2", "enc2_2->up2@UNet")}


class Fan(nn.Module):
    """``h`` is read by three later layers, ``x`` by the last one."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c, self.d, self.e = (nn.Linear(6, 6) for _ in range(5))

    def forward(self, x: Tensor) -> Tensor:
        h = self.a(x)
        u = self.b(torch.relu(h))
        v = self.c(u) * h
        w = self.d(v) + h
        return self.e(w) * h + x


def test_value_read_by_many_layers_crosses_each_cut_once() -> None:
    """``h`` is stashed once, for its first non-adjacent reader ``c``, which passes it on to
    ``d`` and ``e`` with its main value; ``x`` skips from the first layer to the last."""
    model = Fan()
    layers = chain(model)
    assert [layer.name for layer in layers] == ["a", "b", "c", "d", "e"]
    assert [str(key) for layer in layers for key in layer.stash] == ["a->c@Fan", "x->e@Fan"]
    assert [layer.module.main_inputs for layer in layers] == [1, 1, 1, 2, 2]
    x = torch.randn(4, 6)
    _assert_same(_output_and_grads(model, model, x), _output_and_grads(_sequential(layers), model, x))


class Reused(nn.Module):
    """``inner`` is applied twice around ``middle``, and its weight again after ``last``."""

    def __init__(self) -> None:
        super().__init__()
        self.inner, self.middle, self.last, self.head = (nn.Linear(5, 5) for _ in range(4))

    def forward(self, x: Tensor) -> Tensor:
        h = self.last(self.inner(self.middle(self.inner(x))))
        return self.head(nn.functional.linear(h, self.inner.weight))


def test_layers_sharing_parameters_are_merged() -> None:
    """A parameter lives on one stage, so the layers between the calls of its module become
    one; a later read of the weight by attribute gets it as a skip (``last`` stays apart)."""
    model = Reused()
    layers = chain(model)
    assert [layer.name for layer in layers] == ["inner", "last", "head"]
    x = torch.randn(3, 5)
    _assert_same(_output_and_grads(model, model, x), _output_and_grads(_sequential(layers), model, x))
    for bounds in all_splits(3, 3):
        model = Reused()
        balance = [stop - start for start, stop in zip(bounds, bounds[1:])]
        pipe = autopipe.Pipeline(chain(model), balance=balance, devices=["cpu"] * len(balance), chunks=2)
        _assert_same(_output_and_grads(model, model, x), _output_and_grads(pipe, model, x))
        pipe.close()


class Gate(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)

    def forward(self, x: Tensor) -> Tensor:
        if x.sum() > 0:
            return self.linear(x)
        return -x


class Gated(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Linear(4, 4)
        self.blocks = nn.ModuleList([Gate(), Gate()])

    def forward(self, x: Tensor) -> Tensor:
        x = self.stem(x)
        for block in self.blocks:
            x = block(x) + x
        return x


def test_untraceable_module_names_the_operation_and_the_way_out() -> None:
    with pytest.raises(CaptureError) as caught:
        chain(Gated(), granularity="finer")
    message = str(caught.value)
    for part in ("'blocks.0' (Gate)", "`if x.sum() > 0:`", "leaf_modules=['blocks.0']", "nn.Sequential"):
        assert part in message
    model = Gated()
    layers = chain(model, granularity="finer", leaf_modules=[Gate])
    assert [layer.name for layer in layers] == ["stem", "blocks.0", "blocks.1"]
    x = torch.randn(3, 4)
    _assert_same(_output_and_grads(model, model, x), _output_and_grads(_sequential(layers), model, x))


@pytest.mark.parametrize("succeeds", [True, False])
def test_torchs_output_during_an_export_shows_only_if_it_succeeds(capsys, succeeds: bool) -> None:
    """What torch logs or prints while exporting is held back: dropped when the export fails
    (the CaptureError says why), shown as it was when it succeeds."""
    import logging
    import sys

    from autopipe.model.capture._tracing import _torch_output_held

    capsys.readouterr()
    with contextlib.suppress(RuntimeError), _torch_output_held():
        logging.getLogger("torch.export").warning("a torch warning")
        print("a partial graph", file=sys.stderr)
        assert capsys.readouterr().err == ""  # held while the export runs
        if not succeeds:
            raise RuntimeError("export failed")
    err = capsys.readouterr().err
    assert ("a partial graph" in err and "a torch warning" in err) is succeeds
    assert ("a partial graph" in err or "a torch warning" in err) is succeeds


def test_untraceable_root_forward_points_to_sequential() -> None:
    class Root(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = nn.Linear(4, 4)

        def forward(self, x: Tensor) -> Tensor:
            return self.linear(x) if x.mean() > 0 else x

    with pytest.raises(CaptureError,
                       match=r"Root\.forward .*`return self.linear\(x\) if x.mean\(\) > 0 else x`.*nn\.Sequential"):
        chain(Root())


def test_torch_export_captures_what_fx_cannot() -> None:
    """Exported at batch 4, run at 3 and 6 in sequence and as a 3-stage pipeline (training
    mode, per-micro-batch reference), on the model's own tensors; the mode stays the export's."""
    model = StockEncoder()
    with pytest.raises(CaptureError, match="'encoder' .*sample_input"):
        chain(model)
    layers = chain(model, torch.randn(4, 5, 8))
    assert [layer.name for layer in layers] == ["embed", "encoder.layers.0", "encoder.layers.1", "norm", "head"]
    original = model.state_dict(keep_vars=True)
    captured = {k: v for layer in layers for k, v in layer.module.state_dict(keep_vars=True).items()}
    assert captured.keys() == original.keys() and all(captured[k] is original[k] for k in original)
    sequential = _sequential(layers)
    for batch in (3, 6):
        x = torch.randn(batch, 5, 8)
        _assert_same(_output_and_grads(model, model, x), _output_and_grads(sequential, model, x))
    pipe = autopipe.Pipeline(layers, balance=[2, 2, 1], devices=["cpu"] * 3, chunks=3)
    try:
        _assert_same(_output_and_grads(_per_micro_batch(model, 3), model, x), _output_and_grads(pipe, model, x))
    finally:
        pipe.close()
    with pytest.raises(RuntimeError, match="captured with torch.export in train mode"):
        sequential.eval()(x)


def test_finer_granularity_splits_blocks_and_keeps_results() -> None:
    model = torchvision.models.resnet18(num_classes=10)
    layers = chain(model, granularity="finer")
    names = [layer.name for layer in layers]
    assert {"layer1.0.conv1", "layer1.0.relu:2", "layer2.0.downsample.0"} <= set(names)
    x = torch.randn(2, *VISION)
    _assert_same(_output_and_grads(model, model, x), _output_and_grads(_sequential(layers), model, x))
    with pytest.raises(ValueError, match="granularity"):
        chain(model, granularity="coarse")  # type: ignore[arg-type]


def test_layer_chain_captures_other_models_and_keeps_sequentials() -> None:
    assert all(isinstance(layer.module, CapturedLayer) for layer in layer_chain(UNet()))
    sequential = nn.Sequential(nn.Linear(2, 2), nn.ReLU())
    assert [layer.module for layer in layer_chain(sequential)] == list(sequential)


#: (model, stages): every model on 2 and 3 CPU devices, the slow ones once.
PIPELINES = [(name, k) for name in ("unet", "two_branch", "transformer", "vit", "mobilenet_v3_small") for k in (2, 3)]
PIPELINES += [pytest.param("densenet121", k, marks=pytest.mark.slow) for k in (2, 3)]


def _plan(model: nn.Module | list[Layer], x: Tensor, stages: int) -> autopipe.Plan:
    """The planner's split at 3 micro-batches; if it prefers fewer devices than given on this
    tiny model, a per-device memory limit that fewer devices cannot meet makes it use them all
    (its plan may put two stages on each: the pipeline must equal the model either way)."""
    profile = untimed(autopipe.profile(model, x, ["cpu"] * 2, batch_sizes=[2, len(x)], warmup=0, repeats=1,
                                       quiet=True))
    devices = ["cpu"] * stages
    plan = autopipe.plan(profile, devices, chunks=3)
    whole = sum(stage.memory_bytes for stage in plan.stages)
    for factor in (1.2, 1.5, 2.0):
        if plan.device_count == stages:
            break
        try:
            plan = autopipe.plan(profile, devices, chunks=3, memory_limit=whole / stages * factor)
        except PlanningError:  # one layer alone exceeds the limit: try a looser one
            continue
    assert plan.device_count == stages
    return plan


def _per_micro_batch(model: nn.Module, chunks: int) -> Callable[[Tensor], Tensor]:
    """The reference for a pipeline in training mode: batch norm sees one micro-batch at a time."""
    return lambda x: torch.cat([model(part) for part in x.tensor_split(chunks)])


@pytest.mark.parametrize("name, stages", PIPELINES)
def test_pipeline_with_planned_split_equals_model(name: str, stages: int) -> None:
    """Profiled, planned and run through ``layer_chain``'s capture, in training mode."""
    factory, shape, _ = MODELS[name]
    model = factory()
    x = torch.randn(6, *shape)  # micro-batches of 2: batch norm needs two samples at 1x1
    pipe = autopipe.Pipeline(model, _plan(model, x, stages))
    try:
        _assert_same(_output_and_grads(_per_micro_batch(model, 3), model, x), _output_and_grads(pipe, model, x))
    finally:
        pipe.close()


@pytest.mark.slow
@pytest.mark.parametrize("stages", [2, 3])
def test_resnet50_captured_chain_as_pipeline_equals_model(stages: int) -> None:
    """``layer_chain`` reads a ResNet by hand; its captured chain is profiled, planned and run
    as a list of layers."""
    model = torchvision.models.resnet50(num_classes=10).eval()
    layers = chain(model)
    x = torch.randn(6, *VISION)
    pipe = autopipe.Pipeline(layers, _plan(layers, x, stages))
    try:
        _assert_same(_output_and_grads(model, model, x), _output_and_grads(pipe, model, x))
    finally:
        pipe.close()


def test_partition_profiles_plans_and_runs_a_captured_model() -> None:
    model = UNet()
    x = torch.randn(4, *VISION)
    profile = untimed(autopipe.profile(model, x, ["cpu"] * 2, batch_sizes=[2, 4], warmup=0, repeats=1, quiet=True))
    pipe = autopipe.partition(model, x, ["cpu"] * 2, profile=profile, chunks=2)
    try:
        assert pipe.plan.chunks == 2
        _assert_same(_output_and_grads(_per_micro_batch(model, 2), model, x), _output_and_grads(pipe, model, x))
    finally:
        pipe.close()


def test_pipeline_leaves_each_layer_its_own_tensors() -> None:
    """ViT's first layer holds ``encoder.pos_embedding`` (the encoder's forward is traced) in a
    bare container at ``encoder``, under which the encoder's blocks, other layers, go too: the
    pipeline registers the tensor at its path rather than the container, so no layer takes in
    another's modules (whose parameters and buffers it would then train and put back as its
    own) and a second pipeline of the same layers is built alike, under the model's keys."""
    model = _vit()
    layers = chain(model)
    own = [list(layer.module.state_dict()) for layer in layers]
    for _ in range(2):
        pipe = autopipe.Pipeline(layers, balance=[1, len(layers) - 1], devices=["cpu"] * 2)
        pipe.close()
        assert [list(layer.module.state_dict()) for layer in layers] == own
        assert sorted(pipe.state_dict()) == sorted(model.state_dict())


class TwoInputs(nn.Module):
    """The second input is read only by the last layer: it skips there from the first."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(4, 8), nn.Linear(8, 8), nn.Linear(8, 3)

    def forward(self, x: Tensor, weight: Tensor) -> Tensor:
        return self.c(self.b(self.a(x))) * weight


def test_model_with_two_inputs_runs_as_pipeline() -> None:
    model = TwoInputs()
    layers = chain(model)
    assert [str(key) for key in layers[0].stash] == ["weight->c@TwoInputs"]
    x, weight = torch.randn(4, 4), torch.rand(4, 1)
    pipe = autopipe.Pipeline(layers, balance=[1, 1, 1], devices=["cpu"] * 3, chunks=2)
    try:
        _assert_same(_output_and_grads(lambda v: model(v, weight), model, x),
                     _output_and_grads(lambda v: pipe(v, weight), model, x))
    finally:
        pipe.close()


class _WritesInPlace(nn.Module):
    """A module writing in place where glue would otherwise move across the write: an in-place
    leaf call whose result is unused, then glue reading the written value; glue writing into a
    value that a leaf call read before it."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.c, self.b = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4)
        self.act = nn.ReLU(inplace=True)
        self.twice, self.again = _Double(), _Double()

    def forward(self, x: Tensor) -> Tensor:
        h = self.a(x)
        self.act(h)  # h is relu(h) from here on
        y = self.twice(h * 2.0)
        z = self.c(x)
        w = self.again(z)
        z.add_(1.0)  # after again has read z
        return self.b(y) + w + z


class _Double(nn.Module):
    def forward(self, x: Tensor) -> Tensor:
        return x * 2.0


def test_glue_keeps_its_place_around_writes_in_place() -> None:
    """Glue may move up to its latest input's layer, but not across a write in place: the chain
    run in sequence and over every split equals the model."""
    model = _WritesInPlace().double()
    layers = chain(model)
    x = torch.randn(6, 4, dtype=torch.double)
    expected = _output_and_grads(model, model, x)
    _assert_same(expected, _output_and_grads(_sequential(layers), model, x))
    for bounds in all_splits(len(layers), 3):
        balance = [stop - start for start, stop in zip(bounds, bounds[1:])]
        for checkpoint in ("never", "always"):
            pipe = autopipe.Pipeline(layers, balance=balance, devices=["cpu"] * len(balance), checkpoint=checkpoint)
            try:
                _assert_same(expected, _output_and_grads(pipe, model, x))
            finally:
                pipe.close()


class _Centring(nn.Module):
    """Centres its features on a running mean of them, as DINO's head does, and counts its
    calls: its forward (traced, for ``blocks`` is a container) reads both buffers, then updates
    them in place; the mean as it was before the update is used in a later layer."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 6))
        self.proj = nn.Linear(6, 6)
        self.register_buffer("center", torch.zeros(6))
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))

    def forward(self, x: Tensor) -> Tensor:
        before = self.center.clone()
        h = self.blocks(x) / (1.0 + self.calls)
        self.center.mul_(0.9).add_(h.detach().mean(0), alpha=0.1)
        self.calls.add_(1)
        return self.proj(h) - before + self.center


class _Centred(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem, self.body, self.head = nn.Linear(3, 4), _Centring(), nn.Linear(6, 2)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.body(self.stem(x)))


def _steps(chunks: int) -> list[Tensor]:
    """Inputs of two training steps, ``chunks`` micro-batches of two samples each."""
    return [torch.randn(2 * chunks, 3, dtype=torch.double) for _ in range(2)]


@pytest.mark.parametrize("checkpoint", ["never", "always", "except_last"])
def test_buffers_a_traced_forward_updates_follow_the_model(checkpoint: str) -> None:
    """The buffers a traced (non-leaf) forward reads and updates in place are updated at every
    call, in its order, and a recomputation reads what its forward read: two training steps
    over every split into up to three stages equal the plain model run micro-batch by
    micro-batch (outputs, every gradient, the mean and the count)."""
    original = _Centred().double()
    for bounds in all_splits(5, 3):
        model, reference = copy.deepcopy(original), copy.deepcopy(original)
        layers = chain(model)
        # proj reads the mean too: a buffer lives in one layer
        assert [layer.name for layer in layers] == ["stem", "body.blocks.0", "body.blocks.1", "body.blocks.2", "head"]
        balance = [stop - start for start, stop in zip(bounds, bounds[1:])]
        pipe = autopipe.Pipeline(layers, balance=balance, devices=["cpu"] * len(balance), chunks=3,
                                 checkpoint=checkpoint)
        try:
            assert_training_matches(pipe, model, reference, _steps(3), chunks=3, what=f"{balance}: ")
        finally:
            pipe.close()


def test_exported_batch_norm_statistics_follow_the_model_under_checkpointing() -> None:
    """An exported graph's batch norm updates its running statistics with no module the runtime
    could see: a recomputation must not update them again.  Two training steps over every split
    into up to three stages, with each checkpointing, equal the plain model run micro-batch by
    micro-batch (outputs, every gradient, running_mean, running_var, num_batches_tracked)."""
    model = StockEncoder().double()
    original = copy.deepcopy(model)
    layers = chain(model, torch.randn(4, 5, 8, dtype=torch.double))
    inputs = [torch.randn(6, 5, 8, dtype=torch.double) for _ in range(2)]
    for bounds in all_splits(len(layers), 3):
        balance = [stop - start for start, stop in zip(bounds, bounds[1:])]
        for checkpoint in ("always", "except_last"):
            model.load_state_dict(original.state_dict())
            pipe = autopipe.Pipeline(layers, balance=balance, devices=["cpu"] * len(balance), chunks=3,
                                     checkpoint=checkpoint)
            try:
                assert_training_matches(pipe, model, copy.deepcopy(original), inputs, chunks=3,
                                        what=f"{balance} {checkpoint}: ")
            finally:
                pipe.close()


def test_exported_batch_norm_is_not_deferred_but_refused_and_partition_keeps_one_replica() -> None:
    """DeferredBatchNorm replaces batch-norm modules; an exported graph runs batch norm as an
    operation on the running statistics, which it cannot replace: deferring it (asked for, or by
    replicas, which share the statistics) would leave them updated per micro-batch, and by
    replicas at once.  So that is refused, naming the ways out, and ``partition`` plans one
    replica for such a model."""
    model = StockEncoder().double()
    sample = torch.randn(4, 5, 8, dtype=torch.double)
    layers = chain(model, sample)
    for options in ({"deferred_batch_norm": True}, {"replicas": 2}):
        with pytest.raises(ChainError, match=r"captured with torch.export.*traceable by torch.fx.*replicas=1"):
            autopipe.Pipeline(layers, balance=[len(layers)], devices=["cpu"] * options.get("replicas", 1), **options)
    pipe = autopipe.partition(model, sample, devices=["cpu", "cpu"])
    try:
        assert pipe.plan.replicas == 1
    finally:
        pipe.close()


class _CountsItself(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.register_buffer("count", torch.zeros((), dtype=torch.double))

    def forward(self, x: Tensor) -> Tensor:
        self.count.add_(1)
        return self.lin(x)


class _CountedAgainLater(nn.Module):
    """A buffer written by a submodule's forward and again by the parent's glue two layers on;
    fx cannot trace the item assignment, so torch.export captures it, and there the second write
    reads the buffer through the first write's result."""

    def __init__(self) -> None:
        super().__init__()
        self.s, self.a, self.b = _CountsItself(), nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x: Tensor) -> Tensor:
        x = x * 1.0
        x[:, :1] = 0.0
        h = self.a(self.s(x))
        self.s.count.add_(1)
        return self.b(h)


def test_layers_reading_a_buffer_through_a_write_into_it_become_one() -> None:
    """Every layer that reads a buffer, also through what a write into it returns, is one layer
    with the buffer's owner: the pipeline trains as the model (it refused the valid model,
    the buffer's alias sent to another stage as a copy)."""
    original = _CountedAgainLater().double()
    sample = torch.randn(4, 4, dtype=torch.double)
    for checkpoint in ("never", "always"):
        model = copy.deepcopy(original)
        layers = chain(model, sample)
        assert [layer.name for layer in layers] == ["s", "b"]  # a, which the second write follows, joins s
        for bounds in all_splits(len(layers), 2):
            balance = [stop - start for start, stop in zip(bounds, bounds[1:])]
            pipe = autopipe.Pipeline(layers, balance=balance, devices=["cpu"] * len(balance), chunks=2,
                                     checkpoint=checkpoint)
            try:
                assert_training_matches(pipe, model, copy.deepcopy(model), [torch.randn(4, 4, dtype=torch.double)],
                                        chunks=2, what=f"{balance} {checkpoint}: ")
            finally:
                pipe.close()


class _Counting(nn.Module):
    """Counts its calls in its buffer, whose new value it reads, updating it in place
    (``self.calls += 1``) or assigning it (``self.calls = self.calls + 1``); ``blocks`` makes
    its forward traced."""

    def __init__(self, assigns: bool) -> None:
        super().__init__()
        self.assigns = assigns
        self.blocks = nn.Sequential(nn.Linear(4, 4), nn.Tanh())
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))

    def forward(self, x: Tensor) -> Tensor:
        if self.assigns:
            self.calls = self.calls + 1
        else:
            self.calls += 1
        return self.blocks(x) * self.calls


class _Counted(nn.Module):
    def __init__(self, assigns: bool) -> None:
        super().__init__()
        self.stem, self.body, self.head = nn.Linear(3, 4), _Counting(assigns), nn.Linear(4, 2)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.body(self.stem(x)))


class _CountedExported(_Counted):
    """:class:`_Counted` whose forward fx cannot trace (an item assignment): torch.export captures it."""

    def forward(self, x: Tensor) -> Tensor:
        x = x * 1.0
        x[:, :1] = 0.0
        return super().forward(x)


def test_buffer_assigned_in_a_traced_forward_is_refused() -> None:
    """``self.calls = self.calls + 1`` assigns the module a new tensor, which no chain could ever
    update: fx would record nothing and torch.export drops it without a word.  It is refused,
    whether fx sees it or only torch.export does, naming the buffer and the ways out, with the
    model left as it was."""
    for model, samples in ((_Counted(assigns=True), (None, torch.randn(4, 3))),
                           (_CountedExported(assigns=True), (torch.randn(4, 3),))):
        for sample in samples:
            refused = r"assigns the buffers \['body.calls'\].*\+= 1.*leaf_modules"
            with pytest.raises(CaptureError, match=refused) as error:
                chain(model, sample)
            assert "torch.export try" not in str(error.value)
            assert type(model.body.calls) is Tensor and model.body.calls.item() == 0


class _Settings:
    """A config object: plain values a forward reads."""

    def __init__(self) -> None:
        self.shift = 0.0


class _Scaled2(nn.Module):
    """A leaf whose ``alpha`` its parent's forward reads."""

    def __init__(self) -> None:
        super().__init__()
        self.lin, self.alpha = nn.Linear(4, 4), 2.0

    def forward(self, x: Tensor) -> Tensor:
        return self.lin(x)


class _Tempered(nn.Module):
    """Reads plain values in forwards the capture runs as Python: its ``temperature``, a class
    attribute ``bias``, a list item, a config's ``shift``, its ``body``'s ``scale`` (``body`` holds
    two blocks, so fx opens it), a leaf child's ``alpha``, a plain tensor attribute ``mask``;
    ``exported`` makes fx fail on it (an item assignment), ``count`` makes it assign a counter,
    ``cache`` write into a plain tensor attribute."""

    bias = 0.0

    def __init__(self, count: bool = False, cache: bool = False, log: bool = False, exported: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.stem, self.head, self.body, self.leaf = nn.Linear(3, 4), nn.Linear(4, 2), _ScaledBlocks(), _Scaled2()
        self.temperature, self.weights, self.config = 1.0, [1.0, 1.0], _Settings()
        self.calls, self.count, self.writes, self.logs, self.exported = 0, count, cache, log, exported
        self.mask, self.cache, self.log = torch.ones(4), torch.ones(4), [1]

    def forward(self, x: Tensor) -> Tensor:
        if self.exported:  # fx fails here, before any assignment
            x = x * 1.0
            x[:, :1] = 0.0
        if self.count:
            self.calls += 1
        if self.writes:
            self.cache.mul_(1.5)
        if self.logs:
            self.log.append(2)
        h = self.leaf(self.body(self.stem(x))) * self.mask * self.leaf.alpha * self.weights[1]
        return self.head(h + self.config.shift) / self.temperature + self.bias


class _ScaledBlocks(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks, self.scale = nn.Sequential(nn.Linear(4, 4), nn.Tanh()), 2.0

    def forward(self, x: Tensor) -> Tensor:
        return self.blocks(x) * self.scale


#: Each value _Tempered's code reads, how a training loop changes it, and how it is named.
_CHANGES: list[tuple[str, Callable[[_Tempered], None], Callable[[_Tempered], None]]] = [
    ("model.temperature", lambda m: setattr(m, "temperature", 0.5), lambda m: setattr(m, "temperature", 1.0)),
    ("model.body.scale", lambda m: setattr(m.body, "scale", 3.0), lambda m: setattr(m.body, "scale", 2.0)),
    ("model.leaf.alpha", lambda m: setattr(m.leaf, "alpha", 3.0), lambda m: setattr(m.leaf, "alpha", 2.0)),
    ("model.config.shift", lambda m: setattr(m.config, "shift", 1.0), lambda m: setattr(m.config, "shift", 0.0)),
    ("model.weights", lambda m: m.weights.__setitem__(1, 2.0), lambda m: m.weights.__setitem__(1, 1.0)),
    ("model.bias", lambda m: setattr(m, "bias", 1.0), lambda m: delattr(m, "bias")),
    ("model.mask", lambda m: setattr(m, "mask", torch.full((4,), 2.0)), lambda m: None),
]


@pytest.mark.parametrize("exported", [False, True])
def test_plain_values_the_captured_code_reads_are_refused_once_changed(exported: bool) -> None:
    """torch.fx and torch.export run a forward's Python once and keep the values it reads as
    constants (an instance's or a class's, a list's, a config's, a child's; a tensor that is no
    buffer): a pipeline on the capture computed with them after the training loop changed them
    (0.42 off for a temperature of 0.5), and a plain tensor attribute became a key of its
    state_dict.  A change is refused naming the value and the fixes; a capture made after it
    computes with the new value; the value put back, the pipeline runs again."""
    model = _Tempered(exported=exported)
    x = torch.randn(6, 3)
    pipe = autopipe.Pipeline(chain(model, x), balance=[2, 3], devices=["cpu", "cpu"], chunks=2)
    assert (pipe[0].exported_mode is not None) == exported
    torch.testing.assert_close(pipe(x), model(x))
    assert sorted(pipe.state_dict()) == sorted(model.state_dict())
    mask = model.mask
    for where, change, undo in _CHANGES:
        change(model)
        with pytest.raises(ChainError, match=rf"{re.escape(where)} was .* when the model was captured.* now.*"
                                             r"Capture the model again.*register_buffer"):
            pipe(x)
        again = autopipe.Pipeline(chain(model, x), balance=[2, 3], devices=["cpu", "cpu"], chunks=2)
        torch.testing.assert_close(again(x), model(x))
        undo(model)
    model.mask = mask  # the very tensor read: the pipeline runs again
    torch.testing.assert_close(pipe(x), model(x))


@pytest.mark.parametrize("exported", [False, True])
@pytest.mark.parametrize("kind, name", [("count", "calls"), ("cache", "cache"), ("log", "log")])
def test_captured_code_that_changes_its_python_state_is_refused_and_left_as_it_was(kind: str, name: str,
                                                                                  exported: bool) -> None:
    """A counter (``self.calls += 1``), a plain tensor attribute written in place or a list appended
    to runs at the capture only (fx traces twice, for both modes; torch.export puts back what it
    assigns, and dropped the counter without a word), never in the chain: refused naming it, the
    model's values as before the capture (the counter read 2, the tensor 2.25, the list held proxies)."""
    model = _Tempered(**{kind: True}, exported=exported)
    with pytest.raises(CaptureError, match=rf"assigns the attributes \['{name}'\].*register_buffer"):
        chain(model, torch.randn(6, 3))
    assert model.calls == 0 and torch.equal(model.cache, torch.ones(4)) and model.log == [1]


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x: Tensor) -> Tensor:
        return self.b(self.a(x))


_REGISTRY: dict[str, type] = {}


class _Registered(nn.Module):
    """Tests the exact type of a child it traces through, and registers its subclasses by name."""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        _REGISTRY[cls.__name__] = cls

    def __init__(self) -> None:
        super().__init__()
        self.blk, self.head = _Block(), nn.Linear(4, 2)

    def forward(self, x: Tensor) -> Tensor:
        h = self.blk(x)
        if type(self.blk) is _Block and type(self) is _ExactlyTyped:
            h = h * 3.0
        return self.head(h)


class _ExactlyTyped(_Registered):
    pass


def test_the_capture_leaves_the_model_s_classes_as_they_are() -> None:
    """What the capture's code reads is found in that code, not by giving the modules other classes
    while it runs: ``type(self.blk) is Block`` held in the model and not in the capture (its
    output 101 off), and a class registry keyed by name held the capture's class afterwards."""
    model = _ExactlyTyped()
    x = torch.randn(6, 4)
    for granularity in ("module", "finer"):
        layers = chain(model, granularity=granularity)  # no sample: nothing checks the chain against the model
        torch.testing.assert_close(_sequential(layers)(x), model(x))
    assert _REGISTRY == {"_ExactlyTyped": _ExactlyTyped}


@pytest.mark.parametrize("exported", [False, True])
def test_buffer_updated_by_augmented_assignment_trains_as_the_model(exported: bool) -> None:
    """fx's own proxies trace ``self.calls += 1`` as ``self.calls = self.calls + 1``; captured by
    fx (the in-place operator it is on a tensor) or by torch.export, it updates the buffer at
    every call, as in the model."""
    model = (_CountedExported if exported else _Counted)(assigns=False).double()
    reference = copy.deepcopy(model)
    layers = chain(model, torch.randn(4, 3, dtype=torch.double))
    if exported:
        assert layers[0].module.exported_mode is not None
    else:
        assert any(node.target is operator.iadd for layer in layers for node in layer.module.graph.nodes)
    pipe = autopipe.Pipeline(layers, balance=[1, len(layers) - 1], devices=["cpu"] * 2, chunks=3,
                             checkpoint="always")
    try:
        assert_training_matches(pipe, model, reference, _steps(3), chunks=3)
    finally:
        pipe.close()


class _AugmentedThroughAnotherName(nn.Module):
    """``h += ...`` writes into ``h``, which the model reads again through another name: a view
    (``first``) and what ``nn.Dropout(0.0)`` returns (its input itself)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.drop, self.b, self.c = nn.Linear(6, 6), nn.Dropout(0.0), nn.Linear(3, 6), nn.Linear(6, 6)

    def forward(self, x: Tensor) -> Tensor:
        h = self.a(x)
        first = h[:, :3]
        d = self.drop(h)
        d += x
        h *= 2.0
        return self.b(first) + self.c(d)


def test_augmented_assignment_writes_through_every_name_as_in_the_model() -> None:
    """fx's own proxies trace ``h += y`` out of place, so a view or another name of ``h`` missed
    the write (output off by 5.7); captured, the chain in sequence equals the model, and so does
    every split, unless it sends a written tensor apart from another name of it, which is
    refused (:mod:`autopipe.runtime.aliases`), never wrong."""
    model = _AugmentedThroughAnotherName().double()
    layers = chain(model)
    x = torch.randn(6, 6, dtype=torch.double)
    expected = _output_and_grads(model, model, x)
    _assert_same(expected, _output_and_grads(_sequential(layers), model, x))
    ran = 0
    for bounds in all_splits(len(layers), 3):
        balance = [stop - start for start, stop in zip(bounds, bounds[1:])]
        pipe = autopipe.Pipeline(layers, balance=balance, devices=["cpu"] * len(balance), checkpoint="always")
        try:
            _assert_same(expected, _output_and_grads(pipe, model, x))
            ran += 1
        except ChainError as error:
            assert "write in place" in str(error)
        finally:
            pipe.close()
    assert ran >= len(layers)


class _TrainingBranch(nn.Module):
    """A forward that reads ``self.training`` itself: fx keeps only the branch of the capture's mode."""

    def __init__(self, functional: bool = False) -> None:
        super().__init__()
        self.functional = functional
        self.a, self.b, self.c = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 3)

    def forward(self, x: Tensor) -> Tensor:
        h = self.a(x)
        if self.functional:
            h = nn.functional.dropout(h, p=0.5, training=self.training)
        elif self.training:
            h = h * 0.5
        return self.c(self.b(h))


def _pipe(layers: list[Layer], chunks: int = 2) -> autopipe.Pipeline:
    return autopipe.Pipeline(layers, balance=[1, len(layers) - 1], devices=["cpu", "cpu"], chunks=chunks)


@pytest.mark.parametrize("functional", [False, True])
@pytest.mark.parametrize("captured_in", ["train", "eval"])
def test_forward_reading_the_mode_keeps_the_capture_mode(functional: bool, captured_in: str) -> None:
    """fx bakes ``if self.training:`` and ``F.dropout(training=self.training)`` in: the pipeline
    equals the model in the capture's mode and refuses the other (its output was 0.08-0.24 off)."""
    model = getattr(_TrainingBranch(functional), captured_in)()
    layers = chain(model, torch.randn(6, 8))
    assert model.training == (captured_in == "train")
    pipe = _pipe(layers, chunks=1)
    try:
        x = torch.randn(6, 8)
        _assert_same(_output_and_grads(model, model, x), _output_and_grads(pipe, model, x))
        other = "eval" if captured_in == "train" else "train"
        getattr(pipe, other)()
        with pytest.raises(CapturedCallError, match=f"captured with torch.fx in {captured_in} mode.*{other} mode"):
            pipe(x)
    finally:
        pipe.close()


class _LeafModes(nn.Module):
    """Dropout and batch norm as modules: calls in the graph, whose mode stays free."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.norm, self.drop, self.b = nn.Linear(8, 8), nn.BatchNorm1d(8), nn.Dropout(0.3), nn.Linear(8, 3)
        self.frozen = nn.Linear(3, 3).eval()

    def forward(self, x: Tensor) -> Tensor:
        return self.frozen(self.b(self.drop(self.norm(self.a(x)))))


def test_mode_free_capture_runs_in_both_modes_and_keeps_every_flag() -> None:
    """Capturing traces the forward in both modes: every module's own flag is put back (a frozen
    part stays in eval) and a graph that does not read the flag runs in either mode."""
    model = _LeafModes()
    reference = copy.deepcopy(model)
    layers = chain(model, torch.randn(6, 8))
    assert model.training and model.norm.training and not model.frozen.training
    pipe = _pipe(layers, chunks=1)
    try:
        x = torch.randn(6, 8)
        for mode in ("train", "eval"):
            getattr(pipe, mode)(), getattr(reference, mode)()
            _assert_same(_output_and_grads(reference, reference, x), _output_and_grads(pipe, model, x))
    finally:
        pipe.close()


class _NoGradBlock(nn.Module):
    def __init__(self, autocast: bool = False) -> None:
        super().__init__()
        self.autocast = autocast
        self.a, self.b, self.c = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 3)

    def forward(self, x: Tensor) -> Tensor:
        h = self.a(x)
        block = torch.autocast("cpu", dtype=torch.bfloat16) if self.autocast else torch.no_grad()
        with block:
            t = self.b(h)
        return self.c(h + t.float())


@pytest.mark.parametrize("autocast", [False, True])
def test_grad_mode_and_autocast_blocks_are_exported(autocast: bool) -> None:
    """fx drops ``with torch.no_grad():`` and ``torch.autocast`` (the pipeline differentiated ``b``,
    gradients 1.9 off): such a forward is exported, which keeps them, or refused without a sample."""
    model = _NoGradBlock(autocast)
    with pytest.raises(CaptureError, match="changes grad mode or autocast.*pass sample_input"):
        chain(model)
    layers = chain(model, torch.randn(6, 8))
    assert layers[0].module.exported_mode is not None
    pipe = _pipe(layers, chunks=1)  # bfloat16 rounds a split batch's products otherwise
    try:
        x = torch.randn(6, 8)
        expected = _output_and_grads(model, model, x)
        assert ("b.weight" in expected[1]) == autocast
        _assert_same(expected, _output_and_grads(pipe, model, x))
    finally:
        pipe.close()


class _PerSampleNorm(nn.Module):
    """A forward fx cannot trace (a branch on a size), with a per-sample reshape."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 3)

    def forward(self, x: Tensor) -> Tensor:
        if x.shape[1] == 8:
            x = x * 1.0
        h = self.a(x)
        return self.b(h) / h.reshape(h.size(0), -1).pow(2).sum(-1, keepdim=True)


def test_exported_batch_of_one_refuses_other_batch_sizes() -> None:
    """torch.export fixes a sample's batch of 1 in the graph (with only a warning; a batch of 4 was
    0.69 off): other micro-batch sizes are refused, micro-batches of 1 and samples of 2 work."""
    model = _PerSampleNorm()
    x = torch.randn(4, 8)
    layers = chain(model, torch.randn(1, 8))
    assert layers[0].module.batch_sizes == (1,)
    for chunks, refused in ((1, True), (4, False)):
        pipe = _pipe(layers, chunks)
        try:
            if refused:
                with pytest.raises(CapturedCallError, match=r"first sizes \[1\].*at least 2"):
                    pipe(x)
            else:
                _assert_same(_output_and_grads(model, model, x), _output_and_grads(pipe, model, x))
        finally:
            pipe.close()
    layers = chain(model, torch.randn(2, 8))
    assert layers[0].module.batch_sizes is None
    pipe = _pipe(layers, chunks=1)
    try:
        _assert_same(_output_and_grads(model, model, x), _output_and_grads(pipe, model, x))
    finally:
        pipe.close()


class _CastToWeights(nn.Module):
    """Converts a value to its weights' dtype, which export records as a check of the dtype it
    saw; ``exported`` adds a branch on a size, which fx cannot trace."""

    def __init__(self, exported: bool) -> None:
        super().__init__()
        self.exported = exported
        self.a, self.b, self.c = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 3)

    def forward(self, x: Tensor) -> Tensor:
        if self.exported and x.shape[1] == 8:
            x = x * 1.0
        h = self.b(self.a(x))
        return self.c(h.to(self.c.weight.dtype))


def test_exported_graph_refuses_dtypes_it_did_not_see() -> None:
    """An exported graph keeps its inputs' dtypes and, where the model converts a value, the dtype
    it had: another input dtype or autocast failed deep in the graph with "Tensor dtype
    mismatch!", naming nothing; each is refused naming the fix (for a converted model too), and a
    capture of the converted model runs as that model does."""
    model = _CastToWeights(exported=True)
    converted = copy.deepcopy(model).double()
    pipe = _pipe(chain(model, torch.randn(4, 8)))
    try:
        assert pipe[0].exported_mode is not None
        with pytest.raises(CapturedCallError, match=r"'positional argument 1' of torch.float64 \(captured as "
                                                    r"torch.float32\).*capture it again on a batch of these dtypes"):
            pipe(torch.randn(4, 8, dtype=torch.float64))
        with torch.autocast("cpu", dtype=torch.bfloat16), pytest.raises(
                CapturedCallError, match=r"is torch.bfloat16 now\. Autocast is on for cpu \(bfloat16\) here and "
                                         r"was off at the capture: capture the model under the autocast it runs with"):
            pipe(torch.randn(4, 8))
        pipe.double()
        with pytest.raises(CapturedCallError, match=r"'positional argument 1' of torch.float64.*after converting the "
                                                    r"model if it runs converted"):
            pipe(torch.randn(4, 8, dtype=torch.float64))
    finally:
        pipe.close()
    x = torch.randn(4, 8, dtype=torch.float64)
    reference = copy.deepcopy(converted)
    pipe = _pipe(chain(converted, x))
    try:
        _assert_same(_output_and_grads(reference, reference, x), _output_and_grads(pipe, converted, x))
    finally:
        pipe.close()


def test_traced_graph_takes_other_dtypes_as_the_model_does() -> None:
    """An fx graph calls the model's own operations: under autocast and converted, the pipeline
    gives the model's outputs and gradients, nothing refused."""
    model = _CastToWeights(exported=False)
    reference = copy.deepcopy(model)
    pipe = _pipe(chain(model), chunks=1)  # bfloat16 rounds a split batch's products otherwise
    try:
        assert pipe[0].exported_mode is None
        x = torch.randn(4, 8)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            _assert_same(_output_and_grads(reference, reference, x), _output_and_grads(pipe, model, x))
        pipe.double(), reference.double()
        x = x.double()
        _assert_same(_output_and_grads(reference, reference, x), _output_and_grads(pipe, model, x))
    finally:
        pipe.close()


class _Masked(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 3)

    def forward(self, x: Tensor, mask: Tensor | None = None) -> Tensor:
        h = self.a(x)
        if mask is not None:
            h = h * mask
        return self.c(self.b(h))


class _InputNamed(nn.Module):
    """An argument named as another's prefix (``input_ids``, ``input``)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 3)

    def forward(self, input_ids: Tensor, input: Tensor | None = None) -> Tensor:  # noqa: A002
        h = self.a(input_ids)
        return self.b(h if input is None else h + input)


def test_arguments_with_defaults_that_the_sample_passes_are_inputs() -> None:
    """fx fixed every argument with a default, even one the sample passes (the mask was dropped,
    then a TypeError), and lost ``input_ids`` next to ``input=None`` (a bare StopIteration)."""
    model = _Masked()
    x, mask = torch.randn(6, 8), (torch.rand(6, 8) > 0.5).float()
    pipe = _pipe(chain(model, (x, mask)))
    try:
        expected = _output_and_grads(lambda t: model(t, mask), model, x)
        _assert_same(expected, _output_and_grads(lambda t: pipe(t, mask), model, x))
        _assert_same(expected, _output_and_grads(lambda t: pipe(t, mask=mask), model, x))
    finally:
        pipe.close()
    model = _InputNamed()
    pipe = _pipe(chain(model, x))
    try:
        _assert_same(_output_and_grads(model, model, x), _output_and_grads(pipe, model, x))
    finally:
        pipe.close()


class _TwoInputs(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 3)

    def forward(self, x: Tensor, y: Tensor) -> Tensor:
        return self.c(self.b(self.a(x)) * y)


def test_traced_model_takes_its_arguments_by_name() -> None:
    """A model captured by fx is called with its arguments by name, positionally or both, as the
    model is (keyword arguments were refused as if the capture had not seen them)."""
    model = _TwoInputs()
    x, y = torch.randn(6, 8), torch.randn(6, 8)
    pipe = _pipe(chain(model, {"x": x, "y": y}))
    try:
        expected = _output_and_grads(lambda t: model(t, y), model, x)
        for call in (lambda t: pipe(x=t, y=y), lambda t: pipe(t, y=y), lambda t: pipe(t, y)):
            _assert_same(expected, _output_and_grads(call, model, x))
        with pytest.raises(TypeError, match=r"missing \['y'\], unexpected \['z'\]"):
            pipe(x, z=y)
    finally:
        pipe.close()


class _Scaled(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 3)

    def forward(self, x: Tensor, scale: float = 2.0, mask: Tensor | None = None) -> Tensor:
        h = self.a(x) * scale
        if mask is not None:
            h = h * mask
        return self.b(h)


def test_traced_model_binds_positional_arguments_as_its_forward_and_holds_fixed_ones_to_their_value() -> None:
    """A float the sample passes is fixed in the graph: a call may pass it again with that value,
    positionally or by name, and positions bind as the forward binds them; a call leaving it at
    its default, or passing another value, is refused (``pipe(x, mask=mask)`` silently computed
    ``model(x, 3.0, mask)`` where the model computes ``model(x, 2.0, mask)``)."""
    model = _Scaled().double()
    x, mask = torch.randn(6, 8, dtype=torch.float64), (torch.rand(6, 8) > 0.5).double()
    pipe = _pipe(chain(model, (x, 3.0, mask)), chunks=1)
    try:
        for args, kwargs in [((x, 3.0, mask), {}), ((x, 3.0), {"mask": mask}), ((x,), {"scale": 3.0, "mask": mask})]:
            torch.testing.assert_close(pipe(*args, **kwargs), model(*args, **kwargs))
        for args, kwargs, problem in [
            ((x,), {"mask": mask}, r"captured with scale=3.0.*this call leaves it at its default 2.0; pass scale=3.0"),
            ((x, 2.0, mask), {}, r"captured with scale=3.0.*this call passes 2.0"),
            ((x, mask), {}, r"captured with scale=3.0.*this call passes a tensor"),
            ((x, 3.0, mask), {"x": x}, r"missing \[\], unexpected \['x \(given twice\)'\]"),
            ((x, 3.0, mask, mask), {}, r"missing \[\], unexpected \['positional argument 4'\]"),
        ]:
            with pytest.raises(CapturedCallError, match=problem):
                pipe(*args, **kwargs)
    finally:
        pipe.close()


class _OptionalBias(nn.Module):
    """Adds ``bias`` where it is a tensor: fx passes its inputs as proxies, which are no tensors."""

    def __init__(self, dropout: float = 0.0) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b, self.drop = nn.Linear(8, 8), nn.Linear(8, 3), nn.Dropout(dropout)

    def forward(self, x: Tensor, bias: Tensor | None = None) -> Tensor:
        h = self.drop(self.a(x))
        if isinstance(bias, torch.Tensor):
            h = h + bias
        return self.b(h)


def test_a_traced_graph_unlike_the_model_on_the_sample_is_exported_instead() -> None:
    """fx traced ``isinstance(bias, torch.Tensor)`` as false and left ``bias`` out of the graph (the
    pipeline 1.0 off, no error): the chain is run against the model on the sample, and where they
    differ torch.export captures it, which follows the branch the sample takes."""
    model = _OptionalBias()
    x, bias = torch.randn(6, 8), torch.randn(6, 8)
    layers = chain(model, (x, bias))
    assert layers[0].module.exported_mode is not None
    pipe = _pipe(layers, chunks=3)
    try:
        torch.testing.assert_close(pipe(x, bias), model(x, bias))
    finally:
        pipe.close()


def test_a_traced_graph_like_the_model_stays_traced_though_it_draws_random_numbers() -> None:
    """Both runs of the check start from one seed, so dropout in training mode agrees; the model's
    random state is as before the capture."""
    model = _OptionalBias(dropout=0.5).train()
    x = torch.randn(6, 8)
    state = torch.random.get_rng_state()
    layers = chain(model, (x,))
    assert layers[0].module.exported_mode is None
    assert torch.equal(torch.random.get_rng_state(), state)


class _Steps(nn.Module):
    """``range(k)`` and ``if flag:`` on arguments: fx cannot trace them, torch.export fixes them."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 3)

    def forward(self, x: Tensor, k: int, flag: bool) -> Tensor:
        h = self.a(x)
        for _ in range(k):
            h = torch.tanh(h)
        return self.b(h * 2 if flag else h)


def test_numbers_and_flags_an_export_fixed_are_held_to_the_samples() -> None:
    """torch.export specialises its graph to the sample's ``k`` and ``flag`` (its own guard, which
    the capture drops with the size guards, refuses others): a call with others is refused (the
    pipeline computed the sample's, 0.23 off for ``k=5``, 0.51 for ``flag=False``)."""
    model = _Steps()
    x = torch.randn(6, 8)
    pipe = _pipe(chain(model, (x, 2, True)), chunks=3)
    try:
        torch.testing.assert_close(pipe(x, 2, True), model(x, 2, True))
        for k, flag, given in ((5, True, "5"), (2, False, "False")):
            with pytest.raises(CapturedCallError, match=rf"input {2 if k != 2 else 3} .* was {2 if k != 2 else True}, "
                                                        rf"which its graph keeps.*called with {given}"):
                pipe(x, k, flag)
    finally:
        pipe.close()


class _ScaledBySize(nn.Module):
    """Scales by ``x.size(1) ** -0.5``, a Python float that the last layer reads: a skip."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(7, 7), nn.Linear(7, 7), nn.Linear(7, 3)

    def forward(self, x: Tensor) -> Tensor:
        scale = x.size(1) ** -0.5
        return self.c(self.b(self.a(x))) * scale


def test_a_number_between_layers_keeps_its_exact_value() -> None:
    """A Python float travels between layers as a float64 tensor (it was a float32 one, which
    rounded it: a float64 model's output was 5e-9 off); ints and bools come back exactly too."""
    model = _ScaledBySize().double()
    x = torch.randn(6, 7, dtype=torch.float64)
    layers = chain(model)
    assert [str(key) for layer in layers for key in layer.stash] == ["pow_1->c@_ScaledBySize"]
    pipe = _pipe(layers, chunks=1)
    try:
        torch.testing.assert_close(pipe(x), model(x), rtol=0, atol=0)
    finally:
        pipe.close()
    for value in (7 ** -0.5, 2**62 + 1, True):
        unpacked = _unpack(_pack(value))
        assert type(unpacked) is type(value) and unpacked == value


class _ExtraKeywords(_TwoInputs):
    def forward(self, x: Tensor, **settings: Any) -> Tensor:  # type: ignore[override]
        return self.c(self.b(self.a(x)))


def test_unread_variadic_arguments_are_not_inputs() -> None:
    """An unread ``**settings`` was a placeholder of the first layer, which then split its one
    input tensor into rows; it is not an input, and the pipeline equals the model."""
    model = _ExtraKeywords()
    layers = chain(model)
    x = torch.randn(6, 8)
    pipe = _pipe(layers)
    try:
        _assert_same(_output_and_grads(model, model, x), _output_and_grads(pipe, model, x))
    finally:
        pipe.close()


class HeadFirst(nn.Module):
    """Registers its head before the body it runs first."""

    def __init__(self) -> None:
        super().__init__()
        self.head = nn.Linear(8, 4)
        self.body = nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.body(x)))


def test_parameters_are_listed_in_the_models_order() -> None:
    """``pipe.parameters()`` and ``state_dict()`` follow the model's registration order, not
    forward order: an optimizer state saved with the plain model, which ``load_state_dict``
    maps by position, lands on the same tensors (in forward order, head's momentum went to
    the body's weight when the shapes allowed it, silently)."""
    x = torch.randn(6, 8)
    names = [name for name, _ in HeadFirst().named_parameters()]
    keys = list(HeadFirst().state_dict())
    for build in (lambda m: autopipe.Pipeline(m, balance=[2, 1], devices=["cpu", "cpu"]),
                  lambda m: autopipe.Pipeline(autopipe.chain(m, x), balance=[2, 1], devices=["cpu", "cpu"]),
                  lambda m: autopipe.partition(m, x, devices=["cpu", "cpu"], replicas=1)):
        model = HeadFirst()
        pipe = build(model)
        assert [name for name, _ in pipe.named_parameters()] == names
        assert list(pipe.state_dict()) == keys
        assert [id(p) for p in pipe.parameters()] == [id(p) for p in model.parameters()]


class Blocks(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([nn.Sequential(nn.Linear(8, 8), nn.ReLU()) for _ in range(3)])
        self.head = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = x + block(x)
        return self.head(x)


def test_leaf_modules_that_name_nothing_are_refused_with_the_close_names() -> None:
    """A mistyped path was ignored and an instance failed inside ``isinstance``; one path given
    alone is taken as a list of one."""
    x = torch.randn(4, 8)
    with pytest.raises(CaptureError, match=r"no submodule 'block.1' .*e.g. blocks.1"):
        autopipe.chain(Blocks(), x, leaf_modules=["block.1"])
    with pytest.raises(CaptureError, match="neither a dotted path nor a module class"):
        autopipe.chain(Blocks(), x, leaf_modules=[nn.Sequential()])
    with pytest.raises(CaptureError, match="must be a torch.nn.Module, got function"):
        autopipe.chain(lambda t: t, x)
    alone = [layer.name for layer in autopipe.chain(Blocks(), x, leaf_modules="blocks.1")]
    assert alone == [layer.name for layer in autopipe.chain(Blocks(), x, leaf_modules=["blocks.1"])]
    assert "blocks.1" in alone


@pytest.mark.parametrize("checkpoint", ["never", "always"])
def test_tied_weights_read_by_attribute_travel_as_a_skip(checkpoint: str) -> None:
    """The head reading ``emb.weight`` no longer merges the chain into one layer: the weight
    lives with ``emb`` and reaches the head as a skip, and the gradients of both uses add up
    over every split (outputs and gradients equal the plain model's)."""
    original = TiedHead().double()
    ids = [torch.randint(0, 10, (6, 5)) for _ in range(2)]
    assert [layer.name for layer in chain(copy.deepcopy(original), ids[0])] == ["emb", "m", "n"]
    for bounds in all_splits(3, 3):
        model, reference = copy.deepcopy(original), copy.deepcopy(original)
        balance = [stop - start for start, stop in zip(bounds, bounds[1:])]
        pipe = autopipe.Pipeline(chain(model, ids[0]), balance=balance, devices=["cpu"] * len(balance), chunks=3,
                                 checkpoint=checkpoint)
        try:
            assert_training_matches(pipe, model, reference, ids, chunks=3, what=f"{balance}: ")
        finally:
            pipe.close()


class _Checked(nn.Module):
    """A forward that checks its input's width (fx cannot trace the check: torch.export captures
    it) and adds a buffer through ``.to(device)``, which export checks by a node nothing reads."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.BatchNorm1d(8)
        self.a, self.b, self.c = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8)
        self.register_buffer("bias", torch.randn(8))

    def forward(self, x: Tensor, y: Tensor) -> Tensor:
        h = self.norm(x)
        if h.shape[-1] != 8:
            raise _WidthError(f"expected 8 features, got {h.shape[-1]}")
        h = self.c(self.b(self.a(h)))
        return h + self.bias.to(h.device) - y


class _WidthError(ValueError):
    pass


def test_a_sample_passing_one_tensor_twice_captures_two_inputs() -> None:
    """Exported on ``(x, x)``, the graph reads each argument (export made one input of the two,
    and a call on ``(x2, y2)`` computed with ``x2`` for both)."""
    model = _Checked().eval()
    x = torch.randn(4, 8)
    pipe = _pipe(chain(model, (x, x)))
    try:
        x2, y2 = torch.randn(4, 8), torch.randn(4, 8)
        _assert_same(_output_and_grads(lambda v: model(v, y2), model, x2),
                     _output_and_grads(lambda v: pipe(v, y2), model, x2))
    finally:
        pipe.close()


def test_a_buffer_read_through_to_device_stays_in_its_readers_layer() -> None:
    """``self.bias.to(h.device)`` no longer merges the chain into one layer: export's check of the
    buffer, which nothing reads, runs in the layer that adds it (it was placed first, and the
    layers between merged to keep the buffer in one)."""
    model = _Checked().eval()
    x, y = torch.randn(4, 8), torch.randn(4, 8)
    layers = chain(model, (x, y))
    assert [layer.name for layer in layers] == ["norm", "a", "b", "c"]
    assert [name for name, _ in layers[-1].module.named_buffers()] == ["bias"]
    pipe = _pipe(layers)
    try:
        _assert_same(_output_and_grads(lambda v: model(v, y), model, x),
                     _output_and_grads(lambda v: pipe(v, y), model, x))
    finally:
        pipe.close()


def test_the_models_own_exception_on_the_sample_keeps_its_type() -> None:
    """A model that raises on the sample raises so at capture (fx and export failed because of
    it), noted as raised on the sample, and its buffers stay as they were."""
    model = _Checked()
    wide = torch.randn(4, 9)
    model.norm = nn.BatchNorm1d(9)
    before = {name: buffer.clone() for name, buffer in model.named_buffers()}
    with pytest.raises(_WidthError, match="expected 8 features, got 9") as caught:
        chain(model, (wide, wide))
    assert any("run on the sample while capturing it" in note for note in caught.value.__notes__)
    assert all(torch.equal(buffer, before[name]) for name, buffer in model.named_buffers())


@pytest.mark.timeout(120)
def test_a_batch_the_exported_branch_does_not_hold_for_is_refused() -> None:
    """Export records the branch as the batch sizes its graph holds for (7 and more here); a call
    of the pipeline whose whole batch lies outside is refused (a batch of 6 ran the sample's branch,
    0.40 off the model), whatever its micro-batches are, and one inside matches the model."""
    torch.manual_seed(0)
    model = BranchesOnBatch().double()
    pipe = autopipe.Pipeline(chain(model, torch.randn(12, 8, dtype=torch.double)), balance=[1, 1], chunks=4)
    for batch in (12, 8, 7):
        x = torch.randn(batch, 8, dtype=torch.double)
        with torch.no_grad():
            torch.testing.assert_close(pipe(x), model(x))
    with pytest.raises(CapturedCallError, match="branches on the batch size.*batches of 7 or more, and this call's "
                                                "batch is 6; capture it again"):
        pipe(torch.randn(6, 8, dtype=torch.double))
    pipe.close()


@pytest.mark.parametrize("condition, refused, guard", [("even", 7, r"x.size\(\)\[0\] % 2 == 0"),
                                                        ("not 5", 5, r"x.size\(\)\[0\] != 5")])
def test_a_batch_failing_an_exported_condition_that_is_no_range_is_refused(condition: str, refused: int,
                                                                           guard: str) -> None:
    """Export checks the branch's condition on the inputs (its guards), which the capture takes out
    of the graph as micro-batches are smaller; a whole batch failing it ran the sample's branch
    (0.59 off the model at a batch of 7 for ``B % 2 == 0``, without an error).  The pipeline runs
    export's checks on the whole batch: refused naming the condition; batches meeting it, split
    into micro-batches that do not, match the model."""
    torch.manual_seed(0)
    model = BranchesOnBatchParity(condition).double()
    pipe = autopipe.Pipeline(chain(model, torch.randn(8, 8, dtype=torch.double)), balance=[1, 1], chunks=3)
    for batch in (8, 10):
        x = torch.randn(batch, 8, dtype=torch.double)
        with torch.no_grad():
            torch.testing.assert_close(pipe(x), model(x))
    with pytest.raises(CapturedCallError, match=f"branches on the input sizes: .* hold only where {guard}, and this "
                                                "call's inputs do not; capture it again"):
        pipe(torch.randn(refused, 8, dtype=torch.double))
    assert pipe(torch.randn(8, 8, dtype=torch.double)).shape == (8, 3)  # the pipeline runs on
    pipe.close()
