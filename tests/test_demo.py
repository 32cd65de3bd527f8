"""``demo --quick``: every step of the README's main job runs and reports, in order."""
from __future__ import annotations

import pytest

from autopipe.cli import main


@pytest.mark.slow
def test_quick_demo_profiles_plans_trains_and_compares(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["demo", "--quick", "--devices", "cpu,cpu"]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    steps = ["autopipe demo: torchvision:resnet18, batch 4 of 3x64x64, on cpu, cpu", "1. profiled 15 layers",
             "2. planned in", "3. trained 2 steps", "predicted timeline:", "measured timeline (last step):",
             "4. predicted against measured:", "demo done in"]
    found = [next(i for i, line in enumerate(lines) if line.startswith(step)) for step in steps]
    assert found == sorted(found), "the demo's steps are out of order"

    planned = lines[found[2]]
    balance = [int(n) for n in planned.split("balance [")[1].split("]")[0].split(",")]
    assert sum(balance) == 15
    table = lines[found[6] + 1:found[7]]
    assert table[0].startswith(f"{len(balance)} stage")
    assert sum(line.startswith("#") for line in table) == len(balance)
    assert any(line.startswith("iteration ") for line in table)
    assert "speedup" in table[-2]
    losses = lines[found[3]].split("losses ")[1].split(", ")
    assert len(losses) == 2 and all(float(loss) > 0 for loss in losses)
