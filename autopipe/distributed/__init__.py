"""Run a plan on ``torch.distributed.pipelining``: one stage per rank of a torchrun job."""
from __future__ import annotations

from . import pipeline
from .pipeline import *  # noqa: F403 - the package's names are the engine module's

__all__ = pipeline.__all__
