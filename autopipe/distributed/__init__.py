"""Step 5, the distributed engine: takes a model and a plan made with ``engine="distributed"``; gives
this rank's :class:`DistributedPipeline`, one stage per rank of a torchrun job, run by
``torch.distributed.pipelining`` (skips relayed by the stages between, GPipe or 1F1B, checkpoint
modes as the in-process runtime, one state dict under the model's keys).
"""
from __future__ import annotations

from .pipeline import (DistributedError, DistributedPipeline, RunSettings, StageModule, StageOutputError,
                       init_distributed, merge_state_dicts)

__all__ = ["DistributedError", "DistributedPipeline", "RunSettings", "StageModule", "StageOutputError",
           "init_distributed", "merge_state_dicts"]
