"""What the planner decided and predicts: the :class:`Plan` and its JSON file."""
from __future__ import annotations

import difflib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .._jsonio import Fields, plain_number, read_json, write_json_atomic
from ..profiling.profiles import read_model
from .._vocab import CHECKPOINT_MODES, SCHEDULES, TURN_RULES, CheckpointMode, Schedule, TurnRule

__all__ = ["StagePlan", "Prediction", "Plan", "placement", "PLAN_SCHEMA_VERSION", "CHECKPOINT_MODES", "SCHEDULES"]

PLAN_SCHEMA_VERSION = 1


def placement(stages: int, interleave: int) -> list[int]:
    """Device index of every stage when each device holds ``interleave`` of them, round-robin:
    stage ``s`` on device ``s % (stages / interleave)``."""
    return [s % (stages // interleave) for s in range(stages)]


@dataclass
class StagePlan:
    """One stage: layers ``[start, stop)`` on ``device``, with its predicted per-micro-batch costs.

    ``backward_ms`` is the gradient computation alone; ``recompute_ms`` the forward that a
    checkpointed micro-batch reruns before it (0 with ``checkpoint="never"``).
    ``copy_in_ms`` is the forward copy of everything the stage receives (main input and skips,
    each on its own route); ``copy_grad_ms`` the backward copy of the gradients it receives.
    ``reduce_ms`` is the reduction of its gradients across replicas, started when its last
    backward ends (0 with one replica).  ``memory_bytes`` is the predicted peak: parameters,
    gradients, optimizer state, activations of the micro-batches in flight and skip tensors held;
    ``memory_terms`` the same by term (empty in plans made before they were recorded).
    Formulas: :mod:`autopipe.planning.memory`.
    """

    index: int
    device: str
    start: int
    stop: int
    first_layer: str
    last_layer: str
    forward_ms: float
    backward_ms: float
    recompute_ms: float
    copy_in_ms: float
    copy_grad_ms: float
    memory_bytes: int
    reduce_ms: float = 0.0
    memory_terms: dict[str, int] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return dict(self.__dict__)

    def dominant_memory(self) -> tuple[str, float] | None:
        """The largest memory term and its share of the stage's peak, if the plan records terms."""
        if not self.memory_terms or self.memory_bytes <= 0:
            return None
        name = max(self.memory_terms, key=lambda key: self.memory_terms[key])
        return name, self.memory_terms[name] / self.memory_bytes

    @staticmethod
    def from_json(f: Fields) -> StagePlan:
        return StagePlan(
            index=f.int("index", 0), device=f.str("device"), start=f.int("start", 0),
            stop=f.int("stop", 1), first_layer=f.str("first_layer"), last_layer=f.str("last_layer"),
            forward_ms=f.float("forward_ms", 0.0), backward_ms=f.float("backward_ms", 0.0),
            recompute_ms=f.float("recompute_ms", 0.0), copy_in_ms=f.float("copy_in_ms", 0.0),
            copy_grad_ms=f.float("copy_grad_ms", 0.0),
            memory_bytes=f.int("memory_bytes", 0),
            reduce_ms=f.float("reduce_ms", 0.0) if f.has("reduce_ms") else 0.0,
            memory_terms=_terms(f) if f.has("memory_terms") else {},
        )


@dataclass
class Prediction:
    """Predicted times of one training iteration (forward phase + backward phase), in ms.

    ``bubble_fraction`` is the share of device-time (devices × iteration) in which a device
    computes nothing.  ``reduction_ms`` is how much the gradient reduction between replicas
    adds after the backward phase (0 with one replica); ``iteration_ms`` includes it.
    ``lower_bound_ms`` is what the planner proved: no plan it searched is
    faster (equal to ``iteration_ms`` when its search finished); :attr:`gap` how far above that
    this plan may be.
    """

    iteration_ms: float
    forward_ms: float
    backward_ms: float
    bubble_fraction: float
    reduction_ms: float = 0.0
    lower_bound_ms: float | None = None

    @property
    def gap(self) -> float | None:
        """``(iteration_ms - lower_bound_ms) / iteration_ms`` (``None`` if no bound is known)."""
        if self.lower_bound_ms is None or not self.iteration_ms > 0:
            return None if self.lower_bound_ms is None else 0.0
        gap = (self.iteration_ms - self.lower_bound_ms) / self.iteration_ms
        return gap if gap > 1e-9 else 0.0  # below that, rounding between equal sums

    def to_json(self) -> dict[str, Any]:
        return {**self.__dict__, "gap": self.gap}

    @staticmethod
    def from_json(f: Fields) -> Prediction:
        if f.float("bubble_fraction", 0.0) > 1:
            raise f.get("bubble_fraction").error("must be at most 1 (a share of the devices' time)")
        return Prediction(f.float("iteration_ms", 0.0), f.float("forward_ms", 0.0),
                          f.float("backward_ms", 0.0), f.float("bubble_fraction", 0.0),
                          f.float("reduction_ms", 0.0) if f.has("reduction_ms") else 0.0,
                          f.float("lower_bound_ms", 0.0) if f.has("lower_bound_ms")
                          and f.get("lower_bound_ms").value is not None else None)


def _terms(f: Fields) -> dict[str, int]:
    """A stage's memory by term: byte counts (a transient one may be negative) adding up to its
    ``memory_bytes``, as the planner writes them."""
    terms, whole = f.get("memory_terms"), f.int("memory_bytes", 0)
    read = {name: terms.int(name) for name in terms.keys()}
    if read and sum(read.values()) != whole:
        raise terms.error(f"must add up to the stage's memory_bytes, {whole}, found {sum(read.values())}")
    return read


@dataclass
class Plan:
    """Split points, micro-batches and checkpointing for one model on given devices.

    Micro-batches follow ``torch.tensor_split(batch, chunks)``: the first ``batch % chunks``
    micro-batches have one sample more, so every micro-batch has ``micro_batch_size`` or
    ``micro_batch_size - 1`` samples.  The cost model costs every micro-batch at
    ``micro_batch_size = ceil(batch_size / chunks)``: exact when ``chunks`` divides the batch,
    an upper bound otherwise.  ``options`` records what the planner was asked (devices offered,
    memory limits, speeds, requested checkpoint and chunks).

    ``interleave`` is the number of stages per device: with ``k = len(stages) / interleave``
    devices, stage ``s`` runs on device ``s % k`` (``devices`` still names one per stage), so
    each device holds ``interleave`` chunks of the chain, as in torch's interleaved schedules;
    ``turns`` is how such a device picks among its stages' ready tasks
    (:data:`~autopipe.planning.schedules.TURN_RULES`, the faster predicted).

    ``replicas`` copies of this pipeline train side by side (data parallel), replica ``r`` on
    ``replica_devices[r]`` (one device per stage, like ``devices``, which is replica 0's), each
    on its share of the batch: ``torch.tensor_split(batch, replicas)``, so the first
    ``batch_size % replicas`` replicas have one sample more.  ``chunks``, ``micro_batch_size``
    and the stages' predicted costs are per replica; gradients are summed over the replicas.
    """

    model: dict[str, Any]
    profile_digest: str
    devices: list[str]
    batch_size: int
    chunks: int
    checkpoint: CheckpointMode
    schedule: Schedule
    stages: list[StagePlan]
    predicted: Prediction
    options: dict[str, Any] = field(default_factory=dict)
    interleave: int = 1
    replicas: int = 1
    turns: TurnRule = "depth_first"
    replica_devices: list[list[str]] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.replica_devices:
            self.replica_devices = [list(self.devices)]

    @property
    def replica_batch_size(self) -> int:
        """Samples of the largest replica's share of the batch."""
        return -(-self.batch_size // self.replicas)

    @property
    def device_count(self) -> int:
        """Devices the plan uses (stages / interleave)."""
        return len(self.stages) // self.interleave

    @property
    def used_devices(self) -> list[str]:
        """The devices of every replica, replica by replica (``replica_devices`` without an
        interleaved plan's repeats): what the plan runs on, as the devices it was planned for."""
        return [name for group in self.replica_devices for name in group[: self.device_count]]

    @property
    def placement(self) -> list[int]:
        """Device index of every stage: stage ``s`` on ``s % device_count``."""
        return placement(len(self.stages), self.interleave)

    @property
    def balance(self) -> list[int]:
        """Layers per stage."""
        return [stage.stop - stage.start for stage in self.stages]

    @property
    def device_memory_bytes(self) -> list[int]:
        """Predicted peak bytes per device of one replica: the sum of its stages' (what a
        memory limit bounds when a device holds several stages)."""
        held = [0] * self.device_count
        for stage, device in zip(self.stages, self.placement):
            held[device] += stage.memory_bytes
        return held

    @property
    def micro_batch_size(self) -> int:
        return -(-self.replica_batch_size // self.chunks)

    @property
    def split_points(self) -> list[tuple[int, str]]:
        """Index and name of the first layer of every stage after the first."""
        return [(stage.start, stage.first_layer) for stage in self.stages[1:]]

    def to_json(self) -> dict[str, Any]:
        return {
            "kind": "plan",
            "schema_version": PLAN_SCHEMA_VERSION,
            "model": self.model,
            "profile_digest": self.profile_digest,
            "devices": self.devices,
            "batch_size": self.batch_size,
            "chunks": self.chunks,
            "micro_batch_size": self.micro_batch_size,
            "checkpoint": self.checkpoint,
            "schedule": self.schedule,
            "interleave": self.interleave,
            "replicas": self.replicas,
            "replica_devices": self.replica_devices,
            "turns": self.turns,
            "balance": self.balance,
            "split_points": [{"index": i, "name": n} for i, n in self.split_points],
            "stages": [stage.to_json() for stage in self.stages],
            "predicted": self.predicted.to_json(),
            "options": self.options,
        }

    def save(self, path: str | os.PathLike[str]) -> Path:
        """Validate (:meth:`validate`) and write the plan as JSON, atomically."""
        return write_json_atomic(path, self._checked_json())

    def validate(self) -> None:
        """Check a plan built or changed in memory as :meth:`load` checks a file; raises
        :class:`FormatError` naming the field: what is saved is what a file can hold."""
        self._checked_json()

    def _checked_json(self) -> dict[str, Any]:
        """:meth:`to_json`, checked as :meth:`load` checks a file; the counts it divides by
        (``micro_batch_size``) are checked first, so that a zero is named rather than divided by."""
        counts = _as_file({"batch_size": self.batch_size, "replicas": self.replicas, "chunks": self.chunks})
        for name in counts.keys():
            counts.int(name, 1)
        document = self.to_json()
        Plan._read(_as_file(document))
        return document

    @staticmethod
    def load(path: str | os.PathLike[str]) -> Plan:
        """Read and validate a plan file; raises ``FormatError`` naming file and field (an
        ``OptionError`` if ``path`` is no file name)."""
        return Plan._read(read_json(path, "plan", PLAN_SCHEMA_VERSION))

    @staticmethod
    def _read(f: Fields) -> Plan:
        plan = Plan(
            model=read_model(f.get("model")),
            profile_digest=f.str("profile_digest"),
            devices=f.get("devices").device_names(),
            batch_size=f.int("batch_size", 1),
            chunks=f.int("chunks", 1),
            checkpoint=f.str("checkpoint"),
            schedule=f.str("schedule") if f.has("schedule") else "gpipe",
            stages=f.list_of("stages", StagePlan.from_json),
            predicted=Prediction.from_json(f.get("predicted")),
            options=_options(f.get("options")) if f.has("options") else {},
            interleave=f.int("interleave", 1) if f.has("interleave") else 1,
            replicas=f.int("replicas", 1) if f.has("replicas") else 1,
            replica_devices=([item.device_names() for item in f.get("replica_devices").items()]
                             if f.has("replica_devices") else []),
            turns=f.str("turns") if f.has("turns") else "depth_first",
        )
        _check_consistent(plan, f)
        return plan


def _check_known(f: Fields, written: dict[str, Any], what: str) -> None:
    """Refuse a field the plan's own JSON (``written``) does not have: a misspelt one (``"Schedule"``)
    would be ignored, and the plan run with the default of the field it stands for."""
    unknown = sorted(set(f.value) - set(written), key=str)
    if unknown:
        close = difflib.get_close_matches(str(unknown[0]), list(written), 1)
        meant = f" (a misspelt '{close[0]}'?)" if close else ""
        raise f.error(f"is no field of {what}{meant}; remove or correct it, or make the plan again", str(unknown[0]))


def _as_file(document: dict[str, Any]) -> Fields:
    """``document`` as :meth:`Plan.load` would read it back from its JSON (tuples as lists; a
    ``nan``, which saving refuses, as itself), to check before it is written."""
    return Fields(json.loads(json.dumps(document, default=plain_number)), "in-memory plan", "")


def _options(f: Fields) -> dict[str, Any]:
    """What the planner was asked: an object, with the optimizer-state factor that ``bench``
    trains for (where recorded) a number."""
    f.keys()
    if f.has("optimizer_state_factor"):
        f.float("optimizer_state_factor", 0.0)
    return f.value


def _check_consistent(plan: Plan, f: Fields) -> None:
    _check_known(f, plan.to_json(), "a plan")
    for stage, read in zip(plan.stages, f.get("stages").items()):
        _check_known(read, stage.to_json(), "a stage")
    _check_known(f.get("predicted"), plan.predicted.to_json(), "a prediction")
    if plan.checkpoint not in CHECKPOINT_MODES:
        raise f.error(f"'{plan.checkpoint}' is not one of {list(CHECKPOINT_MODES)}", "checkpoint")
    if plan.schedule not in SCHEDULES:
        raise f.error(f"'{plan.schedule}' is not one of {list(SCHEDULES)}", "schedule")
    if plan.turns not in TURN_RULES:
        raise f.error(f"'{plan.turns}' is not one of {list(TURN_RULES)}", "turns")
    if not plan.stages:
        raise f.error("a plan needs at least one stage", "stages")
    if not 1 <= plan.replicas <= plan.batch_size:
        raise f.error(f"{plan.replicas} replicas for a batch of {plan.batch_size}; must be 1..batch_size",
                      "replicas")
    if not 1 <= plan.chunks <= plan.replica_batch_size:
        raise f.error(f"{plan.chunks} micro-batches for a replica's batch of {plan.replica_batch_size}; "
                      "must be 1..batch_size / replicas", "chunks")
    if f.has("micro_batch_size") and f.int("micro_batch_size") != plan.micro_batch_size:
        raise f.error(f"{f.int('micro_batch_size')} disagrees with ceil(batch_size / chunks) = "
                      f"{plan.micro_batch_size}", "micro_batch_size")
    if len(plan.devices) != len(plan.stages):
        raise f.error(f"{len(plan.devices)} devices for {len(plan.stages)} stages", "devices")
    if len(plan.stages) % plan.interleave:
        raise f.error(f"{len(plan.stages)} stages cannot be placed {plan.interleave} per device", "interleave")
    repeated = [plan.devices[d] for d in plan.placement]
    if plan.devices != repeated:
        raise f.error(f"{plan.devices} must repeat the first {plan.device_count} devices for "
                      f"interleave={plan.interleave}: {repeated}", "devices")
    expected_start = 0
    for index, stage in enumerate(plan.stages):
        if stage.index != index or stage.device != plan.devices[index]:
            raise f.error(f"says stage {stage.index} on {stage.device}, but it is stage {index} and "
                          f"devices[{index}] is {plan.devices[index]}", f"stages[{index}]")
        if stage.start != expected_start or stage.stop <= stage.start:
            raise f.error(f"covers layers [{stage.start}, {stage.stop}) but must start at "
                          f"{expected_start} and hold at least one layer", f"stages[{index}]")
        expected_start = stage.stop
    if expected_start != len(plan.model["layers"]):
        raise f.error(f"stages cover {expected_start} layers, the model has {len(plan.model['layers'])}",
                      "stages")
    for index, stage in enumerate(plan.stages):
        first, last = (plan.model["layers"][i]["name"] for i in (stage.start, stage.stop - 1))
        if (stage.first_layer, stage.last_layer) != (first, last):
            raise f.error(f"names its layers '{stage.first_layer}' to '{stage.last_layer}', but layers "
                          f"[{stage.start}, {stage.stop}) of the model are '{first}' to '{last}'", f"stages[{index}]")
    if f.has("split_points") and f.get("split_points").value != [{"index": i, "name": n} for i, n in plan.split_points]:
        raise f.error(f"disagrees with the stages: {plan.split_points}", "split_points")
    bound, time = plan.predicted.lower_bound_ms, plan.predicted.iteration_ms
    if bound is not None and bound > time * (1 + 1e-9):
        raise f.get("predicted").error(f"{bound} ms is above the predicted iteration ({time} ms), which no "
                                       "lower bound can be", "lower_bound_ms")
    if f.has("balance") and f.int_list("balance") != plan.balance:
        raise f.error(f"{f.int_list('balance')} disagrees with the stages {plan.balance}", "balance")
    shapes = [len(d) for d in plan.replica_devices]
    if len(plan.replica_devices) != plan.replicas or shapes != [len(plan.stages)] * plan.replicas \
            or plan.replica_devices[0] != plan.devices:
        raise f.error(f"needs {plan.replicas} lists of {len(plan.stages)} device names, the first equal to "
                      f"'devices'; found {plan.replica_devices}", "replica_devices")
