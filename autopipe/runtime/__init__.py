"""The runtime: stages on worker threads, driven by a schedule, tied into the caller's autograd."""
from .pipeline import Pipeline
from .run import StageError

__all__ = ["Pipeline", "StageError"]
