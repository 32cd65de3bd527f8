"""What a torchgpipe (or ``torch.distributed.pipeline.sync.Pipe``) user relies on, checked on
``autopipe.Pipeline``: every module call runs, checkpointing recomputes from the inputs as
they arrived, skips of any value, errors of the layer's own type, Sequential-like access, the
device rules and the one-line errors of bad input.  Written from the behaviours, not from
torchgpipe's tests; every result is compared with the plain model's."""
from __future__ import annotations

import gc
import time
import weakref
from typing import Any, Callable

import pytest
import torch
from synthetic import make_profile
from torch import nn

import autopipe
from autopipe.errors import OptionError
from autopipe.cli import main
from autopipe.model import layer_chain, model_fingerprint
from autopipe.runtime.pipeline import Engine

CHECKPOINTS = ["never", "except_last", "always"]


def _grads(model: nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


def _reference(model: nn.Module, *args: Any) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    out = model(*args)
    out.sum().backward()
    grads = _grads(model)
    model.zero_grad()
    return out.detach(), grads


def _assert_like_plain(pipe: nn.Module, model: nn.Module, x: Any, out: torch.Tensor,
                       grads: dict[str, torch.Tensor]) -> None:
    got = pipe(x)
    got.sum().backward()
    torch.testing.assert_close(got, out)
    mine = _grads(model)
    assert mine.keys() == grads.keys()
    for name, grad in grads.items():
        torch.testing.assert_close(mine[name], grad, msg=name)
    model.zero_grad()


# -- 1. a module instance used at several positions ----------------------------------------

def _shared_activation() -> nn.Sequential:
    act = nn.Tanh()
    return nn.Sequential(nn.Linear(4, 4), act, nn.Linear(4, 4), act)


def _reused_linear() -> nn.Sequential:
    lin = nn.Linear(4, 4)  # weight tying by reuse: one Linear called twice
    return nn.Sequential(lin, nn.Tanh(), nn.Linear(4, 4), lin, nn.Tanh())


@pytest.mark.timeout(60)
@pytest.mark.parametrize("make", [_shared_activation, _reused_linear])
def test_a_repeated_instance_runs_at_every_position_for_every_balance(make: Callable[[], nn.Sequential]) -> None:
    model = make()
    x = torch.randn(6, 4)
    out, grads = _reference(model, x)
    n = len(model._modules)
    for cut in range(1, n):
        pipe = autopipe.Pipeline(model, balance=[cut, n - cut], devices=["cpu", "cpu"], chunks=3)
        assert len(pipe) == n
        _assert_like_plain(pipe, model, x, out, grads)
        assert list(pipe.state_dict()) == list(model.state_dict())  # the model's keys, each position's
        assert len(list(pipe.parameters())) == len(list(model.parameters()))  # no duplicates
        pipe.close()


@pytest.mark.timeout(120)
def test_partition_runs_a_shared_activation_at_both_positions() -> None:
    model = _shared_activation()
    x = torch.randn(8, 4)
    out, grads = _reference(model, x)
    assert [layer.name for layer in layer_chain(model)] == ["0", "1", "2", "3"]  # stateless: one layer each
    pipe = autopipe.partition(model, x, ["cpu", "cpu"])
    assert len(pipe.plan.model["layers"]) == 4
    _assert_like_plain(pipe, model, x, out, grads)


@pytest.mark.timeout(120)
def test_partition_and_plans_keep_a_reused_module_on_one_stage() -> None:
    model = _reused_linear()
    x = torch.randn(8, 4)
    out, grads = _reference(model, x)
    chain = layer_chain(model)
    # positions 0 and 3 share the Linear: one layer with the Tanh and Linear between them
    assert [layer.name for layer in chain] == ["0", "4"]
    assert sorted(chain[0].module.state_dict()) == ["0.bias", "0.weight", "2.bias", "2.weight", "3.bias", "3.weight"]
    pipe = autopipe.partition(model, x, ["cpu", "cpu"])
    _assert_like_plain(pipe, model, x, out, grads)
    assert list(pipe.state_dict()) == list(model.state_dict())


def test_fingerprints_tell_the_positions_apart() -> None:
    act = nn.Tanh()
    twice = nn.Sequential(nn.Linear(4, 4), act, nn.Linear(4, 4), act)
    once = nn.Sequential(twice[0], act, twice[2])
    names = [entry["name"] for entry in model_fingerprint(layer_chain(twice))["layers"]]
    assert names == ["0", "1", "2", "3"]
    assert model_fingerprint(layer_chain(twice))["digest"] != model_fingerprint(layer_chain(once))["digest"]


def test_shared_parameters_on_two_devices_are_refused() -> None:
    with pytest.raises(ValueError, match=r"layers '0' and '3' share 'weight'.* on cpu and meta"):
        autopipe.Pipeline(_reused_linear(), balance=[2, 3], devices=["cpu", "meta"])


@pytest.mark.timeout(60)
def test_captured_models_run_every_call() -> None:
    """fx records a call_module node per call: a stateless repeat is a layer per call, a
    stateful one (with the layers between) one layer, so a tensor never spans two stages."""

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b, self.c, self.act = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4), nn.Tanh()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.c(self.act(self.a(self.b(self.act(self.a(x))))))

    model = Model()
    x = torch.randn(6, 4)
    out, grads = _reference(model, x)
    chain = autopipe.chain(model)
    assert [layer.name for layer in chain] == ["a", "act", "c"]  # a..a (with b and act between), act, c
    pipe = autopipe.Pipeline(chain, balance=[1, 2], devices=["cpu", "cpu"], chunks=2)
    _assert_like_plain(pipe, model, x, out, grads)


# -- 2. skips of any value --------------------------------------------------------------------

@autopipe.skippable(stash=["s"])
class StashValue(nn.Module):
    def __init__(self, value: Any) -> None:
        super().__init__()
        self.value = value

    def forward(self, x: torch.Tensor) -> Any:
        yield autopipe.stash("s", self.value)
        return x


@autopipe.skippable(pop=["s"])
class PopValue(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.seen: list[Any] = []

    def forward(self, x: torch.Tensor) -> Any:
        value = yield autopipe.pop("s")
        self.seen.append(value)
        return x


@pytest.mark.timeout(60)
@pytest.mark.parametrize("checkpoint", CHECKPOINTS)
@pytest.mark.parametrize("value", [None, 7, "label"])
def test_a_non_tensor_skip_crosses_two_boundaries(checkpoint: str, value: Any) -> None:
    pop = PopValue()
    model = nn.Sequential(nn.Linear(4, 4), StashValue(value), nn.Linear(4, 4), nn.Tanh(), pop, nn.Linear(4, 4))
    x = torch.randn(4, 4)
    out, grads = _reference(model, x)
    pop.seen.clear()
    pipe = autopipe.Pipeline(model, balance=[2, 2, 2], devices=["cpu"] * 3, chunks=2, checkpoint=checkpoint)
    _assert_like_plain(pipe, model, x, out, grads)
    recomputed = {"never": 0, "except_last": 1, "always": 2}[checkpoint]
    assert pop.seen == [value] * (2 + recomputed)


# -- 3. checkpointed stages recompute from their inputs as they arrived ----------------------

class AddInPlace(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.add_(1.0)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("checkpoint", CHECKPOINTS)
@pytest.mark.parametrize("first", [lambda: nn.LeakyReLU(0.1, inplace=True), AddInPlace], ids=["leaky_relu", "add_"])
def test_an_in_place_first_layer_of_a_stage_gives_the_plain_gradients(
        checkpoint: str, first: Callable[[], nn.Module]) -> None:
    model = nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 16), first(), nn.Linear(16, 16))
    x = torch.randn(8, 16)
    out, grads = _reference(model, x)
    pipe = autopipe.Pipeline(model, balance=[2, 2], devices=["cpu", "cpu"], chunks=2, checkpoint=checkpoint)
    for _ in range(2):  # the first call measures whether the stage writes its input; the second relies on it
        _assert_like_plain(pipe, model, x, out, grads)


class ScaleFirstAddSecond(nn.Module):
    """Writes into its first argument, then reads the second: ``2a + b``, or ``4x`` where both are ``x``."""

    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        a.mul_(2.0)
        return a + b


@pytest.mark.timeout(60)
@pytest.mark.parametrize("checkpoint", CHECKPOINTS)
@pytest.mark.parametrize("same", ["object", "view"])
def test_arguments_that_are_one_tensor_stay_one_when_the_first_layer_writes_into_them(
        checkpoint: str, same: str) -> None:
    """``pipe(x, x)``: stage 0 computed on a copy of each argument, so the write into one no longer
    reached the other (3x where the plain model gives 4x; no error)."""
    model = nn.Sequential(ScaleFirstAddSecond(), nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4))
    x = torch.randn(6, 4)
    plain = x.clone()  # a Sequential takes one argument: its layers called in turn
    expected = model[1:](model[0](plain, plain if same == "object" else plain.view(6, 4)))
    expected.sum().backward()
    expected, grads = expected.detach(), _grads(model)
    model.zero_grad()
    pipe = autopipe.Pipeline(model, balance=[2, 2], devices=["cpu", "cpu"], chunks=2, checkpoint=checkpoint)
    for _ in range(2):  # the first call measures whether the stage writes its input; the second relies on it
        batch = x.clone()
        got = pipe(batch, batch if same == "object" else batch.view(6, 4))
        got.sum().backward()
        torch.testing.assert_close(got, expected)
        for name, grad in grads.items():
            torch.testing.assert_close(_grads(model)[name], grad, msg=name)
        model.zero_grad()
        assert torch.equal(batch, x)  # the caller's batch is not written


@pytest.mark.timeout(60)
@pytest.mark.parametrize("checkpoint", CHECKPOINTS)
def test_an_argument_needing_gradients_passed_twice_is_one_tensor(checkpoint: str) -> None:
    """``pipe(h, h)`` with ``h`` needing a gradient: stage 0 made a leaf of each argument, so
    the write into one did not reach the other (3h for 4h); its gradient comes back once."""
    torch.manual_seed(0)
    model = nn.Sequential(ScaleFirstAddSecond(), nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4))
    x, w = torch.randn(6, 4), torch.randn(4, requires_grad=True)
    h = x * w
    expected = model[1:](model[0](*[h.clone()] * 2))
    (grad_w,) = torch.autograd.grad(expected.sum(), w)
    pipe = autopipe.Pipeline(model, balance=[2, 2], devices=["cpu", "cpu"], chunks=2, checkpoint=checkpoint)
    for _ in range(2):
        h = x * w
        got = pipe(h, h)
        torch.testing.assert_close(got, expected)
        torch.testing.assert_close(torch.autograd.grad(got.sum(), w)[0], grad_w)


@pytest.mark.timeout(60)
def test_views_of_one_memory_with_other_values_keep_their_own_copies() -> None:
    """``z.imag`` and ``z.conj().imag`` share memory, not values (a lazy negation): taken for one
    tensor, the first call computed 11 where the plain model computes 9."""
    class Mix(nn.Module):
        def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
            return a * 10 + b

    model = nn.Sequential(Mix(), nn.Identity(), nn.ReLU())
    z = torch.complex(torch.zeros(6, 4), torch.ones(6, 4))
    a, b = z.imag, z.conj().imag
    assert a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr() and b.is_neg()
    pipe = autopipe.Pipeline(model, balance=[1, 2], devices=["cpu", "cpu"], chunks=2, checkpoint="always")
    for _ in range(2):
        torch.testing.assert_close(pipe(a, b), model[1:](model[0](a, b)))


@pytest.mark.timeout(60)
def test_in_place_dropout_first_in_a_stage_is_the_same_in_every_checkpoint_mode() -> None:
    model = nn.Sequential(nn.Linear(16, 16), nn.Dropout(0.5, inplace=True), nn.Linear(16, 16))
    x = torch.randn(8, 16)
    results = []
    for checkpoint in CHECKPOINTS:
        pipe = autopipe.Pipeline(model, balance=[1, 2], devices=["cpu", "cpu"], chunks=2, checkpoint=checkpoint)
        torch.manual_seed(1)
        out = pipe(x)
        out.sum().backward()
        results.append((out.detach(), _grads(model)))
        model.zero_grad()
    for out, grads in results[1:]:
        torch.testing.assert_close(out, results[0][0])
        for name in grads:
            torch.testing.assert_close(grads[name], results[0][1][name], msg=name)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("checkpoint", CHECKPOINTS)
@pytest.mark.parametrize("passed_on", [False, True], ids=["written_by_stage_0", "passed_on_to_stage_1"])
def test_the_callers_input_is_untouched(checkpoint: str, passed_on: bool) -> None:
    """Stage 0's first layer writes into its input, or stage 0 hands the batch on as it is and
    stage 1's first layer writes into it: either way the caller's batch stays as it was (stage 0
    sends a copy of what is the batch; stage 1 once wrote into the second micro-batch's rows)."""
    first = [nn.Identity()] if passed_on else []
    model = nn.Sequential(*first, nn.LeakyReLU(0.1, inplace=True), nn.Linear(16, 16), nn.Linear(16, 16))
    x = torch.randn(8, 16)
    kept = x.clone()
    expected, grads = _reference(model, x.clone())
    pipe = autopipe.Pipeline(model, balance=[1, 3] if passed_on else [2, 1], devices=["cpu", "cpu"], chunks=2,
                             checkpoint=checkpoint)
    for _ in range(2):
        _assert_like_plain(pipe, model, x, expected, grads)
        assert torch.equal(x, kept)
    with torch.no_grad():
        assert torch.equal(pipe.eval()(x), model.eval()(x.clone()))
    assert torch.equal(x, kept)
    with torch.no_grad():
        assert torch.equal(pipe.eval()(x), model(x.clone()))
    assert torch.equal(x, kept)


# -- 4. outputs outlive their pipeline ---------------------------------------------------------

@pytest.mark.timeout(60)
def test_an_output_stays_differentiable_after_the_pipeline_is_dropped() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    x = torch.randn(4, 4)
    out, grads = _reference(model, x)
    engines: list[weakref.ref[Engine]] = []

    def f(x: torch.Tensor) -> torch.Tensor:
        pipe = autopipe.Pipeline(model, balance=[1, 1], devices=["cpu", "cpu"], chunks=2)
        engines.append(weakref.ref(pipe._engine))
        return pipe(x)

    y = f(x)
    gc.collect()
    assert engines[0]() is not None  # the output's graph keeps the workers
    y.sum().backward()
    torch.testing.assert_close(y.detach(), out)
    for name, grad in _grads(model).items():
        torch.testing.assert_close(grad, grads[name])
    threads = [w._thread for w in engines[0]().workers]  # type: ignore[union-attr]
    del y
    gc.collect()
    assert engines[0]() is None
    for thread in threads:
        thread.join(timeout=10)
        assert not thread.is_alive()  # nothing needs them: the workers stopped


# -- 5. a failing stage stops the others early ---------------------------------------------------

class Slow(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        time.sleep(0.05)
        return x


class Fail(nn.Module):
    def __init__(self, error: BaseException) -> None:
        super().__init__()
        self.error = error

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        raise self.error


@pytest.mark.timeout(60)
def test_a_failing_stage_stops_the_stages_before_it_early() -> None:
    slow = Slow()
    pipe = autopipe.Pipeline(nn.Sequential(slow, Fail(ValueError("boom"))), balance=[1, 1],
                             devices=["cpu", "cpu"], chunks=16)
    with pytest.raises(ValueError):
        pipe(torch.randn(16, 4))
    assert slow.calls <= 3  # not all 16 queued micro-batches


# -- 6. balance counts the Sequential's top-level children ---------------------------------------

@pytest.mark.timeout(60)
def test_balance_counts_top_level_children_of_a_nested_sequential() -> None:
    model = nn.Sequential(*[nn.Sequential(nn.Linear(8, 8), nn.Tanh()) for _ in range(6)])
    x = torch.randn(4, 8)
    out, grads = _reference(model, x)
    pipe = autopipe.Pipeline(model, balance=[2, 2, 2], devices=["cpu"] * 3, chunks=2)
    assert [len(stage.layers) for stage in pipe.stages] == [2, 2, 2]
    assert len(pipe) == 6 and pipe[1] is model[1]
    _assert_like_plain(pipe, model, x, out, grads)
    assert list(pipe.state_dict()) == list(model.state_dict())
    assert len(layer_chain(model)) == 12  # plans keep naming the finer layers


# -- 7. the layer's own exception type ----------------------------------------------------------

@pytest.mark.timeout(60)
@pytest.mark.parametrize("error", [ValueError("bad value"), TypeError("bad argument"),
                                   torch.OutOfMemoryError("out of memory")], ids=type)
def test_the_layers_own_exception_reaches_the_caller_with_a_note(error: Exception) -> None:
    pipe = autopipe.Pipeline(nn.Sequential(nn.Linear(4, 4), Fail(error)), balance=[1, 1],
                             devices=["cpu", "cpu"], chunks=2)
    with pytest.raises(type(error)) as info:
        pipe(torch.randn(4, 4))
    assert info.value is error
    assert info.value.__notes__ == ["autopipe: raised by stage 1 (1..1) on cpu in forward of micro-batch 0"]
    pipe[1].error = None  # type: ignore[assignment]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", [KeyboardInterrupt, SystemExit])
def test_interrupts_pass_through_unchanged_and_the_pipeline_works_afterwards(kind: type[BaseException]) -> None:
    class InterruptOnce(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.armed = True

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if self.armed:
                self.armed = False
                raise kind()
            return x

    model = nn.Sequential(nn.Linear(4, 4), InterruptOnce(), nn.Linear(4, 4))
    x = torch.randn(4, 4)
    pipe = autopipe.Pipeline(model, balance=[1, 2], devices=["cpu", "cpu"], chunks=2)
    with pytest.raises(kind) as info:
        pipe(x)
    assert not getattr(info.value, "__notes__", None)
    assert all(worker.alive for worker in pipe._engine.workers)
    out, grads = _reference(model, x)
    _assert_like_plain(pipe, model, x, out, grads)


# -- 8. Sequential-like access ---------------------------------------------------------------------

def test_len_indexing_and_iteration_are_the_sequentials() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4))
    pipe = autopipe.Pipeline(model, balance=[2, 1], devices=["cpu", "cpu"])
    assert len(pipe) == 3
    assert pipe[0] is model[0] and pipe[-1] is model[2] and pipe[-3] is model[0]
    assert list(pipe) == list(model)
    for bad in (3, -4):
        with pytest.raises(IndexError, match=f"index {bad} is out of range for a pipeline of 3 layers"):
            pipe[bad]


# -- 9. devices ---------------------------------------------------------------------------------

def test_extra_devices_are_ignored_as_in_torchgpipe() -> None:
    pipe = autopipe.Pipeline(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)), balance=[1, 1],
                             devices=["cpu", "cpu", "meta"])
    assert pipe.devices == [torch.device("cpu")] * 2
    pipe(torch.randn(2, 4))


@pytest.mark.parametrize("devices", [["cpu", "tpu"], ["cpu", "gpu9"], ["cpu", "-1"], ["cpu", -1]])
def test_bad_device_names_are_one_line_errors_in_the_api(devices: list[Any]) -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    for call in (lambda: autopipe.Pipeline(model, balance=[1, 1], devices=devices),
                 lambda: autopipe.partition(model, torch.randn(2, 4), devices)):
        with pytest.raises(autopipe.DeviceError) as info:
            call()
        assert "\n" not in str(info.value) and str(devices[1]) in str(info.value)


@pytest.fixture
def profile_path(tmp_path):
    return make_profile([1.0] * 4, devices=3, output_bytes=10).save(tmp_path / "p.json")


def _one_line_error(capsys: pytest.CaptureFixture[str], argv: list[str], expected: str) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and expected in err, err


@pytest.mark.timeout(60)
@pytest.mark.parametrize("devices", ["cpu,gpu9", "cpu,tpu"])
def test_bad_device_names_are_one_line_errors_in_the_cli(devices: str, profile_path, capsys) -> None:
    _one_line_error(capsys, ["profile", "torch.nn:Identity", "--devices", devices, "--quiet"],
                    "is not a device autopipe can use")
    _one_line_error(capsys, ["plan", str(profile_path), "--devices", devices], "is not a device autopipe can use")


def test_plan_refuses_a_negative_device(profile_path, capsys) -> None:
    _one_line_error(capsys, ["plan", str(profile_path), "--devices=-1"], "'-1' is not a device autopipe can use")


# -- 10. the other rough edges --------------------------------------------------------------------

def test_plan_output_onto_a_directory_or_an_unwritable_place(profile_path, tmp_path, capsys) -> None:
    _one_line_error(capsys, ["plan", str(profile_path), "-o", str(tmp_path)], "it is a directory")
    blocker = tmp_path / "file"
    blocker.write_text("")
    _one_line_error(capsys, ["plan", str(profile_path), "-o", str(blocker / "plan.json")], "cannot write")


@pytest.mark.timeout(60)
def test_bench_with_a_plan_refuses_devices_it_would_ignore(profile_path, tmp_path, capsys) -> None:
    plan_path = tmp_path / "plan.json"
    assert main(["plan", str(profile_path), "--devices", "cpu,cpu,cpu", "--chunks", "2", "-o", str(plan_path)]) == 0
    capsys.readouterr()
    saved = autopipe.Plan.load(plan_path)
    other = ",".join(saved.devices[: saved.device_count] + ["cpu"])  # one device more than the plan uses
    _one_line_error(capsys, ["bench", "torch.nn:Identity", "--plan", str(plan_path), "--devices", other],
                    "--devices would be ignored")


def test_a_nan_memory_limit_is_refused(profile_path) -> None:
    profile = autopipe.Profile.load(profile_path)
    with pytest.raises(ValueError, match="memory limit nan is not a size"):
        autopipe.plan(profile, memory_limit=float("nan"))


@pytest.mark.parametrize("bad", [float("nan"), -1.0])
def test_an_in_memory_profile_is_validated_before_planning_and_saving(profile_path, tmp_path, bad: float) -> None:
    profile = autopipe.Profile.load(profile_path)
    stat = profile.layers[2].forward[1]
    profile.layers[2].forward[1] = type(stat)(bad, min(bad, stat.min_ms), stat.max_ms, stat.repeats)
    for call in (lambda: autopipe.plan(profile), lambda: profile.save(tmp_path / "bad.json")):
        with pytest.raises(autopipe.FormatError, match=r"in-memory profile: field 'layers\[2\].forward.1.median_ms'"):
            call()
    assert not (tmp_path / "bad.json").exists()


class DictInput(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)

    def forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return self.linear(batch["x"]) * batch["scale"]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("checkpoint", CHECKPOINTS)
def test_dict_batches_are_split_by_key(checkpoint: str) -> None:
    model = nn.Sequential(DictInput(), nn.Tanh(), nn.Linear(4, 4))
    batch = {"x": torch.randn(6, 4), "scale": torch.randn(6, 1)}
    out, grads = _reference(model, batch)
    pipe = autopipe.Pipeline(model, balance=[1, 2], devices=["cpu", "cpu"], chunks=3, checkpoint=checkpoint)
    _assert_like_plain(pipe, model, batch, out, grads)


def test_concurrent_stage_threads_share_a_reused_module_safely() -> None:
    """Both positions of one Linear on two stages of one device accumulate into one ``.grad``
    from two threads; over many steps the sums stay exact."""
    model = _reused_linear()
    x = torch.randn(32, 4)
    out, grads = _reference(model, x)
    pipe = autopipe.Pipeline(model, balance=[1, 4], devices=["cpu", "cpu"], chunks=8, checkpoint="never")
    for _ in range(5):
        _assert_like_plain(pipe, model, x, out, grads)


@pytest.mark.timeout(60)
def test_a_reused_batch_norm_is_deferred_at_both_positions() -> None:
    """The Span holding both positions calls its modules by path, so the deferred batch norms
    that replaced the original (one per position, sharing its tensors, each updating the running
    statistics once per step as the plain model's two calls do) are the ones run."""
    bn = nn.BatchNorm1d(4)
    model = nn.Sequential(nn.Linear(4, 4), bn, nn.Tanh(), bn, nn.Linear(4, 4))
    pipe = autopipe.Pipeline(layer_chain(model), balance=[1, 2], devices=["cpu", "cpu"], chunks=2,
                             deferred_batch_norm=True)
    span = pipe.stages[1].layers[0].module
    called = [span.get_submodule(path) for path in span.paths]
    for deferred in (called[0], called[2]):
        assert isinstance(deferred, autopipe.DeferredBatchNorm)
        assert deferred.weight is bn.weight and deferred.running_mean is bn.running_mean
    pipe(torch.randn(8, 4)).sum().backward()
    assert bn.weight.grad is not None


def test_a_shared_buffer_on_two_stages_is_refused() -> None:
    bn = nn.BatchNorm1d(4)
    model = nn.Sequential(nn.Linear(4, 4), bn, nn.Tanh(), bn)
    with pytest.raises(ValueError, match=r"layers '1' and '3' share 'running_mean'.* in stages 0 and 1"):
        autopipe.Pipeline(model, balance=[2, 2], devices=["cpu", "cpu"])
    autopipe.Pipeline(model, balance=[1, 3], devices=["cpu", "cpu"])(torch.randn(4, 4)).sum().backward()


def test_a_balance_given_where_the_plan_goes_names_the_keyword() -> None:
    """torchgpipe's ``GPipe(model, balance)``: here the second argument is a plan."""
    model = nn.Sequential(nn.Linear(2, 2), nn.ReLU())
    with pytest.raises(OptionError, match=r"layers per stage \[1, 1\] pass balance="):
        autopipe.Pipeline(model, [1, 1])  # type: ignore[arg-type]


def test_partitions_hold_each_stages_modules_as_torchgpipe() -> None:
    model = nn.Sequential(nn.Linear(2, 3), nn.ReLU(), nn.Linear(3, 3), nn.Tanh(), nn.Linear(3, 1))
    pipe = autopipe.Pipeline(model, balance=[2, 3], devices=["cpu", "cpu"], chunks=2)
    try:
        assert [list(partition) for partition in pipe.partitions] == [list(model)[:2], list(model)[2:]]
        assert pipe.partitions[1][0] is model[2]
    finally:
        pipe.close()
