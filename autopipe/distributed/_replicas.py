"""Replicas on the distributed engine: a 2-D device mesh (data parallel × pipeline) and each stage
module in ``DistributedDataParallel`` across its data-parallel group.

Ranks ``r·S .. r·S + S - 1`` run replica ``r``'s stages ``0..S-1`` (mesh dims ``("dp", "pp")``):
the pipeline group of a rank holds its replica's stages, its data-parallel group the same stage
of every replica.  The pipeline schedules talk only within the pipeline group; gradients are
averaged within the data-parallel group.

Why DDP and not FSDP: the planner has placed a whole stage (parameters, gradients, optimizer
state) on each device within its memory, so sharding them buys nothing it needs, while FSDP
would all-gather every stage's parameters for every micro-batch's forward and backward — a
cost the plan does not price.  DDP keeps one all-reduce per stage per step, overlapped with
the last micro-batch's backward in buckets: the plan's reduction lane.
``torch.distributed.pipelining`` runs DDP-wrapped stage modules natively (``no_sync`` for all
but the last backward micro-batch).  It also runs every forward under ``no_sync``, which skips
DDP's broadcast of buffers, so :func:`average_buffers` makes the replicas' buffers alike after
each step.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.device_mesh import init_device_mesh
from torch.nn.parallel import DistributedDataParallel

from ..errors import DistributedError

__all__ = ["Layout", "average_buffers", "data_parallel", "layout"]


@dataclass(frozen=True)
class Layout:
    """Where this rank sits: its replica and stage, and the groups it talks in (``None``: the
    default group, with one replica)."""

    replicas: int
    stages: int
    replica: int
    stage: int
    pipeline_group: dist.ProcessGroup | None
    data_group: dist.ProcessGroup | None

    @property
    def job_group(self) -> dist.ProcessGroup | None:
        """Every rank of the job: the pipeline group with one replica, else the world."""
        return self.pipeline_group if self.replicas == 1 else None


def layout(replicas: int, stages: int, device_type: str, group: dist.ProcessGroup | None) -> Layout:
    """This rank's place in a job of ``replicas × stages`` ranks; refuses another world size."""
    world = dist.get_world_size(group)
    needed = replicas * stages
    if world != needed:
        shape = f"{replicas} replicas × " if replicas > 1 else ""
        raise DistributedError(
            f"the plan has {shape}{stages} stages but the job has {world} ranks; this engine runs one "
            f"stage per rank: launch with torchrun --nproc-per-node {needed} (or nodes × processes = {needed})"
        )
    if replicas == 1:
        return Layout(1, stages, 0, dist.get_rank(group), group, None)
    if group is not None:
        raise DistributedError("replicas build their own process groups over the whole job; pass group=None")
    mesh = init_device_mesh(device_type, (replicas, stages), mesh_dim_names=("dp", "pp"))
    rank = dist.get_rank()
    return Layout(replicas, stages, rank // stages, rank % stages, mesh.get_group("pp"), mesh.get_group("dp"))


def data_parallel(module: nn.Module, where: Layout, device: torch.device) -> nn.Module:
    """``module`` in DDP across the data-parallel group, or itself with one replica or with no
    parameter to train (nothing to reduce; DDP refuses such a module).

    ``find_unused_parameters`` keeps DDP from rebuilding its buckets after the first step: it
    would rebuild them from the order in which gradients became ready, which here records each
    parameter once per micro-batch, and the second step's forward then fails DDP's internal
    check (``rebuilt parameter indices size is not same as original model parameters size``)."""
    if where.replicas == 1 or not any(p.requires_grad for p in module.parameters()):
        return module
    ids = [device] if device.type == "cuda" else None
    return DistributedDataParallel(module, device_ids=ids, process_group=where.data_group,
                                   find_unused_parameters=True)


def average_buffers(module: nn.Module, where: Layout) -> None:
    """Collective over the data-parallel group: every replica's ``module`` leaves with the same buffers,
    the floating-point ones averaged and the others (counters) replica 0's, as DDP would broadcast.

    Each replica's batch norm has seen its own share only.  Averaging after the step makes
    ``running_mean`` the plain model's, updated once per micro-batch made of the replicas' micro-batches
    of that index (each update is linear in its micro-batch's mean, and the shares are equal);
    ``running_var`` becomes the mean of the shares' variances, which leaves out the spread between the
    shares' means.  ``num_batches_tracked`` counts the micro-batches, the same on every replica.
    """
    if where.replicas == 1:
        return
    buffers = list(module.buffers())

    def average(flat: Tensor) -> None:
        dist.all_reduce(flat, group=where.data_group)
        flat.div_(where.replicas)

    _coalesced([b for b in buffers if b.is_floating_point()], average)
    _coalesced([b for b in buffers if not b.is_floating_point()],
               lambda flat: dist.broadcast(flat, group=where.data_group, group_src=0))


def _coalesced(tensors: Sequence[Tensor], collective: Callable[[Tensor], object]) -> None:
    """``collective`` on ``tensors`` flattened into one tensor per dtype (one call each, not one per
    buffer), written back in place.  The dtypes come in the order the module lists its buffers, the
    same on every rank."""
    for dtype in dict.fromkeys(t.dtype for t in tensors):
        alike = [t for t in tensors if t.dtype == dtype]
        flat = torch.cat([t.detach().reshape(-1) for t in alike])
        collective(flat)
        with torch.no_grad():
            for tensor, part in zip(alike, flat.split([t.numel() for t in alike])):
                tensor.copy_(part.view_as(tensor))
