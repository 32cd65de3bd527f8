"""Checks of a subcommand's arguments, run before any work: each bad value gets one error naming
the option and the fix (``main`` prints it as one line), and no output replaces an input."""
from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any, Iterable, Mapping

from .._jsonio import check_writable

__all__ = ["at_least", "given", "fill_defaults", "output_path", "device_names"]


def at_least(args: argparse.Namespace, minimums: Mapping[str, int]) -> None:
    """Refuse an integer option below its minimum (``None``: not given, its default comes later)."""
    for option, minimum in minimums.items():
        value = getattr(args, _dest(option))
        if value is not None and value < minimum:
            raise ValueError(f"{option} must be at least {minimum}, got {value}")


def given(args: argparse.Namespace, options: Iterable[str]) -> list[str]:
    """The options among ``options`` given on the command line: their defaults are ``None`` (or
    ``False`` for a flag) until :func:`fill_defaults`, so a value equal to the default still counts."""
    values = {option: getattr(args, _dest(option)) for option in options}
    return [option for option, value in values.items() if value is not None and value is not False]


def fill_defaults(args: argparse.Namespace, defaults: Mapping[str, Any]) -> None:
    """Set each option not given (``None``) to its default, once the given ones are checked."""
    for name, value in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, value)


def _dest(option: str) -> str:
    """``--batch-size`` → ``batch_size``, ``MODEL`` → ``model``: the attribute argparse sets."""
    return option.lstrip("-").replace("-", "_").lower()


def output_path(text: str | None, option: str, inputs: Iterable[str | None] = (),
                example: str = "out.json", kind: str | None = None) -> Path | None:
    """The file ``option`` names, refused at once if it is empty, would replace one of the
    command's ``inputs`` (by any name: :func:`os.path.samefile`), or cannot be written there
    (``example``: the kind of file name to suggest; ``kind``: what is written, the only kind of
    file it may replace)."""
    if text is None:
        return None
    if not text.strip():
        raise ValueError(f"{option} is empty; give a file name, e.g. {option} {example}")
    target = Path(text)
    for source in filter(None, inputs):
        if _same_file(target, source):
            raise ValueError(f"{option} {text} is the input file {source}: writing it would replace the "
                             "input; choose another file name")
    return check_writable(target, example, kind)


def _same_file(a: Path, b: str) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:  # one of them does not exist (yet), so they are not the same file
        return False


def device_names(text: str | None, example: str = "--devices cpu,cpu") -> list[str] | None:
    """``--devices cpu, cpu`` → ``["cpu", "cpu"]``; ``None`` when not given (each command's
    default); an empty value is refused rather than read as the default."""
    if text is None:
        return None
    names = [name.strip() for name in text.split(",") if name.strip()]
    if not names:
        raise ValueError(f"--devices '{text}' names no device; pass e.g. {example}")
    return names
