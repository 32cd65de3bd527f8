"""Helpers shared by test modules: comparing a pipeline with the plain model, a small MLP, and the
planner's cost model of a synthetic profile."""
from __future__ import annotations

import copy
import itertools
import math
import dataclasses
import threading
import time
from typing import Any, Callable, Sequence

import torch
from torch import Tensor, nn

import autopipe
from autopipe.planning._budget import Budget
from autopipe.planning.cost import CostModel
from autopipe.profiling.profiles import Profile, Stat
from autopipe.runtime.microbatch import split_sizes


def assert_close(actual: Tensor, expected: Tensor, what: str = "", rel: float = 1e-5, least: float = 0.0) -> None:
    """Equal within ``rel`` relative to the expected tensor's norm, or to ``least`` if larger (the
    largest gradient's norm: a gradient that is zero but for rounding has no digits to compare)."""
    assert actual.shape == expected.shape, what
    error = (actual.detach() - expected.detach()).norm().item()
    scale = max(expected.detach().norm().item(), least, 1e-12)
    assert error <= rel * scale, f"{what}: relative error {error / scale:.2e}"


def micro_batches(x: Tensor, replicas: int, chunks: int) -> list[Tensor]:
    """The micro-batches of every replica, in order: the batch split over replicas, each share
    over chunks (as the pipeline splits them)."""
    shares = torch.split(x, split_sizes(len(x), replicas))
    return [part for share in shares for part in torch.split(share, split_sizes(len(share), chunks))]


def reference_step(model: nn.Module, x: Tensor, g: Tensor, chunks: int, replicas: int = 1) -> Tensor:
    """The plain model on each micro-batch (of each replica's share), loss ``sum(out * g)``,
    gradients accumulated."""
    outputs = []
    for xs, gs in zip(micro_batches(x, replicas, chunks), micro_batches(g, replicas, chunks)):
        out = model(xs)
        (out * gs).sum().backward()
        outputs.append(out.detach())
    return torch.cat(outputs)


def assert_step_matches(pipe: nn.Module, reference: nn.Module, x: Tensor, chunks: int, replicas: int = 1,
                        what: str = "") -> None:
    """One step of ``pipe`` and of the plain ``reference`` (:func:`reference_step`, loss
    ``sum(out * g)`` for a random ``g``): the same output, input gradient (if ``x`` needs one)
    and every parameter's gradient; ``what`` prefixes the messages."""
    x_ref = x.detach().clone().requires_grad_(x.requires_grad)
    out = pipe(x)
    g = torch.randn_like(out)
    expected = reference_step(reference, x_ref, g, chunks, replicas)
    (out * g).sum().backward()
    assert_close(out, expected, f"{what}output")
    if x.requires_grad:
        assert_close(x.grad, x_ref.grad, f"{what}input gradient")
    expected_params = dict(reference.named_parameters())
    for name, param in pipe.named_parameters():
        assert param.grad is not None, name
        assert_close(param.grad, expected_params[name].grad, f"{what}{name}.grad")


def assert_training_matches(pipe: nn.Module, model: nn.Module, reference: nn.Module, inputs: Sequence[Tensor],
                            chunks: int, what: str = "") -> None:
    """A training step (SGD) per input of ``pipe``, which holds ``model``'s tensors, and of
    ``reference``, a copy of ``model`` made before, run micro-batch by micro-batch
    (:func:`reference_step`): after each, the same output, every parameter's gradient and every
    buffer (running statistics, counters), which the next step's forward reads."""
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, reference)]
    for step, x in enumerate(inputs):
        for optimizer in optimizers:
            optimizer.zero_grad(set_to_none=True)
        out = pipe(x)
        g = torch.randn_like(out)
        expected = reference_step(reference, x, g, chunks)
        (out * g).sum().backward()
        prefix = f"{what}step {step + 1}: "
        assert_close(out, expected, f"{prefix}output")
        largest = max(q.grad.norm().item() for q in reference.parameters() if q.grad is not None)
        for (name, p), q in zip(model.named_parameters(), reference.parameters()):
            assert p.grad is not None, f"{prefix}{name}"
            assert_close(p.grad, q.grad, f"{prefix}{name}.grad", least=largest)
        for (name, b), c in zip(model.named_buffers(), reference.buffers()):
            assert_close(b.double(), c.double(), f"{prefix}{name}")
        for optimizer in optimizers:
            optimizer.step()


def assert_transparent(model: nn.Module, x: Tensor, balance: Sequence[int], chunks: int,
                       checkpoint: str, **options: Any) -> autopipe.Pipeline:
    """:func:`assert_step_matches` for a new pipeline of ``model``, and the same state after."""
    reference = copy.deepcopy(model)
    devices = ["cpu"] * (len(balance) // options.get("interleave", 1))
    pipe = autopipe.Pipeline(model, balance=list(balance), devices=devices,
                             chunks=chunks, checkpoint=checkpoint, **options)
    assert_step_matches(pipe, reference, x, chunks)
    expected_state = reference.state_dict()
    for name, value in pipe.state_dict().items():
        assert_close(value.float(), expected_state[name].float(), name)
    return pipe


def mlp() -> nn.Sequential:
    return nn.Sequential(
        nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(inplace=True),
        nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 3),
    )


def model_of(profile: Profile, speeds: Sequence[float], engine: str = "local") -> CostModel:
    """The cost model of ``profile`` on its own devices, for SGD with momentum (the planner's default)."""
    return CostModel(profile, profile.devices, speeds, profile.batch_size, "momentum", engine)


def untimed(profile: Profile) -> Profile:
    """``profile`` with its measured times replaced by times that follow from its bytes alone:
    a plan made from it does not change with the machine's load, so a test that plans and runs
    a model checks the same split every time.  Forward ``b · (1 + MiB of parameters)`` ms at
    micro-batch ``b``, backward twice that; copies free (CPU devices share memory)."""
    layers = []
    for layer in profile.layers:
        weight = 1.0 + layer.param_bytes / 2**20
        forward = {b: Stat(b * weight, b * weight, b * weight, 1) for b in layer.forward}
        backward = {b: Stat(2 * b * weight, 2 * b * weight, 2 * b * weight, 1) for b in layer.backward}
        layers.append(dataclasses.replace(layer, forward=forward, backward=backward))
    copies = [dataclasses.replace(fit, latency_ms=0.0, ms_per_byte=0.0) for fit in profile.copies]
    return dataclasses.replace(profile, layers=layers, copies=copies)


def all_splits(layers: int, devices: int) -> Any:
    """Every split of ``layers`` into 1..``devices`` stages, as bounds."""
    for k in range(1, devices + 1):
        for cuts in itertools.combinations(range(1, layers), k - 1):
            yield (0, *cuts, layers)


def brute_force(model: CostModel, chunks: Sequence[int], modes: Sequence[str], limits: Sequence[float]) -> float:
    """Every stage count, split, micro-batch count and mode: the least feasible time."""
    best = math.inf
    for bounds in all_splits(model.layers, len(limits)):
        for m in chunks:
            for mode in modes:
                evaluation = model.evaluate(bounds, m, mode)
                if all(s.memory <= limit for s, limit in zip(evaluation.stages, limits)):
                    best = min(best, evaluation.iteration_ms)
    return best


def balances(stages: int, layers: int) -> list[int]:
    """``layers`` over ``stages`` as evenly as possible, the first stages one larger."""
    return [layers // stages + (1 if s < layers % stages else 0) for s in range(stages)]


class StopAfter(Budget):
    """A budget that runs out at its ``calls``-th check: stops a search at every point in turn,
    independent of the machine's speed."""

    def __init__(self, calls: int) -> None:
        super().__init__(None)
        self.calls = calls

    def out(self, expected: float = 0.0) -> bool:
        self.calls -= 1
        self.spent = self.spent or self.calls < 0
        return self.spent


class Overlap:
    """Two calls from two threads that overlap for sure: the first's :meth:`hold` (put inside it:
    a layer's forward or backward) waits until the second is starting, then a moment more, while
    the second starts its phase (:meth:`run`)."""

    def __init__(self) -> None:
        self.inside, self.other = threading.Event(), threading.Event()

    def hold(self) -> None:
        """In the first call only: wait for the second."""
        if not self.inside.is_set():
            self.inside.set()
            assert self.other.wait(30), "the second call never started"
            time.sleep(0.5)

    def run(self, first: Callable[[], object], second: Callable[[], object]) -> None:
        """``first`` and, once it holds, ``second``, each on its own thread; their failures raised."""
        failures: list[BaseException] = []

        def call(index: int) -> None:
            try:
                if index:
                    assert self.inside.wait(30), "the first call never held"
                    self.other.set()
                (first, second)[index]()
            except BaseException as error:  # raised below, on the test's thread
                failures.append(error)

        threads = [threading.Thread(target=call, args=(i,)) for i in range(2)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(60)
        assert not failures, failures
