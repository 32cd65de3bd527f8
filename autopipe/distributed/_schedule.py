"""The hook into the engine's schedules: the stage tells its module (inside DDP with replicas)
which micro-batch runs, and the next stage's module what it sent in the shape probe."""
from __future__ import annotations

from typing import Any, Callable

from torch import Tensor
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe
from torch.distributed.pipelining.schedules import PipelineScheduleSingle
from torch.nn.parallel import DistributedDataParallel

from .._vocab import Schedule
from ..errors import AutopipeError
from ._stage import StageModule, zero_on

__all__ = ["SCHEDULE_CLASSES", "Stage"]

SCHEDULE_CLASSES: dict[Schedule, type[PipelineScheduleSingle]] = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}


class Stage(PipelineStage):
    """Tells the stage module which micro-batch it runs, which checkpointing ``except_last`` needs,
    and the next stage's module what this stage sent in the shape probe.

    At the first step torch runs each stage once on the first micro-batch before the micro-batches
    (its shape probe), to learn the shapes of what goes between them.  The engine sends tensors only;
    the form of the main value (containers, keys, non-tensor items) goes once, beside the probe's forward
    metadata, which the engine sends after this stage's probe ran (torch's private ``_send_meta``/
    ``_recv_meta`` hooks, called once per pipeline at its first step), and so do the values this stage's
    probe sent: torch gives the next stage's probe uninitialised tensors of their shapes, which its layers
    would read as garbage (an embedding's ids out of range), so it runs on those values instead.
    """

    @property
    def stage_module(self) -> StageModule:
        return self.submod.module if isinstance(self.submod, DistributedDataParallel) else self.submod

    def _send_meta(self, meta: Any, dst_stage: int) -> None:
        if dst_stage == self.stage_index + 1:
            module = self.stage_module
            meta = (meta, module.sent_form, module.probe_sent)
            module.form_sent, module.probe_sent = True, None
        super()._send_meta(meta, dst_stage)

    def _recv_meta(self, src_stage: int) -> Any:
        meta = super()._recv_meta(src_stage)
        if src_stage == self.stage_index - 1:
            meta, self.stage_module.received_form, self.stage_module.probe_received = meta
        return meta

    def _backward_metadata_inference(self, loss_fn: Callable[..., Tensor] | None = None, **kwargs: Any) -> Any:
        """The probe's backward, for the shapes of the gradients only, starts from a zero on the last stage's
        output: ``loss_fn`` runs once per micro-batch, as on the plain model, and not in the probe."""
        return super()._backward_metadata_inference(loss_fn=_probe_loss if loss_fn is not None else None,
                                                    **kwargs)

    def forward_one_chunk(self, fwd_chunk_id: int, *args: Any, **kwargs: Any) -> Any:
        module = self.stage_module
        module.micro_batch = fwd_chunk_id
        try:
            return super().forward_one_chunk(fwd_chunk_id, *args, **kwargs)
        except RuntimeError as error:  # the engine's wrapper of a layer's error: ours is clearer alone
            if isinstance(error.__cause__, AutopipeError):
                raise error.__cause__ from None
            raise
        finally:
            module.micro_batch = None


def _probe_loss(output: Tensor, target: Any, **_: Any) -> Tensor:
    return zero_on(output)
