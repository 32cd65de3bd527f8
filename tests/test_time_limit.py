"""Planning within a time limit: the plan found and its lower bound bracket the optimum (brute
force), whatever point the search is stopped at; a finished search has gap 0."""
from __future__ import annotations

import math
import random

import numpy as np
import pytest
from synthetic import make_profile, random_profile, small_chain, small_hard
from helpers import StopAfter, brute_force, model_of

from autopipe.cli import main
from autopipe.errors import PlanningError
from autopipe.planning import interleaved, search
from autopipe.planning._budget import Budget
from autopipe.planning.plans import Plan
from autopipe.planning.solver import candidate_chunks, plan, solve_within


def instance(rng: random.Random):
    """Random ≤ 12 layers × 4 devices: per-pair copies with 0-3 skips, mixed speeds 1/1.5/2,
    a memory limit half the time."""
    profile, speeds = small_chain(rng, least_skips=0)
    model = model_of(profile, speeds)
    limits = np.full(len(speeds), math.inf)
    if rng.random() < 0.5:
        limits[:] = model.evaluate((0, model.layers), 1, "never").peak_memory * rng.uniform(0.3, 1.0)
    return model, candidate_chunks(profile.batch_size, profile.batch_sizes), limits


@pytest.mark.parametrize("seed", range(3))
def test_bounds_bracket_the_optimum_wherever_the_search_stops(seed: int) -> None:
    rng = random.Random(seed)
    for _ in range(8):
        model, chunks, limits = instance(rng)
        modes = ["never", "except_last"]
        expected = brute_force(model, chunks, modes, limits)
        finished = solve_within(model, chunks, modes, limits, Budget(None))
        assert finished.lower_bound == pytest.approx(expected, rel=1e-9)
        if math.isfinite(expected):
            assert finished.choice.iteration_ms == pytest.approx(expected, rel=1e-9)
        for calls in range(0, 10, 2):
            outcome = solve_within(model, chunks, modes, limits, StopAfter(calls))
            assert outcome.lower_bound <= expected * (1 + 1e-9)
            if outcome.choice is not None:
                assert outcome.choice.iteration_ms >= expected * (1 - 1e-9)


def test_interleaved_bound_brackets_its_optimum() -> None:
    rng = random.Random(7)
    for _ in range(10):
        model, chunks, limits = instance(rng)
        if model.layers < 4:
            continue
        modes = ["never", "except_last"]
        exact = interleaved.search(model, chunks, modes, limits, 2, None)
        best = math.inf if exact.choice is None else exact.choice.iteration_ms
        assert exact.lower_bound == pytest.approx(best, rel=1e-9)
        for calls in range(0, 30, 3):
            stopped = interleaved.search(model, chunks, modes, limits, 2, None, StopAfter(calls))
            assert stopped.lower_bound <= best * (1 + 1e-9)


def test_plan_records_bound_and_gap(tmp_path, capsys) -> None:
    profile = random_profile(random.Random(3), 16, 4, skips=3, per_pair=True, sizes=(1, 2, 4, 8))
    speeds = [1, 1.5, 2, 1]
    exact = plan(profile, speeds=speeds, time_limit=None, interleave=1)
    assert exact.predicted.gap == 0 and exact.predicted.lower_bound_ms == exact.predicted.iteration_ms
    rushed = plan(profile, speeds=speeds, time_limit=1e-6, interleave=1)
    assert rushed.predicted.lower_bound_ms <= exact.predicted.iteration_ms * (1 + 1e-9)
    assert rushed.predicted.iteration_ms >= exact.predicted.iteration_ms * (1 - 1e-9)
    path = rushed.save(tmp_path / "p.json")
    assert Plan.load(path).predicted == rushed.predicted
    profile_path = profile.save(tmp_path / "profile.json")
    assert main(["plan", str(profile_path), "--time-limit", "0", "--interleave", "1"]) == 0
    assert "gap 0.00% — optimal" in capsys.readouterr().out
    with pytest.raises(ValueError, match="time_limit must be a positive number"):
        plan(profile, time_limit=-1)


def test_small_hard_instances_are_solved_exactly() -> None:
    """≤ 12 layers × 4 devices with per-pair copies, skips and mixed speeds: the search
    finishes (gap 0) and the plan equals brute force.  That it finishes within the default one
    second is measured by ``examples/bench_planner.py --cases small``."""
    for profile, speeds in small_hard(random.Random(17)):
        chosen = plan(profile, speeds=speeds, interleave=1, time_limit=None)
        model = model_of(profile, speeds)
        expected = brute_force(model, candidate_chunks(profile.batch_size, profile.batch_sizes),
                               ["never", "except_last"], np.full(len(speeds), math.inf))
        assert chosen.predicted.gap == 0 and not chosen.options["time_limit_reached"]
        assert chosen.predicted.iteration_ms == pytest.approx(expected, rel=1e-9)


def test_a_search_that_would_outgrow_memory_stops_with_a_proven_bound(monkeypatch, tmp_path, capsys) -> None:
    """Per-pair copies with skips on many devices multiply the exact search's partial plans
    (tens of GB at 400 layers × 32 devices without a time limit).  Past its cap the search
    stops as if out of time: the plan and its bound still bracket the optimum, and the plan
    says why the gap is not 0."""
    profile = random_profile(random.Random(3), 16, 4, skips=3, per_pair=True, sizes=(1, 2, 4, 8))
    exact = plan(profile, time_limit=None, interleave=1)
    monkeypatch.setattr(search, "_MOST", 10)
    crowded = plan(profile, time_limit=None, interleave=1)
    assert crowded.options["memory_limit_reached"] and not crowded.options["time_limit_reached"]
    assert crowded.predicted.lower_bound_ms <= exact.predicted.iteration_ms * (1 + 1e-9)
    assert crowded.predicted.iteration_ms >= exact.predicted.iteration_ms * (1 - 1e-9)
    assert crowded.predicted.gap > 0
    assert main(["plan", str(profile.save(tmp_path / "profile.json")), "--time-limit", "0", "--interleave", "1",
                 "--replicas", "1"]) == 0
    assert "the exact search stopped where its partial plans would outgrow memory" in capsys.readouterr().out


def test_a_stage_of_the_exact_search_foreseen_to_end_past_the_limit_is_not_started(monkeypatch) -> None:
    """A stage of the exact DP prices millions of label-move pairs at the largest sizes (half a
    second at 150 layers x 8 devices with per-pair copies and skips, past a 0.5 s limit): one
    foreseen, at the slowest rate so far, to end past the limit is not started, and the plan
    says the limit was reached.  Here every row is foreseen to take a second (on an instance
    whose refined grids alone leave a gap)."""
    profile = random_profile(random.Random(6), 16, 4, skips=3, per_pair=True, sizes=(1, 2, 4, 8))
    speeds = [1, 1.5, 2, 1]
    exact = plan(profile, speeds=speeds, time_limit=None, interleave=1)
    started = []
    run = search.Search.run
    monkeypatch.setattr(search.Search, "run", lambda self: started.append(self) or run(self))
    monkeypatch.setattr(search, "_PER_ROW", 1.0)
    stopped = plan(profile, speeds=speeds, time_limit=60, interleave=1)
    assert started and not all(s.finished for s in started)
    assert stopped.options["time_limit_reached"] and stopped.predicted.gap > 0
    assert stopped.predicted.lower_bound_ms <= exact.predicted.iteration_ms * (1 + 1e-9)
    assert stopped.predicted.iteration_ms >= exact.predicted.iteration_ms * (1 - 1e-9)


def test_only_large_steps_of_the_exact_search_set_its_rate(monkeypatch) -> None:
    """A stage of the DP costs milliseconds whatever its size: a rate per row learned from small
    stages foresaw the large ones far too long and stopped searches that would have finished
    (per-pair copies at 100 x 8 left at a 0.65% gap instead of solved in 0.6 s).  Only steps of
    search._RATED rows or more set it."""
    profile = random_profile(random.Random(3), 16, 4, skips=3, per_pair=True, sizes=(1, 2, 4, 8))
    started = []
    run = search.Search.run
    monkeypatch.setattr(search.Search, "run", lambda self: started.append(self) or run(self))
    plan(profile, time_limit=None, interleave=1)
    assert started and all(not s.rates for s in started)
    monkeypatch.setattr(search, "_RATED", 1)
    started.clear()
    plan(profile, time_limit=None, interleave=1)
    assert any(s.rates.get("pairs", 0) > 0 and s.rates.get("moves", 0) > 0 for s in started)


def test_a_step_foreseen_too_long_leaves_the_time_to_shorter_ones() -> None:
    """Budget.fits, unlike Budget.out, records nothing: the solver skips a grid that would not
    fit and still builds and searches those that do."""
    budget = Budget(10.0)
    assert not budget.fits(20.0) and budget.fits(0.1) and not budget.spent
    assert budget.out(20.0) and not budget.fits(0.1)


def test_the_exact_search_counts_the_ways_to_commit_skips_before_it_lists_them(monkeypatch) -> None:
    """A stage that sends twelve skips, each to any of several consumer stages, has billions
    of ways to commit them (per-pair copies): the search stops as out of memory before it
    lists more commitments than its cap, instead of listing them all first (14 s here before,
    and hours at 40 layers × 16 devices, past any time limit)."""
    rng = random.Random(0)
    layers, devices = 24, 8
    skips = [(f"s{i}", i, layers - 1 - i % 3, 1000) for i in range(12)]
    copies = {(i, j): (rng.uniform(0, 2.0), rng.uniform(0, 1e-3))
              for i in range(devices) for j in range(devices) if i != j}
    profile = make_profile([rng.uniform(1, 2) for _ in range(layers)], devices=devices, skips=skips, copies=copies)
    monkeypatch.setattr(search, "_MOST", 100_000)
    listed = []
    sent = search.Search._sent

    def counted(self, *args):
        ways = sent(self, *args)
        listed.append(sum(len(entries) for _, entries in ways))
        return ways

    monkeypatch.setattr(search.Search, "_sent", counted)
    chosen = plan(profile, time_limit=None, interleave=1)
    assert listed and max(listed) <= search._MOST
    assert chosen.options["memory_limit_reached"] and chosen.predicted.gap > 0


def test_out_of_time_before_any_plan_fits_names_the_memory_limit_and_more_time() -> None:
    """A search stopped before it found a plan within the memory limits says they may be too
    small, and how to learn the smallest that fits; without a time limit it names that."""
    profile = make_profile([1.0] * 6, devices=3, param_bytes=1000)
    with pytest.raises(PlanningError, match=r"fits the memory limits \(10 bytes on every device\) was found within "
                                            r"time_limit=1e-09 s; they may be too small for any plan"):
        plan(profile, memory_limit=10, time_limit=1e-9)
    with pytest.raises(PlanningError, match=r"the smallest per-device memory limit that would fit is \d+ bytes"):
        plan(profile, memory_limit=10, time_limit=None)
    assert plan(profile, time_limit=1e-9).stages  # without memory limits, the first plan is kept


def test_every_exact_search_of_a_plan_call_foresees_its_steps_at_the_slowest_rate_seen(monkeypatch) -> None:
    """The searches of one plan() call run on one machine: each takes the slowest rate per row
    the ones before it saw (memory-limited moves at 300 layers x 4 devices took 8e-7 s a row,
    and a later search that foresaw its million rows at the prior 3e-7 ran past a 1.5 s limit)."""
    profile = random_profile(random.Random(3), 16, 4, skips=3, per_pair=True, sizes=(1, 2, 4, 8))
    seen = []
    run = search.Search.run
    monkeypatch.setattr(search.Search, "run", lambda self: seen.append(dict(self.rates)) or run(self))
    monkeypatch.setattr(search, "_RATED", 1)
    plan(profile, time_limit=60, interleave=1)
    assert len(seen) >= 2 and not seen[0] and all(rates.get("moves", 0) > 0 for rates in seen[1:])


def test_a_stage_prices_its_moves_a_block_at_a_time_and_finds_the_same_plan(monkeypatch) -> None:
    """A rate per row learned on other moves can be a third of a stage's own (memory-limited
    moves at 300 layers x 4 devices ran 0.6 s past a 1 s limit): a stage's moves are priced in
    blocks of search._RATED rows, the time checked before each; the plan is the same."""
    profile = random_profile(random.Random(3), 16, 4, skips=3, per_pair=True, sizes=(1, 2, 4, 8))
    whole = plan(profile, time_limit=None, interleave=1, memory_limit=2e6)
    priced = []
    original = search.Search._priced
    monkeypatch.setattr(search.Search, "_priced",
                        lambda self, *args: priced.append(len(args[-1])) or original(self, *args))
    monkeypatch.setattr(search, "_RATED", 5)
    blocks = plan(profile, time_limit=None, interleave=1, memory_limit=2e6)
    assert len(priced) > 20 and max(priced) <= 5
    assert blocks.predicted.iteration_ms == whole.predicted.iteration_ms and blocks.balance == whole.balance


def test_committing_skips_to_consumers_is_foreseen_before_the_ways_are_listed(monkeypatch) -> None:
    """Committing each skip a stage sends to a consumer multiplies its moves (millions of rows
    at 400 layers x 32 devices, listed for 2.6 s past a 3 s limit): the rows after committing
    are foreseen at their own rate before they are listed.  Here every such row is foreseen to
    take 1000 s, so none is listed and the search stops with a proven bound."""
    profile = random_profile(random.Random(3), 16, 4, skips=3, per_pair=True, sizes=(1, 2, 4, 8))
    exact = plan(profile, time_limit=None, interleave=1)
    started, listed = [], []
    init, keys_after = search.Search.__init__, search.Search._keys_after

    def slow_commits(self, *args, **kwargs):
        init(self, *args, **kwargs)
        self.rates["commits"] = 1000.0
        started.append(self)

    monkeypatch.setattr(search.Search, "__init__", slow_commits)
    monkeypatch.setattr(search.Search, "_keys_after",
                        lambda self, *args: listed.append(len(args[2])) or keys_after(self, *args))
    stopped = plan(profile, time_limit=60, interleave=1)
    assert started and not any(s.finished for s in started) and not any(listed)
    assert stopped.options["time_limit_reached"] and stopped.predicted.gap > 0
    assert stopped.predicted.lower_bound_ms <= exact.predicted.iteration_ms * (1 + 1e-9)
    assert stopped.predicted.iteration_ms >= exact.predicted.iteration_ms * (1 - 1e-9)


def test_the_dominance_tests_of_a_stage_check_the_time_between_batches(monkeypatch) -> None:
    """The label pairs compared for dominance grow as the square of a state's labels (3 s past
    a 3 s limit at 400 layers x 32 devices, with no check between): the time is checked before
    each batch of search._PAIRS pairs, so a time limit that runs out during them stops the
    search at the next batch, with a bound that holds."""
    profile = random_profile(random.Random(3), 16, 4, skips=3, per_pair=True, sizes=(1, 2, 4, 8))
    model = model_of(profile, [1.0] * 4)
    chunks, modes, limits = candidate_chunks(profile.batch_size, profile.batch_sizes), ["never"], np.full(4, math.inf)
    exact = solve_within(model, chunks, modes, limits, Budget(None)).choice
    monkeypatch.setattr(search, "_PAIRS", 1)
    budget, batches = Budget(60), []
    dominated = search._dominated

    def checked(labels, m, check_time):
        def batch():
            batches.append(1)
            if len(batches) == 3:
                budget.end = 0.0  # the time runs out during the third batch
            check_time()
        return dominated(labels, m, batch)

    monkeypatch.setattr(search, "_dominated", checked)
    outcome = solve_within(model, chunks, modes, limits, budget)
    assert len(batches) == 3 and budget.spent
    assert outcome.lower_bound <= exact.iteration_ms * (1 + 1e-9)
    assert outcome.choice is None or outcome.choice.iteration_ms >= exact.iteration_ms * (1 - 1e-9)


def test_out_of_time_with_no_plan_searches_no_more_device_orders(monkeypatch) -> None:
    """``placement="search"`` tries device orders while the time lasts, also when none has found
    a plan that fits yet: with memory limits no plan fits and no time left after the first
    order, the search stops there (not after all 120 orders of 5 devices)."""
    from autopipe.planning import solver

    searched = []
    search_all = solver._search_all
    monkeypatch.setattr(solver, "_search_all", lambda *args, **kwargs: searched.append(1) or search_all(*args,
                                                                                                        **kwargs))
    profile = random_profile(random.Random(1), 12, 5, skips=2, per_pair=True)
    with pytest.raises(PlanningError, match="was found within time_limit"):
        plan(profile, speeds=[1, 2, 1.5, 0.5, 1], memory_limit=1000, placement="search", interleave=1,
             time_limit=1e-9)
    assert len(searched) == 1


def test_chain_bounds_of_mixed_speeds_stop_pricing_counts_when_the_time_is_up() -> None:
    """With mixed speeds every stage count gets its own grid of caps (at 1,000 layers x 64
    devices, 63 of them took 1.2 s of a 1 s limit): once the time is up the counts left keep
    the bound that needs no DP, which is no larger than their priced one, and give no split."""
    from autopipe.planning._chain import Chains

    rng = random.Random(3)
    profile = random_profile(rng, 40, 6, per_pair=False)
    model = model_of(profile, [1.0, 1.5, 2.0, 1.0, 1.5, 2.0])
    counts = [4, 6, 8, 10, 12]
    priced = Chains(model, 4, "never", 2, model.speeds).bound(counts, math.inf)
    chains = Chains(model, 4, "never", 2, model.speeds)
    stopped = chains.bound(counts, math.inf, StopAfter(1))
    assert [n for n in counts if chains.bounds[n].priced] == [12]  # the most stages first
    for n in counts:
        assert stopped[n] <= priced[n] * (1 + 1e-9)
        assert (chains.split(n) is None) == (n != 12)


def test_interleave_auto_leaves_the_interleaved_search_its_share_of_the_time(monkeypatch) -> None:
    """With ``interleave="auto"`` a fill-drain search that would use the whole limit gets half
    of it: the interleaved search after it still has the other half (with none it found no
    plan, and a 2.7% faster one was missed at 1,000 layers x 64 devices)."""
    import time

    from autopipe.planning import solver

    exact = solver.solve_within

    def greedy(model, candidates, modes, limits, budget, incumbent=None):
        outcome = exact(model, candidates, modes, limits, Budget(None), incumbent)
        while not budget.out():  # a search that takes all the time it is given
            time.sleep(0.005)
        return outcome

    given = []
    search_interleaved = interleaved.search

    def timed(*args):
        given.append(args[-1].end - time.perf_counter())
        return search_interleaved(*args)

    monkeypatch.setattr(solver, "solve_within", greedy)
    monkeypatch.setattr(interleaved, "search", timed)
    chosen = plan(random_profile(random.Random(2), 12, 3), time_limit=0.8)
    assert len(given) == 1 and given[0] > 0.25
    assert chosen.options["time_limit_reached"]


def test_a_simulation_foreseen_to_end_past_the_limit_is_not_started(monkeypatch) -> None:
    """The interleaved search simulates every micro-batch on every stage: at 16,384 of them a
    simulation took 2.4 s past a 0.3 s limit.  One is foreseen from its size (micro-batches x
    stages) at the slowest rate per unit so far, or interleaved.SIMULATED before any: here a
    second per unit, so the search under interleave="auto" simulates nothing and says the limit
    was reached, while the fill-drain plan stands."""
    profile = make_profile([1.0, 2.0, 3.0, 4.0, 5.0, 6.0], sizes=(1, 2, 4), batch_size=8, devices=2)
    simulated = []
    timed = interleaved.timed
    monkeypatch.setattr(interleaved, "timed", lambda *args, **kw: simulated.append(args) or timed(*args, **kw))
    assert plan(profile, interleave=2, time_limit=None).interleave == 2 and simulated  # the search simulates
    simulated.clear()
    monkeypatch.setattr(interleaved, "SIMULATED", 1.0)
    chosen = plan(profile, interleave="auto", time_limit=5.0)
    assert not simulated and chosen.interleave == 1 and chosen.options["time_limit_reached"]


def test_a_step_is_foreseen_per_unit_of_its_size() -> None:
    budget = Budget(10.0)
    with budget.step("simulation", 1000):
        pass
    rate = budget.slowest["simulation"]
    assert not budget.before("simulation", size=1000) and budget.before("simulation", size=20.0 / max(rate, 1e-12))
