"""Step 6, the command line: one module per subcommand, each with ``add_arguments`` and ``run``.

``python -m autopipe --help`` lists them; ``python -m autopipe SUBCOMMAND --help`` explains one.
Only the subcommand being run is imported (the others, and torch, stay unloaded), so the listing
answers at once.
"""
from __future__ import annotations

import argparse
import importlib
import os
import sys
from typing import Sequence

from .._jsonio import FormatError
from ..errors import raised_by_model

__all__ = ["main"]

#: name → (module in this package, one-line help).  The flow reads top to bottom.
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "profile": ("profile", "measure a model's layers and the copies between devices; save a profile"),
    "plan": ("plan", "choose split points, micro-batches and checkpointing from a profile"),
    "show": ("show", "print a plan's stages and a timeline of its schedule"),
    "bench": ("bench", "run a plan and compare predicted with measured times"),
    "demo": ("demo", "profile, plan and train a ResNet on the available devices"),
}


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The parser, with the arguments of ``command`` only (every subcommand is listed)."""
    parser = argparse.ArgumentParser(
        prog="python -m autopipe",
        description="Automatic pipeline parallelism for PyTorch: profile → plan → run.",
    )
    commands = parser.add_subparsers(dest="command", metavar="SUBCOMMAND", required=True)
    for name, (module_name, help_text) in SUBCOMMANDS.items():
        sub = commands.add_parser(name, help=help_text, description=help_text)
        if name == command:
            module = importlib.import_module(f".{module_name}", __name__)
            module.add_arguments(sub)
            sub.set_defaults(run=module.run)
    return parser


def _command(argv: Sequence[str]) -> str | None:
    """The subcommand named in ``argv``: the first argument that is not an option."""
    return next((arg for arg in argv if not arg.startswith("-")), None)


def main(argv: Sequence[str] | None = None) -> int:
    """Run one subcommand.  A user's mistake prints one line, an exception the user's model
    raised a few (its type and message, then autopipe's notes on where it was raised), and either
    exits with status 2; any other error, a bug in autopipe, keeps its traceback.

    A closed standard output (``... | head``) ends the command quietly with status 1: every
    subcommand writes its files before it prints, so they are kept."""
    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser(_command(argv)).parse_args(argv)
    try:
        code = int(args.run(args) or 0)
        sys.stdout.flush()  # here, not at exit: a closed pipe is then caught below
        return code
    except BrokenPipeError:
        _silence_stdout()
        return 1
    except Exception as error:
        if raised_by_model(error):
            print(f"autopipe {args.command}: error: {_model_error(error)}", file=sys.stderr)
        elif isinstance(error, (FormatError, ValueError, TypeError, OSError)):
            print(f"autopipe {args.command}: error: {error}", file=sys.stderr)
        else:
            raise
        return 2


def _model_error(error: BaseException) -> str:
    """The model's exception as Python ends its traceback: the type, the message, the notes."""
    kind = type(error)
    name = kind.__qualname__ if kind.__module__ == "builtins" else f"{kind.__module__}.{kind.__qualname__}"
    text = str(error)
    return "\n".join([f"{name}: {text}" if text else name, *error.__notes__])


def _silence_stdout() -> None:
    """Point standard output at the null device, so that Python's own flush at exit does not
    fail on the closed pipe again (the recipe of Python's documentation on SIGPIPE)."""
    try:
        descriptor = sys.stdout.fileno()
    except (AttributeError, ValueError, OSError):  # not a file (captured): nothing to flush at exit
        return
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, descriptor)
    os.close(devnull)
