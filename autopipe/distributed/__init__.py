"""Run a plan on ``torch.distributed.pipelining``: one stage per rank of a torchrun job."""
from __future__ import annotations

from .pipeline import (
    DistributedError,
    DistributedPipeline,
    SkipRoute,
    StageModule,
    StageOutputError,
    init_distributed,
    merge_state_dicts,
    skip_routes,
)

__all__ = [
    "DistributedError",
    "DistributedPipeline",
    "SkipRoute",
    "StageModule",
    "StageOutputError",
    "init_distributed",
    "merge_state_dicts",
    "skip_routes",
]
