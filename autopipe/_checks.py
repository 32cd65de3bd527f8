"""Checks of the arguments every entry point (``profile``, ``plan``, ``partition``,
``Pipeline``) shares, without torch (the planner uses them too).

Each refuses a user's argument with one :class:`~autopipe.OptionError` naming the
argument and what it takes, before any work starts: left to the code that uses it, a wrong value
fails deep inside (``'float' object cannot be interpreted as an integer``) or, worse, is
truncated or carried into a plan (``batch_size=2.5`` planned as 2, a ``nan`` speed predicted as
``nan`` ms).
"""
from __future__ import annotations

import difflib
import math
import numbers
import os
from collections.abc import Iterable
from typing import Collection, TypeVar

from .errors import DeviceError, OptionError

__all__ = ["check_device_list", "is_positive_int", "is_positive_number", "positive_int", "positive_number",
           "check_choice", "check_keywords", "loaded"]

T = TypeVar("T")


def check_device_list(devices: object) -> None:
    """Refuse a ``devices`` argument that is neither ``None``, a count nor a list of devices: a
    string would otherwise be read one letter per device (``'cpu'`` as ``'c'``, ``'p'``, ``'u'``)."""
    if isinstance(devices, str):
        raise DeviceError(f"devices must be a list of devices or a count, got the string {devices!r}; "
                          f"pass {devices.split(',')}")
    if devices is not None and (isinstance(devices, bool) or not isinstance(devices, (int, Iterable))):
        raise DeviceError(f"devices must be a list of devices (e.g. ['cpu', 'cpu']) or a count, got {devices!r}")


def is_positive_int(value: object) -> bool:
    """An integer of at least 1; not a bool, nor a float such as 2.5 that ``int()`` would truncate."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool) and value >= 1


def is_positive_number(value: object) -> bool:
    """A finite real number above 0 (not a bool, a string or ``nan``)."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool) and 0 < value < math.inf


def positive_int(value: object, name: str) -> int:
    """``value`` as an ``int``; raises :class:`OptionError` naming ``name`` unless it is a positive integer."""
    if not is_positive_int(value):
        raise OptionError(f"{name} must be a positive integer, got {value!r}")
    return int(value)  # type: ignore[call-overload]  # an Integral: checked above


def positive_number(value: object, name: str, meaning: str = "") -> float:
    """``value`` as a ``float``; raises :class:`OptionError` naming ``name`` (and its ``meaning``)
    unless it is finite and positive."""
    if not is_positive_number(value):
        raise OptionError(f"{name} must be a positive number{meaning}, got {value!r}")
    return float(value)  # type: ignore[arg-type]  # a Real, checked above


def check_choice(value: object, name: str, choices: Collection[str]) -> None:
    """Raise :class:`OptionError` unless ``value`` is one of ``choices``, listing them."""
    if not isinstance(value, str) or value not in choices:
        raise OptionError(f"{name} {value!r} is not one of {list(choices)}")


def check_keywords(function: str, given: Collection[str], accepted: Collection[str]) -> None:
    """Refuse keywords that ``function`` (which forwards them) does not take, as Python would for
    its own parameters, suggesting the closest accepted one: forwarded blindly, the error would
    name the internal function that finally refused them."""
    for keyword in given:
        if keyword not in accepted:
            close = difflib.get_close_matches(keyword, list(accepted), n=1)
            hint = f"did you mean '{close[0]}'?" if close else f"it takes {sorted(accepted)}"
            raise OptionError(f"{function}() got an unexpected keyword argument '{keyword}'; {hint}")


def loaded(given: object, kind: type[T], name: str) -> T:
    """``given`` if it is a ``kind`` (a :class:`~autopipe.Profile` or :class:`~autopipe.Plan`),
    else the ``kind`` read from the JSON file it names (``kind.load``): every step takes either."""
    if isinstance(given, kind):
        return given
    if isinstance(given, (str, os.PathLike)):
        return kind.load(given)  # type: ignore[attr-defined]  # Profile.load, Plan.load
    raise OptionError(f"{name} must be an autopipe.{kind.__name__} or the path of one saved as JSON "
                      f"(autopipe.{kind.__name__}.load), got {type(given).__name__}")
