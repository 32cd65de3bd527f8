"""The hook into the engine's schedules: the stage tells its module (inside DDP with replicas)
which micro-batch runs."""
from __future__ import annotations

from typing import Any

from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe
from torch.distributed.pipelining.schedules import PipelineScheduleSingle
from torch.nn.parallel import DistributedDataParallel

from .._vocab import Schedule
from ..errors import AutopipeError
from ._stage import StageModule

__all__ = ["SCHEDULE_CLASSES", "Stage"]

SCHEDULE_CLASSES: dict[Schedule, type[PipelineScheduleSingle]] = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}


class Stage(PipelineStage):
    """Tells the stage module which micro-batch it runs, which checkpointing ``except_last`` needs,
    and the next stage's module the form of the main value it receives.

    The engine sends tensors only; the form (containers, keys, non-tensor items) goes once, beside
    the shape probe's forward metadata, which the engine sends after this stage's probe ran
    (torch's private ``_send_meta``/``_recv_meta`` hooks, called once per pipeline at its first step).
    """

    @property
    def stage_module(self) -> StageModule:
        return self.submod.module if isinstance(self.submod, DistributedDataParallel) else self.submod

    def _send_meta(self, meta: Any, dst_stage: int) -> None:
        if dst_stage == self.stage_index + 1:
            meta = (meta, self.stage_module.sent_form)
            self.stage_module.form_sent = True
        super()._send_meta(meta, dst_stage)

    def _recv_meta(self, src_stage: int) -> Any:
        meta = super()._recv_meta(src_stage)
        if src_stage == self.stage_index - 1:
            meta, self.stage_module.received_form = meta
        return meta

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
