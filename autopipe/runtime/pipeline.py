"""``autopipe.Pipeline``: a model split into stages that run micro-batches concurrently.

Use it like the model::

    pipe = autopipe.Pipeline(model, plan)            # or balance=[7, 8], devices=["cpu", "cpu"]
    optimizer = torch.optim.SGD(pipe.parameters(), lr=0.1)
    loss_fn(pipe(x), y).backward()
    optimizer.step()

The pipeline takes over the model's modules: it moves each stage's layers to the stage's
device and, with ``deferred_batch_norm=True``, swaps their batch norms for
:class:`~autopipe.DeferredBatchNorm` (sharing parameters and buffers).  ``state_dict`` keys and
values are the model's own, so checkpoints load both ways, and so are ``named_modules()``: the
model's modules under its names, parameterless ones too, so ``for m in pipe.modules(): if
isinstance(m, nn.Dropout): ...`` reaches what the stages run.  A model built on the meta device
is refused for stages with data: materialize it first.
"""
from __future__ import annotations

import contextlib
import os
import warnings
from typing import Any, Callable, Iterator, Sequence

import torch
from torch import nn

from .._vocab import CHECKPOINT_MODES, CheckpointMode
from .._checks import check_choice, is_positive_int, loaded, positive_int
from .batchnorm import DeferredBatchNorm, subclassed
from ..errors import ChainError, DeviceError, OptionError, add_note
from ..device import MATERIALIZE, check_not_meta, meta_tensor, resolve_devices
from ..model.fingerprint import check_made_for
from ..model import Layer, call_arguments, layer_chain
from ..model.capture import CapturedLayer, autocast_state
from ..model.layers import attach, module_at, run_modules
from ..model.reading import balance_units
from ._model_calls import model_output
from ._structure import Structure, submodule
from .microbatch import scatter, tensors_of
from ..planning.plans import Plan
from .._vocab import REDUCTIONS, SCHEDULES, TURN_RULES, Reduction, Schedule, TurnRule
from ..timeline import Event
from .balance import check_balance, stage_of_layer
from .checkpoint import checkpointed
from .engine import Engine
from .function import PipelineTie
from .memory import StageMeter, StagePeak
from .replicas import Copies, Replicas, copied_layers, pair_stages, shares_parameters
from .run import Loss, Run
from .skips import skip_spans, stage_routes
from .stage import Stage
from .turns import Turns

__all__ = ["Pipeline", "undeferrable"]


#: Marks a call that a compiled caller (``torch.compile``) runs eagerly, as a graph break: the
#: stages run on worker threads, which no graph can hold.
_eager = torch.compiler.disable(
    reason="an autopipe.Pipeline runs its stages on worker threads, which a compiled graph cannot hold, so it runs "
           "eagerly between the caller's graphs; with fullgraph=True, call the pipeline outside the compiled function")

#: The manual form's options that a plan would set, and their values without one (torchgpipe's).
_MANUAL_DEFAULTS: dict[str, Any] = {"chunks": 1, "checkpoint": "except_last", "interleave": 1, "replicas": 1,
                                    "schedule": "gpipe", "turns": "depth_first"}


class Pipeline(nn.Module):
    """A model run as a pipeline of stages, one worker thread per stage.

    Give a :class:`~autopipe.Plan` (its fingerprint must match the model) or the manual form:
    ``balance`` (layers per stage; for an ``nn.Sequential`` these are its top-level children, a
    nested Sequential counting as one, as in torchgpipe), ``devices`` (one per device, default
    ``"cpu"`` each; extra devices are ignored, the first ones used, as in torchgpipe),
    ``chunks`` (micro-batches per mini-batch), ``checkpoint`` (``"never"``,
    ``"except_last"`` or ``"always"``), ``interleave`` (stages per device: stage ``s`` runs
    on ``devices[s % len(devices)]``; default 1, one stage per device) and ``schedule``
    (``"gpipe"``, fill-drain, or ``"1f1b"``: :mod:`autopipe.planning.schedules`); ``turns``
    (``"depth_first"`` or ``"breadth_first"``) is how stages sharing a device take turns.
    ``model`` is anything :func:`~autopipe.layer_chain`
    reads, or a layer chain (``list[Layer]``, e.g. from :func:`autopipe.chain`).

    ``replicas`` (or the plan's) runs that many copies of the pipeline side by side, each on its
    share of the batch (``devices`` then lists every replica's devices in turn): ``.grad`` is the
    whole batch's and ``parameters()`` is one set (:mod:`autopipe.runtime.replicas`: shared on
    CPU, copied and reduced elsewhere).  Replicas always defer batch norm.

    * ``pipe(*args, **kwargs)``: keyword arguments reach a chain captured with them
      (``autopipe.chain(hf_model, {"input_ids": ids, "labels": ids})``), as positional inputs
      of its first layer, and the output is the model's own type (``out.logits``, ``out.loss``,
      the loss joined over micro-batches as their size-weighted mean:
      :mod:`autopipe.runtime._model_calls`).  Tensor arguments are split along dim 0 as
      :mod:`autopipe.runtime.microbatch` describes (a batch smaller than ``chunks`` gives one
      micro-batch per sample), other arguments go to every micro-batch; the first layer is
      called with them all, every later layer with the previous layer's value (a tensor or a
      tuple), as in ``nn.Sequential``.
      The output (a tensor or a tuple of tensors) is on the last stage's device.
    * Grad mode, autocast and the intra-op thread count are per thread; the caller's are
      applied on the workers for each call (a layer exported by torch.export refuses an autocast
      or dtypes its graph does not cover: :mod:`autopipe.model.capture._layer`).
    * Under ``torch.no_grad()`` only the forward runs and nothing is kept, as where neither an
      input nor a parameter requires grad (a frozen model).  In ``eval()``
      layers behave as in eval and nothing is checkpointed, but gradients still flow.
    * Each call's state lives in its own run: several forwards may precede their backwards,
      and a forward whose output is dropped frees its state with the output.  Calls from
      several threads may overlap: every worker takes their phases in one order.
    * A checkpointed micro-batch recomputes from the caller's batch: a write into it between
      the forward and the backward is refused as autograd refuses it (``modified by an inplace
      operation``).  A meta tensor (no values) given for a stage with data is refused.
    * A stage's failure, forward or backward, stops the other stages after their current
      micro-batch and reaches the caller as the layer's own exception, with a note naming the
      stage (and replica), phase and micro-batch (``KeyboardInterrupt`` and ``SystemExit``
      unchanged); the workers live on, so the pipeline stays usable.
    * A module instance called at several positions (``nn.Sequential(a, act, b, act)``) runs
      at each, sharing its parameters; refused are shared parameters on two devices and shared
      buffers (batch norm statistics) on two stages.
    * A stage whose first layer writes into its input (``LeakyReLU(inplace=True)``, ``x.add_``)
      computes on copies where it matters (:mod:`autopipe.runtime.inplace`): a checkpointed
      micro-batch recomputes from its inputs as they arrived, and the caller's batch is never
      written.  A write into a tensor that is also stashed under another name, in another
      stage (``stash(name, x); return x``), would change every name of it in the plain model,
      which a pipeline cannot do: :class:`~autopipe.ChainError` names the fixes
      (:mod:`autopipe.runtime.aliases`).
    * A checkpointed micro-batch recomputes on the stage's buffers as its forward found them
      (a copy is kept until its backward; a buffer the forward assigns anew is followed where
      it lives) and what the recomputation writes into them (batch norm statistics, counters)
      is put back: each micro-batch updates them once.
    * The stages run the modules the pipeline was built with: one replaced since, in the model
      or the pipeline, and hooks that would not run (on the model itself, or added since on a
      container whose layers were split) are refused at the call (:mod:`autopipe.runtime._structure`).
    * ``len(pipe)``, ``pipe[i]`` and ``iter(pipe)`` give the layers, as on the Sequential.
    * ``train_step(*args, target=y, loss_fn=f, **kwargs)``: one training iteration with the loss
      on the last stage, run by the pipeline's schedule; the only way to train a ``"1f1b"``
      pipeline (its backwards start before the last forward), and equivalent to
      ``f(pipe(*args, **kwargs), y).backward()`` for a ``"gpipe"`` one (a model's own loss:
      ``train_step(**batch, loss_fn=lambda out, _: out.loss)``).
    * ``last_trace()``: the measured timeline of the last iteration, for ``bench``; with
      ``pipe.measure_memory = True``, ``last_memory()``: each stage's peak bytes over it (on
      CPU every operator then reports its allocations, which slows the step: measure memory
      and time in different steps).
    * Inside a compiled caller (``torch.compile(pipe)``, or a compiled function that calls the
      pipeline) the pipeline runs eagerly, a graph break: its stages run on worker threads.
    * Stages on one device (``interleave > 1``) take turns computing
      (:class:`~autopipe.runtime.turns.Turns`), so each device runs one task at a time.

    Each stage runs its own backward, so parameters receive their gradients in ``.grad`` (as
    with ``loss.backward()``); ``torch.autograd.grad`` with respect to the pipeline's
    parameters is not supported (they are not in the caller's graph, so they get no gradient,
    without an error, and ``loss.backward(inputs=[param])`` leaves their ``.grad`` alone;
    gradients with respect to the inputs work), and ``create_graph=True`` (a gradient penalty) is
    refused.  A second backward
    through the same output needs ``retain_graph=True`` in the first, as on the plain model.

    Args:
        model: anything :func:`~autopipe.layer_chain` reads, or a list of layers.
        plan: the plan to run, or the path of one saved as JSON; it sets balance, devices,
            chunks, checkpoint, interleave, replicas, schedule and turns.
        balance: layers per stage (manual form, without a plan).
        devices: one per device (manual form; default ``"cpu"`` for each).
        chunks: micro-batches per mini-batch (manual form).
        checkpoint: which micro-batches recompute their forward in backward (manual form).
        deferred_batch_norm: swap batch norms for :class:`~autopipe.DeferredBatchNorm`, whose
            running statistics see the whole mini-batch once, as in the plain model.
        interleave: stages per device (manual form).
        replicas: copies of the pipeline trained side by side on shares of the batch (manual form).
        schedule: ``"gpipe"`` or ``"1f1b"`` (manual form).
        turns: ``"depth_first"`` or ``"breadth_first"``: how stages sharing a device take turns
            (manual form).

    Raises:
        TypeError: neither a plan nor a balance, or both a plan and any option of the manual form.
        OptionError: the plan was made for another model; a balance, chunks, checkpoint mode,
            interleave, replica count, schedule or turn rule that does not fit (a ``ValueError``).
        FormatError: the plan file is corrupt or of another schema.
        ChainError: the model cannot be read as a chain of layers, or batch norm is to be
            deferred (``deferred_batch_norm``, replicas) in layers captured by torch.export.
        DeviceError: a device does not exist, or fewer devices than stages, or the model's
            parameters are on the meta device for a stage with data (``model.to_empty(device=...)``
            and load its weights first).
    """

    def __init__(
        self,
        model: nn.Module | Sequence[Layer],
        plan: Plan | str | os.PathLike[str] | None = None,
        *,
        balance: Sequence[int] | None = None,
        devices: Sequence[torch.device | str | int] | None = None,
        chunks: int | None = None,
        checkpoint: CheckpointMode | None = None,
        deferred_batch_norm: bool = False,
        interleave: int | None = None,
        replicas: int | None = None,
        schedule: Schedule | None = None,
        turns: TurnRule | None = None,
    ) -> None:
        super().__init__()
        manual = {"balance": balance, "devices": devices, "chunks": chunks, "checkpoint": checkpoint,
                  "interleave": interleave, "replicas": replicas, "schedule": schedule, "turns": turns}
        if isinstance(plan, (list, tuple)):  # torchgpipe's GPipe(model, balance)
            raise OptionError(f"Pipeline's second argument is a plan; for the layers per stage {list(plan)} "
                              "pass balance=... (with devices=... and chunks=...)")
        if plan is not None:
            plan = loaded(plan, Plan, "plan")
            layers = layer_chain(model)
            balance, devices, chunks, checkpoint, interleave, replicas, schedule = _from_plan(plan, layers, manual)
            turns = plan.turns
        elif balance is None:
            raise TypeError("give a plan, or balance=[layers per stage] (and devices=[...])")
        else:
            layers = balance_units(model)
            chunks, checkpoint, interleave, replicas, schedule, turns = (
                _MANUAL_DEFAULTS[name] if manual[name] is None else manual[name] for name in _MANUAL_DEFAULTS)
        _check(layers, list(balance), chunks, checkpoint, interleave, replicas, schedule, turns)
        per_replica = len(balance) // interleave
        resolved = resolve_devices(devices if devices is not None else ["cpu"] * (per_replica * replicas))
        resolved = _used_devices(resolved, per_replica, interleave, replicas)
        groups = [resolved[r * per_replica:(r + 1) * per_replica] for r in range(replicas)]
        _check_shared(layers, list(balance), groups[0])
        _check_materialized(layers, list(balance), groups)
        if deferred_batch_norm or replicas > 1:
            _check_deferrable(layers, "deferred_batch_norm=True" if deferred_batch_norm else f"replicas={replicas}")
            for layer in layers:
                DeferredBatchNorm.convert(layer.module)
        self.plan, self.chunks, self.checkpoint, self.schedule = plan, chunks, checkpoint, schedule
        self.balance, self.devices, self.interleave = list(balance), resolved, interleave
        self.replicas = replicas
        held = self._register_modules(layers, getattr(layers, "model", None))  # the model the chain was read from
        _warn_left_out(self, getattr(layers, "model", None))
        self._layers = [layer.module for layer in layers]
        shared = shares_parameters(groups)
        self._structure = Structure.of(self, held, layers, inside=not shared and replicas > 1)  # copies
        self._structure.check()
        chains = [layers if r == 0 or shared else copied_layers(layers) for r in range(replicas)]
        self._engines = [Engine(_build_stages(chain, self.balance, group, turns, r if replicas > 1 else None), schedule)
                         for r, (chain, group) in enumerate(zip(chains, groups))]
        self._copies = None if shared or replicas == 1 else Copies(chains[0], chains[1:])
        if replicas > 1:
            pair_stages(self._engines, shared)
        self._engine = self._engines[0]
        self._dummy = torch.ones((), requires_grad=True)
        self.measure_memory = False

    @property
    def stages(self) -> list[Stage]:
        """The stages of the first replica (every replica runs the same modules)."""
        return self._engine.stages

    @property
    def partitions(self) -> nn.ModuleList:
        """Each stage's modules (of the first replica), in stage order, as torchgpipe's
        ``GPipe.partitions``: the same modules, not copies."""
        return nn.ModuleList(nn.Sequential(*stage.modules) for stage in self.stages)

    def __len__(self) -> int:
        return len(self._layers)

    def __getitem__(self, index: int) -> nn.Module:
        """The layer at ``index`` (negative counts from the end), as ``sequential[index]``."""
        if not -len(self._layers) <= index < len(self._layers):
            raise IndexError(f"index {index} is out of range for a pipeline of {len(self._layers)} layers")
        return self._layers[index]

    def __iter__(self) -> Iterator[nn.Module]:
        return iter(self._layers)

    def __getstate__(self) -> dict[str, Any]:
        # its stages hold threads, locks and streams: neither pickle nor deepcopy can take them
        raise TypeError("an autopipe.Pipeline cannot be pickled or copied: save pipe.state_dict() (the model's own "
                        "keys) and build the pipeline again from the model (autopipe.Pipeline(model, plan)), or "
                        "copy the model before partitioning it")

    @_eager
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        args = call_arguments(self.stages[0].modules[0], args, kwargs)
        grad = torch.is_grad_enabled() and self._differentiable(args)
        if grad and self.schedule != "gpipe":
            raise RuntimeError(
                f"a '{self.schedule}' pipeline interleaves forwards and backwards, so it needs the loss "
                "inside: train with pipe.train_step(*inputs, target=..., loss_fn=...) (a model that computes "
                "its own loss: pipe.train_step(**batch, loss_fn=lambda out, _: out.loss)); call pipe(x) "
                "under torch.no_grad() for inference"
            )
        replicas = self._replicas(args, grad)
        if grad:
            output = PipelineTie.apply(replicas, self._dummy, *tensors_of(args))
        else:
            replicas.run_phase("forward")
            output = replicas.take_outputs()
        return model_output(self.stages[-1].modules[-1], output)

    def _differentiable(self, args: tuple[Any, ...]) -> bool:
        """Whether a call on ``args`` can give an output that requires grad: an input or a
        parameter requires one.  A frozen pipeline on data (a feature extractor) then runs as
        under ``no_grad``: its output requires no grad, as the plain model's, so a backward
        neither reaches it (running the stages' backwards for nothing) nor passes silently."""
        return any(t.requires_grad for t in tensors_of(args)) or any(p.requires_grad for p in self.parameters())

    @_eager
    def train_step(self, *args: Any, target: Any = None, loss_fn: Callable[..., torch.Tensor],
                   reduction: Reduction = "mean", **kwargs: Any) -> torch.Tensor:
        """One training iteration under the pipeline's schedule, the loss on the last stage.

        Gradients (accumulated into ``.grad``) are those of ``loss_fn(model(*args, **kwargs),
        target)``.  ``loss_fn`` gets each micro-batch's output as ``pipe(*args, **kwargs)``
        returns it (a captured transformers model's own ``ModelOutput``), and ``target`` split
        along dim 0 like the inputs (a tensor or a tuple of tensors), or ``None`` as it is for a
        model that computes its loss itself: ``pipe.train_step(**batch, loss_fn=lambda out, _:
        out.loss)``.  The loss runs once per micro-batch, so how they add up depends on how
        ``loss_fn`` reduces its samples, which only the caller knows: a mean over samples
        (``"mean"``) has micro-batch ``j`` of ``n_j`` samples (of ``N``) contribute
        ``loss_fn(out_j, target_j) · n_j / N``, a sum (``"sum"``) its loss as it is.  A mean
        over something else (tokens not ignored, class weights) is neither: reduce by sum and
        divide by a count that does not depend on the micro-batch.  Parameters get gradients;
        the inputs do not (use ``pipe(x)`` with a gpipe pipeline for input gradients).

        Args:
            args: the model's positional inputs, as for ``pipe(*args, **kwargs)``.
            target: what ``loss_fn`` compares the output with, one row per sample, or ``None``.
            loss_fn: ``loss_fn(output, target) -> scalar tensor``.
            reduction: ``"mean"`` (the default of torch's losses) or ``"sum"``: how ``loss_fn``
                reduces the samples it is given.
            kwargs: the model's keyword inputs, as for ``pipe(*args, **kwargs)`` (an argument
                named ``target``, ``loss_fn`` or ``reduction`` is this method's, not the model's).

        Returns:
            The batch's loss (detached, on the last stage's device).

        Raises:
            Exception: a layer's (or ``loss_fn``'s, on the last stage) own exception, with a note
                naming the stage, phase and micro-batch.  A ``.grad`` that was ``None`` before the
                failed step is ``None`` again; one that held gradients and now holds part of the
                step's too gets a note saying so.
            RuntimeError: gradients are disabled (``torch.no_grad()``, ``torch.inference_mode()``),
                or ``loss_fn``'s loss does not require grad (detached), where the plain model's
                ``loss.backward()`` raises too.
            ValueError: ``target`` does not have the inputs' batch size, or the batch is empty
                with ``reduction="mean"``.
            TypeError: ``target`` holds no tensor.
            DeviceError: an input or ``target`` is a meta tensor, for a stage with data.
            OptionError: ``reduction`` is not ``"mean"`` or ``"sum"``.
        """
        check_choice(reduction, "reduction", REDUCTIONS)
        _check_grad_enabled()
        args = call_arguments(self.stages[0].modules[0], args, kwargs)
        replicas = self._replicas(args, True)
        total = sum(replicas.sizes)
        if total == 0 and reduction == "mean":
            raise ValueError("train_step got a batch of 0 samples, whose mean loss is undefined (the plain model's "
                             "is NaN); skip empty batches, or give reduction='sum' with a loss_fn that sums")
        targets = [None] * len(replicas.runs) if target is None else self._shares(self._target(target, total))
        last = self.stages[-1].modules[-1]

        def on_model_output(output: Any, micro_target: Any) -> torch.Tensor:
            return loss_fn(model_output(last, output), micro_target)

        for run, share_target in zip(replicas.runs, targets):
            micro_targets = _micro_targets(share_target, self.chunks, run.chunks)
            weights = [n / total if reduction == "mean" else 1.0 for n in run.sizes]
            run.loss = Loss(on_model_output, micro_targets, weights)
        with _restored_on_failure(list(self.parameters())):
            replicas.run_phase("train")
        _check_differentiable(replicas.runs)
        losses = [run.outputs.pop(j) for run in replicas.runs for j in range(run.chunks)]
        return torch.stack([loss.detach().to(losses[0].device) for loss in losses]).sum()

    def _target(self, target: Any, batch: int) -> tuple[Any]:
        """``target`` as the one argument to split like the inputs, refused (naming ``target``)
        unless it holds tensors with one row per sample on devices with data where it goes."""
        tensors = tensors_of(target)
        if not tensors:
            raise TypeError(f"target is of type {type(target).__name__}, but it is split into micro-batches like the "
                            "inputs: give a tensor (or a tuple of tensors) with one row per sample (torch.tensor(...) "
                            "makes one), or None for a model that computes its own loss")
        for tensor in tensors:
            if tensor.dim() == 0 or tensor.shape[0] != batch:
                found = (f"is a scalar tensor but the inputs have batch size {batch}" if tensor.dim() == 0
                         else f"has batch size {tensor.shape[0]} but the inputs {batch}")
                raise ValueError(f"target {found}; target is split along dim 0 like the inputs, so give one target "
                                 "row per sample (a target shared by every sample belongs in loss_fn)")
        for engine in self._engines:
            check_not_meta(tensors, engine.stages[-1].device, "target")
        return (target,)

    def _shares(self, args: tuple[Any, ...]) -> list[tuple[Any, ...]]:
        """``args`` split into the replicas' shares of the batch, as micro-batches are split."""
        return scatter(args, self.replicas) if self.replicas > 1 else [args]

    def _replicas(self, args: tuple[Any, ...], grad: bool) -> Replicas:
        """One call's runs: the batch split into replica shares, each into micro-batches."""
        self._structure.check()
        for engine in self._engines:
            check_not_meta(tensors_of(args), engine.stages[0].device, "an input of the pipeline")
        first = self._engines[0].stages[0].layers[0].module
        if isinstance(first, CapturedLayer):  # its graph may hold for some batch sizes only
            first.check_whole_batch(args)
        runs = [self._new_run(scatter(share, self.chunks), grad) for share in self._shares(args)]
        replays = any(any(run.checkpointed) for run in runs)  # the replicas share generators and buffers
        for run in runs:
            run.replays, run.step = replays, runs[0].step
        engines = self._engines[:len(runs)]
        if self.measure_memory:
            for engine, run in zip(engines, runs):
                run.meter = StageMeter(engine.stages)
        return Replicas(engines, runs, self._copies)

    def _new_run(self, micro_batches: list[tuple[Any, ...]], grad: bool) -> Run:
        chunks = len(micro_batches)
        checkpointing = grad and self.training
        dropped = [checkpointing and checkpointed(self.checkpoint, j, chunks) for j in range(chunks)]
        return Run(micro_batches, dropped, grad, list(autocast_state()), torch.get_num_threads(), len(self.stages))

    def last_trace(self) -> list[Event]:
        """Events of the last completed iteration (forward and backward), sorted by start."""
        return list(self._engine.last)

    def last_memory(self) -> list[StagePeak] | None:
        """Each stage's peak bytes over the last completed iteration, if ``measure_memory`` was
        on when it started (:mod:`autopipe.runtime.memory` says what a stage's bytes are); with
        replicas, the first replica's stages."""
        return self._engine.last_memory

    def train(self, mode: bool = True) -> Pipeline:
        super().train(mode)
        for engine in self._engines:
            for stage in engine.stages:
                for module in stage.modules:
                    module.train(mode)
        return self

    def close(self) -> None:
        """Stop the worker threads (also done when the pipeline is garbage collected)."""
        for engine in self._engines:
            engine.close()

    def _register_modules(self, layers: list[Layer], model: nn.Module | None) -> list[tuple[str, nn.Module]]:
        """Hold the model's modules at their paths in the model, so ``named_modules()``,
        ``apply()``, ``get_submodule()`` and ``print(pipe)`` show the model's own (the objects
        the first replica's stages run: setting ``dropout.p`` or zeroing ``bn2.weight`` through
        them changes what runs) and ``state_dict`` keys (and ``parameters()``) are the model's.

        Each layer's modules are attached at their paths, parameterless ones too (a module at a
        path the model lacks, as a ResNet chain's ``flatten``, only if it holds tensors), except
        what the layers make themselves: a captured layer or a
        :class:`~autopipe.model.layers.Span` (at the model's own path) and the bare
        ``nn.Module`` containers giving a captured layer the model's paths.  Those cannot be
        registered: a layer would sit where the pipeline does, a container would take in the
        modules other layers attach under its path (``encoder.pos_embedding``'s container would
        hold ``encoder.layers``: another stage's tensors), and several layers may hold tensors
        at one path.  So the pipeline makes its own container there, holding their tensors in
        slots linked to the layer's (:class:`_LinkedSlots`): a tensor that
        ``load_state_dict(assign=True)``, ``double()`` or ``functional_call`` puts there is the
        one the stage runs on.  Given the ``model`` (itself, or the one a
        :class:`~autopipe.model.layers.Chain` read it from), a container is then the model's
        own module where that changes neither state nor modules (:func:`_adopt_containers`):
        its ``Sequential``, its ``BasicBlock``; elsewhere (the model's root, a container
        holding more) the model's slots are linked too (:func:`_link_model_slots`).  Modules
        are attached in the model's order where the chain knows it (a
        :class:`~autopipe.model.layers.Chain`), else in forward order, so ``parameters()``
        lists them as ``model.parameters()`` does.  Returns the modules attached, with their paths."""
        order = {path: index for index, path in reversed(list(enumerate(getattr(layers, "module_order", ()))))}
        held = [(layer.path(name), module)
                for layer in layers for name, module in layer.module.named_modules(remove_duplicate=False)]
        linked: list[tuple[str, nn.Module]] = []
        attached: list[tuple[str, nn.Module]] = []
        for path, module in sorted(held, key=lambda entry: order.get(entry[0], len(order))):
            if path and type(module) is not nn.Module:
                if not order or path in order or _holds_tensors(module):
                    attach(self, path, module)
                    attached.append((path, module))
            elif module._parameters or module._buffers:
                module_at(self, path)  # made now, so that it comes in the model's order
                linked.append((path, module))
        if model is not None:
            state = {layer.path(key): id(value)
                     for layer in layers for key, value in layer.module.state_dict(keep_vars=True).items()}
            _adopt_containers(self, model, state)
        for path, module in linked:
            _link_tensors(module_at(self, path), module)
            if model is not None:
                _link_model_slots(module_at(self, path), model, path)
        return attached


#: A slot that is not there (``None`` is a slot's value: a parameter set to none).
_ABSENT = object()


class _LinkedSlots(dict):  # type: ignore[type-arg]
    """A module's ``_parameters`` or ``_buffers`` whose named slots other modules' dicts hold too.

    ``nn.Module`` replaces a tensor by writing its slot (``register_parameter``, ``_apply``,
    ``load_state_dict(assign=True)``, ``functional_call``), so a tensor registered on two
    modules would part at the first swap; writing or deleting a linked slot here writes or
    deletes it in each linked dict too, so both modules always hold the same tensor.  A copy
    (``deepcopy``, pickling) is a plain dict, linked to nothing."""

    def __init__(self, slots: dict[str, Any]) -> None:
        super().__init__(slots)
        self.links: dict[str, list[dict[str, Any]]] = {}

    def link(self, name: str, other: _LinkedSlots) -> None:
        """Hold ``other``'s tensor ``name`` in a slot linked to ``other``'s, both ways."""
        super().__setitem__(name, other[name])
        self.links.setdefault(name, []).append(other)
        other.links.setdefault(name, []).append(self)

    def __setitem__(self, name: str, value: Any) -> None:
        super().__setitem__(name, value)
        for other in self.links.get(name, ()):
            if other.get(name, _ABSENT) is not value:
                other[name] = value

    def __delitem__(self, name: str) -> None:
        super().__delitem__(name)
        for other in self.links.get(name, ()):
            if name in other:
                del other[name]

    def __reduce__(self) -> tuple[Any, ...]:
        return dict, (dict(self),)


def _warn_left_out(pipe: nn.Module, model: nn.Module | None) -> None:
    """Warn of the ``model``'s parameters and buffers that no layer holds (a learnable temperature
    the loss reads outside ``forward``, a module ``forward`` never calls): the pipeline's
    ``parameters()`` and ``state_dict()`` leave them out, so an optimizer given
    ``pipe.parameters()`` would not train them."""
    if model is None:
        return
    held = {id(tensor) for tensor in pipe.state_dict(keep_vars=True).values()}
    left = [name for name, tensor in model.state_dict(keep_vars=True).items() if id(tensor) not in held]
    if left:
        named = ", ".join(repr(name) for name in left[:5]) + (f" and {len(left) - 5} more" if len(left) > 5 else "")
        warnings.warn(f"the model's tensors {named} are in no layer the pipeline runs (read outside forward, or in "
                      "a module forward never calls): pipe.parameters() and pipe.state_dict() leave them out. Give "
                      "the optimizer model.parameters() (the same tensors, those included) and save "
                      "model.state_dict()", stacklevel=3)


def _link_tensors(holder: nn.Module, owner: nn.Module) -> None:
    """Register ``owner``'s own parameters and buffers on ``holder`` too, in linked slots."""
    for kind in ("_parameters", "_buffers"):
        theirs, mine = _linked_slots(owner, kind), _linked_slots(holder, kind)
        for name, tensor in list(theirs.items()):
            if tensor is not None:
                mine.link(name, theirs)
    holder._non_persistent_buffers_set |= owner._non_persistent_buffers_set


def _link_model_slots(holder: nn.Module, model: nn.Module, path: str) -> None:
    """Link the slots of the model's own module at ``path`` that hold the tensor ``holder``'s
    do (the model's root, or a container not adopted, holds a parameter a captured layer reads)
    to ``holder``'s: ``load_state_dict(assign=True)`` on the model then reaches the stages, and
    on the pipeline the model."""
    own = submodule(model, path)
    if own is None or own is holder:  # no module there (a holder the capture made), or the one adopted
        return
    for kind in ("_parameters", "_buffers"):
        mine = vars(holder)[kind]
        for name, tensor in list(vars(own)[kind].items()):
            if tensor is not None and mine.get(name) is tensor:
                _linked_slots(holder, kind).link(name, _linked_slots(own, kind))


def _linked_slots(module: nn.Module, kind: str) -> _LinkedSlots:
    """``module``'s ``kind`` (``_parameters`` or ``_buffers``) as linkable slots."""
    slots = vars(module)[kind]
    if not isinstance(slots, _LinkedSlots):
        slots = vars(module)[kind] = _LinkedSlots(slots)
    return slots


def _holds_tensors(module: nn.Module) -> bool:
    """Whether ``module`` or a module in it holds a parameter or a buffer."""
    return any(True for _ in module.parameters()) or any(True for _ in module.buffers())


def _adopt_containers(root: nn.Module, model: nn.Module, state: dict[str, int], path: str = "") -> None:
    """Put the model's own module in place of each container the pipeline made under ``root``
    (at ``path`` in the model) where that changes neither the pipeline's ``state`` (its
    ``state_dict`` keys and the ids of their tensors, linked or not yet) nor the modules the
    stages run (:func:`_same_contents`): ``layer1`` is then the model's ``Sequential`` and
    ``layer1.0`` its ``BasicBlock``, as ``model.modules()`` shows them.  A model module holding
    more (a part no layer runs, whose tensors would join ``state_dict``) leaves the container."""
    for name, child in list(root._modules.items()):
        qualified = f"{path}.{name}" if path else name
        if child is None or type(child) is not nn.Module:
            continue
        own = submodule(model, qualified)
        if own is not None and own is not child and _same_contents(child, own, state, qualified):
            root._modules[name] = own
        else:
            _adopt_containers(child, model, state, qualified)


def _same_contents(container: nn.Module, own: nn.Module, state: dict[str, int], path: str) -> bool:
    """Whether the model's module ``own`` at ``path`` has the pipeline's ``state`` under
    ``path`` (the same tensors under the same keys) and, at the same paths, every module that
    the pipeline's ``container`` there holds from the layers, and holds no leaf module without
    tensors that they do not run (a layer torch.export captured runs its graph, not the model's
    dropouts: shown, changing them would change nothing; a module whose tensors a layer reads
    is the state linked to the stage's, so it may be shown)."""
    prefix = path + "."
    mine = {key[len(prefix):]: value for key, value in state.items() if key.startswith(prefix)}
    run = {id(module) for module in run_modules(container)}
    return mine == {key: id(value) for key, value in own.state_dict(keep_vars=True).items()} and all(
        submodule(own, name) is module for name, module in container.named_modules(remove_duplicate=False)
        if type(module) is not nn.Module) and all(
        id(module) in run or module._parameters or module._buffers for module in own.modules() if not module._modules)


def _micro_targets(share: tuple[Any, ...] | None, chunks: int, count: int) -> list[Any]:
    """A replica's ``share`` of the target split as its ``count`` micro-batches (as its inputs:
    :meth:`Pipeline._target` checked the batch sizes), or ``None`` for each where there is no
    target (a model that computes its own loss)."""
    if share is None:
        return [None] * count
    return [parts[0] for parts in scatter(share, chunks)]


def _check_grad_enabled() -> None:
    """Refuse a training step with gradients disabled: the plain model's ``loss.backward()``
    raises there, and the workers, which take the caller's grad mode per call, would otherwise
    compute the gradients of a step the caller asked to run without them."""
    if not torch.is_grad_enabled():
        mode = "torch.inference_mode()" if torch.is_inference_mode_enabled() else "torch.no_grad()"
        raise RuntimeError(
            f"train_step computes gradients, but it was called with gradients disabled ({mode} or "
            "torch.set_grad_enabled(False)), where the plain model's loss.backward() raises too (element 0 of "
            "tensors does not require grad); call train_step outside that block, and pipe(x) inside it for "
            "inference")


def _check_differentiable(runs: list[Run]) -> None:
    """Refuse a step whose loss had no graph in any micro-batch (``loss_fn`` detached it, or
    nothing it depends on requires grad), as the plain model's ``loss.backward()`` does: the
    step ran no backward and gave no gradient.  A loss without a graph in some micro-batches
    only (a constant for one without labels) is the plain model's too, so it passes."""
    if not any(run.loss_has_graph for run in runs):
        raise RuntimeError(
            "loss_fn returned a loss that requires grad in no micro-batch (element 0 of tensors does "
            "not require grad and does not have a grad_fn, as the plain model's loss.backward() raises), so this "
            "step gave no gradient: the loss was detached (.detach(), .item(), torch.tensor(...)) or computed "
            "under torch.no_grad(), or nothing it depends on requires grad; return the loss computed from "
            "loss_fn's output argument, under autograd")


@contextlib.contextmanager
def _restored_on_failure(params: list[nn.Parameter]) -> Iterator[None]:
    """A failed step's gradients taken back where that is cheap: a ``.grad`` that was ``None``
    is ``None`` again (1F1B runs backwards before the last forward, which may fail; the plain
    model's failed forward leaves ``.grad`` alone).  One that held gradients (accumulation) and
    changed cannot be taken back without a copy per step, so the error says so."""
    before = [(p, p.grad, None if p.grad is None else p.grad._version) for p in params]
    try:
        yield
    except BaseException as error:
        changed = False
        for param, grad, version in before:
            if grad is None:
                param.grad = None
            else:
                changed = changed or param.grad is not grad or grad._version != version
        if changed and isinstance(error, Exception):
            add_note(error, "autopipe: .grad held gradients before this failed step and now also holds part of its "
                            "gradients (of the micro-batches whose backward ran); call optimizer.zero_grad() (or "
                            "redo the accumulated steps) before the next step")
        raise


def _from_plan(plan: Plan, layers: list[Layer],
               manual: dict[str, object]) -> tuple[list[int], list[str], int, CheckpointMode, int, int, Schedule]:
    given = [name for name, value in manual.items() if value is not None]
    if given:  # the plan sets them all: one given beside it would be silently overridden
        raise TypeError(f"give either a plan or {', '.join(given)}, not both: the plan sets balance, devices, "
                        "chunks, checkpoint, interleave, replicas, schedule and turns; to change one, plan again "
                        "with it (autopipe.plan(..., chunks=8)) or give all of them without a plan")
    check_made_for(plan.model, layers, "plan", "plan this model again")
    return (plan.balance, plan.used_devices, plan.chunks, plan.checkpoint, plan.interleave, plan.replicas,
            plan.schedule)


def _check(layers: list[Layer], balance: list[int], chunks: int, checkpoint: CheckpointMode, interleave: int,
           replicas: int, schedule: str, turns: str) -> None:
    check_balance(balance, len(layers))
    check_choice(schedule, "schedule", SCHEDULES)
    check_choice(turns, "turns", TURN_RULES)
    if not is_positive_int(interleave) or len(balance) % interleave:
        raise OptionError(f"interleave={interleave!r} must be a positive integer dividing the "
                          f"{len(balance)} stages of balance {balance}")
    positive_int(chunks, "chunks")
    positive_int(replicas, "replicas")
    check_choice(checkpoint, "checkpoint", CHECKPOINT_MODES)


def _used_devices(devices: list[torch.device], per_replica: int, interleave: int,
                  replicas: int) -> list[torch.device]:
    """The first ``per_replica * replicas`` devices (extra ones are ignored, as torchgpipe does)."""
    wanted = per_replica * replicas
    if len(devices) < wanted:
        per = "device per stage" if interleave == 1 else f"device per {interleave} stages (interleave={interleave})"
        each = "" if replicas == 1 else f" in each of {replicas} replicas"
        raise DeviceError(f"{len(devices)} devices for {per_replica * interleave} stages{each}; give one {per}{each}")
    return devices[:wanted]


def _check_shared(layers: list[Layer], balance: list[int], devices: list[torch.device]) -> None:
    """Refuse a tensor shared by layers (a module called at several positions) that exactness
    cannot allow: a parameter on two devices (a tensor lives on one), or a buffer on two stages
    (batch norm statistics would be updated in place by two threads at once).  A parameter
    shared by stages on one device is fine: each stage's backward adds into its ``.grad``."""
    placed: dict[int, tuple[str, int]] = {}
    for layer, stage in zip(layers, stage_of_layer(balance)):
        state: list[tuple[str, torch.Tensor, bool]] = [(name, p, True) for name, p in layer.module.named_parameters()]
        state += [(name, b, False) for name, b in layer.module.named_buffers()]
        for name, tensor, is_parameter in state:
            first, there = placed.setdefault(id(tensor), (layer.name, stage))
            apart = devices[there % len(devices)] != devices[stage % len(devices)]
            if apart or (there != stage and not is_parameter):
                where = (f"on {devices[there % len(devices)]} and {devices[stage % len(devices)]}" if apart
                         else f"in stages {there} and {stage}, whose threads would update it at once")
                raise OptionError(
                    f"layers '{first}' and '{layer.name}' share '{name}' (one module used at both positions) "
                    f"but would run {where}; choose a balance that puts both positions in one "
                    f"{'stage' if not is_parameter else 'device'}, or give each its own module"
                )


def _check_materialized(layers: list[Layer], balance: list[int], groups: list[list[torch.device]]) -> None:
    """Refuse a layer whose parameters or buffers are meta tensors (a model built under
    ``torch.device("meta")``) for a stage with data: they have no values to move there (torch's
    own ``.to()`` fails on them), and the pipeline cannot place them itself, as its stages sit
    on several devices.  Stages on the meta device take them as they are."""
    for layer, stage in zip(layers, stage_of_layer(balance)):
        devices = [group[stage % len(group)] for group in groups]
        with_data = next((device for device in devices if device.type != "meta"), None)
        if with_data is not None and meta_tensor(layer.module) is not None:
            raise DeviceError(
                f"layer '{layer.name}' has parameters or buffers on the meta device (shapes without values), but "
                f"its stage runs on {with_data}, which needs their values; a pipeline cannot be built from a model "
                f"on the meta device: {MATERIALIZE}, then build the pipeline")


def undeferrable(layers: Sequence[Layer]) -> list[str]:
    """The layers whose batch norms :class:`DeferredBatchNorm` cannot take over: exported in
    training mode, where batch norm is an operation on the running statistics, not a module,
    or a subclass of ``nn.BatchNorm*``, whose own forward the takeover would drop."""
    return [layer.name for layer in layers
            if isinstance(layer.module, CapturedLayer) and layer.module.updates_batch_norm_statistics()
            or subclassed(layer.module)]


def _check_deferrable(layers: Sequence[Layer], why: str) -> None:
    """Refuse ``why`` (which defers batch norm) where a batch norm cannot be deferred: its
    statistics would update once per micro-batch (and replica), not once per mini-batch."""
    names = undeferrable(layers)
    if names:
        raise ChainError(
            f"{why} needs every training batch norm as an nn.BatchNorm module itself, to update its running "
            f"statistics once per mini-batch, but layers {names[:3]} hold one captured with torch.export, where "
            "batch norm is an operation (it would update once per micro-batch, and replicas at once), or a "
            "subclass of nn.BatchNorm (its own forward would be lost). Make the model's forward traceable by "
            "torch.fx (batch norms then stay modules), use nn.BatchNorm itself, capture in eval mode, or train "
            "with deferred_batch_norm=False and replicas=1")


def _build_stages(layers: list[Layer], balance: list[int], devices: list[torch.device],
                  turns: TurnRule, replica: int | None) -> list[Stage]:
    """Stage ``s`` on ``devices[s % len(devices)]``, sharing that device's turns (taken by rule ``turns``),
    of ``replica`` (``None`` without replicas)."""
    routes = stage_routes(skip_spans(layers, stage_of_layer(balance)), len(balance))
    shared = [Turns(turns) for _ in devices]
    stages: list[Stage] = []
    start = 0
    for index, count in enumerate(balance):
        device = devices[index % len(devices)]
        chunk = layers[start:start + count]
        for layer in chunk:
            layer.module.to(device)
        stages.append(Stage(index, len(balance), chunk, device, routes[index], stages, shared[index % len(devices)],
                            replica))
        start += count
    return stages
