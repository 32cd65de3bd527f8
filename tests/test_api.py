"""The public API: every exported name resolves, and the CLI lists every subcommand."""
from __future__ import annotations

import subprocess
import sys

import autopipe
from autopipe.cli import SUBCOMMANDS


def test_every_exported_name_resolves() -> None:
    missing = [name for name in autopipe.__all__ if getattr(autopipe, name, None) is None]
    assert missing == []
    assert {"partition", "profile", "plan", "Pipeline", "Plan", "Profile", "chain", "skippable"} <= set(autopipe.__all__)


def test_help_lists_every_subcommand() -> None:
    result = subprocess.run([sys.executable, "-m", "autopipe", "--help"], capture_output=True, text=True,
                            timeout=120, check=True)
    for name in SUBCOMMANDS:
        assert f"    {name} " in result.stdout
