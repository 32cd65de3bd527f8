"""Checks every rank makes alike before running: the plan's fit to the model, balance, schedule,
checkpoint mode, micro-batch split and replicas; the process group from torchrun; the agreement
that brings a refusal only one rank can see to every rank; and the comparison of the batch sizes
the ranks feed."""
from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta
from typing import Sequence

import torch
import torch.distributed as dist

from .._vocab import CHECKPOINT_MODES, SCHEDULES, CheckpointMode, Schedule
from .._checks import is_positive_int
from ..errors import DistributedError
from ..model import Layer
from ..model.fingerprint import check_made_for
from ..planning.plans import Plan
from ..runtime.balance import check_balance

__all__ = ["RunSettings", "agree", "init_distributed", "plan_device", "unequal_batches", "uneven_split"]


def init_distributed(backend: str | None = None, timeout_s: float = 600.0) -> None:
    """Initialise the default process group from torchrun's environment, unless already done."""
    if dist.is_initialized():
        return
    missing = [name for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if name not in os.environ]
    if missing:
        raise DistributedError(
            f"no process group and {missing} not set: launch with "
            "'torchrun --nproc-per-node N script.py' or call torch.distributed.init_process_group first"
        )
    dist.init_process_group(backend or "gloo", timeout=timedelta(seconds=timeout_s))


@dataclass
class RunSettings:
    """What the engine runs: the plan's choices, overridden by explicit options."""

    balance: list[int]
    chunks: int
    schedule: Schedule
    checkpoint: CheckpointMode
    batch_size: int | None
    devices: list[str]
    replicas: int = 1

    @staticmethod
    def resolve(layers: Sequence[Layer], plan: Plan | None, balance: Sequence[int] | None = None,
                chunks: int | None = None, schedule: Schedule | None = None, checkpoint: CheckpointMode | None = None,
                batch_size: int | None = None, replicas: int | None = None) -> RunSettings:
        """Check everything that every rank can check alike, so a mistake fails on all ranks at once."""
        if plan is not None:
            check_made_for(plan.model, layers, "plan", "make a plan for this model", DistributedError)
            if plan.interleave > 1:
                raise DistributedError(
                    f"the plan puts {plan.interleave} stages on each device (interleave={plan.interleave}); "
                    "this engine runs one stage per process: plan with engine='distributed', which "
                    "never interleaves"
                )
        balance = list(balance or (plan.balance if plan else []))
        if not balance:
            raise DistributedError("give a plan or a balance (layers per stage), e.g. balance=[7, 8]")
        check_balance(balance, len(layers), DistributedError)
        for name, value in (("chunks", chunks), ("batch_size", batch_size), ("replicas", replicas)):
            if value is not None and not is_positive_int(value):
                raise DistributedError(f"{name} must be a positive integer, got {value!r}")
        settings = RunSettings(
            balance=balance,
            chunks=chunks if chunks is not None else (plan.chunks if plan else 1),
            schedule=schedule or (plan.schedule if plan else "gpipe"),
            checkpoint=checkpoint or (plan.checkpoint if plan else "never"),
            batch_size=batch_size if batch_size is not None else (plan.replica_batch_size if plan else None),
            devices=plan.devices if plan is not None and plan.balance == balance else ["cpu"] * len(balance),
            replicas=replicas if replicas is not None else (plan.replicas if plan else 1),
        )
        if plan is not None and plan.replicas > 1 and plan.batch_size % plan.replicas:
            raise DistributedError(
                f"the plan's batch of {plan.batch_size} does not split into {plan.replicas} equal replica "
                "shares, which the engine's averaged gradients need; plan a batch size divisible by the replicas")
        check_schedule(settings.schedule, settings.chunks, len(balance), settings.checkpoint)
        problem = uneven_split(settings.batch_size, settings.chunks) if settings.batch_size is not None else None
        if problem:
            raise DistributedError(problem)
        return settings


def plan_device(name: str) -> torch.device:
    """The plan's device, except that under torchrun a CUDA stage uses ``cuda:LOCAL_RANK``:
    a plan's ``cuda:5`` is the second GPU of the second node when nodes have four."""
    device = torch.device(name)
    if device.type == "cuda" and "LOCAL_RANK" in os.environ:
        return torch.device("cuda", int(os.environ["LOCAL_RANK"]))
    return device


def check_schedule(schedule: Schedule, chunks: int, stages: int, checkpoint: CheckpointMode) -> None:
    if schedule not in SCHEDULES:
        raise DistributedError(f"schedule '{schedule}' is not one of {list(SCHEDULES)}")
    if checkpoint not in CHECKPOINT_MODES:
        raise DistributedError(f"checkpoint '{checkpoint}' is not one of {list(CHECKPOINT_MODES)}")
    if schedule == "1f1b" and chunks < stages:
        raise DistributedError(
            f"1F1B needs at least as many micro-batches as stages, got chunks={chunks} for "
            f"{stages} stages. Fix: use chunks >= {stages} or schedule='gpipe'"
        )


def uneven_split(batch_size: int, chunks: int) -> str | None:
    """Why ``batch_size`` cannot run as ``chunks`` micro-batches, or ``None`` when it can."""
    if not batch_size % chunks:
        return None
    return (f"batch size {batch_size} does not split into {chunks} equal micro-batches, and "
            "torch.distributed.pipelining needs one micro-batch shape. Fix: use a batch size "
            f"divisible by chunks (e.g. {batch_size - batch_size % chunks or chunks}) or other chunks")


def agree(refusal: str | None, group: dist.ProcessGroup | None, device: torch.device, elsewhere: str) -> None:
    """Raise :class:`DistributedError` on every rank of ``group`` when any rank refuses: its own
    ``refusal`` there, ``elsewhere`` on the others.

    A step's inputs, target, loss and trainable parameters are seen by some ranks only; a rank that
    raised alone would leave its peers waiting on it inside the engine.  One flag is all-reduced,
    so every rank raises together and the job can go on (build a new pipeline) or end cleanly.
    """
    flag = torch.tensor([refusal is not None], dtype=torch.int32, device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
    if flag.item():
        raise DistributedError(refusal or elsewhere)


def unequal_batches(size: int, group: dist.ProcessGroup | None, device: torch.device, replicas: int) -> str | None:
    """Collective over ``group``: why the batches its ranks feed differ in size, or ``None`` when they do not.

    ``size`` is this rank's (0 on a rank that feeds none), which only it sees: replica shares of
    different sizes would weigh samples unequally in the averaged gradients, and a target of another
    size than the inputs would meet another number of outputs, both without an error.
    """
    ranks: dict[int, list[int]] = {}
    for rank, fed in enumerate(_gathered(size, group, device)):
        if fed:
            ranks.setdefault(fed, []).append(rank)
    if len(ranks) < 2:
        return None
    said = " and ".join(f"{n} samples on rank{'s' if len(r) > 1 else ''} {', '.join(map(str, r))}"
                        for n, r in ranks.items())
    why = ("the replicas' gradients are averaged, which weighs each share alike, so unequal shares would weigh the "
           "samples unequally. Fix: pass runner.shard(x) and runner.shard(y) of one whole batch (a size divisible "
           f"by {replicas}) on every replica's first and last ranks" if replicas > 1 else
           "the loss would meet outputs and targets of different sizes. Fix: give the first rank's inputs and the "
           "last rank's target one batch size")
    return f"the ranks feed batches of different sizes: {said}; {why}"


def _gathered(value: int, group: dist.ProcessGroup | None, device: torch.device) -> list[int]:
    """Collective over ``group``: every rank's ``value``, in rank order."""
    values = [torch.zeros(1, dtype=torch.int64, device=device) for _ in range(dist.get_world_size(group))]
    dist.all_gather(values, torch.tensor([value], dtype=torch.int64, device=device), group=group)
    return [int(v.item()) for v in values]
