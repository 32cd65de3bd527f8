"""The public API: every exported name resolves, and the CLI lists every subcommand."""
from __future__ import annotations

import subprocess
import sys

import autopipe
from autopipe.cli import SUBCOMMANDS


def test_every_exported_name_resolves() -> None:
    missing = [name for name in autopipe.__all__ if getattr(autopipe, name, None) is None]
    assert missing == []
    expected = {"partition", "profile", "plan", "Pipeline", "Plan", "Profile", "chain", "skippable"}
    assert expected <= set(autopipe.__all__)


def test_help_lists_every_subcommand() -> None:
    result = subprocess.run([sys.executable, "-m", "autopipe", "--help"], capture_output=True, text=True,
                            timeout=120, check=True)
    for name in SUBCOMMANDS:
        assert f"    {name} " in result.stdout


def test_every_exported_error_has_the_one_base() -> None:
    errors = [getattr(autopipe, name) for name in autopipe.__all__ if name.endswith("Error")]
    assert len(errors) >= 10
    for error in errors:
        assert issubclass(error, autopipe.AutopipeError), error
        assert error.__module__.startswith("autopipe.")


def test_errors_keep_their_builtin_bases() -> None:
    """Code that caught the built-in base before still catches each error."""
    bases = {"FormatError": ValueError, "DeviceError": ValueError, "ChainError": TypeError,
             "CaptureError": TypeError, "PlanningError": ValueError,
             "DistributedError": ValueError, "StageOutputError": TypeError,
             "LaunchError": RuntimeError, "OptionError": ValueError}
    for name, base in bases.items():
        assert issubclass(getattr(autopipe, name), base), name
    # an option of the wrong type raised a TypeError before it raised an OptionError
    assert issubclass(autopipe.OptionError, TypeError)


def test_errors_are_the_ones_the_steps_raise() -> None:
    """The exported classes are the very ones each step's module raises (one class, not a copy)."""
    from autopipe._jsonio import FormatError
    from autopipe.device import DeviceError
    from autopipe.distributed.pipeline import DistributedError, StageOutputError
    from autopipe.model.capture import CaptureError
    from autopipe.planning import PlanningError

    for error in (FormatError, DeviceError, DistributedError, StageOutputError, CaptureError, PlanningError):
        assert getattr(autopipe, error.__name__) is error


def test_committed_plans_and_profiles_load_and_match() -> None:
    """Files written before the package was reorganised still load, and each plan names the
    committed profile it was made from."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    plans = sorted((root / "plans").glob("*.json"))
    assert plans
    for path in plans:
        plan = autopipe.Plan.load(path)
        profile = autopipe.Profile.load(root / "profiles" / path.name)
        assert plan.profile_digest == profile.digest and plan.model == profile.model
        assert sum(plan.balance) == len(profile.layers)


class _NoAddNote(ValueError):
    """An exception as Python 3.10 has them: no ``add_note``."""

    def __getattribute__(self, name: str) -> object:
        if name == "add_note":
            raise AttributeError(name)
        return super().__getattribute__(name)


def test_a_note_on_python_without_add_note_is_kept_as_311_keeps_it() -> None:
    """The runtime and the profiler note where the model raised; without ``add_note`` (3.10) the
    note goes into ``__notes__``, which the CLI reads, rather than failing with an AttributeError."""
    from autopipe.errors import RAISED_BY, add_note, raised_by_model

    for error in (_NoAddNote("bad"), ValueError("bad")):
        assert not raised_by_model(error)
        add_note(error, f"{RAISED_BY}stage 0")
        add_note(error, "and more")
        assert error.__notes__ == [f"{RAISED_BY}stage 0", "and more"]
        assert raised_by_model(error)
