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
from ..errors import ChainError, DistributedError, StageOutputError
from ..model import CapturedLayer, Layer, layer_chain
from ..model.capture import CapturedCallError
from ..planning.plans import Plan
from ..runtime._structure import Structure
from ..runtime.balance import stage_of_layer
from ..runtime.hooks import HeldHooks, fired_after
from ..runtime.skips import skip_spans
from ._replicas import average_buffers, data_parallel, layout
from ._schedule import SCHEDULE_CLASSES, Stage
from ._settings import RunSettings, agree, init_distributed, plan_device, unequal_batches, uneven_split
from ._stage import StageModule, zero_on
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
    too (the plan's, ``batch_size``, or the first step's, one on every rank), and so are the shapes
    and dtypes of every input, the target and every tensor sent between stages (a sequence length
    too): another one raises :class:`DistributedError`; build a new pipeline on every rank for new shapes.
    To learn them, torch runs each stage once more at the first step, on the first micro-batch (its
    shape probe): buffers, the parameters it writes into and the random state are put back after
    it, and ``loss_fn`` does not run in it, but a forward hook, or a count a layer keeps in a Python
    attribute, sees that extra call.

    ``loss_fn`` must be a mean over its micro-batch's samples, each sample weighed alike: the
    engine divides each micro-batch's loss by their count (and DDP averages the replicas), which is
    the whole batch's loss only when that is the mean of its equal micro-batches' losses.

    With ``replicas`` (or the plan's) ``R > 1`` the job has ``R × stages`` ranks: rank
    ``r·S + s`` runs stage ``s`` of replica ``r`` (:mod:`autopipe.distributed._replicas`), its
    stage module in ``DistributedDataParallel`` across the replicas.  Each replica trains on its
    own share of the batch, as with DDP: its first and last ranks pass that share to
    :meth:`step` (:meth:`shard` cuts it from the whole batch); ``batch_size`` is the share's.

    Args:
        model: anything :func:`~autopipe.layer_chain` reads, or a list of layers; the same
            (same initial weights) on every rank.
        plan: the plan to run (made with ``engine="distributed"``, one stage per rank).
        loss_fn: ``loss_fn(output, target)`` on the last rank, once per micro-batch: a scalar tensor,
            the micro-batch's mean over its samples (``reduction="mean"``).  Not exact otherwise:
            ``reduction="sum"`` gives the whole batch's sum divided by ``chunks × replicas``;
            a mean that weighs samples unequally (``cross_entropy`` with ``ignore_index`` and
            uneven padding, or class ``weight``) gives the mean of the micro-batches' own means,
            and a micro-batch with every target ignored gives NaN (PyTorch's mean of nothing),
            which reaches every gradient.  Exact for those: a sum divided by a count that does
            not depend on the targets, e.g. ``cross_entropy(o, t, reduction="sum") / t.numel()``.
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
        # every layer as the model holds them (each rank has the whole model: each names what changed), and the
        # hooks above them
        held = [(layer.path(name), module) for layer in self.layers
                for name, module in layer.module.named_modules(remove_duplicate=False) if type(module) is not nn.Module]
        self._structure = Structure.of(None, [(path, module) for path, module in held if path], self.layers)
        self._structure.check()
        spans = skip_spans(self.layers, stage_of_layer(self.balance))
        self.module = StageModule(self.stage_layers, self.rank, self.num_stages, spans,
                                  settings.checkpoint, self.chunks).to(self.device)
        self.stage = Stage(data_parallel(self.module, self.layout, self.device), self.rank, self.num_stages,
                           self.device, group=self.group)
        # what DDP averages: the parameters that required grad when it was built
        self._trainable = [p.requires_grad for _, p in self.named_parameters()]
        # what this rank fed the first step it ran, "input (8, 10) float32" ([] on a rank that feeds nothing),
        # which the engine's buffers keep
        self._first_fed: list[str] | None = None
        self._loss = _Share(loss_fn, self.chunks, self.module)
        # each micro-batch's loss divided by their count, and gradients left as they come: the
        # engine's own averaging (scale_grads) divides all of .grad, also what an earlier step
        # left there, so gradients accumulated over steps would not add up as the plain model's
        self.schedule = SCHEDULE_CLASSES[self.schedule_name](
            self.stage, self.chunks, loss_fn=self._loss, scale_grads=False)

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
        without ``zero_grad`` between accumulate.  Hooks on a parameter (``register_hook``,
        ``register_post_accumulate_grad_hook``: an optimizer in backward) fire once, on the step's
        whole gradient (:mod:`autopipe.runtime.hooks`), not once per micro-batch.  With replicas,
        their buffers are averaged at the end (:func:`~autopipe.distributed._replicas.average_buffers`).
        Returns the mean micro-batch loss on the last rank, ``None`` elsewhere.

        Raises:
            DistributedError: on every rank, when any rank refuses the step.  Before anything runs:
                it is called under ``torch.no_grad()``; the first rank's inputs or the last rank's
                target are missing or differ in batch size, shape or dtype from the first step's;
                at the first step, the ranks' batches differ in size (the replicas' shares, or the
                inputs and the target); with replicas, a parameter's ``requires_grad`` changed since
                construction; a layer of the model (or a container holding one) was replaced since
                construction, or hooks the stages would not run were put above them
                (:mod:`autopipe.runtime._structure`).
                After the step (which ran with zeros in place of what was refused): a stage's value for
                the next rank differs in form, shape or dtype from the first step's shape probe; the last
                stage's output holds no tensor or hides tensors in an object's attributes; ``loss_fn``
                did not return a scalar tensor on the output's graph.
        """
        fed = self._fed(inputs, target)
        agree(self._refusal(fed), self.layout.job_group, self.device,
              "another rank refused this step, so no rank ran it: that rank's error names the problem and the fix")
        if self._first_fed is None:
            self._fix_batch(fed)
        losses: list[Tensor] = []
        args = tuple(t.to(self.device) for t in inputs) if self.is_first else ()
        kwargs = {"target": target.to(self.device), "losses": losses} if self.is_last else {}  # type: ignore[union-attr]
        self._loss.refusal = self.module.refusal = None
        # parameter hooks fire once, after every micro-batch's backward
        with fired_after(HeldHooks.hold(self.module.parameters())):
            # the merged output is not needed, and merging refuses a 0-dim tensor (an auxiliary loss)
            self.schedule.step(*args, return_outputs=False, **kwargs)
            agree(self.module.refusal or self._loss.refusal, self.layout.job_group, self.device,
                  "another rank refused a value of this step or its loss, or a recomputation (that rank's error names "
                  "the problem and the fix); the step ran to its end, so its gradients are not the plain model's")
        average_buffers(self.module, self.layout)
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

    def _fed(self, inputs: tuple[Any, ...], target: Any) -> list[tuple[str, Any]]:
        """What this rank feeds the engine, named: the inputs on the first rank, the target on the last."""
        fed: list[tuple[str, Any]] = []
        if self.is_first:
            fed += [("input" if len(inputs) <= 1 else f"input {i}", t) for i, t in enumerate(inputs or (None,))]
        if self.is_last:
            fed.append(("target", target))
        return fed

    def _fix_batch(self, fed: list[tuple[str, Tensor]]) -> None:
        """Collective, at the first step: the batch this rank feeds is fixed, the same size on every rank
        that feeds one (each sees only its own), or the step is refused on every rank."""
        size = fed[0][1].size(0) if fed else 0
        refusal = unequal_batches(size, self.layout.job_group, self.device, self.replicas)
        if refusal:
            raise DistributedError(refusal)
        self._first_fed, self.batch_size = _described(fed), size or self.batch_size

    def _refusal(self, fed: list[tuple[str, Any]]) -> str | None:
        """What this rank finds wrong with the step it is asked to run, or ``None``."""
        if not torch.is_grad_enabled():
            return ("step() trains (forward and backward) but runs under torch.no_grad() or torch.inference_mode(), "
                    "and this engine has no forward-only mode. Fix: call step() with gradients enabled; to evaluate, "
                    "load save_checkpoint's file into the plain model")
        return (self._fed_refusal(fed) or self._branch_refusal(fed) or self._trainable_refusal()
                or self._structure_refusal())

    def _fed_refusal(self, fed: list[tuple[str, Any]]) -> str | None:
        """The engine fixes its micro-batch shapes and dtypes at the first step: another batch size
        or shape (a sequence length) would be read into the first step's buffers, wrong values without
        an error."""
        for what, value in fed:
            if not isinstance(value, Tensor):
                return (f"rank {self.rank} runs the {'last' if what == 'target' else 'first'} stage and needs "
                        f"the {what} tensor: call step(x, target=y) on this rank")
        if not fed:
            return None
        batch = self.batch_size or fed[0][1].size(0)
        uneven = uneven_split(batch, self.chunks) if self.batch_size is None else None
        if uneven:
            return uneven
        for what, tensor in fed:
            if tensor.size(0) == batch * self.replicas and self.replicas > 1:
                return (f"the {what} batch has {tensor.size(0)} samples, the whole batch of {self.replicas} replicas; "
                        f"each replica runs its share of {batch}. Fix: pass runner.shard({what}) to step()")
            if tensor.size(0) != batch:
                return (f"the {what} batch has {tensor.size(0)} samples but this pipeline runs batches of {batch}: "
                        "torch.distributed.pipelining fixes micro-batch shapes at the first step and would compute "
                        "wrong values. Fix: keep the batch size constant (DataLoader(drop_last=True)) or build a new "
                        f"DistributedPipeline with batch_size={tensor.size(0)} on every rank")
        if self._first_fed is not None and _described(fed) != self._first_fed:
            return (f"this step's {', '.join(_described(fed))} differs from the first step's "
                    f"{', '.join(self._first_fed)}: torch.distributed.pipelining fixes the shapes and dtypes it sends "
                    "at the first step and would read others into those buffers (wrong values, no error). Fix: keep "
                    "every shape and dtype constant (pad sequences to one length) or build a new DistributedPipeline "
                    "for the new shapes on every rank")
        return None

    def _structure_refusal(self) -> str | None:
        """A module of the layers replaced in the model since it was built, or hooks above the
        layers that the stages would not run (:mod:`autopipe.runtime._structure`)."""
        try:
            self._structure.check()
        except ChainError as error:
            return str(error)
        return None

    def _branch_refusal(self, fed: list[tuple[str, Any]]) -> str | None:
        """A first layer captured with torch.export on a forward that branches on the batch size
        holds for some whole batches only (:meth:`CapturedLayer.check_whole_batch`): the model's,
        ``replicas`` shares of this one (export's checks read sizes only, so shapes stand in)."""
        first = self.stage_layers[0].module
        if not self.is_first or not isinstance(first, CapturedLayer):
            return None
        inputs = tuple(value for what, value in fed if what != "target")
        if self.replicas > 1:
            inputs = tuple(torch.empty((t.size(0) * self.replicas, *t.shape[1:]), dtype=t.dtype, device="meta")
                           if isinstance(t, Tensor) and t.dim() else t for t in inputs)
        try:
            first.check_whole_batch(inputs)
        except (CapturedCallError, ValueError) as error:
            return str(error)
        return None

    def _trainable_refusal(self) -> str | None:
        """With replicas, DDP averages the gradients of the parameters that required grad when it was
        built, and no others: one unfrozen since would train apart on each replica.  Without, a stage
        whose outputs needed no gradient in the engine's shape probe (it and every stage before were
        frozen) gets none back: parameters unfrozen there since would get no gradient (torch raises
        mid-step)."""
        if self.replicas == 1:
            params = {id(p) for p in self.module.unfrozen_without_gradient()}
            unfrozen = [name for name, p in self.named_parameters() if id(p) in params]
            if not unfrozen:
                return None
            return (f"requires_grad of {unfrozen[:3]}{' and others' if len(unfrozen) > 3 else ''} was set since the "
                    f"first step, in which stage {self.rank}'s outputs needed no gradient (it and the stages before "
                    "it were frozen): torch.distributed.pipelining fixed then that no gradient comes back to it, so "
                    "these parameters would get none. Fix: build a new DistributedPipeline on every rank after "
                    "unfreezing (the same model and plan keep each rank's trained stage)")
        changed = [name for (name, p), was in zip(self.named_parameters(), self._trainable) if p.requires_grad != was]
        if not changed:
            return None
        return (f"requires_grad of {changed[:3]}{' and others' if len(changed) > 3 else ''} changed since this "
                "DistributedPipeline was built, and its replicas average (DDP) only the gradients of the parameters "
                "that required grad then: the replicas would drift apart. Fix: build a new DistributedPipeline on "
                "every rank after changing requires_grad (the same model and plan keep each rank's trained stage)")


def _described(fed: list[tuple[str, Tensor]]) -> list[str]:
    return [f"{what} {tuple(t.shape)} {str(t.dtype).removeprefix('torch.')}" for what, t in fed]


class _Share:
    """``loss_fn`` divided by the micro-batch count: each micro-batch's share of the batch's mean.

    It runs mid-step on the last rank only, where raising would leave the other ranks waiting: a
    result the engine cannot run backward from is put in :attr:`refusal` and a zero on the output's
    graph stands in, so the step ends on every rank and then raises on all of them.  ``loss_fn`` gets
    the output as the last layer returned it (:meth:`StageModule.take_output`; the engine's ``output``
    is one of its tensors, or the stand-in for an output the stage refused, when ``loss_fn`` is not called).
    """

    def __init__(self, loss_fn: Callable[..., Tensor], chunks: int, stage: StageModule) -> None:
        self.loss_fn, self.chunks, self.stage = loss_fn, chunks, stage
        self.refusal: str | None = None

    def __call__(self, output: Any, target: Any) -> Tensor:
        if self.stage.refusal is not None:
            return zero_on(output)
        output = self.stage.take_output()
        loss = self.loss_fn(output, target)
        if isinstance(loss, Tensor) and loss.numel() == 1 and loss.requires_grad:
            return loss / self.chunks
        self.refusal = (
            f"loss_fn returned {_what_loss(loss)}, and the engine runs the backward of one number per micro-batch: "
            "return a scalar tensor computed from the output, the micro-batch's mean over its samples "
            "(reduction='mean', not 'none'; not .item()). This step ran with a zero loss in its place")
        return zero_on(output)


def _what_loss(loss: Any) -> str:
    if not isinstance(loss, Tensor):
        return f"a {type(loss).__name__}"
    if loss.numel() != 1:
        return f"a tensor of shape {tuple(loss.shape)}"
    return "a tensor that does not require grad (detached from the output, or no parameter before it trains)"
