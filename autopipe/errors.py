"""Every error autopipe raises for a user's mistake or a failed step, under one base.

``except autopipe.AutopipeError`` catches them all; each also keeps the built-in base it has
always had (``except ValueError`` still catches a :class:`PlanningError`).  The capture step's
:class:`~autopipe.model.capture.CaptureError` is a :class:`ChainError`, so it is one too.
"""
from __future__ import annotations

__all__ = [
    "AutopipeError", "ChainError", "DeviceError", "DistributedError", "FormatError", "LaunchError",
    "OptionError", "PlanningError", "StageOutputError", "RAISED_BY", "add_note", "raised_by_model",
]

#: How autopipe's note on an exception the user's model raised begins (a pipeline stage's, a
#: profiled layer's, the model's own on the sample while capturing it): such an exception reaches
#: the caller as itself, and the CLI shows it without a traceback.
RAISED_BY = "autopipe: raised by "


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


class PlanningError(AutopipeError, ValueError):
    """No plan satisfies the options (memory limits, chunks, batch size)."""


class DistributedError(AutopipeError, ValueError):
    """A plan, job or batch that ``torch.distributed.pipelining`` cannot run as asked."""


class StageOutputError(AutopipeError, TypeError):
    """A stage would send something other than tensors to the next rank."""


class LaunchError(AutopipeError, RuntimeError):
    """A rank failed or the job ran out of time; the message carries the failed ranks' logs."""


def add_note(error: BaseException, note: str) -> None:
    """``error.add_note(note)``, also on Python 3.10, which keeps the note in ``__notes__`` as
    3.11 does (its tracebacks do not print them; the CLI does)."""
    if hasattr(error, "add_note"):
        error.add_note(note)
    else:
        error.__notes__ = [*getattr(error, "__notes__", ()), note]


def raised_by_model(error: BaseException) -> bool:
    """Whether the user's model raised ``error``: autopipe noted where (:data:`RAISED_BY`)."""
    return any(isinstance(note, str) and note.startswith(RAISED_BY) for note in getattr(error, "__notes__", ()))
