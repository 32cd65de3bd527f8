"""``autopipe.Pipeline``: a model split into stages that run micro-batches concurrently.

Use it like the model::

    pipe = autopipe.Pipeline(model, plan)            # or balance=[7, 8], devices=["cpu", "cpu"]
    optimizer = torch.optim.SGD(pipe.parameters(), lr=0.1)
    loss_fn(pipe(x), y).backward()
    optimizer.step()

The pipeline takes over the model's modules: it moves each stage's layers to the stage's
device and, with ``deferred_batch_norm=True``, swaps their batch norms for
:class:`~autopipe.DeferredBatchNorm` (sharing parameters and buffers).  ``state_dict`` keys and
values are the model's own, so checkpoints load both ways.
"""
from __future__ import annotations

import weakref
from typing import Any, Sequence

import torch
from torch import nn

from .._vocab import CHECKPOINT_MODES, CheckpointMode
from .batchnorm import DeferredBatchNorm
from ..device import resolve_devices
from ..model.fingerprint import check_made_for
from ..model import Layer, layer_chain
from .microbatch import gather, scatter, tensors_of
from ..planning.plans import Plan
from ..timeline import Event
from .balance import check_balance, stage_of_layer
from .checkpoint import checkpointed
from .engine import Engine
from .function import PipelineTie
from .memory import StageMeter, StagePeak
from .run import Run
from .skips import skip_spans, stage_routes
from .stage import Stage
from .turns import Turns

__all__ = ["Pipeline"]


class Pipeline(nn.Module):
    """A model run as a pipeline of stages, one worker thread per stage.

    Give a :class:`~autopipe.Plan` (its fingerprint must match the model) or the manual form:
    ``balance`` (layers per stage), ``devices`` (one per device, default ``"cpu"`` each),
    ``chunks`` (micro-batches per mini-batch), ``checkpoint`` (``"never"``,
    ``"except_last"`` or ``"always"``) and ``interleave`` (stages per device: stage ``s`` runs
    on ``devices[s % len(devices)]``; default 1, one stage per device).  ``model`` is anything
    :func:`~autopipe.layer_chain`
    reads, or a layer chain (``list[Layer]``, e.g. from :func:`autopipe.chain`).

    * ``pipe(*args)``: tensor arguments are split along dim 0 as :mod:`autopipe.runtime.microbatch`
      describes (a batch smaller than ``chunks`` gives one micro-batch per sample), other
      arguments go to every micro-batch; the first layer is called with them all, every later
      layer with the previous layer's value (a tensor or a tuple), as in ``nn.Sequential``.
      The output (a tensor or a tuple of tensors) is on the last stage's device.
    * Grad mode, autocast and the intra-op thread count are per thread; the caller's are
      applied on the workers for each call.
    * Under ``torch.no_grad()`` only the forward runs and nothing is kept.  In ``eval()``
      layers behave as in eval and nothing is checkpointed, but gradients still flow.
    * Each call's state lives in its own run: several forwards may precede their backwards,
      and a forward whose output is dropped frees its state with the output.
    * A stage's failure, forward or backward, is raised to the caller as a
      :class:`~autopipe.runtime.StageError` naming the stage, phase and micro-batch (the
      original as ``__cause__``) once every stage has stopped; the workers live on, so the
      pipeline stays usable.
    * ``last_trace()``: the measured timeline of the last iteration, for ``bench``; with
      ``pipe.measure_memory = True``, ``last_memory()``: each stage's peak bytes over it (on
      CPU every operator then reports its allocations, which slows the step: measure memory
      and time in different steps).
    * Stages on one device (``interleave > 1``) take turns computing
      (:class:`~autopipe.runtime.turns.Turns`), so each device runs one task at a time.

    Each stage runs its own backward, so parameters receive their gradients in ``.grad`` (as
    with ``loss.backward()``); ``torch.autograd.grad`` with respect to the pipeline's
    parameters, ``create_graph=True`` and a second backward through the same output are not
    supported (gradients with respect to the inputs are).

    Args:
        model: anything :func:`~autopipe.layer_chain` reads, or a list of layers.
        plan: the plan to run; it sets balance, devices, chunks, checkpoint and interleave.
        balance: layers per stage (manual form, without a plan).
        devices: one per device (manual form; default ``"cpu"`` for each).
        chunks: micro-batches per mini-batch (manual form).
        checkpoint: which micro-batches recompute their forward in backward (manual form).
        deferred_batch_norm: swap batch norms for :class:`~autopipe.DeferredBatchNorm`, whose
            running statistics see the whole mini-batch once, as in the plain model.
        interleave: stages per device (manual form).

    Raises:
        TypeError: neither a plan nor a balance, or both a plan and balance/devices.
        ValueError: the plan was made for another model or for another schedule; a balance,
            chunks, checkpoint mode, interleave or device count that does not fit the model.
        ChainError: the model cannot be read as a chain of layers.
        DeviceError: a device does not exist.
    """

    def __init__(
        self,
        model: nn.Module | Sequence[Layer],
        plan: Plan | None = None,
        *,
        balance: Sequence[int] | None = None,
        devices: Sequence[torch.device | str | int] | None = None,
        chunks: int = 1,
        checkpoint: CheckpointMode = "except_last",
        deferred_batch_norm: bool = False,
        interleave: int = 1,
    ) -> None:
        super().__init__()
        layers = layer_chain(model)
        if plan is not None:
            balance, devices, chunks, checkpoint, interleave = _from_plan(plan, layers, balance, devices)
        if balance is None:
            raise TypeError("give a plan, or balance=[layers per stage] (and devices=[...])")
        _check(layers, list(balance), chunks, checkpoint, interleave)
        resolved = resolve_devices(list(devices) if devices is not None else ["cpu"] * (len(balance) // interleave))
        _check_devices(resolved, len(balance), interleave)
        if deferred_batch_norm:
            layers = [_deferred(layer) for layer in layers]
        self.plan, self.chunks, self.checkpoint = plan, chunks, checkpoint
        self.balance, self.devices, self.interleave = list(balance), resolved, interleave
        self._register_state(layers)
        self._engine = Engine(_build_stages(layers, self.balance, resolved))
        self._dummy = torch.ones((), requires_grad=True)
        self.measure_memory = False
        weakref.finalize(self, self._engine.close)

    @property
    def stages(self) -> list[Stage]:
        return self._engine.stages

    def forward(self, *args: Any) -> Any:
        grad = torch.is_grad_enabled()
        run = self._new_run(scatter(args, self.chunks), grad)
        if not grad:
            self._engine.run_phase(run, "forward")
            return gather([run.outputs.pop(j) for j in range(run.chunks)])
        return PipelineTie.apply(self._engine, run, self._dummy, *tensors_of(args))

    def _new_run(self, micro_batches: list[tuple[Any, ...]], grad: bool) -> Run:
        chunks = len(micro_batches)
        checkpointing = grad and self.training
        dropped = [checkpointing and checkpointed(self.checkpoint, j, chunks) for j in range(chunks)]
        autocast = [(kind, torch.get_autocast_dtype(kind)) for kind in ("cpu", "cuda")
                    if torch.is_autocast_enabled(kind)]
        run = Run(micro_batches, dropped, grad, autocast, torch.get_num_threads(), len(self.stages))
        if self.measure_memory:
            run.meter = StageMeter(self.stages)
        return run

    def last_trace(self) -> list[Event]:
        """Events of the last completed iteration (forward and backward), sorted by start."""
        return list(self._engine.last)

    def last_memory(self) -> list[StagePeak] | None:
        """Each stage's peak bytes over the last completed iteration, if ``measure_memory`` was
        on when it started (:mod:`autopipe.runtime.memory` says what a stage's bytes are)."""
        return self._engine.last_memory

    def train(self, mode: bool = True) -> Pipeline:
        super().train(mode)
        for stage in self.stages:
            for module in stage.modules:
                module.train(mode)
        return self

    def close(self) -> None:
        """Stop the worker threads (also done when the pipeline is garbage collected)."""
        self._engine.close()

    def _register_state(self, layers: list[Layer]) -> None:
        """Register every module that directly holds parameters or buffers at its path in the
        original model, so ``state_dict`` keys (and ``parameters()``) are the model's own."""
        for layer in layers:
            for name, module in layer.module.named_modules():
                path = ".".join(p for p in (layer.state_prefix, name) if p)
                if not path:  # a captured layer holding the model's top-level tensors itself
                    self._adopt_tensors(module)
                elif module._parameters or module._buffers:
                    _place(self, path, module)

    def _adopt_tensors(self, module: nn.Module) -> None:
        for name, param in module.named_parameters(recurse=False):
            self.register_parameter(name, param)
        for name, buffer in module.named_buffers(recurse=False):
            self.register_buffer(name, buffer, persistent=name not in module._non_persistent_buffers_set)


def _place(root: nn.Module, path: str, module: nn.Module) -> None:
    *parents, leaf = path.split(".")
    node = root
    for part in parents:
        child = node._modules.get(part)
        if child is None:
            child = nn.Module()
            node.add_module(part, child)
        node = child
    existing = node._modules.get(leaf)
    if existing is None:
        node.add_module(leaf, module)
    elif existing is not module and not _contains(existing, module):
        raise ValueError(f"two different modules claim the state path '{path}'")


def _contains(parent: nn.Module, module: nn.Module) -> bool:
    return any(sub is module for sub in parent.modules())


def _from_plan(plan: Plan, layers: list[Layer], balance: object,
               devices: object) -> tuple[list[int], list[str], int, CheckpointMode, int]:
    if balance is not None or devices is not None:
        raise TypeError("give either a plan or balance/devices, not both")
    check_made_for(plan.model, layers, "plan", "plan this model again")
    if plan.schedule != "gpipe":
        raise ValueError(
            f"the plan's schedule is '{plan.schedule}'; autopipe.Pipeline runs 'gpipe' (fill-drain), "
            "because its caller computes the loss after the forward; plan with schedule='gpipe'"
        )
    return plan.balance, plan.devices[: plan.device_count], plan.chunks, plan.checkpoint, plan.interleave


def _check(layers: list[Layer], balance: list[int], chunks: int, checkpoint: CheckpointMode, interleave: int) -> None:
    check_balance(balance, len(layers))
    if not isinstance(interleave, int) or interleave < 1 or len(balance) % interleave:
        raise ValueError(f"interleave={interleave!r} must be a positive integer dividing the "
                         f"{len(balance)} stages of balance {balance}")
    if not isinstance(chunks, int) or chunks < 1:
        raise ValueError(f"chunks must be a positive integer, got {chunks!r}")
    if checkpoint not in CHECKPOINT_MODES:
        raise ValueError(f"checkpoint '{checkpoint}' is not one of {list(CHECKPOINT_MODES)}")


def _check_devices(devices: list[torch.device], stages: int, interleave: int) -> None:
    if len(devices) * interleave != stages:
        per = "device per stage" if interleave == 1 else f"device per {interleave} stages (interleave={interleave})"
        raise ValueError(f"{len(devices)} devices for {stages} stages; give one {per}")


def _deferred(layer: Layer) -> Layer:
    module = DeferredBatchNorm.convert(layer.module)
    if module is layer.module:
        return layer
    return Layer(layer.name, module, layer.stash, layer.pop, layer.prefix)


def _build_stages(layers: list[Layer], balance: list[int], devices: list[torch.device]) -> list[Stage]:
    """Stage ``s`` on ``devices[s % len(devices)]``, sharing that device's turns."""
    routes = stage_routes(skip_spans(layers, stage_of_layer(balance)), len(balance))
    turns = [Turns() for _ in devices]
    stages: list[Stage] = []
    start = 0
    for index, count in enumerate(balance):
        device = devices[index % len(devices)]
        chunk = layers[start:start + count]
        for layer in chunk:
            layer.module.to(device)
        stages.append(Stage(index, len(balance), chunk, device, routes[index], stages, turns[index % len(devices)]))
        start += count
    return stages
