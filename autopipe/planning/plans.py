"""What the planner decided and predicts: the :class:`Plan` and its JSON file."""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .._vocab import CHECKPOINT_MODES, SCHEDULES, CheckpointMode, Schedule
from .._jsonio import Fields, read_json, write_json_atomic

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
    ``memory_bytes`` is the predicted peak: parameters, gradients, optimizer state, activations
    of the micro-batches in flight and skip tensors held; ``memory_terms`` the same by term
    (empty in plans made before they were recorded).  Formulas: :mod:`autopipe.planning.memory`.
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
            memory_terms=({k: f.get("memory_terms").int(k) for k in f.get("memory_terms").keys()}
                          if f.has("memory_terms") else {}),
        )


@dataclass
class Prediction:
    """Predicted times of one training iteration (forward phase + backward phase), in ms.

    ``bubble_fraction`` is the share of device-time (devices × iteration) in which a device
    computes nothing.
    """

    iteration_ms: float
    forward_ms: float
    backward_ms: float
    bubble_fraction: float

    def to_json(self) -> dict[str, Any]:
        return dict(self.__dict__)

    @staticmethod
    def from_json(f: Fields) -> Prediction:
        return Prediction(f.float("iteration_ms", 0.0), f.float("forward_ms", 0.0),
                          f.float("backward_ms", 0.0), f.float("bubble_fraction", 0.0))


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
    each device holds ``interleave`` chunks of the chain, as in torch's interleaved schedules.
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

    @property
    def device_count(self) -> int:
        """Devices the plan uses (stages / interleave)."""
        return len(self.stages) // self.interleave

    @property
    def placement(self) -> list[int]:
        """Device index of every stage: stage ``s`` on ``s % device_count``."""
        return placement(len(self.stages), self.interleave)

    @property
    def balance(self) -> list[int]:
        """Layers per stage."""
        return [stage.stop - stage.start for stage in self.stages]

    @property
    def micro_batch_size(self) -> int:
        return -(-self.batch_size // self.chunks)

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
            "balance": self.balance,
            "split_points": [{"index": i, "name": n} for i, n in self.split_points],
            "stages": [stage.to_json() for stage in self.stages],
            "predicted": self.predicted.to_json(),
            "options": self.options,
        }

    def save(self, path: str | os.PathLike[str]) -> Path:
        """Write the plan as JSON, atomically."""
        return write_json_atomic(path, self.to_json())

    @staticmethod
    def load(path: str | os.PathLike[str]) -> Plan:
        """Read and validate a plan file; raises ``FormatError`` naming file and field."""
        f = read_json(path, "plan", PLAN_SCHEMA_VERSION)
        model = f.get("model")
        model.get("digest")
        plan = Plan(
            model=model.value,
            profile_digest=f.str("profile_digest"),
            devices=f.str_list("devices"),
            batch_size=f.int("batch_size", 1),
            chunks=f.int("chunks", 1),
            checkpoint=f.str("checkpoint"),
            schedule=f.str("schedule"),
            stages=f.list_of("stages", StagePlan.from_json),
            predicted=Prediction.from_json(f.get("predicted")),
            options=f.get("options").value if f.has("options") else {},
            interleave=f.int("interleave", 1) if f.has("interleave") else 1,
        )
        _check_consistent(plan, f)
        return plan


def _check_consistent(plan: Plan, f: Fields) -> None:
    if plan.checkpoint not in CHECKPOINT_MODES:
        raise f.error(f"'{plan.checkpoint}' is not one of {list(CHECKPOINT_MODES)}", "checkpoint")
    if plan.schedule not in SCHEDULES:
        raise f.error(f"'{plan.schedule}' is not one of {list(SCHEDULES)}", "schedule")
    if not plan.stages:
        raise f.error("a plan needs at least one stage", "stages")
    if not 1 <= plan.chunks <= plan.batch_size:
        raise f.error(f"{plan.chunks} micro-batches for a batch of {plan.batch_size}; must be 1..batch_size",
                      "chunks")
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
    if f.has("balance") and f.int_list("balance") != plan.balance:
        raise f.error(f"{f.int_list('balance')} disagrees with the stages {plan.balance}", "balance")
