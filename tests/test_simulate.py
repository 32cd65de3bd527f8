"""The event simulator against the closed form, and the text timeline."""
from __future__ import annotations

import random

import pytest

from autopipe.planning.cost import StageLanes, phase_makespan
from autopipe.planning.schedules import GRADIENT_WINDOW
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
    """One stage per device, fill-drain, any copies: the runtime's gradient window (three) never
    holds a backward back beyond the flow shop's own waits."""
    rng = random.Random(mode)
    for _ in range(300):
        chunks = rng.randint(1, 8)
        stages = random_stages(rng, rng.randint(1, 6), chunks, mode)
        forward, backward = phase_makespan(stages, chunks, mode)
        simulation = simulate(stages, chunks, mode)
        assert simulation.forward_ms == pytest.approx(forward, abs=1e-9)
        assert simulation.backward_ms == pytest.approx(backward, abs=1e-9)


def test_a_window_of_two_would_delay_a_gradient_copy_by_hand():
    """Backwards of 2 ms on both stages, the gradient's copy 2 ms, four micro-batches (no
    forward work).  Without a window: stage 1 runs B3 B2 B1 B0 from 0 to 8, each copy follows,
    stage 0 runs B3 at 4 ... B0 until 12.  With two: stage 1's B1 waits for stage 0's B3
    (ends at 6), B0 for its B2 (8), so stage 0 ends at 14.  With three (the runtime's) B0 waits
    for stage 0's B3 (6), which it passes anyway: 12."""
    stages = [StageLanes(0.0, 2.0, 0.0, 0.0, 2.0, 0.0), StageLanes(0.0, 2.0, 0.0, 0.0, 0.0, 0.0)]
    times = {window: simulate(stages, 4, "never", window=window).iteration_ms for window in (None, 2, 3)}
    assert times == {None: pytest.approx(12.0), 2: pytest.approx(14.0), 3: pytest.approx(12.0)}
    events = simulate(stages, 4, "never", window=2).events
    starts = {(e.stage, e.kind, e.micro_batch): e.start_ms for e in events}
    assert starts[(1, "B", 1)] == pytest.approx(6.0) and starts[(1, "B", 0)] == pytest.approx(8.0)
    assert simulate(stages, 4, "never").iteration_ms == times[GRADIENT_WINDOW]


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_no_backward_starts_before_its_credit(schedule):
    """Random lanes, stages sharing devices, either turn rule: stage ``s``'s ``k``-th backward
    starts after stage ``s - 1``'s ``(k - W)``-th ends (the runtime's backpressure, which also
    makes these plans slower than without it, sometimes)."""
    rng = random.Random(schedule)
    slower = 0
    for _ in range(150):
        chunks, count = rng.randint(1, 8), 2 * rng.randint(1, 3)
        stages = random_stages(rng, count, chunks, "never")
        placement = [s % (count // 2) for s in range(count)]
        turns = rng.choice(["depth_first", "breadth_first"])
        simulation = simulate(stages, chunks, "never", placement, schedule, turns)
        backwards = {s: sorted((e.start_ms, e.end_ms) for e in simulation.events if e.stage == s and e.kind == "B")
                     for s in range(count)}
        for s in range(1, count):
            for k in range(GRADIENT_WINDOW, len(backwards[s])):
                assert backwards[s][k][0] >= backwards[s - 1][k - GRADIENT_WINDOW][1] - 1e-9
        free = simulate(stages, chunks, "never", placement, schedule, turns, window=None)
        slower += simulation.iteration_ms > free.iteration_ms + 1e-9
    assert slower > 0


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


# -- 1F1B --------------------------------------------------------------------------------

def test_1f1b_equal_stages_takes_as_long_as_fill_drain():
    """Equal stages: both schedules take (m + S - 1)(F + B)."""
    stages = [StageLanes(1.0, 2.0, 0.0, 0.0, 0.0, 0.0)] * 3
    for chunks in (1, 2, 4, 7):
        expected = (chunks + 2) * 3.0
        assert simulate(stages, chunks, "never", schedule="1f1b").iteration_ms == pytest.approx(expected)
        assert simulate(stages, chunks, "never").iteration_ms == pytest.approx(expected)


def test_1f1b_events_by_hand():
    """Two stages, F=1, B=2, three micro-batches: stage 0 runs F0 F1 B0 F2 B1 B2."""
    stages = [StageLanes(1.0, 2.0, 0.0, 0.0, 0.0, 0.0)] * 2
    events = simulate(stages, 3, "never", schedule="1f1b").events
    rows = {s: [(e.kind, e.micro_batch, e.start_ms) for e in sorted(events, key=lambda e: e.start_ms)
                if e.stage == s] for s in (0, 1)}
    assert rows[0] == [("F", 0, 0.0), ("F", 1, 1.0), ("B", 0, 4.0), ("F", 2, 6.0), ("B", 1, 7.0), ("B", 2, 10.0)]
    assert rows[1] == [("F", 0, 1.0), ("B", 0, 2.0), ("F", 1, 4.0), ("B", 1, 5.0), ("F", 2, 7.0), ("B", 2, 8.0)]


@pytest.mark.parametrize("mode", ["never", "except_last", "always"])
def test_1f1b_respects_every_dependency(mode):
    """Random lanes and placements: every task starts after its input and its worker's previous
    task, no device runs two tasks at once, and the time is at least the busiest device's work."""
    rng = random.Random(mode)
    for _ in range(100):
        chunks = rng.randint(1, 6)
        count = rng.randint(1, 5)
        stages = random_stages(rng, count, chunks, mode)
        devices = rng.randint(1, count)
        where = [s % devices for s in range(count)]
        simulation = simulate(stages, chunks, mode, where, schedule="1f1b")
        at = {(e.stage, e.kind, e.micro_batch): e for e in simulation.events}
        for e in simulation.events:
            needs = {"F": (e.stage, "C"), "B": (e.stage, "G"), "C": (e.stage - 1, "F"), "G": (e.stage + 1, "B")}
            before = at.get((*needs[e.kind], e.micro_batch))
            assert before is None or before.end_ms <= e.start_ms + 1e-9
        for device in range(devices):
            busy = sorted((e.start_ms, e.end_ms) for e in simulation.events
                          if e.lane == "compute" and where[e.stage] == device)
            assert all(a[1] <= b[0] + 1e-9 for a, b in zip(busy, busy[1:]))
            assert simulation.iteration_ms >= sum(end - start for start, end in busy) - 1e-9


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_pricing_a_split_keeps_no_timeline_and_gives_the_same_times(schedule):
    """The searches price splits without the events (``timeline=False``): the same phase
    lengths, for stages sharing devices under either turn rule too."""
    rng = random.Random(schedule)
    for _ in range(100):
        chunks, count = rng.randint(1, 8), 2 * rng.randint(1, 4)
        stages = random_stages(rng, count, chunks, "never")
        placement = [s % (count // 2) for s in range(count)] if rng.random() < 0.5 else None
        turns = rng.choice(["depth_first", "breadth_first"])
        full = simulate(stages, chunks, "never", placement, schedule, turns)
        priced = simulate(stages, chunks, "never", placement, schedule, turns, timeline=False)
        assert priced.events == [] and (priced.forward_ms, priced.backward_ms) == (full.forward_ms, full.backward_ms)
        assert full.events or full.iteration_ms == 0
