"""The command line when the user's model fails: its exception in a few lines (type, message, and
autopipe's notes naming where it was raised) with status 2, no traceback; a bug in autopipe keeps
its traceback."""
from __future__ import annotations

import threading
from pathlib import Path

import pytest
from torch import Tensor, nn

from autopipe.cli import main
from autopipe.cli import profile as profile_cli

FAST = ["--input-shape", "4", "--batch-size", "4", "--warmup", "0", "--repeats", "1", "--quiet"]
HERE = "test_cli_model_errors"


class Boom(Exception):
    """The model's own exception class."""


class Raises(nn.Module):
    def forward(self, x: Tensor) -> Tensor:
        raise Boom("my layer failed")


class RaisesKeyError(nn.Module):
    def forward(self, x: Tensor) -> Tensor:
        return {}["missing"]


class Captured(nn.Module):
    """Not a Sequential: captured by running it, where it raises."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)

    def forward(self, x: Tensor) -> Tensor:
        raise Boom("my forward failed")


class DataDependent(nn.Module):
    """Branches on a value: neither torch.fx nor torch.export captures it (export prints its
    partial graph on the way out)."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)

    def forward(self, x: Tensor) -> Tensor:
        return self.linear(x) if x.sum() > 0 else x


class OffMainThread(nn.Module):
    """Runs where a profile alone times it, on the main thread; fails in a pipeline's stage."""

    def forward(self, x: Tensor) -> Tensor:
        if threading.current_thread() is not threading.main_thread():
            raise Boom("not on the main thread")
        return x


def boom() -> nn.Module:
    return nn.Sequential(nn.Linear(4, 4), Raises(), nn.Linear(4, 2))


def key_error() -> nn.Module:
    return nn.Sequential(nn.Linear(4, 4), RaisesKeyError())


def captured() -> nn.Module:
    return Captured()


def data_dependent() -> nn.Module:
    return DataDependent()


def off_main_thread() -> nn.Module:
    return nn.Sequential(nn.Linear(4, 4), OffMainThread(), nn.Linear(4, 2))


def tiny() -> nn.Module:
    return nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))


@pytest.fixture(autouse=True)
def _importable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(Path(__file__).parent))


def _failed(capsys: pytest.CaptureFixture[str], argv: list[str]) -> list[str]:
    """Run the CLI, check it failed with status 2 and no traceback; the lines it printed."""
    capsys.readouterr()
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    return err.splitlines()


@pytest.mark.parametrize(("spec", "error", "note"), [
    ("boom", f"{HERE}.Boom: my layer failed", "layer '1' (Raises) in forward at micro-batch size 4"),
    ("key_error", "KeyError: 'missing'", "layer '1' (RaisesKeyError) in forward at micro-batch size 4"),
], ids=["own-class", "builtin"])
def test_a_layer_failing_while_profiled_is_its_exception_and_the_layer(capsys, spec: str, error: str,
                                                                       note: str) -> None:
    lines = _failed(capsys, ["profile", f"{HERE}:{spec}", *FAST, "--batch-sizes", "4", "--devices", "cpu"])
    assert lines == [f"autopipe profile: error: {error}", f"autopipe: raised by {note}, while profiling it"]


def test_a_model_failing_while_captured_is_its_exception(capsys) -> None:
    lines = _failed(capsys, ["profile", f"{HERE}:captured", *FAST, "--devices", "cpu"])
    assert lines == [f"autopipe profile: error: {HERE}.Boom: my forward failed",
                     "autopipe: raised by Captured run on the sample while capturing it (torch.export failed, "
                     "and the model itself fails on this sample)"]


def test_a_model_neither_tracer_captures_is_one_line_without_torchs_output(capsys) -> None:
    lines = _failed(capsys, ["profile", f"{HERE}:data_dependent", *FAST, "--devices", "cpu"])
    assert len(lines) == 1, lines
    assert lines[0].startswith("autopipe profile: error: cannot capture DataDependent: torch.fx cannot trace")
    assert "torch.export failed too" in lines[0]


def test_a_layer_failing_in_a_pipeline_stage_is_its_exception_and_the_stage(capsys, tmp_path: Path) -> None:
    profile_path, plan_path = tmp_path / "profile.json", tmp_path / "plan.json"
    spec = f"{HERE}:off_main_thread"
    assert main(["profile", spec, *FAST, "--devices", "cpu,cpu", "--alone", "-o", str(profile_path)]) == 0
    assert main(["plan", str(profile_path), "--devices", "cpu,cpu", "--replicas", "1", "--chunks", "2",
                 "-o", str(plan_path)]) == 0
    lines = _failed(capsys, ["bench", spec, "--plan", str(plan_path), "--steps", "1", "--warmup", "0"])
    assert lines[0] == f"autopipe bench: error: {HERE}.Boom: not on the main thread"
    assert len(lines) == 2 and lines[1].startswith("autopipe: raised by stage ")
    assert lines[1].endswith(" in forward of micro-batch 0")


def test_profiling_on_the_meta_device_is_one_error(capsys) -> None:
    lines = _failed(capsys, ["profile", f"{HERE}:tiny", *FAST, "--devices", "meta"])
    assert len(lines) == 1 and lines[0].startswith("autopipe profile: error: cannot profile on the meta device")


def test_a_bug_in_autopipe_keeps_its_traceback(monkeypatch: pytest.MonkeyPatch) -> None:
    """An exception no model raised (no autopipe note says so) is not a user's mistake: it
    propagates, so Python prints its traceback."""
    def broken(*args: object, **kwargs: object) -> None:
        raise KeyError("an internal table")

    monkeypatch.setattr(profile_cli, "profile", broken)
    with pytest.raises(KeyError, match="an internal table"):
        main(["profile", f"{HERE}:tiny", *FAST, "--devices", "cpu"])
