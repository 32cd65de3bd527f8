"""The command line's mistakes: each is one line on stderr with status 2, found before any work
(nothing printed on stdout), and no input file is ever replaced by an output."""
from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import autopipe
from autopipe._jsonio import write_json_atomic
from autopipe.cli import main
from autopipe.timeline import Event, render

FEATURES = 16
SPEC = "test_cli_errors:tiny_model"


def tiny_model() -> nn.Module:
    """The model of every saved profile and plan here."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(FEATURES, 32), nn.ReLU(), nn.Linear(32, 4))


def narrow_model() -> nn.Module:
    """Another model, which fails on the tiny model's samples."""
    return nn.Sequential(nn.Linear(FEATURES // 2, 4), nn.ReLU())


def boom() -> nn.Module:
    raise RuntimeError("factory exploded")


@pytest.fixture(autouse=True)
def _importable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(Path(__file__).parent))


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A profile of the tiny model made by ``profile -o`` and a two-stage plan of it."""
    where = tmp_path_factory.mktemp("saved")
    profile_path, plan_path = where / "profile.json", where / "plan.json"
    assert main(["profile", SPEC, "--input-shape", str(FEATURES), "--batch-size", "8", "--batch-sizes", "4,8",
                 "--devices", "cpu,cpu", "--warmup", "0", "--repeats", "1", "--quiet", "-o", str(profile_path)]) == 0
    assert main(["plan", str(profile_path), "--devices", "cpu,cpu", "--replicas", "1", "--chunks", "2",
                 "-o", str(plan_path)]) == 0
    return profile_path, plan_path


def _error(capsys: pytest.CaptureFixture[str], argv: list[str], expected: str) -> str:
    """Run the CLI and check it failed at once with one line naming ``expected``."""
    capsys.readouterr()
    assert main(argv) == 2
    out, err = capsys.readouterr()
    assert err.count("\n") == 1 and expected in err, err
    assert out == "", f"work was done before the error: {out}"
    return err


@pytest.mark.parametrize("width", ["0", "-5"])
def test_show_refuses_a_width_below_one(saved, width, capsys) -> None:
    _error(capsys, ["show", str(saved[1]), "--width", width], f"--width must be at least 1, got {width}")
    with pytest.raises(ValueError, match="width of at least 1"):
        render([Event(0, "compute", "F", 0, 0.0, 1.0)], 0)


def test_bench_refuses_an_input_shape_the_plan_or_profile_was_not_made_for(saved, capsys) -> None:
    profile_path, plan_path = saved
    for option, path, what in (("--plan", plan_path, "plan"), ("--profile", profile_path, "profile")):
        _error(capsys, ["bench", SPEC, option, str(path), "--input-shape", "17", "--steps", "1"],
               f"--input-shape 17 is not the shape the {what} was made for (16)")


def test_a_model_failing_on_the_synthetic_batch_is_one_error(capsys) -> None:
    expected = "the model's forward on a random batch of shape [8, 17] failed: RuntimeError: mat1 and mat2"
    _error(capsys, ["bench", SPEC, "--input-shape", "17", "--batch-size", "8", "--devices", "cpu,cpu"], expected)
    _error(capsys, ["demo", "--model", SPEC, "--quick", "--devices", "cpu,cpu"],
           "the model's forward on a random batch of shape [4, 3, 64, 64] failed")


def test_bench_refuses_a_plan_of_another_model_before_running_it(saved, capsys) -> None:
    profile_path, plan_path = saved
    for option, path, what in (("--plan", plan_path, "plan"), ("--profile", profile_path, "profile")):
        _error(capsys, ["bench", "test_cli_errors:narrow_model", option, str(path), "--steps", "1"],
               f"the {what} was made for another model: layer 0 differs")


def test_a_failing_model_factory_is_one_error(capsys) -> None:
    expected = "building the model test_cli_errors:boom failed: RuntimeError: factory exploded"
    _error(capsys, ["profile", "test_cli_errors:boom", "--input-shape", "16", "--quiet"], expected)
    _error(capsys, ["demo", "--model", "test_cli_errors:boom", "--devices", "cpu,cpu"], expected)


def test_a_model_module_failing_as_it_is_imported_is_one_error(tmp_path, monkeypatch, capsys) -> None:
    """A syntax error or a typo in the user's model file (a traceback before: only ImportError was caught)."""
    (tmp_path / "broken_syntax.py").write_text("def f(:\n    pass\n")
    (tmp_path / "broken_name.py").write_text("x = undefined_name\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    for module, kind in (("broken_syntax", "SyntaxError"), ("broken_name", "NameError")):
        _error(capsys, ["profile", f"{module}:f", "--input-shape", "16", "--quiet"],
               f"importing '{module}' for MODEL '{module}:f' failed: {kind}")


def test_a_batch_that_cannot_be_allocated_is_one_error(capsys) -> None:
    """``--input-shape 99999,99999,99`` asks for 236,030 GiB: torch's allocation error came with a traceback."""
    _error(capsys, ["profile", SPEC, "--input-shape", "99999,99999,99", "--batch-size", "64", "--quiet"],
           "a random batch of 64 samples of shape [99999, 99999, 99] takes 236029.7 GiB, which this machine cannot "
           "allocate; give a smaller --batch-size or --input-shape")
    # beyond torch's sizes: its error came with a dump of C++ frames
    _error(capsys, ["profile", SPEC, "--input-shape", "16", "--batch-size", str(10 ** 20), "--quiet"],
           f"a random batch of {10 ** 20} samples of shape [16] takes")


def test_no_output_replaces_an_input(saved, tmp_path, capsys) -> None:
    profile_path, plan_path = saved
    copy = tmp_path / "copy.json"
    copy.write_bytes(plan_path.read_bytes())
    alias = tmp_path / "sub" / ".." / "copy.json"  # the same file by another name
    (tmp_path / "sub").mkdir()
    profile_copy = tmp_path / "profile.json"
    profile_copy.write_bytes(profile_path.read_bytes())
    for argv in (["plan", str(profile_copy), "-o", str(profile_copy)],
                 ["bench", "--plan", str(copy), "--steps", "1", "--json", str(alias)],
                 ["show", str(copy), "--png", str(copy)]):
        _error(capsys, argv, "is the input file")
    assert copy.read_bytes() == plan_path.read_bytes()
    assert profile_copy.read_bytes() == profile_path.read_bytes()


def test_an_unwritable_output_is_refused_before_the_work(saved, tmp_path, capsys) -> None:
    blocker = tmp_path / "precious.txt"
    blocker.write_text("keep me")
    expected = f"{blocker} is a file, not a directory"
    _error(capsys, ["profile", SPEC, "--input-shape", "16", "--batch-size", "8", "--quiet",
                    "-o", str(blocker / "p.json")], expected)
    _error(capsys, ["bench", "--plan", str(saved[1]), "--steps", "1", "--json", str(blocker / "x" / "b.json")],
           expected)
    _error(capsys, ["plan", str(saved[0]), "-o", str(tmp_path)], "it is a directory")
    with pytest.raises(NotADirectoryError, match="is a file, not a directory"):
        write_json_atomic(blocker / "x.json", {})
    assert blocker.read_text() == "keep me"


@pytest.mark.parametrize(("argv", "expected"), [
    (["bench", SPEC, "--input-shape", "16", "--batch-size", "0", "--devices", "cpu,cpu", "--steps", "1"],
     "--batch-size must be at least 1, got 0"),
    (["demo", "--steps", "0"], "--steps must be at least 1, got 0"),
    (["demo", "--batch-size", "0", "--quick"], "--batch-size must be at least 1, got 0"),
    (["demo", "--repeats", "0", "--quick"], "--repeats must be at least 1, got 0"),
    (["demo", "--input-shape", "3,x", "--quick"], "--input-shape would be ignored: --quick sets"),
    (["demo", "--steps", "2", "--batch-size", "8", "--quick"], "--batch-size, --steps would be ignored"),
])
def test_invalid_or_overridden_counts_are_refused(argv, expected, capsys) -> None:
    _error(capsys, argv, expected)


def test_bytes_of_refuses_what_it_would_ignore(saved, capsys) -> None:
    profile_path, _ = saved
    # the profile's model is no torchvision one: the fix is to name it (it said "drop MODEL", then
    # refused the command without it, asking for MODEL)
    _error(capsys, ["profile", "test_cli_errors:narrow_model", "--bytes-of", str(profile_path), "--quiet"],
           f"MODEL test_cli_errors:narrow_model is not the model of {profile_path}: --bytes-of measures the "
           f"profile's own model, {SPEC}; give {SPEC}")
    _error(capsys, ["profile", "--bytes-of", str(profile_path), "--input-shape", "3,32,32", "--batch-size", "4"],
           "--input-shape, --batch-size would be ignored")


def test_bytes_of_a_profile_without_its_model_needs_the_model(tmp_path, capsys) -> None:
    measured = autopipe.profile(tiny_model(), torch.randn(8, FEATURES), ["cpu"], batch_sizes=[8], warmup=0,
                                repeats=1, quiet=True)
    path = measured.save(tmp_path / "python.json")
    _error(capsys, ["profile", "--bytes-of", str(path), "--quiet"], "does not name its model")
    assert main(["profile", SPEC, "--bytes-of", str(path), "--quiet"]) == 0
    assert "micro-batch 8 of batch 8" in capsys.readouterr().out


def test_wording_of_empty_and_bad_values(saved, capsys) -> None:
    profile_path, _ = saved
    err = _error(capsys, ["plan", str(profile_path), "--devices", ""], "pass e.g. --devices cpu,cpu or --devices 2")
    assert "[" not in err
    _error(capsys, ["profile", SPEC, "--devices", "", "--quiet"], "names no device; pass e.g. --devices cpu,cpu")
    _error(capsys, ["plan", str(profile_path), "-o", ""], "--output is empty")
    _error(capsys, ["profile", SPEC, "--batch-sizes", "0,2", "--quiet"],
           "--batch-sizes expects comma-separated positive integers like 1,2,4, got '0,2'")


def test_an_output_that_is_not_a_regular_file_is_refused_before_the_work(saved, tmp_path, capsys) -> None:
    """A FIFO (or a device) named as an output stays what it is: saving would rename a file over it."""
    profile_path, plan_path = saved
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    for argv in (["plan", str(profile_path), "-o", str(fifo)],
                 ["profile", SPEC, "--input-shape", "16", "--batch-size", "8", "--quiet", "-o", str(fifo)],
                 ["bench", "--plan", str(plan_path), "--steps", "1", "--json", str(fifo)],
                 ["show", str(plan_path), "--png", str(fifo)]):
        _error(capsys, argv, f"cannot write {fifo}: it exists and is not a regular file")
    assert stat.S_ISFIFO(fifo.stat().st_mode) and [p.name for p in tmp_path.iterdir()] == ["pipe"]


def test_a_directory_given_for_a_png_suggests_a_png(saved, tmp_path, capsys) -> None:
    _error(capsys, ["show", str(saved[1]), "--png", str(tmp_path)], f"such as {tmp_path / 'timeline.png'}")


def test_a_closed_stdout_keeps_the_profile(tmp_path) -> None:
    """The profile is saved before its table is printed: with the reader gone (``| head``) the
    command ends quietly (status 1, no traceback) and the file is whole."""
    out = tmp_path / "p.json"
    read, write = os.pipe()
    os.close(read)
    tests = Path(__file__).parent
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": os.pathsep.join([str(tests.parent), str(tests)])}
    try:
        done = subprocess.run([sys.executable, "-m", "autopipe", "profile", SPEC, "--input-shape", str(FEATURES),
                               "--batch-size", "4", "--devices", "cpu", "--warmup", "0", "--repeats", "1", "--quiet",
                               "-o", str(out)], stdout=write, stderr=subprocess.PIPE, text=True, env=env, timeout=300)
    finally:
        os.close(write)
    assert (done.returncode, done.stderr) == (1, "")
    assert autopipe.Profile.load(out).model["spec"] == SPEC


def test_bench_refuses_a_plan_for_the_distributed_engine(saved, tmp_path, capsys) -> None:
    """``plan --engine distributed`` makes a plan for one process per stage under torchrun, which
    ``bench`` ran in its one process without a word."""
    path = tmp_path / "distributed.json"
    assert main(["plan", str(saved[0]), "--devices", "cpu,cpu", "--engine", "distributed", "--chunks", "2",
                 "-o", str(path)]) == 0
    stages = len(autopipe.Plan.load(path).stages)
    _error(capsys, ["bench", "--plan", str(path), "--steps", "1"],
           f"{path} was made for --engine distributed, which bench does not run (it runs plans in one process): "
           f"run it under torchrun, one process per stage, e.g. torchrun --nproc-per-node {stages}")
