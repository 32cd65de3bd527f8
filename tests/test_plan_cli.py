"""``python -m autopipe plan`` and ``show`` end to end, in process."""
from __future__ import annotations

import importlib.util

import pytest
from synthetic import make_profile

from autopipe.cli import main
from autopipe.planning.plans import Plan


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
