"""Replicas of one pipeline in one process: data parallel over pipelines.

Each replica is an :class:`~autopipe.runtime.pipeline.Engine` (its stages and worker threads)
on its own devices, running the same layer modules — on CPU the replicas share parameter
storage, so each parameter's ``AccumulateGrad`` (thread-safe) sums every replica's gradient
into the one ``.grad``: after ``backward`` it holds the plain model's gradient on the whole
batch with no separate reduction step, the optimizer sees one set of parameters, and the next
step computes with the updated weights everywhere.

A call splits the batch with ``torch.tensor_split(batch, replicas)``, each share into the
plan's micro-batches, runs every replica's phase at once (:class:`Replicas`) and joins the
outputs in order, so the caller's loss sees the whole batch as from the plain model.

Batch norm: replicas always use :class:`~autopipe.DeferredBatchNorm` (the pipeline converts),
bracketed here once per call rather than per stage, so its running statistics are updated
once from the whole batch's statistics, as ``nn.BatchNorm`` on the whole batch would; plain
batch norms would be updated by every replica's thread at once.

CUDA devices cannot share parameter storage; replicating modules per device and reducing
gradients as ``torch.nn.parallel`` does is not written yet, so replicas need CPU devices
(:func:`check_replica_devices`).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

import torch

from .batchnorm import DeferredBatchNorm

if TYPE_CHECKING:
    from .engine import Engine
    from .run import Run

__all__ = ["Replicas", "check_replica_devices"]


def check_replica_devices(devices: Sequence[Sequence[torch.device]]) -> None:
    """Refuse replicas on non-CPU devices (they would need copies of the parameters)."""
    if len(devices) > 1 and any(d.type != "cpu" for group in devices for d in group):
        raise ValueError(
            f"{len(devices)} replicas on {[str(d) for group in devices for d in group]}: the in-process "
            "runtime runs replicas on CPU devices only (they share the parameters); plan with replicas=1 "
            "for CUDA devices")


class Replicas:
    """The run of one call on every replica: phases start on all, then wait for all."""

    def __init__(self, engines: Sequence["Engine"], runs: Sequence["Run"]) -> None:
        self.pairs = list(zip(engines, runs))
        self.runs = [run for _, run in self.pairs]
        # with several replicas the call brackets deferred batch norm (module docstring)
        self.deferred: list[DeferredBatchNorm] = []
        if len(self.pairs) > 1:
            stages = self.pairs[0][0].stages
            self.deferred = list({id(bn): bn for stage in stages for bn in stage.deferred}.values())

    def run_phase(self, phase: str) -> None:
        self.start_phase(phase)
        self.finish_phase(phase)

    def start_phase(self, phase: str) -> None:
        if phase == "forward":
            for bn in self.deferred:
                bn.begin_step()
        for engine, run in self.pairs:
            engine.start_phase(run, phase)

    def finish_phase(self, phase: str) -> None:
        """Wait for every replica; then raise the first failure, if any."""
        failure: BaseException | None = None
        for engine, run in self.pairs:
            try:
                engine.finish_phase(run, phase)
            except BaseException as error:  # every replica must stop before the caller goes on
                failure = failure or error
        if failure is not None:
            raise failure
        if phase == "forward":
            for bn in self.deferred:
                bn.end_step()
