"""A stage: a slice of the layer chain on one device, with its neighbours and skip routes.

Its compute (a forward, or a recomputation and backward) holds its device's
:class:`~autopipe.runtime.turns.Turns`, which it shares with the other stages on that device.

The stage knows what to compute and where to send results; the schedule only tells it the
order.  For micro-batch ``j`` it

* forward: takes its input (and arriving skips) from its inbox, makes them leaves
  (``requires_grad`` as the producer's outputs), runs its layers, sends the detached output
  to the next stage and each leaving skip straight to its consumer, and keeps what its
  backward needs (everything, or for a checkpointed micro-batch only the inputs, a copy
  of the stage's buffers and its parameters' version counters, less the writes of its own
  forwards, and ``requires_grad`` flags);
* backward: takes one of its credits for input gradients (:class:`~autopipe.runtime.run.Credits`:
  at most ``GRADIENT_WINDOW`` of them alive), the gradient of its output and of each leaving skip, recomputes
  if checkpointed (on the buffers as the forward found them; refusing parameters written
  since but by its own forwards, and giving none frozen at the forward a gradient), runs ``torch.autograd.backward``
  on this thread (into the received leaves alone in a call marked ``inputs_only``; keeping its
  graph and saved state where the caller's backward retains its graph),
  sends each leaf's gradient back to where the leaf came from (the previous stage, a skip's
  producer, or the caller for stage 0), and gives the next stage its credit back.
"""
from __future__ import annotations

import contextlib
import threading
from typing import Any, Callable, Hashable, Iterator, Sequence

import torch
from torch import Tensor, nn

from .._vocab import EventKind, TaskKind
from .batchnorm import DeferredBatchNorm, micro_batch_forward
from .checkpoint import (BufferSlot, RandomGuard, RngStates, buffer_slots, buffers_kept, buffers_replayed,
                         writes_undone)
from ..errors import RAISED_BY, ChainError, add_note
from ..device import DeviceOps, ops_for
from ..model.layers import Layer
from ..model._tensors import map_distinct
from .microbatch import Value, map_tensors, tensors_of
from ..model.skip import SkipKey, use_skip_tracker
from ..timeline import Event
from .aliases import Marks, Watch, buffer_spans, mark, tensor_spans, unshared
from .boundary import Boundary
from .inplace import InputGuard
from .run import Aborted, ParamsAtForward, Run, Saved
from .schedule import Action
from .skips import SkipRoutes, StageTracker
from .turns import Turns

__all__ = ["Stage"]

#: A tensor on its way to another stage: detached, and whether the receiver's leaf needs grad.
Message = tuple[Value, list[bool]]


class Stage:
    """Layers ``[start, stop)`` of the chain on ``device``; stage ``index`` of ``count``, of
    ``replica`` where there are several (its errors name it), else ``None``."""

    def __init__(self, index: int, count: int, layers: Sequence[Layer], device: torch.device,
                 routes: SkipRoutes, neighbours: Sequence[Stage], turns: Turns, replica: int | None = None) -> None:
        self.index, self.count = index, count
        self.turns = turns  # shared with the other stages on this device
        self.layers = list(layers)
        self.modules = [layer.module for layer in self.layers]
        self.device = device
        self.ops: DeviceOps = ops_for(device)
        self.stream = self.ops.new_stream()
        self.routes = routes
        self.neighbours = neighbours  # every stage, by index, for sending
        self.random = RandomGuard(device)
        # shared with the same stage of the other replicas where they run these very modules
        # (autopipe.runtime.replicas): a recomputation puts older values into the buffers
        self.replay_lock: threading.Lock | None = None
        # False when the caller brackets the deferred batch norms' steps (replicas share them)
        self.brackets_batch_norm = True
        of_replica = "" if replica is None else f" of replica {replica}"
        self.name = f"stage {index}{of_replica} ({self.layers[0].name}..{self.layers[-1].name}) on {device}"
        self.inputs = InputGuard(self.name)
        # touched by this stage's worker thread alone (:meth:`_writes_counted`)
        self._tracked = _Tracked([], [])
        self._fresh = False  # whether this phase read the parameters into _tracked
        self._counting = False  # from the stage's first checkpointed forward on

    # The modules and buffers are read at each use: the caller may add some to the layers after
    # building the pipeline (a parametrization such as spectral norm, with its own buffers).

    @property
    def submodules(self) -> list[nn.Module]:
        """Every module of the stage's layers."""
        return [m for module in self.modules for m in module.modules()]

    @property
    def deferred(self) -> list[DeferredBatchNorm]:
        """The stage's deferred batch norms."""
        return [m for m in self.submodules if isinstance(m, DeferredBatchNorm)]

    @property
    def replayed(self) -> list[BufferSlot]:
        """What a checkpointed micro-batch keeps a copy of: the buffers later forwards may change
        before its recomputation (a deferred batch norm's statistics change only at a step's end)."""
        return buffer_slots(self.modules, skip={id(bn) for bn in self.deferred})

    @property
    def buffers(self) -> dict[str, Tensor]:
        """The stage's buffers now, by path in the model (a forward may assign one anew)."""
        return dict(_each_once(self.layers, nn.Module.named_buffers))

    @property
    def params(self) -> list[tuple[str, Tensor]]:
        """The stage's parameters now, with their paths in the model (each once)."""
        return _each_once(self.layers, nn.Module.named_parameters)

    def _phase_params(self) -> _Tracked:
        """:attr:`params` as this phase found them, with the stage's own writes into each: read
        once per phase (hundreds of parameters take a millisecond to walk), as the caller may
        replace or add parameters between calls; the same object while they are the same."""
        if not self._fresh:
            named = self.params
            if not _same_tensors(named, self._tracked.named):
                own = {id(p): count for p, count in zip(self._tracked.params, self._tracked.own)}
                self._tracked = _Tracked(named, [own.get(id(p), 0) for _, p in named])
            self._fresh = True
        return self._tracked

    @property
    def is_last(self) -> bool:
        return self.index == self.count - 1

    # -- running a phase ---------------------------------------------------------------

    def execute(self, run: Run, actions: list[Action]) -> None:
        """Run ``actions`` in order, stopping before the next one once any stage has failed.

        A failure propagates as itself, with a note naming this stage, the phase and the
        micro-batch (``KeyboardInterrupt`` and ``SystemExit`` without one)."""
        starts = bool(actions) and actions[0].kind == "F"  # a call's first phase
        self._fresh = False
        if starts:
            self.random.measure_again()
        norms = self.deferred if starts and self.brackets_batch_norm else []
        for bn in norms:
            bn.begin_step(run.step)
        try:
            for action in actions:
                self._act(run, action)
        except BaseException:
            for bn in norms:
                bn.end_step(run.step, update=False)
            raise
        for bn in norms:
            bn.end_step(run.step)

    def _act(self, run: Run, action: Action) -> None:
        """One action of :meth:`execute`."""
        if run.error is not None:
            raise Aborted
        try:
            if action.kind == "F":
                self._forward(run, action.micro_batch)
            else:
                self._backward(run, action.micro_batch)
        except Exception as error:
            if not isinstance(error, Aborted):
                phase = "forward" if action.kind == "F" else "backward"
                add_note(error, f"{RAISED_BY}{self.name} in {phase} of micro-batch {action.micro_batch}")
            raise

    # -- forward -----------------------------------------------------------------------

    def _forward(self, run: Run, j: int) -> None:
        args, skips = self._receive_inputs(run, j)
        checkpointed = run.checkpointed[j]
        self._counting = self._counting or (checkpointed and run.grad_enabled)
        with self._turn("F"), self._buffers_held(run):
            begin = run.ms()
            with self._on_stream(), torch.set_grad_enabled(run.grad_enabled and not checkpointed):
                kept = buffers_kept(self.replayed) if checkpointed else None
                with self._random(run) as rng, micro_batch_forward(run.step), self._writes_counted() as written:
                    output, leaving, watch = self._compute(run, j, args, skips,
                                                           wrap=run.grad_enabled and not checkpointed,
                                                           keep=checkpointed or self.index == 0,
                                                           marks=self._marks(run, j))
            run.events.append(Event(self.index, "compute", "F", j, begin, run.ms()))
        self._send_forward(run, j, output, leaving, checkpointed, args, skips, watch)
        if run.grad_enabled:
            saved = Saved(args, skips, rng=rng, buffers=kept, modes=self._modes() if checkpointed else None,
                          versions=_versions((args, skips)) if checkpointed else None,
                          params=self._params_at_forward() if checkpointed else None,
                          written=written if checkpointed else None)
            if not checkpointed:
                saved.output, saved.leaving = output, leaving
            run.saved[self.index][j] = saved

    def _params_at_forward(self) -> ParamsAtForward:
        """What a checkpointed micro-batch's recomputation checks and honours of the parameters
        (references, counts of others' writes and flags: no copy)."""
        tracked = self._phase_params()
        return ParamsAtForward(tracked.named, tracked.foreign(), [p.requires_grad for p in tracked.params])

    @contextlib.contextmanager
    def _writes_counted(self) -> Iterator[list[tuple[str, Tensor]]]:
        """Count the writes the stage's own forward or recomputation makes into its parameters
        (an Embedding's ``max_norm`` renormalises its weight in place, a max-norm constraint
        clamps it), which the plain model makes too: a checkpointed micro-batch refuses only
        the others'.  Nothing to count before the stage's first checkpointed forward.  Yields
        the list it fills, on leaving, with the parameters written (named)."""
        written: list[tuple[str, Tensor]] = []
        if not self._counting:
            yield written
            return
        tracked = self._phase_params()
        before = tracked.versions()
        try:
            yield written
        finally:
            after = tracked.versions()
            if after != before:
                tracked.own = [own + now - then for own, then, now in zip(tracked.own, before, after)]
                written += [named for named, then, now in zip(tracked.named, before, after) if now != then]

    def _random(self, run: Run) -> contextlib.AbstractContextManager[RngStates | None]:
        if run.replays:
            return self.random.forward()
        return contextlib.nullcontext()

    def _receive_inputs(self, run: Run, j: int) -> tuple[tuple[Any, ...], dict[SkipKey, Value]]:
        inbox = run.inboxes[self.index]
        if self.index == 0:
            given = map_tensors(run.micro_batches[j], lambda t: self._pull(run, j, t, "C"))
            originals = tensors_of(run.micro_batches[j])
            flags = [run.grad_enabled and t.requires_grad for t in originals]
            args = _leaves(given, flags, [id(t) for t in originals])  # pipe(h, h): one leaf, as h is one
        else:
            args = (_leaves(*inbox.take(("x", j))),)
        skips = {key: _leaves(*inbox.take(("skip", key, j))) for key in self.routes.arriving}
        return args, skips

    def _marks(self, run: Run, j: int) -> dict[Hashable, Marks]:
        """The marks of micro-batch ``j``'s messages to this stage (:mod:`~autopipe.runtime.aliases`)."""
        keys = [("x", j)] + [("skip", key, j) for key in self.routes.arriving]
        return {key: run.marks.pop((self.index, key)) for key in keys if (self.index, key) in run.marks}

    def _compute(self, run: Run, j: int, args: tuple[Any, ...], skips: dict[SkipKey, Value], wrap: bool, keep: bool,
                 marks: dict[Hashable, Marks] | None = None) -> tuple[Value, dict[SkipKey, Value], Watch]:
        """Run the layers on micro-batch ``j``'s ``args`` under the caller's autocast (the last
        stage then the loss, under it too, in ``train_step``); ``wrap`` puts grad-requiring leaves behind a
        Boundary; ``keep`` leaves ``args`` and ``skips`` as they are even if the first layer
        writes into its input (:mod:`~autopipe.runtime.inplace`).  The received tensors that
        ``marks`` marks are watched: the layers must not write into them
        (:mod:`~autopipe.runtime.aliases`)."""
        with contextlib.ExitStack() as stack:
            if keep:
                training = any(m.training for m in self.modules)
                args, skips = stack.enter_context(self.inputs.kept((args, skips), training))
            if wrap:
                args, skips = _boundaries((args, skips))
            tracker = StageTracker(skips, self.routes.leaving)
            stack.enter_context(_autocast(run))
            stack.enter_context(use_skip_tracker(tracker))
            marks = marks or {}
            watch = Watch([("their input", args, marks.get(("x", j), {}))]
                          + [(f"the skip '{key}'", value, marks.get(("skip", key, j), {}))
                             for key, value in skips.items()])
            value = self.modules[0](*args)
            for module in self.modules[1:]:
                value = module(value)
            watch.check(self.name, j)
        self._check_stashed(tracker, j)
        if self.is_last and run.loss is not None:
            value = self._loss(run, j, value)
        return value, tracker.leaving, watch

    def _check_stashed(self, tracker: StageTracker, j: int) -> None:
        """Refuse a forward that did not stash a skip a later stage pops: that stage would wait
        for it forever (a skippable layer called only on some forwards, such as a branch taken
        in training only)."""
        missing = [key for key in self.routes.leaving if key not in tracker.leaving]
        if missing:
            raise ChainError(
                f"{self.name} did not stash {[str(key) for key in missing]} in micro-batch {j}, which "
                f"stage {self.routes.leaving[missing[0]]} pops: a skippable layer the forward did not call "
                "(a branch taken only in training?). Call every skippable layer on every forward, or keep "
                "its stash and pop in one stage (balance)")

    def _loss(self, run: Run, j: int, output: Value) -> Tensor:
        """Micro-batch ``j``'s weighted loss (``train_step``)."""
        assert run.loss is not None
        target = map_tensors(run.loss.targets[j], lambda t: self._pull(run, j, t, "C"))
        with _autocast(run):  # as loss_fn(model(x), y) runs in the caller's context
            loss = run.loss.fn(output, target)
        if not isinstance(loss, Tensor) or loss.numel() != 1:
            raise TypeError(f"loss_fn must return a tensor of one element (a mean over the micro-batch), "
                            f"got {type(loss).__name__}{'' if not isinstance(loss, Tensor) else tuple(loss.shape)}")
        if torch.is_grad_enabled() and loss.requires_grad:  # a checkpointed forward tells in its recomputation
            run.loss_has_graph = True
        return loss.reshape(()) * run.loss.weights[j]

    def _send_forward(self, run: Run, j: int, output: Value, leaving: dict[SkipKey, Value], checkpointed: bool,
                      args: tuple[Any, ...], skips: dict[SkipKey, Value], watch: Watch) -> None:
        messages: dict[Hashable, tuple[int, str, Value]] = {}
        if self.is_last:
            run.outputs[j] = output
        else:
            messages["x", j] = (self.index + 1, f"the output of stage {self.index}", output)
        for key, tensor in leaving.items():
            messages["skip", key, j] = (self.routes.leaving[key], f"the skip '{key}'", tensor)
        owned = buffer_spans(self.buffers)
        sent = mark({key: (what, value) for key, (_, what, value) in messages.items()}, watch, owned)
        # stage 0's inputs are views of the caller's batch, which no stage writes into
        caller = tensor_spans(("the caller's batch", t) for t in tensors_of(args)) if self.index == 0 else []
        for key, (to, _, value) in messages.items():
            if key in sent:
                run.marks[to, key] = sent[key]
            with self._on_stream():  # a copy of a buffer (later micro-batches update it) or of the batch
                value = unshared(value, owned + caller)
            run.inboxes[to].put(key, self._message(run, j, value, to, checkpointed, args, skips))

    def _message(self, run: Run, j: int, value: Value, to: int, checkpointed: bool,
                 args: tuple[Any, ...], skips: dict[SkipKey, Value]) -> Message:
        """``value`` detached and on stage ``to``'s device, with whether each tensor needs a
        gradient from its receiver.

        A checkpointed forward ran without grad, so it cannot tell; it assumes a floating
        point or complex result (the dtypes autograd differentiates) needs one if any input or
        parameter of the stage does (the recomputed backward then simply drops gradients of
        results that turn out not to need one)."""
        if checkpointed:
            needs = run.grad_enabled and self._any_grad(args, skips)
            flags = [needs and (t.is_floating_point() or t.is_complex()) for t in tensors_of(value)]
        else:
            flags = [t.requires_grad for t in tensors_of(value)]
        return map_tensors(value, lambda t: self._push(run, j, t.detach(), to, "C")), flags

    def _any_grad(self, args: tuple[Any, ...], skips: dict[SkipKey, Value]) -> bool:
        inputs = tensors_of((args, skips))
        return any(t.requires_grad for t in inputs) or any(
            p.requires_grad for m in self.modules for p in m.parameters()
        )

    # -- backward ----------------------------------------------------------------------

    def _backward(self, run: Run, j: int) -> None:
        """Micro-batch ``j``'s backward, under backpressure on input gradients (:class:`~autopipe.runtime.run.Credits`).

        The credit is taken before the device's turn (a stage waiting for one while holding the
        turn would stall the stages it shares the device with) and the next stage's given back
        once the gradient of this stage's output is dropped, when :meth:`_backward_of` returns."""
        if self.index > 0:
            run.credits.take(self.index)
        self._backward_of(run, j)
        if not self.is_last:
            run.credits.give(self.index + 1)
        elif run.loss is not None:
            # train_step reads only the loss's value; its graph would keep this stage's input
            # leaves and their gradients alive until the step ends, one set per micro-batch
            run.outputs[j] = map_tensors(run.outputs[j], Tensor.detach)

    def _backward_of(self, run: Run, j: int) -> None:
        saved = run.saved[self.index][j] if run.retain_graph else run.saved[self.index].pop(j)
        inbox = run.inboxes[self.index]
        if self.is_last and run.loss is not None:
            output_grads = None  # the loss's own: ones, once the loss exists
        elif self.is_last:
            output_grads = [None if g is None else self._pull(run, j, g, "G") for g in run.output_grads[j]]
        else:
            output_grads = inbox.take(("dy", j))
        skip_grads = {key: inbox.take(("dskip", key, j)) for key in self.routes.leaving}
        with self._turn("B"), self._buffers_held(run), self._on_stream(), self._as_at_forward(saved):
            if saved.output is None:
                begin = run.ms()
                saved.output, saved.leaving = self._recompute(run, j, saved)
                run.events.append(Event(self.index, "compute", "R", j, begin, run.ms()))
            assert saved.leaving is not None
            begin = run.ms()
            outputs = tensors_of(saved.output)
            pairs = list(zip(outputs, [torch.ones_like(t) for t in outputs] if output_grads is None else output_grads))
            for key in self.routes.leaving:
                pairs += zip(tensors_of(saved.leaving[key]), skip_grads[key])
            pairs = [(t, g) for t, g in pairs if t.requires_grad and g is not None]
            into = self._gradients_into(run, saved, [t for t, _ in pairs])
            _clear_grads((saved.args, saved.skips))
            if pairs and into != []:
                with self._on_stream():
                    torch.autograd.backward([t for t, _ in pairs], [g for _, g in pairs], inputs=into,
                                            retain_graph=run.retain_graph)
            run.events.append(Event(self.index, "compute", "B", j, begin, run.ms()))
        self._send_backward(run, j, saved)

    @staticmethod
    def _gradients_into(run: Run, saved: Saved, roots: list[Tensor]) -> list[Tensor] | None:
        """What a backward of ``run`` from ``roots`` accumulates into: every leaf (``None``), or
        the received leaves alone (:attr:`Run.inputs_only`).

        A checkpointed micro-batch's recomputation builds its graph on the parameters' flags at
        the backward; one frozen at the forward and unfrozen since (a GAN's discriminator
        around the generator's loss) is then in it, but was not in the plain model's graph,
        which gives it no gradient: the leaves of the graph but those, then."""
        if run.inputs_only:
            return [t for t in tensors_of((saved.args, saved.skips)) if t.requires_grad]
        unfrozen = {id(p) for (_, p), then in zip(saved.params.named, saved.params.requires_grad)
                    if not then and p.requires_grad} if saved.params is not None else set()
        if not unfrozen:
            return None
        return [leaf for leaf in _graph_leaves(roots) if id(leaf) not in unfrozen]

    def _modes(self) -> tuple[bool, ...]:
        """Each of the stage's modules' ``training`` flag."""
        return tuple(m.training for m in self.submodules)

    def _recompute(self, run: Run, j: int, saved: Saved) -> tuple[Value, dict[SkipKey, Value]]:
        self._check_inputs_unchanged(j, saved)
        self._check_params_unchanged(j, saved)
        refused: list[str] = []
        with torch.enable_grad(), self.random.replay(saved.rng), self._writes_counted(), \
                writes_undone(saved.written or [], f"{self.name}, checkpointed micro-batch {j},", refused.append):
            # keep: a received tensor may be the sender's own saved input (a stage that passes its
            # input on, as output or skip), which the sender's recomputation reads after this one
            output, leaving, _ = self._compute(run, j, saved.args, saved.skips, wrap=True, keep=True)
        if refused:
            raise RuntimeError(refused[0])
        return output, leaving

    def _check_inputs_unchanged(self, j: int, saved: Saved) -> None:
        """Refuse to recompute micro-batch ``j`` from inputs written in place since its forward
        (``y = pipe(x); x.add_(1); y.sum().backward()``): it would give the gradients of other
        inputs, where the plain model (and ``torch.utils.checkpoint``) raises autograd's error."""
        assert saved.versions is not None
        for i, (then, now) in enumerate(zip(saved.versions, _versions((saved.args, saved.skips)))):
            if now != then:
                which = (f"the pipeline's input tensor {i}" if self.index == 0 and i < len(tensors_of(saved.args))
                         else f"tensor {i} received by {self.name}")
                raise RuntimeError(
                    f"one of the variables needed for gradient computation has been modified by an inplace "
                    f"operation: {which} (in micro-batch {j}) is at version {now}, but was at version {then} when "
                    "its forward ran; this checkpointed micro-batch recomputes its forward from it in backward. "
                    "Write into a copy (x = x.clone()) or after backward(), or use checkpoint='never'")

    def _check_params_unchanged(self, j: int, saved: Saved) -> None:
        """Refuse to recompute micro-batch ``j`` on parameters replaced or written in place by
        others than the stage's own computations since its forward (an ``optimizer.step()`` or
        ``load_state_dict()`` before ``backward()``): its gradients would mix the old weights (its
        output) and the new (its recomputation), where the plain model raises autograd's error
        for the weights it saved.  Where replicas share the stage's modules (CPU devices), not for
        the parameters the forwards write (an Embedding's ``max_norm``): the other replica's
        writes are not the caller's, yet counted as others'."""
        assert saved.params is not None
        tracked = self._phase_params()
        if tracked.named is not saved.params.named:
            raise RuntimeError(
                f"{self.name}: parameters were replaced, added or removed between micro-batch {j}'s forward and "
                "its backward (load_state_dict(assign=True)? torch.func.functional_call, which puts the module's own "
                "back when it returns?); a checkpointed stage recomputes its forward on the parameters it finds: "
                "change them after backward() (or use checkpoint='never')")
        # replicas running these very modules (pair_stages gives them one lock) write into them in
        # their own forwards too, which this stage cannot tell from the caller's: the parameters its
        # own forwards write are not checked there
        shared = self.replay_lock is not None
        for (name, param), then, now, own in zip(tracked.named, saved.params.foreign, tracked.foreign(), tracked.own):
            if now != then and not (shared and own):
                raise RuntimeError(
                    f"one of the variables needed for gradient computation has been modified by an inplace "
                    f"operation: the parameter '{name}' of {self.name} was written in place {now - then} time(s) "
                    f"since the forward of micro-batch {j} ran (now at version {param._version}), not by this "
                    "stage's forwards; it was modified after the forward (by optimizer.step() or load_state_dict() "
                    "before backward()? or by another stage's forward, for a parameter two stages share), and this "
                    "checkpointed micro-batch recomputes its forward on it in backward, which would mix old and "
                    "new weights. Step the optimizer (or load the state) after backward()")

    def _as_at_forward(self, saved: Saved) -> contextlib.AbstractContextManager[None]:
        """A checkpointed micro-batch's recomputation and backward see the buffers as its forward
        did, though later forwards updated them (a spectral norm's vectors); what the
        recomputation writes (running statistics, counters) is undone after."""
        if saved.buffers is None:
            return contextlib.nullcontext()
        slots = self.replayed
        self._check_unchanged(saved, slots)
        return buffers_replayed(slots, saved.buffers)

    def _check_unchanged(self, saved: Saved, slots: list[BufferSlot]) -> None:
        """Refuse to recompute a checkpointed micro-batch on other modules, buffers or modes than
        its forward ran with: batch norm and dropout would recompute another forward, and the
        buffers kept would go back into the wrong slots."""
        assert saved.modes is not None and saved.buffers is not None
        modes = self._modes()
        if len(modes) != len(saved.modes) or len(slots) != len(saved.buffers):
            raise RuntimeError(
                f"{self.name}: modules or buffers were added or removed between this step's forward and its "
                "backward; a checkpointed stage recomputes its forward on the modules it finds: call "
                "backward() before changing the model (or use checkpoint='never')")
        if modes != saved.modes:
            raise RuntimeError(
                f"{self.name}: train()/eval() changed between this step's forward and its backward; a "
                "checkpointed stage recomputes its forward in the modes it finds, which would give other "
                "gradients: call backward() before switching modes (or use checkpoint='never')")

    def _buffers_held(self, run: Run) -> contextlib.AbstractContextManager[object]:
        """This stage's buffers to itself among the replicas sharing them, in a call that
        replays them.  Taken after the turn and before the random generators' locks, in the
        forward as in the backward."""
        held = self.replay_lock is not None and run.replays and (bool(self.replayed) or any(self._tracked.own))
        return self.replay_lock if held else contextlib.nullcontext()

    def _send_backward(self, run: Run, j: int, saved: Saved) -> None:
        leaves = tensors_of(saved.args)
        grads = [None if any(leaf is other for other in leaves[:i]) else leaf.grad  # a leaf's gradient once
                 for i, leaf in enumerate(leaves)]
        if self.index == 0:
            run.input_grads[j] = grads
        else:
            back = [None if g is None else self._push(run, j, g, self.index - 1, "G") for g in grads]
            run.inboxes[self.index - 1].put(("dy", j), back)
        for key, value in saved.skips.items():
            producer = self.routes.arriving[key]
            skip_grads = [None if leaf.grad is None else self._push(run, j, leaf.grad, producer, "G")
                          for leaf in tensors_of(value)]
            run.inboxes[producer].put(("dskip", key, j), skip_grads)

    # -- devices -----------------------------------------------------------------------

    def _push(self, run: Run, j: int, tensor: Tensor, to: int, kind: EventKind) -> Tensor:
        """``tensor``, made on this stage's stream, on stage ``to``'s device and stream.

        Sent from the producing thread, so the copy is ordered after the work that made the
        tensor.  Cross-device copies are traced on the receiver's copy lane (``C`` forward,
        ``G`` gradient)."""
        target = self.neighbours[to]
        begin = run.ms() if tensor.device != target.device else None
        with self._on_stream():
            moved = self.ops.copy_to(tensor, target.ops, target.stream)
        if begin is not None:
            run.events.append(Event(to, "copy", kind, j, begin, run.ms()))
        return moved

    def _pull(self, run: Run, j: int, tensor: Tensor, kind: EventKind) -> Tensor:
        """A caller's tensor (input or output gradient) on this stage's device and stream."""
        begin = run.ms() if tensor.device != self.device else None
        moved = ops_for(tensor.device).copy_to(tensor, self.ops, self.stream)
        if begin is not None:
            run.events.append(Event(self.index, "copy", kind, j, begin, run.ms()))
        return moved

    def _on_stream(self) -> contextlib.AbstractContextManager[None]:
        return self.ops.use_stream(self.stream)

    def _turn(self, kind: TaskKind) -> contextlib.AbstractContextManager[None]:
        """This stage's turn on its device for a ``kind`` ("F" or "B") task."""
        return self.turns.hold(self.turns.rank(self.index, kind))


class _Tracked:
    """A stage's parameters with their paths (``named``) and, aligned, the versions the stage's
    own forwards and recomputations wrote into each (``own``): plain lists, as a checkpointed
    micro-batch reads them twice."""

    def __init__(self, named: list[tuple[str, Tensor]], own: list[int]) -> None:
        self.named = named
        self.params = [p for _, p in named]
        self.own = own

    def versions(self) -> list[int]:
        """Each parameter's version counter (autograd's count of in-place writes)."""
        return [p._version for p in self.params]

    def foreign(self) -> list[int]:
        """Each parameter's version counter less the stage's own writes into it: what changes
        only where something else (the caller's ``optimizer.step()``, another stage, a replica
        running the same modules) writes into it."""
        return [p._version - own for p, own in zip(self.params, self.own)]


def _each_once(layers: Sequence[Layer], named: Callable[[nn.Module], Iterator[tuple[str, Tensor]]]
               ) -> list[tuple[str, Tensor]]:
    """The ``named`` tensors of ``layers``' modules with their paths in the model, each tensor
    once (a module at two positions lists its tensors twice)."""
    once = {id(t): (layer.path(name), t) for layer in layers for name, t in named(layer.module)}
    return list(once.values())


def _clear_grads(leaves: Value) -> None:
    """Empty the received leaves' ``.grad`` before a backward: after an earlier backward through a
    retained graph they hold its gradients, already sent, which this one's would add to."""
    for leaf in tensors_of(leaves):
        leaf.grad = None


def _versions(value: Value) -> list[int]:
    """The version counter of each tensor in ``value`` (autograd's count of in-place writes)."""
    return [t._version for t in tensors_of(value)]


def _same_tensors(named: list[tuple[str, Tensor]], others: list[tuple[str, Tensor]]) -> bool:
    """Whether two lists of named tensors hold the very same tensors, in order (by identity:
    ``==`` on tensors compares values)."""
    return named is others or (len(named) == len(others) and all(a is b for (_, a), (_, b) in zip(named, others)))


def _graph_leaves(roots: list[Tensor]) -> list[Tensor]:
    """Every leaf a backward from ``roots`` accumulates into (each one once): the roots that
    are leaves and the tensor of each ``AccumulateGrad`` node of their graph."""
    leaves = {id(t): t for t in roots if t.is_leaf}
    stack = [t.grad_fn for t in roots if t.grad_fn is not None]
    seen = set(stack)
    while stack:
        node = stack.pop()
        variable = getattr(node, "variable", None)
        if isinstance(variable, Tensor):
            leaves.setdefault(id(variable), variable)
        for child, _ in node.next_functions:
            if child is not None and child not in seen:
                seen.add(child)
                stack.append(child)
    return list(leaves.values())


def _leaves(value: Value, flags: list[bool], ids: list[int] | None = None) -> Value:
    """``value``'s tensors as fresh leaves, requiring grad per ``flags``; tensors whose ``ids``
    (default: their own) are alike get one leaf."""
    needs, keys, made = iter(flags), iter(ids) if ids is not None else None, {}

    def leaf(t: Tensor) -> Tensor:
        key, need = id(t) if keys is None else next(keys), next(needs)
        if key not in made:
            made[key] = t.detach().requires_grad_(need)
        return made[key]

    return map_tensors(value, leaf)


def _autocast(run: Run) -> contextlib.ExitStack:
    """The caller's autocast (autocast is per thread), entered on this worker's."""
    stack = contextlib.ExitStack()
    for kind, dtype in run.autocast:
        stack.enter_context(torch.autocast(kind, dtype))
    return stack


def _boundaries(value: Value) -> Value:
    """``value`` with each tensor needing a gradient behind a :class:`Boundary`, one for each
    tensor object (``pipe(h, h)``'s two arguments stay one tensor)."""
    return map_distinct(value, lambda tensor: Boundary.apply(tensor) if tensor.requires_grad else tensor)
