"""One pipeline call: the messages between its stages, its saved state, failure and trace.

Everything a call needs lives here, not on the pipeline, so two forwards before one backward
(or a forward whose output is dropped) never see each other's micro-batches.
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Hashable, NamedTuple

import torch
from torch import Tensor

from .aliases import Marks
from .checkpoint import RngStates
from .microbatch import Value, tensors_of
from ..model.skip import SkipKey
from ..planning.schedules import GRADIENT_WINDOW
from ..timeline import Event

if TYPE_CHECKING:
    from .memory import StageMeter

__all__ = ["Run", "Saved", "ParamsAtForward", "Loss", "Aborted", "Credits"]


class Aborted(Exception):
    """Raised in a stage's wait when another stage of the same call failed."""


def _raised() -> Aborted:
    """What a run keeps as its error once the error was raised to the caller (:meth:`Run.wait_phase`)."""
    return Aborted("this call failed; its error was raised to the caller")


class Inbox:
    """Messages addressed to one stage, keyed by what they are and their micro-batch."""

    def __init__(self, run: Run) -> None:
        self._run = run
        self._ready = threading.Condition()
        self._items: dict[Hashable, Any] = {}

    def put(self, key: Hashable, value: Any) -> None:
        with self._ready:
            self._items[key] = value
            self._ready.notify()

    def take(self, key: Hashable) -> Any:
        """Wait for ``key``; raises :class:`Aborted` as soon as any stage has failed."""
        with self._ready:
            while key not in self._items:
                if self._run.error is not None:
                    raise Aborted
                self._ready.wait()
            return self._items.pop(key)

    def wake(self) -> None:
        with self._ready:
            self._ready.notify_all()


class Credits:
    """Backpressure on input gradients: per stage, how many more backwards it may start.

    Without it a fast stage sends the gradients of its inputs (``dy``) faster than the slower
    stage before it uses them, and they pile up in that stage's inbox, up to one per
    micro-batch.  Stage ``s >= 1`` takes a credit before each backward; stage ``s - 1`` gives
    it back once its own backward of that micro-batch is done and the gradient is dropped.
    Every stage runs its backwards in the same micro-batch order, so the credit given back is
    always for a backward stage ``s`` already ran: the wait never forms a cycle."""

    def __init__(self, run: Run, stages: int, window: int = GRADIENT_WINDOW) -> None:
        self._run = run
        self._changed = threading.Condition()
        self._free = [window] * stages

    def take(self, stage: int) -> None:
        """Wait for one of ``stage``'s credits; raises :class:`Aborted` as soon as any stage has failed."""
        with self._changed:
            while not self._free[stage]:
                if self._run.error is not None:
                    raise Aborted
                self._changed.wait()
            if self._run.error is not None:
                raise Aborted
            self._free[stage] -= 1

    def give(self, stage: int) -> None:
        """Give one of ``stage``'s credits back: an input gradient of it is gone."""
        with self._changed:
            self._free[stage] += 1
            self._changed.notify_all()

    def wake(self) -> None:
        with self._changed:
            self._changed.notify_all()


class ParamsAtForward(NamedTuple):
    """A stage's parameters as a checkpointed micro-batch's forward left them.

    Its recomputation must find the same tensors (``named``: the stage's list of the phase,
    shared, with their paths in the model), written since by nothing but the stage's own
    computations (``foreign``: each one's version counter less the stage's own writes into it,
    which a forward may make: an Embedding's ``max_norm`` renormalises its weight), and gives no
    gradient to one that did not require one (``requires_grad``), as the plain model's graph,
    built at the forward, would not."""

    named: list[tuple[str, Tensor]]
    foreign: list[int]
    requires_grad: list[bool]


@dataclass
class Saved:
    """What a stage keeps of one micro-batch's forward for its backward.

    ``args`` and ``skips`` hold the received leaves (the stage's inputs); ``output`` and
    ``leaving`` the results with their autograd graph, or ``None`` for a checkpointed
    micro-batch, whose backward recomputes them replaying ``rng`` on ``buffers`` (copies of
    the stage's buffers as the forward found them) in ``modes`` (its modules' ``training``
    flags at the forward, which the recomputation must find again) from the received leaves
    at ``versions`` (their version counters at the forward: a leaf may be the caller's batch,
    which the caller may write into before the backward), with the stage's ``params`` as the
    forward left them (:class:`ParamsAtForward`: an ``optimizer.step()`` or a freeze toggled
    before the backward must not reach the recomputation) and those its forward wrote into
    (``written``, which the recomputation must leave as it found them).
    """

    args: tuple[Any, ...]
    skips: dict[SkipKey, Value]
    output: Value | None = None
    leaving: dict[SkipKey, Value] | None = None
    rng: RngStates | None = None
    buffers: list[Tensor] | None = None
    modes: tuple[bool, ...] | None = None
    versions: list[int] | None = None
    params: ParamsAtForward | None = None
    written: list[tuple[str, Tensor]] | None = None


@dataclass(frozen=True)
class Loss:
    """The loss a :meth:`~autopipe.Pipeline.train_step` computes on the last stage: micro-batch
    ``j``'s is ``fn(output_j, targets[j]) * weights[j]`` (its share of the batch for a mean, 1
    for a sum, so the micro-batches' add up to the batch's loss)."""

    fn: Callable[..., Tensor]
    targets: list[Any]
    weights: list[float]


@dataclass
class Run:
    """The state of one ``pipe(*args)`` call, from its forward to the end of its backward."""

    micro_batches: list[tuple[Any, ...]]
    checkpointed: list[bool]
    grad_enabled: bool
    autocast: list[tuple[str, torch.dtype]]  # the caller's enabled autocast device types
    threads: int
    stages: int
    inboxes: list[Inbox] = field(init=False)
    credits: Credits = field(init=False)  # of each stage's input gradients (Credits)
    saved: list[dict[int, Saved]] = field(init=False)
    outputs: dict[int, Value] = field(default_factory=dict)
    output_grads: list[list[Tensor | None]] = field(default_factory=list)
    input_grads: dict[int, list[Tensor | None]] = field(default_factory=dict)
    events: list[Event] = field(default_factory=list)
    error: BaseException | None = None
    loss: Loss | None = None  # set by train_step: the last stage ends in the loss
    loss_has_graph: bool = False  # set by the last stage once a micro-batch's loss requires grad
    # set by the tie's backward under autograd.grad(loss, x) or loss.backward(inputs=[x]): the stages
    # give their received tensors gradients and leave every parameter's .grad alone
    inputs_only: bool = False
    # set by the tie's backward: whether the caller's backward keeps its graph (retain_graph=True), so
    # the stages keep theirs and their saved state; freed once a backward did not
    retain_graph: bool = False
    freed: bool = False

    meter: StageMeter | None = None  # set when the pipeline measures memory
    # (receiving stage, message key) -> the marks of a message's tensors that are, in the plain
    # model, the same tensor as another sent apart (autopipe.runtime.aliases)
    marks: dict[tuple[int, Hashable], Marks] = field(default_factory=dict)
    # whether this run or another replica's run of the same call checkpoints: a replay needs its
    # own draws, so stages that draw random numbers take the generator's lock (RandomGuard), and
    # its own buffers, so stages with buffers take their replicas' lock (Stage.replay_lock)
    replays: bool = False
    # the key of the call's deferred batch norm step (autopipe.runtime.batchnorm): every replica's run
    # of one call has the same
    step: object = field(default_factory=object)

    def __post_init__(self) -> None:
        self.inboxes = [Inbox(self) for _ in range(self.stages)]
        self.credits = Credits(self, self.stages)
        self.saved = [{} for _ in range(self.stages)]
        self.t0 = time.perf_counter()
        self._done = threading.Condition()
        self._pending = 0

    @property
    def chunks(self) -> int:
        return len(self.micro_batches)

    @property
    def sizes(self) -> list[int]:
        """Samples per micro-batch."""
        return [tensors_of(mb)[0].shape[0] for mb in self.micro_batches]

    def ms(self) -> float:
        """Now, in ms since the call started (the trace's clock)."""
        return (time.perf_counter() - self.t0) * 1e3

    def fail(self, error: BaseException) -> None:
        """Record the first failure and wake every waiting stage so that it aborts."""
        with self._done:
            if self.error is None:
                self.error = error
        for inbox in self.inboxes:
            inbox.wake()
        self.credits.wake()

    def begin_phase(self) -> None:
        self._pending = self.stages

    def stage_done(self) -> None:
        with self._done:
            self._pending -= 1
            self._done.notify_all()

    def wait_phase(self) -> None:
        """Block until every stage finished the phase; re-raise the first failure.

        An interrupt of the wait itself (``KeyboardInterrupt``) fails the call, so the stages
        stop after their current micro-batch, and is raised once they have.  The run then
        keeps only that it failed, not the error: raised, its traceback takes in the caller's
        frames, which hold the run through the output's autograd graph, a cycle through C++
        that the garbage collector cannot see (it kept a dropped pipeline and its threads alive)."""
        try:
            self._wait_stages()
        except BaseException as interrupt:
            self.fail(interrupt)
            self._wait_stages()
            self.error = _raised()
            raise
        error = self.error
        if error is not None:
            self.error = _raised()
            raise error

    def _wait_stages(self) -> None:
        with self._done:
            while self._pending:
                self._done.wait()
