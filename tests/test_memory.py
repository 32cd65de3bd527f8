"""Per-stage peak memory: measured against a hand count, predicted as a bound within 10%."""
from __future__ import annotations

import threading
from typing import Any, Callable

import pytest
import torch
from torch import nn

from autopipe import Pipeline
from autopipe._jsonio import write_json_atomic
from autopipe.profiling._meter import AllocationCounter
from autopipe.bench import Trainer, measure_memory, plan_of
from autopipe.planning._assembly import build_plan
from autopipe.planning.cost import CostModel
from autopipe.planning.plans import Plan
from autopipe.profiling.profiler import profile
from autopipe.profiling.profiles import Profile
from models import TiedHead

D, BATCH, CHUNKS = 512, 64, 4
B = BATCH // CHUNKS
LINEAR = (D * D + D) * 4  # one Linear's parameter bytes (and its gradient's)
ACT = B * D * 4  # one activation of one micro-batch


def mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(D, D), nn.ReLU(), nn.Linear(D, D), nn.ReLU(), nn.Linear(D, D), nn.ReLU())


def hand_count(mode: str, momentum: bool) -> list[int]:
    """What each stage holds at its peak, by hand, for balance [2, 4] (Linear+ReLU | 2x that):
    parameters, gradients, the optimizer's momentum (one buffer per parameter), the gradient a
    Linear makes for its weight before adding it to ``.grad`` (one Linear's worth), and the
    ReLU outputs the stage keeps: for every micro-batch in flight without checkpointing; with
    it, one micro-batch's being recomputed — except stage 0's output, which stage 1 keeps as
    its input until that micro-batch's backward (CPU stages share memory: it is charged to
    stage 0, which made it)."""
    state = [(1 + 1 + momentum) * LINEAR * n + LINEAR for n in (1, 2)]
    if mode == "never":
        kept = [CHUNKS * ACT, CHUNKS * 2 * ACT]
    else:
        kept = [CHUNKS * ACT, 2 * ACT]
    return [s + k for s, k in zip(state, kept)]


@pytest.fixture(scope="module")
def mlp_profile() -> Profile:
    torch.set_num_threads(1)
    return profile(mlp(), torch.randn(BATCH, D), ["cpu", "cpu"], batch_sizes=[B, BATCH],
                   warmup=0, repeats=1, quiet=True)


@pytest.mark.parametrize("mode,optimizer", [("never", "sgd"), ("except_last", "sgd"), ("always", "sgd"),
                                            ("never", "momentum")])
def test_measured_peak_is_the_hand_count_and_the_prediction_a_close_bound(mlp_profile, mode, optimizer):
    torch.set_num_threads(1)
    plan = plan_of(mlp_profile, ["cpu", "cpu"], [2, 4], CHUNKS, mode, optimizer_state=optimizer)
    model = mlp()
    batch = torch.randn(BATCH, D)
    pipe = Pipeline(model, plan)
    try:
        trainer = Trainer(pipe, batch, torch.randn(BATCH, D), devices=plan.devices, optimizer=optimizer)
        trainer.step()  # the optimizer's state exists from the first step on
        measured = measure_memory(trainer, pipe)
    finally:
        pipe.close()
    predicted = [stage.memory_bytes for stage in plan.stages]
    for stage, (hand, got, bound) in enumerate(zip(hand_count(mode, optimizer == "momentum"), measured, predicted)):
        assert got == pytest.approx(hand, rel=0.05), f"stage {stage}: measured {got}, by hand {hand}"
        assert got <= bound <= 1.10 * got, f"stage {stage}: predicted {bound}, measured {got}"


def test_pipeline_reports_memory_only_when_asked():
    pipe = Pipeline(mlp(), balance=[2, 4], devices=["cpu", "cpu"], chunks=2)
    try:
        pipe(torch.randn(8, D)).sum().backward()
        assert pipe.last_memory() is None
        pipe.measure_memory = True
        pipe(torch.randn(8, D)).sum().backward()
        peaks = pipe.last_memory()
    finally:
        pipe.close()
    assert peaks is not None and len(peaks) == 2
    assert all(not peak.per_device for peak in peaks)
    assert peaks[1].peak_bytes > peaks[0].peak_bytes > LINEAR  # parameters and more


def test_counter_charges_the_allocating_thread_until_any_thread_frees():
    counter = AllocationCounter()
    made: dict[str, torch.Tensor] = {}

    def work() -> None:
        with counter.track("worker"):
            a = torch.ones(1000)  # 4000 bytes
            made["b"] = a * 2  # 4000 more, kept
            view = made["b"][:10]  # a view: no new memory
            del a, view

    thread = threading.Thread(target=work)
    thread.start()
    thread.join()
    assert counter.peak["worker"] == 8000
    assert counter.current["worker"] == 4000
    del made["b"]  # freed on this thread: still the worker's memory that is gone
    assert counter.current["worker"] == 0
    assert counter.peak["worker"] == 8000


def test_profiles_without_the_memory_fields_still_load(tmp_path, mlp_profile):
    path = write_json_atomic(tmp_path / "old.json", _without_memory_fields(mlp_profile.to_json()))
    old = Profile.load(path)
    assert old.layers[0].workspace_bytes == {} and old.layers[0].output_saved is None
    assert old.layers[0].aliases_input is None
    # measured now: a Linear's workspace is its weight gradient (and its input's gradient)
    assert mlp_profile.layers[0].workspace_bytes[B] == LINEAR
    assert mlp_profile.layers[2].workspace_bytes[B] == LINEAR + ACT
    assert [layer.output_saved for layer in mlp_profile.layers] == [False, True] * 3


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_stage_peak_is_its_device_peak():
    pipe = Pipeline(mlp(), balance=[2, 4], devices=["cuda:0"], chunks=2, interleave=2)
    try:
        pipe.measure_memory = True
        pipe(torch.randn(8, D, device="cuda:0")).sum().backward()
        peaks = pipe.last_memory()
    finally:
        pipe.close()
    assert peaks is not None and all(peak.per_device for peak in peaks)
    assert peaks[0].peak_bytes == peaks[1].peak_bytes >= 3 * LINEAR * 2


def test_bytes_measured_again_keep_the_times(tmp_path, mlp_profile):
    from autopipe.profiling.remeasure import remeasure_memory

    stripped = Profile.load(write_json_atomic(tmp_path / "old.json", _without_memory_fields(mlp_profile.to_json())))
    again = remeasure_memory(stripped, mlp(), torch.randn(BATCH, D), quiet=True)
    for old, new in zip(mlp_profile.layers, again.layers):
        assert new.forward == old.forward and new.backward == old.backward
        assert (new.saved_bytes, new.workspace_bytes, new.output_saved, new.aliases_input) == \
            (old.saved_bytes, old.workspace_bytes, old.output_saved, old.aliases_input)
    with pytest.raises(ValueError, match="another model"):
        remeasure_memory(stripped, nn.Sequential(nn.Linear(D, D)), torch.randn(BATCH, D), quiet=True)


def test_bytes_measured_again_are_the_bytes_profiling_records(tmp_path):
    """Every field but the times comes out as profiling makes it: ``stash_params`` (a tied
    head's weight) and ``grad_param_bytes`` (a frozen layer's 0) were kept as the old profile
    had them, absent, so the weight was charged as a new tensor per micro-batch and the frozen
    parameters gradients and optimizer state."""
    from autopipe.profiling.remeasure import remeasure_memory

    model = TiedHead()
    model.m.requires_grad_(False)
    ids = torch.randint(0, 10, (8, 5))
    profiled = profile(model, ids, ["cpu", "cpu"], batch_sizes=[2, 8], warmup=0, repeats=1, quiet=True)
    assert profiled.layers[0].stash_params and profiled.layers[1].grad_param_bytes == 0
    document = profiled.to_json()
    for layer in document["layers"]:
        for key in ("stash_params", "grad_param_bytes", "workspace_bytes", "output_saved", "aliases_input"):
            layer.pop(key, None)
    old = Profile.load(write_json_atomic(tmp_path / "old.json", document))
    again = remeasure_memory(old, model, ids, quiet=True)
    assert again.layers == profiled.layers
    assert again.copies == profiled.copies and again.model == profiled.model


def _without_memory_fields(document: dict) -> dict:
    for layer in document["layers"]:
        for key in ("workspace_bytes", "output_saved", "aliases_input"):
            layer.pop(key, None)
    return document


# -- backpressure on input gradients, and the 1F1B loss: the prediction bounds the measurement --

def narrowing() -> nn.Sequential:
    """Three Linear+ReLU pairs then a Linear to 8 outputs: with balance [6, 1] the last stage is
    far faster than the first, so without backpressure its input gradients wait in stage 0's
    inbox, up to one per micro-batch (each charged to the last stage, which made it)."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(D, D), nn.ReLU(), nn.Linear(D, D), nn.ReLU(), nn.Linear(D, D), nn.ReLU(),
                         nn.Linear(D, 8))


def measured_peaks(pipe: Pipeline, step: Callable[[], None]) -> list[int]:
    """The pipeline's own per-stage peaks over a second step (the first makes the gradients)."""
    for measure in (False, True):
        pipe.zero_grad(set_to_none=True)
        pipe.measure_memory = measure
        step()
    peaks = pipe.last_memory()
    assert peaks is not None
    return [peak.peak_bytes for peak in peaks]


def plan_1f1b(profile_: Profile, balance: list[int], chunks: int) -> Plan:
    """A hand-picked 1F1B plan costed by the planner's own model (as ``plan_of`` for fill-drain)."""
    bounds = [0, balance[0], sum(balance)]
    model = CostModel(profile_, ["cpu", "cpu"], [1.0, 1.0], profile_.batch_size, "sgd")
    options = {"balance": balance, "chunks": chunks, "checkpoint": "never", "optimizer_state": "sgd",
               "optimizer_state_factor": 0.0}
    return build_plan(profile_, model, bounds, chunks, "never", options, schedule="1f1b")


@pytest.mark.parametrize("chunks", [8, 16])
def test_a_fast_last_stage_keeps_one_input_gradient_alive_as_predicted(chunks):
    torch.set_num_threads(1)
    x, y = torch.randn(BATCH, D), torch.randn(BATCH, 8)
    prof = profile(narrowing(), x, ["cpu", "cpu"], batch_sizes=[BATCH // chunks, BATCH], warmup=0, repeats=1,
                   quiet=True)
    plan = plan_of(prof, ["cpu", "cpu"], [6, 1], chunks, "never", optimizer_state="sgd")
    pipe = Pipeline(narrowing(), plan)
    try:
        measured = measured_peaks(pipe, lambda: nn.functional.mse_loss(pipe(x), y).backward())
    finally:
        pipe.close()
    for stage, (got, bound) in enumerate(zip(measured, (s.memory_bytes for s in plan.stages))):
        assert got <= bound, f"stage {stage}: measured {got}, predicted {bound}"


@pytest.mark.parametrize("chunks", [8, 16])
def test_1f1b_keeps_only_the_value_of_each_micro_batch_loss(chunks):
    """Each micro-batch's loss with its graph would keep the last stage's input leaf and its
    gradient until the step ends."""
    torch.set_num_threads(1)
    x, y = torch.randn(BATCH, D), torch.randn(BATCH, D)
    prof = profile(mlp()[:4], x, ["cpu", "cpu"], batch_sizes=[BATCH // chunks, BATCH], warmup=0, repeats=1,
                   quiet=True)
    plan = plan_1f1b(prof, [2, 2], chunks)
    pipe = Pipeline(mlp()[:4], plan)
    try:
        measured = measured_peaks(pipe, lambda: pipe.train_step(x, target=y, loss_fn=nn.functional.mse_loss))
    finally:
        pipe.close()
    values = chunks * 16  # the losses' values train_step sums at the end (a scalar each), which no plan counts
    for stage, (got, bound) in enumerate(zip(measured, (s.memory_bytes for s in plan.stages))):
        assert got <= bound + values, f"stage {stage}: measured {got}, predicted {bound}"


class FailsInBackward(torch.autograd.Function):
    """The identity, whose backward raises while ``armed``."""

    armed = True

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        if FailsInBackward.armed:
            raise ValueError("broken backward")
        return grad


class Fails(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return FailsInBackward.apply(x)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("schedule,interleave", [("gpipe", 1), ("1f1b", 1), ("gpipe", 2), ("1f1b", 2)])
def test_a_backward_that_raises_under_backpressure_surfaces_and_the_next_call_works(schedule, interleave):
    """Stage 0 fails in its first backward while the later stages wait for its credits: they
    abort, the caller gets the layer's own exception, and the next call (a new run, new credits)
    trains as usual."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(D, D), Fails(), nn.ReLU(), nn.Linear(D, D), nn.ReLU(), nn.Linear(D, 8))
    pipe = Pipeline(model, balance=[2, 1, 2, 1], devices=["cpu"] * (4 // interleave), chunks=8,
                    interleave=interleave, schedule=schedule)
    x, y = torch.randn(BATCH, D), torch.randn(BATCH, 8)

    def step() -> torch.Tensor:
        if schedule == "gpipe":
            loss = nn.functional.mse_loss(pipe(x), y)
            loss.backward()
            return loss.detach()
        return pipe.train_step(x, target=y, loss_fn=nn.functional.mse_loss)

    try:
        FailsInBackward.armed = True
        with pytest.raises(ValueError, match="broken backward"):
            step()
        FailsInBackward.armed = False
        pipe.zero_grad(set_to_none=True)
        assert torch.isfinite(step())
        assert all(p.grad is not None for p in pipe.parameters())
    finally:
        FailsInBackward.armed = True
        pipe.close()


def test_1f1b_without_checkpointing_is_bounded_on_every_stage():
    """In 1F1B's steady state a forward refills the micro-batches in flight between two
    backwards, so a later backward still finds all of them held (the model counted one fewer,
    like fill-drain's: stages after the first measured up to 5% over)."""
    torch.set_num_threads(1)
    x, y = torch.randn(BATCH, D), torch.randn(BATCH, D)
    layers = nn.Sequential(*mlp(), *mlp())
    prof = profile(layers, x, ["cpu", "cpu"], batch_sizes=[BATCH // 8, BATCH], warmup=0, repeats=1, quiet=True)
    plan = plan_1f1b(prof, [6, 6], 8)
    pipe = Pipeline(nn.Sequential(*mlp(), *mlp()), plan)
    try:
        measured = measured_peaks(pipe, lambda: pipe.train_step(x, target=y, loss_fn=nn.functional.mse_loss))
    finally:
        pipe.close()
    for stage, (got, bound) in enumerate(zip(measured, (s.memory_bytes for s in plan.stages))):
        assert got <= bound + 8 * 16 <= 1.10 * got, f"stage {stage}: measured {got}, predicted {bound}"
