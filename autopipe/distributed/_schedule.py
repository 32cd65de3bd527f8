"""The hook into the engine's schedules: the stage tells its module which micro-batch runs."""
from __future__ import annotations

from typing import Any

from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe
from torch.distributed.pipelining.schedules import PipelineScheduleSingle

from .._vocab import Schedule

__all__ = ["SCHEDULE_CLASSES", "Stage"]

SCHEDULE_CLASSES: dict[Schedule, type[PipelineScheduleSingle]] = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}


class Stage(PipelineStage):
    """Tells the stage module which micro-batch it runs, which checkpointing ``except_last`` needs."""

    def forward_one_chunk(self, fwd_chunk_id: int, *args: Any, **kwargs: Any) -> Any:
        self.submod.micro_batch = fwd_chunk_id
        try:
            return super().forward_one_chunk(fwd_chunk_id, *args, **kwargs)
        finally:
            self.submod.micro_batch = None
