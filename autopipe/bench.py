"""Run a plan beside the unpartitioned model and hold the planner's predictions against the clock."""
from __future__ import annotations

import copy
import math
import statistics
import time
from dataclasses import dataclass, fields
from typing import Any, Callable, Iterable, Mapping, Sequence, TypeVar

import torch
from torch import Tensor, nn

from ._vocab import CheckpointMode
from .planning.cost import CostModel
from .planning.memory import OPTIMIZER_STATE
from .device import ops_for, resolve_devices
from .planning.plans import Plan, StagePlan
from .profiling.profiles import Profile
from .runtime import Pipeline
from .runtime.memory import optimizer_state_bytes
from .runtime.microbatch import Value, map_tensors, tensors_of
from .planning.replicas import plan_events
from .planning.simulate import Simulation, simulate_plan
from .planning import build_plan
from .timeline import Event

__all__ = [
    "random_batch", "synthetic_batch", "regression_loss", "StepTime", "Trainer", "round_robin", "medians",
    "Times", "stage_times", "Row", "BenchResult", "bench_plan", "format_bench", "plan_of",
    "make_optimizer", "plan_optimizer", "measure_memory", "plan_devices", "check_local", "describe_plan",
]

#: Figures under this share of the measured iteration get no error percentage: at that size the
#: percentage measures the timer, not the model (a CPU "copy" takes microseconds).
ERROR_FLOOR = 0.01

T = TypeVar("T")


def random_batch(batch_size: int, shape: Sequence[int], generator: torch.Generator | None = None) -> Tensor:
    """A batch of standard normal samples of ``shape``; one ``ValueError`` naming the sizes where
    it does not fit in memory (a mistyped ``--input-shape 99999,99999`` asked for 160 GB)."""
    size = 4 * batch_size * math.prod(shape)
    too_large = ValueError(f"a random batch of {batch_size} samples of shape {list(shape)} takes "
                           f"{size / 2**30:.1f} GiB, which this machine cannot allocate; give a smaller --batch-size "
                           "or --input-shape")
    if size >= 2**62:  # no allocator takes it, and torch's sizes overflow (a dump of C++ frames)
        raise too_large
    try:
        return torch.randn(batch_size, *shape, generator=generator)
    except RuntimeError as error:  # torch's "can't allocate memory" (OutOfMemoryError on CUDA is one)
        if "alloc" not in str(error).lower() and not isinstance(error, torch.OutOfMemoryError):
            raise
        raise too_large from None


def synthetic_batch(model: nn.Module, shape: Sequence[int], batch_size: int,
                    seed: int = 0, *, shape_source: str | None = None) -> tuple[Tensor, Value]:
    """A random input batch and a regression target of the model's output's structure: a random
    tensor of each output tensor's shape (a tuple or dict output gets a tuple or dict of them).

    Synthetic data is enough to time a step; the target comes from one no-grad forward so any
    model (classifier or not) gets a well-defined loss (:func:`regression_loss`).  That forward is
    also the first call of the model on ``shape``, so its failure (most often a shape the model
    does not take) is raised as one ``ValueError`` naming the shape and, if given,
    ``shape_source`` (where the shape came from and how to give another), not as an error from
    deep inside the model; so is an output with no floating-point tensor, which no loss can train.
    """
    generator = torch.Generator().manual_seed(seed)
    batch = random_batch(batch_size, shape, generator)
    try:
        with torch.no_grad():
            output = model(batch)
    except Exception as error:
        source = "" if shape_source is None else f" ({shape_source})"
        raise ValueError(f"the model's forward on a random batch of shape {list(batch.shape)} failed: "
                         f"{type(error).__name__}: {error}; check that the model takes samples of shape "
                         f"{list(shape)}{source}") from error
    if not any(t.is_floating_point() for t in tensors_of(output)):
        raise ValueError(f"the model's output ({_described(output)}) has no floating-point tensor, so bench "
                         "has no loss to train it with; bench a model that returns its float outputs "
                         "(e.g. logits rather than their argmax)")
    # integer outputs keep themselves as their target: regression_loss skips them
    return batch, map_tensors(output, lambda t: torch.randn(t.shape, generator=generator)
                              if t.is_floating_point() else t.clone())


def _described(output: Value) -> str:
    shapes = [f"{t.dtype} {tuple(t.shape)}" for t in tensors_of(output)]
    return ", ".join(shapes) if shapes else f"a {type(output).__name__} without tensors"


def regression_loss(output: Value, target: Value) -> Tensor:
    """The sum of each floating-point output tensor's MSE against its target tensor (the tensor
    at the same place of :func:`synthetic_batch`'s target), so every output trains alike."""
    pairs = zip(tensors_of(output), tensors_of(target))
    return sum(nn.functional.mse_loss(o, t.to(o.device)) for o, t in pairs if o.is_floating_point())


@dataclass(frozen=True)
class StepTime:
    """One timed training step, in ms.

    ``forward_ms`` is the model call; ``backward_ms`` the loss and its backward; ``step_ms`` adds
    ``zero_grad`` and the optimizer step, i.e. what a training loop pays per batch.
    """

    forward_ms: float
    backward_ms: float
    step_ms: float

    @property
    def iteration_ms(self) -> float:
        """Forward plus backward: what the planner predicts."""
        return self.forward_ms + self.backward_ms


#: The optimizers a bench trains with, by the optimizer-state factor a plan was made for.
OPTIMIZERS = {factor: name for name, factor in OPTIMIZER_STATE.items()}


def make_optimizer(name: str, params: Iterable[Tensor], lr: float) -> torch.optim.Optimizer:
    """``sgd``, ``momentum`` (SGD with momentum 0.9) or ``adam``: the optimizers whose state the
    planner's ``optimizer_state`` names."""
    if name == "adam":
        return torch.optim.Adam(params, lr=lr)
    if name in ("sgd", "momentum"):
        return torch.optim.SGD(params, lr=lr, momentum=0.9 if name == "momentum" else 0.0)
    raise ValueError(f"optimizer '{name}' is not one of sgd, momentum, adam")


def plan_optimizer(plan: Plan) -> str:
    """The optimizer whose state ``plan`` was sized for (its ``optimizer_state_factor``)."""
    factor = float(plan.options.get("optimizer_state_factor", 1.0))
    if factor not in OPTIMIZERS:
        raise ValueError(f"the plan counts {factor}x the parameters of optimizer state; bench trains with "
                         f"{', '.join(f'{v} ({k:g}x)' for k, v in OPTIMIZERS.items())}: plan again with one of them")
    return OPTIMIZERS[factor]


class Trainer:
    """A model (plain or pipelined) training on one fixed batch, every step timed alike.

    Plain and pipelined models go through this same loop so their step times compare; a
    pipeline's trace of each step is kept for the per-stage figures.
    """

    def __init__(self, module: nn.Module, batch: Tensor, target: Value, *,
                 loss_fn: Callable[[Value, Value], Tensor] = regression_loss,
                 devices: Sequence[torch.device | str] = ("cpu",), lr: float = 1e-3,
                 optimizer: str = "sgd") -> None:
        self.module = module
        self.batch = batch
        self.target = target
        self.loss_fn = loss_fn
        self.optimizer = make_optimizer(optimizer, module.parameters(), lr)
        self.ops = [ops_for(device) for device in dict.fromkeys(str(d) for d in devices)]
        self.times: list[StepTime] = []
        self.losses: list[float] = []
        self.traces: list[list[Event]] = []

    def _now(self) -> float:
        for ops in self.ops:
            ops.synchronize()
        return time.perf_counter() * 1e3

    def step(self) -> StepTime:
        """Run one training step and record its time, loss and (for a pipeline) trace."""
        start = self._now()
        self.optimizer.zero_grad(set_to_none=True)
        begin = self._now()
        if isinstance(self.module, Pipeline) and self.module.schedule != "gpipe":
            loss, forward = self._train_step()
            end = self._now()
            middle = min(begin + forward, end)
        else:
            output = self.module(self.batch)
            middle = self._now()
            loss = self.loss_fn(output, _on_device_of(self.target, output))
            loss.backward()
            end = self._now()
        self.optimizer.step()
        done = self._now()
        measured = StepTime(middle - begin, end - middle, done - start)
        self.times.append(measured)
        self.losses.append(float(loss.detach()))
        last_trace = getattr(self.module, "last_trace", None)
        if callable(last_trace):
            self.traces.append(list(last_trace()))
        return measured

    def _train_step(self) -> tuple[Tensor, float]:
        """A pipeline whose schedule interleaves forwards and backwards (1F1B) trains with the loss
        inside (``train_step``): its loss, and when its last forward ended (ms from the call's
        start), where the simulator ends the forward phase too."""
        assert isinstance(self.module, Pipeline)
        loss = self.module.train_step(self.batch, target=self.target, loss_fn=self.loss_fn)
        forwards = [event.end_ms for event in self.module.last_trace() if event.kind == "F"]
        return loss, max(forwards, default=0.0)

    def forget(self) -> None:
        """Drop warm-up's times and traces, so medians are of steady-state steps only (its
        losses stay: those were training steps all the same)."""
        self.times.clear()
        self.traces.clear()


def _on_device_of(target: Value, output: Value) -> Value:
    """``target`` on the device of ``output``'s first tensor (a pipeline's outputs are all on its
    last stage's device)."""
    device = tensors_of(output)[0].device
    return map_tensors(target, lambda t: t.to(device))


def round_robin(trainers: Mapping[str, Trainer], steps: int, warmup: int = 1) -> None:
    """Round-robin: each round runs one step of every trainer, starting one further along.

    Load from elsewhere on the machine then falls on all trainers alike, which is what makes
    ratios measured in one run trustworthy when absolute times are not.
    """
    names = list(trainers)
    for round_index in range(warmup + steps):
        if round_index == warmup:
            for trainer in trainers.values():
                trainer.forget()
        shift = round_index % len(names)
        for name in names[shift:] + names[:shift]:
            trainers[name].step()


def medians(items: Sequence[T]) -> T:
    """Each field's median over ``items``, dataclasses of one type (the steps of one trainer)."""
    kind = type(items[0])
    return kind(*(statistics.median(getattr(item, f.name) for item in items) for f in fields(kind)))


@dataclass(frozen=True)
class Times:
    """Where one stage's (or the whole iteration's) time went, in ms."""

    forward_ms: float
    backward_ms: float
    copy_ms: float
    idle_ms: float

    def to_json(self) -> dict[str, float]:
        return {f.name: round(getattr(self, f.name), 4) for f in fields(self)}


def stage_times(events: Sequence[Event], stages: int, iteration_ms: float,
                placement: Sequence[int] | None = None) -> list[Times]:
    """Per stage: forward and backward compute summed over micro-batches, copy-lane time, and
    the rest of the iteration, when the stage's device computed nothing (its bubble; the
    device of stage ``s`` is ``placement[s]``, by default its own).

    Predicted and measured events go through this same function, so the two compare field by
    field.  Recomputation (``R``) counts as backward, as the planner predicts it.
    """
    where = list(range(stages)) if placement is None else list(placement)
    totals = [{"F": 0.0, "B": 0.0, "copy": 0.0} for _ in range(stages)]
    for event in events:
        key = "copy" if event.lane == "copy" else ("F" if event.kind == "F" else "B")
        totals[event.stage][key] += event.duration_ms
    busy = [0.0] * (max(where) + 1)
    for stage, total in enumerate(totals):
        busy[where[stage]] += total["F"] + total["B"]
    return [Times(t["F"], t["B"], t["copy"], max(iteration_ms - busy[where[s]], 0.0)) for s, t in enumerate(totals)]


@dataclass(frozen=True)
class Row:
    """Predicted next to measured for one stage or for the whole iteration."""

    name: str
    predicted: Times
    measured: Times
    predicted_total_ms: float
    measured_total_ms: float
    predicted_bytes: int | None = None
    measured_bytes: int | None = None

    @property
    def memory_error(self) -> float | None:
        """Error of the predicted peak in percent of the measured one."""
        if self.predicted_bytes is None or not self.measured_bytes:
            return None
        return 100.0 * (self.predicted_bytes - self.measured_bytes) / self.measured_bytes

    def errors(self, scale_ms: float) -> dict[str, float | None]:
        """Error of each figure in percent of the measured value, ``(predicted − measured) /
        measured``; ``None`` for figures under :data:`ERROR_FLOOR` of ``scale_ms``."""
        pairs = {f.name: (getattr(self.predicted, f.name), getattr(self.measured, f.name))
                 for f in fields(Times)}
        pairs["total_ms"] = (self.predicted_total_ms, self.measured_total_ms)
        return {name: _error(p, m, scale_ms) for name, (p, m) in pairs.items()}


def _error(predicted: float, measured: float, scale_ms: float) -> float | None:
    if measured < ERROR_FLOOR * scale_ms or measured <= 0:
        return None
    return 100.0 * (predicted - measured) / measured


@dataclass
class BenchResult:
    """A plan's predicted and measured figures, and its speedup over one device, from one run."""

    plan: Plan
    rows: list[Row]
    single: StepTime
    pipeline: StepTime
    steps: int
    warmup: int
    predicted_events: list[Event]
    measured_events: list[Event]
    losses: list[float]

    @property
    def speedup(self) -> float:
        """One device's median step time over the pipeline's, both measured in the same rounds."""
        return self.single.step_ms / self.pipeline.step_ms

    @property
    def iteration(self) -> Row:
        return self.rows[-1]

    def to_json(self) -> dict[str, Any]:
        scale = self.iteration.measured_total_ms
        return {
            "kind": "bench",
            "schema_version": 1,
            "model": self.plan.model.get("digest"),
            "optimizer": plan_optimizer(self.plan),
            "devices": self.plan.devices,
            "replicas": self.plan.replicas,
            "replica_devices": self.plan.replica_devices,
            "interleave": self.plan.interleave,
            "schedule": self.plan.schedule,
            "batch_size": self.plan.batch_size,
            "chunks": self.plan.chunks,
            "balance": self.plan.balance,
            "checkpoint": self.plan.checkpoint,
            "steps": self.steps,
            "warmup": self.warmup,
            "rows": [
                {"name": row.name, "predicted": row.predicted.to_json(), "measured": row.measured.to_json(),
                 "predicted_total_ms": round(row.predicted_total_ms, 4),
                 "measured_total_ms": round(row.measured_total_ms, 4),
                 "error_pct": {k: _rounded(v) for k, v in row.errors(scale).items()},
                 "predicted_memory_bytes": row.predicted_bytes, "measured_memory_bytes": row.measured_bytes,
                 "memory_error_pct": _rounded(row.memory_error)}
                for row in self.rows
            ],
            "single_device": _step_json(self.single),
            "pipeline": _step_json(self.pipeline),
            "speedup": round(self.speedup, 4),
        }


def _rounded(value: float | None) -> float | None:
    return None if value is None else round(value, 2)


def _step_json(step: StepTime) -> dict[str, float]:
    return {"forward_ms": round(step.forward_ms, 4), "backward_ms": round(step.backward_ms, 4),
            "iteration_ms": round(step.iteration_ms, 4), "step_ms": round(step.step_ms, 4)}


def bench_plan(model: nn.Module, plan: Plan, batch: Tensor, target: Value, *, steps: int,
               warmup: int = 1) -> BenchResult:
    """Train ``model`` as ``plan``'s pipeline and as one module on ``plan.devices[0]``, in
    alternating steps, and compare the pipeline's medians with the plan's predictions.

    The pipeline takes over ``model``'s modules; the one-device run trains a copy made first.
    """
    if steps < 1 or warmup < 0:
        raise ValueError(f"need steps >= 1 and warmup >= 0, got steps={steps}, warmup={warmup}")
    check_local(plan)
    device = plan_devices(plan)[0]
    optimizer = plan_optimizer(plan)
    single = Trainer(copy.deepcopy(model).to(device), batch.to(device), target, devices=[device], optimizer=optimizer)
    pipe = Pipeline(model, plan)
    try:
        piped = Trainer(pipe, batch.to(device), target, devices=plan.used_devices, optimizer=optimizer)
        round_robin({"single device": single, "pipeline": piped}, steps, warmup)
        memory = measure_memory(piped, pipe)
    finally:
        pipe.close()
    simulation = simulate_plan(plan)
    return BenchResult(
        plan=plan, rows=_rows(plan, simulation, piped, memory), single=medians(single.times),
        pipeline=medians(piped.times), steps=steps, warmup=warmup,
        predicted_events=plan_events(plan, simulation), measured_events=piped.traces[-1], losses=piped.losses,
    )


def check_local(plan: Plan, path: str | None = None) -> None:
    """Refuse a plan made for the distributed engine (``--engine distributed``), naming its file
    ``path`` if given: bench runs plans in this one process, on the in-process runtime, which
    would run it without a word while its predictions are the distributed engine's (one process
    per stage, skips relayed stage by stage, a receive buffer per stage), comparable with
    nothing measured here."""
    if plan.options.get("engine", "local") == "local":
        return
    processes = plan.replicas * len(plan.stages)
    raise ValueError(f"{path or 'the plan'} was made for --engine distributed, which bench does not run (it runs "
                     f"plans in one process): run it under torchrun, one process per stage, e.g. torchrun "
                     f"--nproc-per-node {processes} examples/distributed_train.py --plan {path or 'PLAN'} (a "
                     "DistributedPipeline script), or plan again without --engine distributed to bench it here")


def plan_devices(plan: Plan) -> list[torch.device]:
    """The devices of every replica of ``plan``, each checked as :class:`~autopipe.Pipeline`
    checks them (:class:`~autopipe.DeviceError`): before a model is moved, which would fail
    in torch instead (a CUDA plan on a machine without CUDA)."""
    return resolve_devices(plan.used_devices)


def measure_memory(trainer: Trainer, pipe: Pipeline) -> list[int]:
    """Each stage's measured peak bytes over one more training step, apart from the timed ones
    (on CPU the measurement slows every operator): what the pipeline measures
    (:mod:`autopipe.runtime.memory`) plus, on CPU, the optimizer's state for the stage's
    parameters, which a device's own peak already includes.  The step leaves no time, trace or
    loss behind: those stay the steps run beside the plain model."""
    pipe.measure_memory = True
    try:
        trainer.step()
    finally:
        pipe.measure_memory = False
    for kept in (trainer.times, trainer.traces, trainer.losses):
        kept.pop()
    peaks = pipe.last_memory()
    assert peaks is not None
    return [peak.peak_bytes + (0 if peak.per_device else optimizer_state_bytes(
        trainer.optimizer, [p for m in stage.modules for p in m.parameters()]))
        for stage, peak in zip(pipe.stages, peaks)]


def plan_of(profile: Profile, devices: Sequence[str], balance: Sequence[int], chunks: int,
            checkpoint: CheckpointMode = "never", batch_size: int | None = None,
            optimizer_state: str = "momentum") -> Plan:
    """The plan of a configuration chosen by hand, costed by the planner's own cost model.

    Hand-picked rows (a tutorial's split, a sweep) then run and are predicted exactly like the
    planner's choice, so their predicted and measured times compare on equal terms.
    """
    batch = profile.batch_size if batch_size is None else batch_size
    model = CostModel(profile, list(devices[:len(balance)]),
                      [1.0] * len(balance), batch, optimizer_state)
    bounds = [0]
    for count in balance:
        bounds.append(bounds[-1] + count)
    options = {"balance": list(balance), "chunks": chunks, "checkpoint": checkpoint,
               "optimizer_state": optimizer_state, "optimizer_state_factor": model.optimizer_state_factor}
    return build_plan(profile, model, bounds, chunks, checkpoint, options)


def _rows(plan: Plan, simulation: Simulation, piped: Trainer, memory: Sequence[int]) -> list[Row]:
    """One row per stage and one for the whole iteration (mean idle per stage, which is its
    device's, total copy; no memory: stages peak at different times)."""
    count = len(plan.stages)
    predicted = stage_times(simulation.events, count, simulation.iteration_ms, plan.placement)
    per_step = [stage_times(trace, count, step.iteration_ms, plan.placement)
                for trace, step in zip(piped.traces, piped.times)]
    measured = [medians([step[s] for step in per_step]) for s in range(count)]
    step = medians(piped.times)
    rows = [Row(_stage_name(stage), p, m, simulation.iteration_ms, step.iteration_ms,
                _predicted_peak(plan, stage), measured_bytes)
            for stage, p, m, measured_bytes in zip(plan.stages, predicted, measured, memory)]
    whole_predicted = Times(plan.predicted.forward_ms, plan.predicted.backward_ms,
                            sum(t.copy_ms for t in predicted), statistics.fmean(t.idle_ms for t in predicted))
    whole_measured = Times(step.forward_ms, step.backward_ms, sum(t.copy_ms for t in measured),
                           statistics.fmean(t.idle_ms for t in measured))
    rows.append(Row("iteration", whole_predicted, whole_measured, plan.predicted.iteration_ms,
                    step.iteration_ms))
    return rows


def _predicted_peak(plan: Plan, stage: StagePlan) -> int:
    """The plan's peak for ``stage``; on a device that measures its own peak (CUDA), that of all
    the stages on the stage's device."""
    if stage.device.startswith("cpu"):
        return stage.memory_bytes
    return sum(s.memory_bytes for s in plan.stages if s.device == stage.device)


def _stage_name(stage: StagePlan) -> str:
    layers = stage.first_layer if stage.stop - stage.start == 1 else f"{stage.first_layer}..{stage.last_layer}"
    return f"#{stage.index} {layers} ({stage.device})"


def format_bench(result: BenchResult) -> str:
    """The comparison as a table: per stage and for the iteration, predicted, measured, error."""
    plan = result.plan
    scale = result.iteration.measured_total_ms
    width = max(len(row.name) for row in result.rows)
    figures = ("forward_ms", "backward_ms", "copy_ms", "idle_ms", "total_ms")
    labels = ("forward", "backward", "copy", "idle", "total", "peak memory MiB")
    head = " ".join(f"{label:^22}" for label in labels)
    sub = " ".join(f"{'pred':>7}{'meas':>8}{'err':>7}" for _ in labels)
    lines = [
        f"{describe_plan(plan)}; medians of {_count(result.steps, 'step')} after {result.warmup} warm-up, in ms",
        f"{'':<{width}} {head}", f"{'stage':<{width}} {sub}",
    ]
    for row in result.rows:
        errors = row.errors(scale)
        cells = []
        for name in figures:
            p, m = _pair(row, name)
            cells.append(f"{p:7.1f}{m:8.1f}{_percent(errors[name]):>7}")
        if row.predicted_bytes is not None and row.measured_bytes is not None:
            cells.append(f"{row.predicted_bytes / 2**20:7.1f}{row.measured_bytes / 2**20:8.1f}"
                         f"{_percent(row.memory_error):>7}")
        lines.append(f"{row.name:<{width}} {' '.join(cells)}")
    lines.append("error = (predicted - measured) / measured; '-' where the figure is under "
                 f"{ERROR_FLOOR:.0%} of the iteration; iteration idle = mean over stages; peak memory: "
                 f"one more step, {_memory_note(plan)}, optimizer {plan_optimizer(plan)}"
                 + ("; stage rows: replica 0's" if plan.replicas > 1 else ""))
    lines.append(f"one device {result.single.step_ms:.1f} ms/step, the plan {result.pipeline.step_ms:.1f} "
                 f"ms/step: speedup {result.speedup:.2f}x (steps interleaved, medians)")
    return "\n".join(lines)


def describe_plan(plan: Plan) -> str:
    """What ``plan`` runs, in one line: its replicas and their devices (with more than one), its
    stages, stages per device (with more than one), balance, micro-batches, checkpointing and
    schedule (when not fill-drain)."""
    replicas = ""
    if plan.replicas > 1:
        groups = ", ".join(f"[{', '.join(group[:plan.device_count])}]" for group in plan.replica_devices)
        replicas = f"{plan.replicas} replicas (data parallel) on {groups}, each "
    per_device = f", {plan.interleave} per device" if plan.interleave > 1 else ""
    shares = f" (batch {plan.batch_size}, {plan.replica_batch_size} per replica)" if plan.replicas > 1 else ""
    schedule = f", schedule {plan.schedule}" if plan.schedule != "gpipe" else ""
    return (f"{replicas}{_count(len(plan.stages), 'stage')}{per_device}, balance {plan.balance}, "
            f"{_count(plan.chunks, 'micro-batch')} of {plan.micro_batch_size}{shares}, "
            f"checkpoint {plan.checkpoint}{schedule}")


def _memory_note(plan: Plan) -> str:
    if all(device.startswith("cpu") for device in plan.used_devices):
        return "what each stage's thread allocates, plus its parameters and optimizer state"
    return "per device where a device measures its own (stages on it summed)"


def _count(number: int, noun: str) -> str:
    return f"{number} {noun}" if number == 1 else f"{number} {noun}{'es' if noun.endswith('h') else 's'}"


def _pair(row: Row, name: str) -> tuple[float, float]:
    if name == "total_ms":
        return row.predicted_total_ms, row.measured_total_ms
    return getattr(row.predicted, name), getattr(row.measured, name)


def _percent(value: float | None) -> str:
    return "-" if value is None else f"{value:+.0f}%"
