"""``python -m autopipe plan`` and ``show`` end to end, in process."""
from __future__ import annotations

import importlib.util
import math
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from synthetic import make_profile

from autopipe.cli import main
from autopipe.cli.plan import summary
from autopipe.errors import OptionError
from autopipe.planning._options import parse_bytes
from autopipe.planning.compare import compare
from autopipe.planning.cost import CostModel
from autopipe.planning.plans import Plan
from autopipe.planning.replicas import plan
from autopipe.planning.simulate import evaluate


@pytest.fixture
def profile_path(tmp_path):
    profile = make_profile([4.0, 4.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0], sizes=(1, 2, 4, 8), devices=2,
                           output_bytes=[10, 10, 10, 10, 10, 10, 10, 10], param_bytes=[0, 0, 0, 0, 0, 0, 0, 10**6],
                           copies=(0.05, 1e-5))
    return profile.save(tmp_path / "profiles" / "p.json")


def test_plan_writes_the_plan_and_compares(profile_path, tmp_path, capsys):
    out = tmp_path / "plans" / "p.json"
    assert main(["plan", str(profile_path), "--devices", "cpu,cpu", "--memory-limit", "1GiB",
                 "--checkpoint", "never", "-o", str(out), "--compare"]) == 0
    text = capsys.readouterr().out
    chosen = Plan.load(out)
    assert f"balance:       {chosen.balance}" in text
    assert "ours (autopipe)" in text and "1.00x" in text
    for name in ("equal layers", "parameter-balanced", "time min-max, no copies"):
        assert name in text
    # equal layers [4, 4] is worse here: the two slow layers are both in the first half
    equal = next(line for line in text.splitlines() if line.startswith("equal layers"))
    assert "[4,4]" in equal and float(equal.split()[4].rstrip("x")) > 1.0


def test_plan_options_reach_the_solver(profile_path, tmp_path, capsys):
    out = tmp_path / "p.json"
    assert main(["plan", str(profile_path), "--devices", "2", "--chunks", "4", "--speeds", "1,2",
                 "--batch-size", "8", "-o", str(out)]) == 0
    chosen = Plan.load(out)
    assert chosen.chunks == 4 and chosen.options["speeds"] == [1.0, 2.0]
    assert main(["plan", str(profile_path), "--engine", "distributed", "--batch-size", "6", "-o", str(out)]) == 0
    assert "engine: distributed" in capsys.readouterr().out
    chosen = Plan.load(out)
    assert chosen.options["engine"] == "distributed" and 6 % chosen.chunks == 0


def test_show_prints_stages_and_timeline(profile_path, tmp_path, capsys):
    out = tmp_path / "p.json"
    main(["plan", str(profile_path), "--chunks", "4", "-o", str(out)])
    capsys.readouterr()
    assert main(["show", str(out), "--width", "40"]) == 0
    text = capsys.readouterr().out
    chosen = Plan.load(out)
    assert f"predicted iteration {chosen.predicted.iteration_ms:.2f} ms" in text
    rows = [line for line in text.splitlines() if line.startswith("stage ") and "compute" in line]
    assert len(rows) == len(chosen.stages) and all(len(r.split("|")[1]) == 40 for r in rows)
    if len(chosen.stages) > 1:
        assert "." in rows[-1].split("|")[1]  # the last stage waits for the first: a bubble
    for stage in chosen.stages:  # each stage's largest memory term, named with its share
        name, share = stage.dominant_memory()
        assert sum(stage.memory_terms.values()) == pytest.approx(stage.memory_bytes, abs=len(stage.memory_terms))
        assert stage.memory_terms[name] == max(stage.memory_terms.values())
        assert f"{name} ({share:.0%})" in text


def test_png_needs_matplotlib_or_draws(profile_path, tmp_path, capsys):
    out = tmp_path / "p.json"
    main(["plan", str(profile_path), "-o", str(out)])
    code = main(["show", str(out), "--png", str(tmp_path / "t.png")])
    if importlib.util.find_spec("matplotlib") is None:
        assert code == 2 and "pip install 'autopipe[plot]'" in capsys.readouterr().err
    else:
        assert code == 0 and (tmp_path / "t.png").stat().st_size > 0


def test_errors_are_one_line_with_status_2(profile_path, tmp_path, capsys):
    assert main(["plan", str(tmp_path / "missing.json")]) == 2
    assert "no such profile file" in capsys.readouterr().err
    assert main(["plan", str(profile_path), "--memory-limit", "1KB"]) == 2
    assert "smallest per-device memory limit that would fit" in capsys.readouterr().err
    assert main(["plan", str(profile_path), "--memory-limit", "lots"]) == 2
    assert "cannot read 'lots' as a memory size" in capsys.readouterr().err


def test_png_is_written_atomically_and_never_over_the_plan(profile_path, tmp_path, capsys):
    from types import SimpleNamespace

    from autopipe.cli.show import draw_png
    from autopipe.timeline import Event

    written = []
    figure = SimpleNamespace(tight_layout=lambda: None,
                             savefig=lambda handle, format: written.append(format) or handle.write(b"png"))
    axes = SimpleNamespace(barh=lambda *a, **k: None, set_yticks=lambda *a: None, invert_yaxis=lambda: None,
                           set_xlabel=lambda *a: None)
    plt = SimpleNamespace(subplots=lambda figsize: (figure, axes), close=lambda f: None)
    out = tmp_path / "new" / "t.png"
    assert draw_png(plt, [Event(0, "compute", "F", 0, 0.0, 1.0)], out) == out
    assert out.read_bytes() == b"png" and written == ["png"] and [p.name for p in out.parent.iterdir()] == ["t.png"]

    plan_path = tmp_path / "p.json"
    main(["plan", str(profile_path), "-o", str(plan_path)])
    before = plan_path.read_bytes()
    capsys.readouterr()
    assert main(["show", str(plan_path), "--png", str(plan_path)]) == 2
    assert "is the input file" in capsys.readouterr().err and plan_path.read_bytes() == before


def test_compare_prices_the_baselines_under_the_plans_schedule():
    """A 1F1B plan's baselines are priced under 1F1B too (by the simulator, as the plan is), so
    each ratio is that of the split alone, not of fill-drain against 1F1B."""
    profile = make_profile([3.0, 1.0, 1.0, 2.0, 1.0, 1.0, 4.0, 1.0, 1.0, 1.0, 2.0, 1.0, 1.0], sizes=(1, 2, 4, 8, 16),
                           devices=4, output_bytes=1000, param_bytes=[10**6 * (i % 3) for i in range(13)],
                           copies=(0.05, 1e-5))
    chosen = plan(profile, 4, replicas=1, schedule="1f1b", chunks=8, interleave=1)
    assert chosen.schedule == "1f1b"
    model = CostModel(profile, chosen.options["devices"], chosen.options["speeds"], chosen.batch_size,
                      chosen.options["optimizer_state"])
    rows = compare(profile, chosen)
    for row in rows[1:]:
        bounds = [0, *np.cumsum(row.balance).tolist()]
        priced = evaluate(model, bounds, row.chunks, chosen.checkpoint, "1f1b")
        assert row.iteration_ms == pytest.approx(priced.iteration_ms)
        assert row.ratio == pytest.approx(priced.iteration_ms / chosen.predicted.iteration_ms)
    fill_drain = model.evaluate([0, *np.cumsum(rows[1].balance).tolist()], 8, chosen.checkpoint).iteration_ms
    assert rows[1].iteration_ms < fill_drain  # the schedule matters here: the test tells them apart


def test_compare_prices_the_baselines_memory_for_the_plans_optimizer():
    """Under SGD with momentum (the default) a baseline's memory is what the plan's would be for
    the same split: it was priced for the most any optimizer's step allocates, and a split
    that fits was listed as exceeding the limit the plan fits."""
    profile = make_profile([1.0] * 4, sizes=(1, 2, 4, 8), devices=2, output_bytes=10, saved_bytes=10,
                           param_bytes=[100_000, 1000, 1000, 100_000])
    limit = 450_000
    chosen = plan(profile, replicas=1, memory_limit=limit, time_limit=None, interleave=1, chunks=8)
    model = CostModel(profile, chosen.options["devices"], chosen.options["speeds"], chosen.batch_size, "momentum")
    rows = compare(profile, chosen)
    assert rows[0].fits and any(row.balance == chosen.balance for row in rows[1:])
    for row in rows[1:]:
        stages = model.evaluate([0, *np.cumsum(row.balance).tolist()], row.chunks, chosen.checkpoint).stages
        assert row.fits == all(stage.memory <= limit for stage in stages)


@pytest.mark.parametrize("speeds, words", [
    ("5e-324,1", "speeds must be 2 finite positive numbers (one per device, each at least 2.23e-308)"),
    ("1e-300,1", "speeds [1e-300, 1.0] make the fastest device 1e+300 times the slowest; give speeds within a "
                 "factor of 1,000,000"),
])
def test_speeds_are_normal_numbers_within_a_ratio(profile_path, capsys, speeds, words):
    """A denormal speed (or one a million times another) made the predicted time nan, the bound
    inf and the plan 'optimal'; the API and the command line refuse it alike."""
    with pytest.raises(OptionError) as caught:
        plan(profile_path, 2, speeds=[float(v) for v in speeds.split(",")])
    assert words in str(caught.value)
    assert main(["plan", str(profile_path), "--devices", "2", "--speeds", speeds]) == 2
    assert "error: " + words.replace("speeds", "--speeds") in capsys.readouterr().err


@pytest.mark.parametrize("factor", [math.inf, 1e308, 1001, -1, math.nan])
def test_an_optimizer_state_factor_is_finite_and_at_most_1000(profile_path, capsys, factor):
    with pytest.raises(OptionError, match="optimizer_state must be one of .* or a number from 0 to 1000"):
        plan(profile_path, 2, optimizer_state=factor)
    assert main(["plan", str(profile_path), "--optimizer-state", str(factor)]) == 2
    assert "error: --optimizer-state must be one of" in capsys.readouterr().err


def test_memory_limits_are_finite_whole_bytes(profile_path, capsys):
    """``1e400`` is refused as ``inf`` is (it silently meant no limit), and ``1.5B`` rather than
    planned as 1.5 bytes and reported as 1."""
    for limit in ("1e400", "inf"):
        assert main(["plan", str(profile_path), "--memory-limit", limit]) == 2
        assert f"error: --memory-limit '{limit}' is not a finite size" in capsys.readouterr().err
    assert main(["plan", str(profile_path), "--memory-limit", "1.5B"]) == 2
    assert "'1.5B' is 1.5 bytes, not a whole number; give whole bytes (e.g. 1 or 2)" in capsys.readouterr().err
    assert [parse_bytes(text) for text in ("0.3GB", "1.5KiB", "7")] == [3e8, 1536.0, 7.0]
    assert [parse_bytes(number) for number in (math.inf, 2.5)] == [math.inf, 2.5]  # the API's numbers, as given


def test_errors_name_the_options_not_the_api_parameters(profile_path, capsys):
    assert main(["plan", str(profile_path), "--time-limit", "-1"]) == 2
    assert "error: --time-limit must be a positive number of seconds (finite; 0 for no limit)" in \
        capsys.readouterr().err
    assert main(["plan", str(profile_path), "--memory-limit", "1KB", "--time-limit", "0", "--replicas", "1"]) == 2
    err = capsys.readouterr().err
    assert "raise --memory-limit" in err and "--checkpoint " in err and "memory_limit" not in err, err


def test_a_gap_of_rounding_is_reported_optimal(profile_path):
    chosen = plan(profile_path, 2, replicas=1)
    chosen.predicted = replace(chosen.predicted, lower_bound_ms=chosen.predicted.iteration_ms * (1 - 2e-8))
    assert chosen.predicted.gap and "optimal (search finished)" in summary(chosen)


def test_a_closed_stdout_keeps_the_plan_and_ends_quietly(profile_path, tmp_path):
    """The plan is written before anything is printed; a reader gone (``| head``) ends the
    command with status 1 and no traceback, buffered output or not."""
    for unbuffered in ("1", ""):
        out = tmp_path / f"plan{unbuffered}.json"
        read, write = os.pipe()
        os.close(read)
        env = {**os.environ, "PYTHONUNBUFFERED": unbuffered, "PYTHONPATH": str(Path(__file__).parents[1])}
        try:
            done = subprocess.run([sys.executable, "-m", "autopipe", "plan", str(profile_path), "-o", str(out)],
                                  stdout=write, stderr=subprocess.PIPE, text=True, env=env, timeout=120)
        finally:
            os.close(write)
        assert (done.returncode, done.stderr) == (1, "")
        assert Plan.load(out).stages


@pytest.mark.parametrize("option", ["--chunks", "--replicas", "--interleave"])
def test_a_count_the_planner_refuses_is_named_as_the_option(profile_path, capsys, option):
    """``--chunks 0`` said ``chunks must be a positive integer``: the planner's parameter, not
    the option the user typed; every such check now names the option."""
    assert main(["plan", str(profile_path), option, "0"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"autopipe plan: error: {option} must be ") and err.endswith(", got 0\n"), err


def test_show_refuses_a_width_too_narrow_for_its_axis_labels(profile_path, tmp_path, capsys):
    """``--width 5`` drew the end time's label over the ``0`` of the axis: a width below the
    label's length is refused naming the least, which draws the two apart."""
    out = tmp_path / "p.json"
    main(["plan", str(profile_path), "-o", str(out)])
    capsys.readouterr()
    assert main(["show", str(out)]) == 0
    end = " ".join(capsys.readouterr().out.splitlines()[-1].split()[1:])  # e.g. "12.3 ms"
    assert main(["show", str(out), "--width", str(len(end) - 1)]) == 2
    out_text, err = capsys.readouterr()
    assert out_text == "" and err == (f"autopipe show: error: --width {len(end) - 1} is too narrow for the "
                                      f"timeline's axis labels (0 and {end}): give at least --width {len(end)}\n")
    assert main(["show", str(out), "--width", str(len(end))]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == f"{'':17}0 {end}"
