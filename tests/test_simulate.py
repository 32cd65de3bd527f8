"""The event simulator against the closed form, and the text timeline."""
from __future__ import annotations

import random

import pytest

from autopipe.planning.cost import StageLanes, phase_makespan
from autopipe.planning.simulate import simulate
from autopipe.timeline import render


def random_stages(rng: random.Random, count: int, chunks: int, mode: str) -> list[StageLanes]:
    stages = []
    for _ in range(count):
        forward = rng.choice([0.0, rng.uniform(0, 5)])
        recompute = 0.0 if mode == "never" or mode == "except_last" and chunks == 1 else forward
        stages.append(StageLanes(forward, rng.uniform(0, 8), recompute, rng.choice([0.0, rng.uniform(0, 4)]),
                                 rng.choice([0.0, rng.uniform(0, 4)]), 0.0))
    return stages


@pytest.mark.parametrize("mode", ["never", "except_last", "always"])
def test_closed_form_equals_simulator(mode):
    rng = random.Random(mode)
    for _ in range(300):
        chunks = rng.randint(1, 8)
        stages = random_stages(rng, rng.randint(1, 6), chunks, mode)
        forward, backward = phase_makespan(stages, chunks, mode)
        simulation = simulate(stages, chunks, mode)
        assert simulation.forward_ms == pytest.approx(forward, abs=1e-9)
        assert simulation.backward_ms == pytest.approx(backward, abs=1e-9)


def test_simulated_events_by_hand():
    stages = [StageLanes(2.0, 4.0, 0.0, 0.0, 1.0, 0.0), StageLanes(3.0, 6.0, 0.0, 1.0, 0.0, 0.0)]
    events = simulate(stages, 2, "never").events
    table = {(e.stage, e.kind, e.micro_batch): (e.start_ms, e.end_ms) for e in events}
    assert table[(0, "F", 0)] == (0.0, 2.0) and table[(0, "F", 1)] == (2.0, 4.0)
    assert table[(1, "C", 0)] == (2.0, 3.0) and table[(1, "C", 1)] == (4.0, 5.0)
    assert table[(1, "F", 0)] == (3.0, 6.0) and table[(1, "F", 1)] == (6.0, 9.0)
    # backward starts at 9 with the last micro-batch
    assert table[(1, "B", 1)] == (9.0, 15.0) and table[(0, "G", 1)] == (15.0, 16.0)
    assert table[(0, "B", 1)] == (16.0, 20.0) and table[(1, "B", 0)] == (15.0, 21.0)
    assert table[(0, "G", 0)] == (21.0, 22.0) and table[(0, "B", 0)] == (22.0, 26.0)


def test_except_last_skips_recomputing_the_first_backward():
    stages = [StageLanes(2.0, 4.0, 2.0, 0.0, 0.0, 0.0)]
    events = [e for e in simulate(stages, 3, "except_last").events if e.kind == "B"]
    assert [(e.micro_batch, e.duration_ms) for e in events] == [(2, 4.0), (1, 6.0), (0, 6.0)]


def test_text_timeline_shows_bubbles_and_micro_batches():
    stages = [StageLanes(2.0, 4.0, 0.0, 0.0, 0.0, 0.0), StageLanes(2.0, 4.0, 0.0, 0.0, 0.0, 0.0)]
    text = render(simulate(stages, 2, "never").events, width=18)
    rows = text.splitlines()
    # 1 ms per column: stage 0 idles while stage 1 works (bubbles), micro-batches alternate case
    assert rows[0].split("|")[1] == "FFff......bbbbBBBB"
    assert rows[1].split("|")[1] == "..FFffbbbbBBBB...."
    assert rows[-1].strip().endswith("18.0 ms")
