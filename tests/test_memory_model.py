"""The memory model on skips and parameters: predictions against the measured peak of each stage
(as in ``test_memory``) and against hand counts where no device here can measure them."""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Iterator

import numpy as np
import pytest
import torch
from torch import nn

import autopipe
from autopipe import Pipeline, pop, skippable, stash
from autopipe.bench import Trainer, measure_memory, plan_of
from autopipe.errors import OptionError
from autopipe.planning.cost import CostModel
from autopipe.planning.graph import build_graph, chain_of
from autopipe.planning.memory import MemoryTerms, stage_memory, step_factor
from autopipe.profiling._meter import AllocationCounter
from autopipe.profiling.profiler import profile
from autopipe.profiling.profiles import Profile
from autopipe.runtime.memory import optimizer_state_bytes, unique_bytes

D, BATCH, CHUNKS = 256, 64, 4
B = BATCH // CHUNKS
WIDE = 8  # the gated skip's width, in multiples of D


@skippable(stash=["g"])
class Gate(nn.Module):
    """Stashes a new tensor WIDE times its input's width (nothing in this layer saves it)."""

    def forward(self, x: torch.Tensor) -> Iterator[object]:
        yield stash("g", x.repeat(1, WIDE) * 2.0)
        return x


@skippable(pop=["g"])
class Mul(nn.Module):
    """Pops the gate and saves a slice of it for backward: all of it stays alive."""

    def forward(self, x: torch.Tensor) -> Iterator[object]:
        g = yield pop("g")
        return x * g[:, :D]


@skippable(stash=["w"])
class TiedIn(nn.Module):
    """An input projection whose weight a later layer reuses (a tied head)."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(4 * D, D) / D)

    def forward(self, x: torch.Tensor) -> Iterator[object]:
        yield stash("w", self.weight)
        return x @ self.weight


@skippable(pop=["w"])
class TiedOut(nn.Module):
    def forward(self, x: torch.Tensor) -> Iterator[object]:
        w = yield pop("w")
        return x @ w.t()


def gated() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(D, D), Gate(), nn.Tanh(), Mul(), nn.Linear(D, D))


def tied() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(TiedIn(), nn.Linear(D, D), nn.Tanh(), nn.Linear(D, D), TiedOut())


def frozen() -> nn.Sequential:
    """Three Linear+ReLU pairs, the first two Linears frozen: no gradients, no optimizer state."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(D, D), nn.ReLU(), nn.Linear(D, D), nn.ReLU(), nn.Linear(D, D), nn.ReLU())
    model[0].requires_grad_(False)
    model[2].requires_grad_(False)
    return model


def profiled(make: Callable[[], nn.Sequential], width: int) -> Profile:
    torch.set_num_threads(1)
    return profile(make(), torch.randn(BATCH, width), ["cpu", "cpu"], batch_sizes=[B, BATCH], warmup=0,
                   repeats=1, quiet=True)


def predicted_and_measured(make: Callable[[], nn.Sequential], prof: Profile, width: int, out: int,
                           balance: list[int], optimizer: str = "sgd") -> list[tuple[int, int]]:
    """Each stage's (predicted, measured) peak bytes after a first step (the optimizer's state
    exists from then on)."""
    torch.set_num_threads(1)
    plan = plan_of(prof, ["cpu", "cpu"], balance, CHUNKS, "never", optimizer_state=optimizer)
    pipe = Pipeline(make(), plan)
    try:
        trainer = Trainer(pipe, torch.randn(BATCH, width), torch.randn(BATCH, out), devices=plan.devices,
                          optimizer=optimizer)
        trainer.step()
        measured = measure_memory(trainer, pipe)
    finally:
        pipe.close()
    return [(stage.memory_bytes, got) for stage, got in zip(plan.stages, measured)]


def assert_close_bounds(pairs: list[tuple[int, int]], slack: float) -> None:
    for stage, (bound, got) in enumerate(pairs):
        assert got <= bound <= slack * got, f"stage {stage}: predicted {bound}, measured {got}"


def test_a_skip_stashed_and_popped_inside_one_stage_is_counted():
    """The pop layer saves (a slice of) the skip, which its saved bytes leave out: stage 1
    holds WIDE·b·D floats per micro-batch that nothing else counted (predicted 26% short)."""
    prof = profiled(gated, D)
    assert_close_bounds(predicted_and_measured(gated, prof, D, D, [1, 4]), 1.15)
    model = CostModel(prof, ["cpu", "cpu"], [1.0, 1.0], BATCH, "sgd")
    costs = model.at(B)
    assert model.inner_bytes(costs, 1, 5) == WIDE * B * D * 4
    assert model.inner_bytes(costs, 1, 3) == 0 == model.held_bytes(costs, 1, 5)
    # checkpointed, only the micro-batch recomputed holds it
    never, always = (model.memory_terms(costs, 1, 5, CHUNKS, mode, 0.0).skips for mode in ("never", "always"))
    assert (never, always) == (CHUNKS * WIDE * B * D * 4, WIDE * B * D * 4)


def test_a_stashed_parameter_is_charged_as_the_copies_and_gradients_a_stage_holds():
    """The tied weight is the sender's parameter, already counted (the sender was predicted
    +100% when charged a weight per micro-batch).  Its gradients, made by the receiver, wait
    for the sender's backward with no backpressure: one per micro-batch in flight, the
    receiver's memory on CPU (a bound: one to two of four measured).  With devices of their own
    the receiver holds one copy per micro-batch until its backward, and the gradients wait on
    the sender's device."""
    prof = profiled(tied, 4 * D)
    assert prof.layers[0].stash_params == ["w"] and prof.layers[0].stash_fixed_bytes == {"w": 4 * D * D * 4}
    for balance in ([2, 3], [4, 1]):
        (sender, got_sender), (receiver, got_receiver) = predicted_and_measured(tied, prof, 4 * D, 4 * D, balance)
        assert got_sender <= sender <= 1.10 * got_sender and got_receiver <= receiver
    weight = 4 * D * D * 4
    cpu = CostModel(prof, ["cpu", "cpu"], [1.0, 1.0], BATCH, "sgd")
    cuda = CostModel(dataclasses.replace(prof, devices=["cuda:0", "cuda:1"]), ["cuda:0", "cuda:1"], [1.0, 1.0],
                     BATCH, "sgd")
    assert [cpu.held_bytes(cpu.at(B), a, c) for a, c in ((0, 2), (2, 5))] == [0, weight]
    assert [cuda.held_bytes(cuda.at(B), a, c) for a, c in ((0, 2), (2, 5))] == [weight, weight]
    assert cuda.inner_bytes(cuda.at(B), 0, 5) == 0 == cuda.held_bytes(cuda.at(B), 0, 5)


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_frozen_parameters_get_no_gradients_nor_optimizer_state(optimizer):
    """Stage 0 holds a frozen Linear: its parameters only (predicted +76% with SGD, +229% with
    Adam before)."""
    prof = profiled(frozen, D)
    linear = (D * D + D) * 4
    assert [layer.grad_param_bytes for layer in prof.layers[::2]] == [0, 0, linear]
    pairs = predicted_and_measured(frozen, prof, D, D, [2, 4], optimizer)
    assert_close_bounds(pairs, 1.10)
    model = CostModel(prof, ["cpu", "cpu"], [1.0, 1.0], BATCH, optimizer)
    terms = model.memory_terms(model.at(B), 2, 6, CHUNKS, "never", 0.0)
    assert (terms.parameters, terms.gradients, terms.optimizer) == (2 * linear, linear, {"sgd": 0, "adam": 2}[
        optimizer] * linear)


def adam_stage(params: Any, saved: Any, step: float = 2.0) -> MemoryTerms:
    """One stage alone under Adam (state 2): ``params`` bytes, all trainable, one micro-batch
    saving ``saved`` bytes (its output among them) and a backward peak of ``saved + 20``
    beyond what the stage holds steadily."""
    return stage_memory(params=params, buffers=0.0, saved=saved, output=5.0, output_saved=1.0, input_bytes=5.0,
                        first=True, skips=0.0, backward=(params + saved + 20.0, saved + 20.0), in_flight=1,
                        checkpointed=False, optimizer=2.0, step=step, own_copies=False)


def test_the_optimizer_step_is_the_peak_when_parameters_outweigh_activations():
    """After the backward, Adam's step holds parameters, gradients, two moments and its
    temporaries (2 per parameter byte): 1000 + 1000 + 2000 + 2000 = 6000 bytes, where the
    backward held 1000 + 1000 + 2000 + 10 saved + 20 = 4030; ``step`` is the difference."""
    terms = adam_stage(1000.0, 10.0)
    assert dataclasses.asdict(terms) == dict(parameters=1000, gradients=1000, optimizer=2000, buffers=0,
                                             activations=10, outputs=0, inputs=0, input_grad=0, skips=0,
                                             transient=20, step=1970)
    assert terms.total == 6000 and terms.dominant() == "optimizer"


def test_the_optimizer_step_adds_nothing_when_the_backward_holds_more():
    """5000 saved bytes: the backward's 9020 exceed the step's 6000, as without the step."""
    with_step, without = adam_stage(1000.0, 5000.0), adam_stage(1000.0, 5000.0, step=0.0)
    assert with_step == without and with_step.step == 0 and with_step.total == 4000 + 5000 + 20
    # candidate stages as arrays, as the search passes them: each its own case
    both = adam_stage(np.array([1000.0, 1000.0]), np.array([10.0, 5000.0]))
    assert both.total.tolist() == [6000, 9020] and both.step.tolist() == [1970, 0]


def test_the_step_factor_of_each_optimizer_name_and_of_a_given_state_factor():
    assert [step_factor(name) for name in ("sgd", "momentum", "adam")] == [0.0, 0.0, 2.0]
    assert step_factor(1.5) == step_factor(3) == 2.0  # a number names no optimizer: the largest measured
    assert step_factor(0.0) == 0.0  # no state: plain SGD, which updates in place
    for bad in ("lion", -1.0):
        with pytest.raises(OptionError):
            step_factor(bad)


def big_linear() -> nn.Sequential:
    """One parameter tensor outweighing the activations (1 MiB against 16·512 floats)."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(2 * D, 2 * D), nn.ReLU())


@pytest.mark.parametrize("foreach", [False, True])
def test_an_adam_step_peaks_within_the_prediction(foreach):
    """The peak while ``Adam.step()`` runs, on top of what it finds (parameters, gradients,
    moments), against the one-stage plan's: torch's for-loop step (CPU's default) makes twice
    the largest tensor in temporaries, its foreach step (CUDA's) one copy of every parameter
    (the bound's 2 covers both: 20% over here).  Without the step counted the prediction was
    the backward's, 15.6% short of the for-loop's."""
    torch.set_num_threads(1)
    x = torch.randn(B, 2 * D)
    prof = profile(big_linear(), x, ["cpu"], batch_sizes=[B], warmup=0, repeats=1, quiet=True)
    predicted = plan_of(prof, ["cpu"], [2], 1, "never", optimizer_state="adam").stages[0]
    model = big_linear()
    params = list(model.parameters())
    optimizer = torch.optim.Adam(params, foreach=foreach)
    peaks = []
    for _ in range(2):  # the first step makes the moments, the second finds them
        optimizer.zero_grad(set_to_none=True)
        model(x).square().mean().backward()
        held = unique_bytes(params + [p.grad for p in params]) + optimizer_state_bytes(optimizer, params)
        counter = AllocationCounter()
        with counter.track("step"):
            optimizer.step()
        peaks.append(held + counter.peak["step"])
    got = max(peaks)
    assert got <= predicted.memory_bytes <= (1.25 if foreach else 1.01) * got, (predicted.memory_bytes, got)
    assert predicted.memory_terms["step"] > 0


def test_a_layer_pairing_a_skip_inside_itself_is_profiled_and_planned():
    @skippable(stash=["identity"])
    class Save(nn.Module):
        def forward(self, x: torch.Tensor) -> Iterator[object]:
            yield stash("identity", x)
            return x

    @skippable(pop=["identity"])
    class Add(nn.Module):
        def forward(self, x: torch.Tensor) -> Iterator[object]:
            identity = yield pop("identity")
            return x + identity

    model = nn.Sequential(nn.Linear(4, 4), nn.Sequential(nn.Sequential(Save(), nn.Linear(4, 4), Add())),
                          nn.Linear(4, 4))
    prof = profile(model, torch.randn(8, 4), ["cpu", "cpu"], warmup=0, repeats=1, quiet=True)
    assert [(layer.stash, layer.pop) for layer in prof.layers] == [([], [])] * 3
    assert chain_of(build_graph(prof)).skips == []
    autopipe.partition(model, torch.randn(8, 4), devices=["cpu", "cpu"], profile=prof).close()
    # a profile listing the pair (made by hand) is read the same way
    paired = dataclasses.replace(prof, layers=[prof.layers[0], dataclasses.replace(
        prof.layers[1], stash=["identity"], pop=["identity"], stash_bytes={"identity": 16}), prof.layers[2]])
    assert chain_of(build_graph(paired)).skips == []


def test_one_copy_size_between_devices_is_refused_before_any_timing():
    calls = []
    layer = nn.Linear(4, 4)
    layer.register_forward_hook(lambda *_: calls.append(1))
    with pytest.raises(OptionError, match=r"copy_sizes needs two or more .* \[1024\]"):
        profile(nn.Sequential(layer), torch.randn(8, 4), ["cpu", "cpu"], copy_sizes=[1024], quiet=True)
    assert calls == []
    profile(nn.Sequential(nn.Linear(4, 4)), torch.randn(8, 4), ["cpu"], copy_sizes=[1024], warmup=0, repeats=1,
            quiet=True)


def test_checkpointed_micro_batches_keep_a_copy_of_the_buffers_each():
    """A checkpointed micro-batch recomputes on the buffers as its forward found them: the runtime
    keeps a copy per micro-batch in flight and the recomputation one of those it restores after
    (5 x 1000 bytes beside the 1000 of the buffers)."""
    common = dict(params=0.0, buffers=1000.0, saved=10.0, output=5.0, output_saved=1.0, input_bytes=5.0, first=True,
                  skips=0.0, backward=(30.0, 30.0), in_flight=4, optimizer=0.0, step=0.0, own_copies=False)
    kept, plain = stage_memory(checkpointed=True, **common), stage_memory(checkpointed=False, **common)
    assert (kept.buffers, plain.buffers) == (6000, 1000)


def test_unique_bytes_counts_views_once_and_sparse_tensors_by_what_they_hold() -> None:
    """A sparse gradient (``Embedding(sparse=True)``'s) has no storage of its own: its indices and
    values are counted (``measure_memory`` raised NotImplementedError on it)."""
    dense = torch.zeros(10, 4)
    assert unique_bytes([dense, dense[2:], dense.t()]) == 160
    embedding = torch.nn.Embedding(100, 8, sparse=True)
    embedding(torch.tensor([[1, 2, 2], [5, 1, 7]])).sum().backward()
    grad = embedding.weight.grad
    assert grad.layout == torch.sparse_coo
    assert unique_bytes([grad]) == 6 * 8 * 4 + 6 * 8  # per lookup a row of 8 float32 values and an int64 index
