"""The engine side: a plan's stage per rank as a torch.distributed.pipelining PipelineStage."""
from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe
from torch.distributed.pipelining.schedules import PipelineScheduleSingle
from torch.utils.checkpoint import checkpoint as checkpoint_fn

from ..runtime.checkpoint import recomputing
from ..model.fingerprint import first_difference, model_fingerprint
from .._jsonio import write_atomic
from ..model import Layer, layer_chain
from ..planning.plans import CHECKPOINT_MODES, SCHEDULES, Plan
from ..model.skip import SkipKey, SkipTracker, use_skip_tracker

__all__ = [
    "DistributedError",
    "DistributedPipeline",
    "RunSettings",
    "SkipRoute",
    "StageModule",
    "StageOutputError",
    "init_distributed",
    "merge_state_dicts",
    "skip_routes",
]

_SCHEDULE_CLASSES: dict[str, type[PipelineScheduleSingle]] = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}


class DistributedError(ValueError):
    """A plan, job or batch that ``torch.distributed.pipelining`` cannot run as asked."""


class StageOutputError(TypeError):
    """A stage would send something other than tensors to the next rank."""


@dataclass(frozen=True)
class SkipRoute:
    """A skip tensor stashed in stage ``src`` and popped in stage ``dst`` (``src <= dst``).

    The engine only talks to neighbours, so every stage ``src <= s < dst`` sends it on.
    """

    key: SkipKey
    src: int
    dst: int

    def crosses_into(self, stage: int) -> bool:
        return self.src < stage <= self.dst

    def crosses_out_of(self, stage: int) -> bool:
        return self.src <= stage < self.dst


def skip_routes(layers: Sequence[Layer], balance: Sequence[int]) -> list[SkipRoute]:
    """Every skip's producing and consuming stage, in stash order (the same order on every rank)."""
    stage_of: list[int] = [s for s, count in enumerate(balance) for _ in range(count)]
    stashed: dict[SkipKey, int] = {}
    popped: dict[SkipKey, int] = {}
    for index, layer in enumerate(layers):
        stashed.update((key, stage_of[index]) for key in layer.stash)
        popped.update((key, stage_of[index]) for key in layer.pop)
    return [SkipRoute(key, src, popped[key]) for key, src in stashed.items()]


class StageModule(nn.Module):
    """One rank's layers as the engine's stage: ``(main, *skips_in) -> (main, *skips_out)``.

    The engine passes a stage's outputs as the next stage's positional arguments, so a tuple main
    value travels flattened; the receiver knows how many trailing arguments are skips and packs
    the rest back into the tuple the next layer expects.
    """

    def __init__(self, layers: Sequence[Layer], index: int, num_stages: int,
                 routes: Sequence[SkipRoute], checkpoint: str = "never", chunks: int = 1) -> None:
        super().__init__()
        self.layers = nn.ModuleList(layer.module for layer in layers)
        self.layer_names = [layer.name for layer in layers]
        self.index = index
        self.is_last = index == num_stages - 1
        self.skips_in = [route.key for route in routes if route.crosses_into(index)]
        self.skips_out = [route.key for route in routes if route.crosses_out_of(index)]
        self.checkpoint = checkpoint
        self.chunks = chunks
        #: The micro-batch being run, set by :class:`_Stage`; ``None`` in the engine's shape probe.
        self.micro_batch: int | None = None

    def forward(self, *received: Tensor) -> Any:
        if self._checkpointing():
            return self._checkpointed(*received)
        return self._run(*received)

    def _run(self, *received: Tensor) -> Any:
        # Received activations are autograd leaves; an in-place first op (ReLU(inplace=True))
        # on a leaf that requires grad fails, so the layers work on a copy (which also leaves
        # a checkpoint's saved inputs intact for the recomputation).
        received = tuple(_non_leaf(t) for t in received)
        n_main = len(received) - len(self.skips_in)
        main: Any = received[0] if n_main == 1 else tuple(received[:n_main])
        tracker = SkipTracker()
        for key, tensor in zip(self.skips_in, received[n_main:]):
            tracker.save(key, tensor)
        with use_skip_tracker(tracker):
            for layer in self.layers:
                main = layer(main)
        if self.is_last:
            return main
        sent = self._flat_main(main) + tuple(tracker.tensors.pop(key) for key in self.skips_out)
        # The receiver's buffers copy the first micro-batch's strides and gloo refuses
        # non-contiguous buffers (a slice like x[:, :8]), so send contiguous tensors only.
        return tuple(t.contiguous() for t in sent)

    def _checkpointing(self) -> bool:
        """As the in-process runtime: ``except_last`` keeps the last micro-batch's activations."""
        if not torch.is_grad_enabled() or self.micro_batch is None or self.checkpoint == "never":
            return False
        return self.checkpoint == "always" or self.micro_batch < self.chunks - 1

    def _checkpointed(self, *received: Tensor) -> Any:
        """Recompute the stage in backward; the recomputation must not update buffers twice.

        ``nn.BatchNorm`` does not ask :func:`is_recomputing`, so its buffers are put back too.
        """
        calls = 0

        def run(*args: Tensor) -> Any:
            nonlocal calls
            calls += 1
            if calls == 1:
                return self._run(*args)
            with recomputing(), _buffers_restored(self):
                return self._run(*args)

        return checkpoint_fn(run, *received, use_reentrant=False)

    def _flat_main(self, main: Any) -> tuple[Tensor, ...]:
        if isinstance(main, Tensor):
            return (main,)
        if isinstance(main, (tuple, list)) and len(main) > 1 and all(isinstance(t, Tensor) for t in main):
            return tuple(main)
        raise StageOutputError(
            f"stage {self.index} ends with layer '{self.layer_names[-1]}', which returns "
            f"{_describe(main)}; torch.distributed.pipelining can only send a tensor or a flat "
            "tuple of two or more tensors to the next rank. Fix: split the model at another layer "
            "(change the plan's balance) or make that layer return tensors only"
        )


class _Stage(PipelineStage):
    """Tells the stage module which micro-batch it runs, which checkpointing ``except_last`` needs."""

    def forward_one_chunk(self, fwd_chunk_id: int, *args: Any, **kwargs: Any) -> Any:
        self.submod.micro_batch = fwd_chunk_id
        try:
            return super().forward_one_chunk(fwd_chunk_id, *args, **kwargs)
        finally:
            self.submod.micro_batch = None


def _non_leaf(tensor: Tensor) -> Tensor:
    return tensor.clone() if tensor.is_leaf and tensor.requires_grad else tensor


@contextlib.contextmanager
def _buffers_restored(module: nn.Module) -> Iterator[None]:
    """Put buffers back without bumping their autograd version: a micro-batch that was not
    checkpointed saved them for its backward, which under 1F1B runs after this recomputation."""
    saved = [(buffer, buffer.detach().clone()) for buffer in module.buffers()]
    try:
        yield
    finally:
        for buffer, value in saved:
            buffer.data.copy_(value)


def _describe(value: Any) -> str:
    if isinstance(value, (tuple, list)):
        inner = ", ".join(type(v).__name__ for v in value)
        return f"a {type(value).__name__} of ({inner})"
    return f"a {type(value).__name__}"


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
    schedule: str
    checkpoint: str
    batch_size: int | None
    devices: list[str]

    @staticmethod
    def resolve(layers: Sequence[Layer], plan: Plan | None, balance: Sequence[int] | None = None,
                chunks: int | None = None, schedule: str | None = None, checkpoint: str | None = None,
                batch_size: int | None = None) -> "RunSettings":
        """Check everything that every rank can check alike, so a mistake fails on all ranks at once."""
        if plan is not None:
            _check_fingerprint(layers, plan)
            if plan.interleave > 1:
                raise DistributedError(
                    f"the plan puts {plan.interleave} stages on each device (interleave={plan.interleave}); "
                    "this engine runs one stage per process: plan with engine='distributed', which "
                    "never interleaves"
                )
        balance = list(balance or (plan.balance if plan else []))
        if not balance:
            raise DistributedError("give a plan or a balance (layers per stage), e.g. balance=[7, 8]")
        if sum(balance) != len(layers) or min(balance) < 1:
            raise DistributedError(
                f"balance {balance} must give every stage at least one layer and cover the model's "
                f"{len(layers)} layers (it covers {sum(balance)})"
            )
        settings = RunSettings(
            balance=balance,
            chunks=chunks or (plan.chunks if plan else 1),
            schedule=schedule or (plan.schedule if plan else "gpipe"),
            checkpoint=checkpoint or (plan.checkpoint if plan else "never"),
            batch_size=batch_size or (plan.batch_size if plan else None),
            devices=plan.devices if plan is not None and plan.balance == balance else ["cpu"] * len(balance),
        )
        _check_schedule(settings.schedule, settings.chunks, len(balance), settings.checkpoint)
        if settings.batch_size is not None:
            _check_divisible(settings.batch_size, settings.chunks)
        return settings


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
    """

    def __init__(
        self,
        model: nn.Module | Sequence[Layer],
        plan: Plan | None = None,
        *,
        loss_fn: Callable[..., Tensor],
        balance: Sequence[int] | None = None,
        chunks: int | None = None,
        schedule: str | None = None,
        checkpoint: str | None = None,
        batch_size: int | None = None,
        device: torch.device | str | None = None,
        group: dist.ProcessGroup | None = None,
    ) -> None:
        self.layers = layer_chain(model)
        settings = RunSettings.resolve(self.layers, plan, balance, chunks, schedule, checkpoint, batch_size)
        self.balance, self.chunks, self.schedule_name = settings.balance, settings.chunks, settings.schedule
        self.batch_size = settings.batch_size
        kinds = [torch.device(device).type] if device is not None else [torch.device(d).type for d in settings.devices]
        init_distributed("nccl" if "cuda" in kinds else "gloo")
        self.group = group
        self.num_stages = len(self.balance)
        self.rank = _check_world(self.num_stages, group)
        self.device = torch.device(device) if device is not None else _plan_device(settings.devices[self.rank])
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        start = sum(self.balance[: self.rank])
        self.stage_layers = self.layers[start : start + self.balance[self.rank]]
        self.module = StageModule(self.stage_layers, self.rank, self.num_stages, skip_routes(self.layers, self.balance),
                                  settings.checkpoint, self.chunks).to(self.device)
        self.stage = _Stage(self.module, self.rank, self.num_stages, self.device, group=group)
        self.schedule = _SCHEDULE_CLASSES[self.schedule_name](self.stage, self.chunks, loss_fn=loss_fn)

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
                yield _prefix(layer) + name, parameter

    def step(self, *inputs: Tensor, target: Tensor | None = None) -> Tensor | None:
        """One training iteration: forward and backward of every micro-batch, gradients accumulated.

        Every rank calls it; the first uses ``inputs``, the last ``target``, others ignore both.
        Gradients are averaged over micro-batches (as one ``loss_fn`` over the whole batch with
        a mean reduction).  Returns the mean micro-batch loss on the last rank, ``None`` elsewhere.
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
        return torch.stack(losses).detach().mean() if self.is_last else None

    def broadcast_loss(self, loss: Tensor | None) -> float:
        """Collective: the last rank's loss as a float on every rank (so rank 0 can print it)."""
        value = torch.zeros(1, device=self.device)
        if self.is_last and loss is not None:
            value = loss.detach().reshape(1).to(self.device)
        dist.broadcast(value, src=self._global_rank(self.num_stages - 1), group=self.group)
        return float(value.item())

    def state_dict(self) -> dict[str, Tensor]:
        """This rank's tensors under the original model's keys (``layer1.0.conv1.weight``)."""
        state: dict[str, Tensor] = {}
        for layer in self.stage_layers:
            state.update((_prefix(layer) + key, value) for key, value in layer.module.state_dict().items())
        return state

    def save_checkpoint(self, path: str | os.PathLike[str]) -> Path | None:
        """Collective: gather every rank's :meth:`state_dict` to rank 0 and write one file there.

        Gathering through the process group (not a shared directory) works across nodes; the
        file is written atomically and loads into the plain model with ``strict=True``.
        Returns the path on rank 0, ``None`` elsewhere.
        """
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
            _check_divisible(size, self.chunks)
            self.batch_size = size
        if size != self.batch_size:
            raise DistributedError(
                f"the {what} batch has {size} samples but this pipeline runs batches of "
                f"{self.batch_size}: torch.distributed.pipelining fixes micro-batch shapes at the "
                "first step and would compute wrong values. Fix: keep the batch size constant "
                "(DataLoader(drop_last=True)) or build a new DistributedPipeline with "
                f"batch_size={size} on every rank"
            )


def _prefix(layer: Layer) -> str:
    return f"{layer.state_prefix}." if layer.state_prefix else ""


def merge_state_dicts(parts: Sequence[dict[str, Tensor]]) -> dict[str, Tensor]:
    """One state dict from the ranks' parts; a key on two ranks means the stages share a tensor."""
    merged: dict[str, Tensor] = {}
    for part in parts:
        shared = merged.keys() & part.keys()
        if shared:
            raise DistributedError(
                f"{sorted(shared)[:3]} appear in more than one stage; tied weights across stages "
                "are not supported by this engine — put the layers that share them in one stage"
            )
        merged.update(part)
    return merged


def _plan_device(name: str) -> torch.device:
    """The plan's device, except that under torchrun a CUDA stage uses ``cuda:LOCAL_RANK``:
    a plan's ``cuda:5`` is the second GPU of the second node when nodes have four."""
    device = torch.device(name)
    if device.type == "cuda" and "LOCAL_RANK" in os.environ:
        return torch.device("cuda", int(os.environ["LOCAL_RANK"]))
    return device


def _check_fingerprint(layers: Sequence[Layer], plan: Plan) -> None:
    difference = first_difference(plan.model, model_fingerprint(layers))
    if difference is not None:
        raise DistributedError(f"the plan was made for another model ({difference}); make a plan for this model")


def _check_schedule(schedule: str, chunks: int, stages: int, checkpoint: str) -> None:
    if schedule not in SCHEDULES:
        raise DistributedError(f"schedule '{schedule}' is not one of {list(SCHEDULES)}")
    if checkpoint not in CHECKPOINT_MODES:
        raise DistributedError(f"checkpoint '{checkpoint}' is not one of {list(CHECKPOINT_MODES)}")
    if schedule == "1f1b" and chunks < stages:
        raise DistributedError(
            f"1F1B needs at least as many micro-batches as stages, got chunks={chunks} for "
            f"{stages} stages. Fix: use chunks >= {stages} or schedule='gpipe'"
        )


def _check_divisible(batch_size: int, chunks: int) -> None:
    if batch_size % chunks:
        raise DistributedError(
            f"batch size {batch_size} does not split into {chunks} equal micro-batches, and "
            "torch.distributed.pipelining needs one micro-batch shape. Fix: use a batch size "
            f"divisible by chunks (e.g. {batch_size - batch_size % chunks or chunks}) or other chunks"
        )


def _check_world(num_stages: int, group: dist.ProcessGroup | None) -> int:
    world = dist.get_world_size(group)
    if world != num_stages:
        raise DistributedError(
            f"the plan has {num_stages} stages but the job has {world} ranks; this engine runs one "
            f"stage per rank: launch with torchrun --nproc-per-node {num_stages} (or nodes × "
            f"processes = {num_stages})"
        )
    return dist.get_rank(group)
