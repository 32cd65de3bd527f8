"""The user's class of the engine side: :class:`DistributedPipeline`, this rank's stage of a plan run by
``torch.distributed.pipelining`` (the stage module, schedule hook, checks and state-dict merge are in
the private modules beside it)."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import torch
import torch.distributed as dist
from torch import Tensor, nn

from .._vocab import CheckpointMode, Schedule
from .._jsonio import write_atomic
from ..errors import DistributedError, StageOutputError
from ..model import Layer, layer_chain
from ..planning.plans import Plan
from ..runtime.balance import stage_of_layer
from ..runtime.skips import skip_spans
from ._replicas import data_parallel, layout
from ._schedule import SCHEDULE_CLASSES, Stage
from ._settings import RunSettings, check_divisible, init_distributed, plan_device
from ._stage import StageModule
from ._state import merge_state_dicts, state_prefix

__all__ = [
    "DistributedError",
    "DistributedPipeline",
    "RunSettings",
    "StageModule",
    "StageOutputError",
    "init_distributed",
    "merge_state_dicts",
]


class DistributedPipeline:
    """This rank's stage of a plan, run by ``torch.distributed.pipelining``.

    Build it on every rank with the same model (same initial weights) and plan; call
    :meth:`step` on every rank each iteration.  Rank ``r`` runs stage ``r`` on the plan's device
    for that stage (CUDA: ``cuda:LOCAL_RANK`` under torchrun, so multi-node plans work), or on
    ``device``.  Its parameters are :meth:`parameters` (give those to the optimizer) and
    :meth:`state_dict` uses the original model's keys.

    Micro-batch shapes are fixed by the engine at the first step, so the batch size is fixed
    too (the plan's, ``batch_size``, or the first step's): another one raises
    :class:`DistributedError`; build a new pipeline on every rank for a new batch size.

    With ``replicas`` (or the plan's) ``R > 1`` the job has ``R × stages`` ranks: rank
    ``r·S + s`` runs stage ``s`` of replica ``r`` (:mod:`autopipe.distributed._replicas`), its
    stage module in ``DistributedDataParallel`` across the replicas.  Each replica trains on its
    own share of the batch, as with DDP: its first and last ranks pass that share to
    :meth:`step` (:meth:`shard` cuts it from the whole batch); ``batch_size`` is the share's.

    Args:
        model: anything :func:`~autopipe.layer_chain` reads, or a list of layers; the same
            (same initial weights) on every rank.
        plan: the plan to run (made with ``engine="distributed"``, one stage per rank).
        loss_fn: ``loss_fn(output, target)`` on the last rank.
        balance: layers per stage, without a plan (or overriding the plan's).
        chunks: micro-batches per step (default: the plan's, else 1).
        schedule: ``"gpipe"`` or ``"1f1b"`` (default: the plan's, else ``"gpipe"``).
        checkpoint: checkpoint mode (default: the plan's, else ``"never"``).
        batch_size: the fixed batch size (default: the plan's, else the first step's).
        device: this rank's device, instead of the plan's.
        group: the process group (default: the world).
        replicas: pipeline replicas (default: the plan's, else 1); the job has replicas × stages ranks.

    Raises:
        DistributedError: no process group and no torchrun environment; the plan was made for
            another model or interleaves stages; a balance, schedule, checkpoint mode, chunk
            count or world size (other than replicas × stages) that this engine cannot run.
        ChainError: the model cannot be read as a chain of layers.
    """

    def __init__(
        self,
        model: nn.Module | Sequence[Layer],
        plan: Plan | None = None,
        *,
        loss_fn: Callable[..., Tensor],
        balance: Sequence[int] | None = None,
        chunks: int | None = None,
        schedule: Schedule | None = None,
        checkpoint: CheckpointMode | None = None,
        batch_size: int | None = None,
        device: torch.device | str | None = None,
        group: dist.ProcessGroup | None = None,
        replicas: int | None = None,
    ) -> None:
        self.layers = layer_chain(model)
        settings = RunSettings.resolve(self.layers, plan, balance, chunks, schedule, checkpoint, batch_size, replicas)
        self.balance, self.chunks, self.schedule_name = settings.balance, settings.chunks, settings.schedule
        self.batch_size = settings.batch_size
        kinds = [torch.device(device).type] if device is not None else [torch.device(d).type for d in settings.devices]
        init_distributed("nccl" if "cuda" in kinds else "gloo")
        self.num_stages = len(self.balance)
        self.layout = layout(settings.replicas, self.num_stages, "cuda" if "cuda" in kinds else "cpu", group)
        self.group, self.rank, self.replica = self.layout.pipeline_group, self.layout.stage, self.layout.replica
        self.device = torch.device(device) if device is not None else plan_device(settings.devices[self.rank])
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        start = sum(self.balance[: self.rank])
        self.stage_layers = self.layers[start : start + self.balance[self.rank]]
        spans = skip_spans(self.layers, stage_of_layer(self.balance))
        self.module = StageModule(self.stage_layers, self.rank, self.num_stages, spans,
                                  settings.checkpoint, self.chunks).to(self.device)
        self.stage = Stage(data_parallel(self.module, self.layout, self.device), self.rank, self.num_stages,
                           self.device, group=self.group)
        # each micro-batch's loss divided by their count, and gradients left as they come: the
        # engine's own averaging (scale_grads) divides all of .grad, also what an earlier step
        # left there, so gradients accumulated over steps would not add up as the plain model's
        self.schedule = SCHEDULE_CLASSES[self.schedule_name](
            self.stage, self.chunks, loss_fn=_Share(loss_fn, self.chunks), scale_grads=False)

    @property
    def replicas(self) -> int:
        return self.layout.replicas

    def shard(self, tensor: Tensor) -> Tensor:
        """This replica's share of a whole batch: ``torch.tensor_split(tensor, replicas)[replica]``.

        Raises:
            DistributedError: the batch does not split into equal shares: the replicas' gradients
                are averaged, which weighs each share alike (the plain model weighs each sample).
        """
        if tensor.size(0) % self.replicas:
            raise DistributedError(
                f"a batch of {tensor.size(0)} does not split into {self.replicas} equal replica shares, which "
                "the averaged gradients need (unequal shares would weigh samples unequally); use a batch size "
                f"divisible by {self.replicas}")
        return torch.tensor_split(tensor, self.replicas)[self.replica]

    @property
    def is_first(self) -> bool:
        return self.rank == 0

    @property
    def is_last(self) -> bool:
        return self.rank == self.num_stages - 1

    def parameters(self) -> Iterator[nn.Parameter]:
        """This rank's parameters: what its optimizer updates."""
        return self.module.parameters()

    def named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        """This rank's parameters under the original model's names."""
        for layer in self.stage_layers:
            for name, parameter in layer.module.named_parameters():
                yield state_prefix(layer) + name, parameter

    def step(self, *inputs: Tensor, target: Tensor | None = None) -> Tensor | None:
        """One training iteration: forward and backward of every micro-batch, gradients accumulated.

        Every rank calls it; the first uses ``inputs``, the last ``target``, others ignore both.
        Gradients are averaged over micro-batches (as one ``loss_fn`` over the whole batch with
        a mean reduction) and added to what ``.grad`` holds, as ``loss.backward()`` does: steps
        without ``zero_grad`` between accumulate.  Returns the mean micro-batch loss on the last
        rank, ``None`` elsewhere.
        """
        args: tuple[Tensor, ...] = ()
        kwargs: dict[str, Any] = {}
        losses: list[Tensor] = []
        if self.is_first:
            args = tuple(t.to(self.device) for t in inputs)
            self._check_batch(args[0] if args else None, "input")
        if self.is_last:
            self._check_batch(target, "target")
            kwargs = {"target": target.to(self.device), "losses": losses}  # type: ignore[union-attr]
        self.schedule.step(*args, **kwargs)
        return torch.stack(losses).detach().sum() if self.is_last else None  # the shares' sum: their mean

    def broadcast_loss(self, loss: Tensor | None) -> float:
        """Collective: the last rank's loss as a float on every rank (so rank 0 can print it),
        averaged over the replicas."""
        value = torch.zeros(1, dtype=torch.float64, device=self.device)  # one dtype on every rank
        if self.is_last and loss is not None:
            value = loss.detach().reshape(1).to(self.device, torch.float64)
        dist.broadcast(value, src=self._global_rank(self.num_stages - 1), group=self.group)
        if self.replicas > 1:
            dist.all_reduce(value, group=self.layout.data_group)
            value /= self.replicas
        return float(value.item())

    def state_dict(self) -> dict[str, Tensor]:
        """This rank's tensors under the original model's keys (``layer1.0.conv1.weight``)."""
        state: dict[str, Tensor] = {}
        for layer in self.stage_layers:
            state.update((state_prefix(layer) + key, value) for key, value in layer.module.state_dict().items())
        return state

    def save_checkpoint(self, path: str | os.PathLike[str]) -> Path | None:
        """Collective: gather every rank's :meth:`state_dict` to rank 0 and write one file there.

        Gathering through the process group (not a shared directory) works across nodes; the
        file is written atomically and loads into the plain model with ``strict=True``.
        Returns the path on rank 0, ``None`` elsewhere.  Replicas hold the same weights, so only
        the first replica's ranks take part.
        """
        if self.replica != 0:
            return None
        local = {key: value.detach().cpu() for key, value in self.state_dict().items()}
        parts: list[dict[str, Tensor]] | None = [{} for _ in range(self.num_stages)] if self.rank == 0 else None
        dist.gather_object(local, parts, dst=self._global_rank(0), group=self.group)
        if parts is None:
            return None
        state = merge_state_dicts(parts)
        return write_atomic(path, lambda handle: torch.save(state, handle))

    def _global_rank(self, group_rank: int) -> int:
        return group_rank if self.group is None else dist.get_global_rank(self.group, group_rank)

    def _check_batch(self, tensor: Tensor | None, what: str) -> None:
        if not isinstance(tensor, Tensor):
            raise DistributedError(
                f"rank {self.rank} runs the {'first' if what == 'input' else 'last'} stage and needs "
                f"the {what} tensor: call step(x, target=y) on this rank"
            )
        size = tensor.size(0)
        if self.batch_size is None:
            check_divisible(size, self.chunks)
            self.batch_size = size
        if size != self.batch_size:
            raise DistributedError(
                f"the {what} batch has {size} samples but this pipeline runs batches of "
                f"{self.batch_size}: torch.distributed.pipelining fixes micro-batch shapes at the "
                "first step and would compute wrong values. Fix: keep the batch size constant "
                "(DataLoader(drop_last=True)) or build a new DistributedPipeline with "
                f"batch_size={size} on every rank"
            )


class _Share:
    """``loss_fn`` divided by the micro-batch count: each micro-batch's share of the batch's mean."""

    def __init__(self, loss_fn: Callable[..., Tensor], chunks: int) -> None:
        self.loss_fn, self.chunks = loss_fn, chunks

    def __call__(self, output: Any, target: Any) -> Tensor:
        return self.loss_fn(output, target) / self.chunks
