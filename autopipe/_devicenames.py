"""Device names as users type them, checked without torch (the planner must not import it).

autopipe runs on ``cpu`` and ``cuda`` devices (and ``meta`` in tests); every step accepts a name
of the form ``type`` or ``type:index`` and refuses anything else with one line naming the name
and the forms it accepts, before torch would raise its own message or a plan would name a
device that cannot exist.
"""
from __future__ import annotations

import re

__all__ = ["DeviceError", "check_device_name"]

_NAME = re.compile(r"(cpu|cuda|meta)(:\d+)?")


class DeviceError(ValueError):
    """A device that does not exist or cannot be used."""


def check_device_name(name: object) -> str:
    """``name`` as a device name (``cpu``, ``cuda``, ``cuda:N``); raises :class:`DeviceError`."""
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise DeviceError(f"'{name}' is not a device autopipe can use; name devices 'cpu', 'cuda' or "
                          "'cuda:N' (N = 0, 1, ...), e.g. cpu,cpu or cuda:0,cuda:1")
    return name
