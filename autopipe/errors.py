"""Every error autopipe raises for a user's mistake or a failed step, under one base.

``except autopipe.AutopipeError`` catches them all; each also keeps the built-in base it has
always had (``except ValueError`` still catches a :class:`PlanningError`).  The capture step's
:class:`~autopipe.model.capture.CaptureError` is a :class:`ChainError`, so it is one too.
"""
from __future__ import annotations

__all__ = [
    "AutopipeError", "ChainError", "DeviceError", "DistributedError", "FormatError", "LaunchError",
    "OptionError", "PlanningError", "ProfileError", "StageOutputError",
]


class AutopipeError(Exception):
    """The base of every error autopipe raises on purpose."""


class OptionError(AutopipeError, ValueError, TypeError):
    """An argument autopipe cannot take: an option of the wrong type or out of range, or a
    profile or plan given for another model.  Both built-in bases, as such mistakes raised
    either before (``chunks=0`` a ``ValueError``, ``chunks=2.5`` a ``TypeError``)."""


class FormatError(AutopipeError, ValueError):
    """A profile or plan file that is corrupt, truncated, of another schema or inconsistent."""


class DeviceError(AutopipeError, ValueError):
    """A device that does not exist or cannot be used."""


class ChainError(AutopipeError, TypeError):
    """The model cannot be read as a chain of layers."""


class ProfileError(AutopipeError, ValueError):
    """The model or its sample input cannot be profiled as given."""


class PlanningError(AutopipeError, ValueError):
    """No plan satisfies the options (memory limits, chunks, batch size)."""


class DistributedError(AutopipeError, ValueError):
    """A plan, job or batch that ``torch.distributed.pipelining`` cannot run as asked."""


class StageOutputError(AutopipeError, TypeError):
    """A stage would send something other than tensors to the next rank."""


class LaunchError(AutopipeError, RuntimeError):
    """A rank failed or the job ran out of time; the message carries the failed ranks' logs."""
