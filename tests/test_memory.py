"""Per-stage peak memory: measured against a hand count, predicted as a bound within 10%."""
from __future__ import annotations

import threading

import pytest
import torch
from torch import nn

from autopipe import Pipeline
from autopipe._jsonio import write_json_atomic
from autopipe.profiling._meter import AllocationCounter
from autopipe.bench import Trainer, measure_memory, plan_of
from autopipe.profiling.profiler import profile
from autopipe.profiling.profiles import Profile

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


def _without_memory_fields(document: dict) -> dict:
    for layer in document["layers"]:
        for key in ("workspace_bytes", "output_saved", "aliases_input"):
            layer.pop(key, None)
    return document
