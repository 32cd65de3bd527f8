"""Step 2, profiling: takes a layer chain, a sample batch and devices; gives a :class:`Profile`.

A profile holds each layer's forward and backward time at several micro-batch sizes, the
bytes it outputs, saves for backward and holds in parameters, and the copy cost between every
pair of devices, and is saved as JSON.  The :class:`Profile` format needs no torch, so the
planner can read it without loading torch; :func:`profile` (the measurement) loads torch when
first used.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .profiles import PROFILE_SCHEMA_VERSION, CopyFit, LayerProfile, Profile, Stat

__all__ = ["PROFILE_SCHEMA_VERSION", "CopyFit", "LayerProfile", "Profile", "Stat", "profile"]


def __getattr__(name: str) -> Any:
    if name == "profile":
        from .profiler import profile

        return profile
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


if TYPE_CHECKING:  # pragma: no cover
    from .profiler import profile
