"""Every error autopipe raises for a user's mistake or a failed step."""
from __future__ import annotations

__all__ = ["DistributedError", "ProfileError", "StageOutputError"]


class ProfileError(ValueError):
    """The model or its sample input cannot be profiled as given."""


class DistributedError(ValueError):
    """A plan, job or batch that ``torch.distributed.pipelining`` cannot run as asked."""


class StageOutputError(TypeError):
    """A stage would send something other than tensors to the next rank."""
