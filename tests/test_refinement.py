"""Best-first refinement of lane-cap cells: each cell bounds every plan whose lanes lie in it,
halving covers a cell exactly, and the refined bound is sound and tight where the relaxation is."""
from __future__ import annotations

import math
import random

import numpy as np
import pytest
from helpers import all_splits, model_of
from synthetic import random_profile

from autopipe.planning._budget import Budget
from autopipe.planning.candidates import Candidate, Choice
from autopipe.planning.completion import Completions, grid_levels
from autopipe.planning.refinement import Cells, refine


def lanes_of(model, bounds, chunks, mode):
    """A split's time and its largest forward and backward lanes (as the search counts them)."""
    evaluation = model.evaluate(bounds, chunks, mode)
    x = max(max(s.forward, s.copy_in) for s in evaluation.stages)
    y = max(max(s.backward + s.recompute, s.copy_grad) for s in evaluation.stages)
    return evaluation.iteration_ms, x, y


@pytest.mark.parametrize("skips", [False, True])
@pytest.mark.parametrize("seed", range(3))
def test_a_cell_bounds_every_plan_whose_lanes_lie_in_it(seed: int, skips: bool) -> None:
    """Also when each stage is charged the least its device pays to receive the skips it pops
    (which then raises some bounds)."""
    rng = random.Random(seed)
    raised = 0
    for _ in range(10):
        layers, devices = rng.randint(2, 8), rng.randint(1, 4)
        profile = random_profile(rng, layers, devices, skips=rng.randint(0, 3), per_pair=rng.random() < 0.7)
        model = model_of(profile, [rng.choice([0.5, 1.0, 2.0]) for _ in range(devices)])
        chunks, mode = rng.choice([1, 2, 4, 8]), rng.choice(["never", "except_last", "always"])
        candidate = Candidate.of(model, chunks, mode, devices)
        grid = Completions.grid(candidate, model.speeds[:devices],
                                *grid_levels(candidate, devices, (math.inf, math.inf), None), skips=skips)
        plain = Completions.grid(candidate, model.speeds[:devices],
                                 *grid_levels(candidate, devices, (math.inf, math.inf), None))
        assert np.all(grid.cell_bounds() >= plain.cell_bounds() - 1e-9)
        raised += int(np.any(grid.cell_bounds() > plain.cell_bounds() + 1e-9))
        cells = Cells.of(grid)
        for _ in range(3):  # halve a few times, then check every cell left and its halves
            halves = cells.halves(1e3)
            if halves is None:
                break
            cells.add(Completions(candidate, model.speeds[:devices], halves.cells, skips=skips,
                                  ), halves.bounds)
        for bounds in all_splits(layers, devices):
            time, x, y = lanes_of(model, bounds, chunks, candidate.effective)
            floor_x, floor_y = candidate.floors  # the lowest cells hold their floor too
            inside = ((cells.low_x < x) | np.isclose(cells.low_x, floor_x)) & (x <= cells.cap_x * (1 + 1e-9))
            inside &= ((cells.low_y < y) | np.isclose(cells.low_y, floor_y)) & (y <= cells.cap_y * (1 + 1e-9))
            assert np.all(cells.bound[inside] <= time * (1 + 1e-9))
    assert raised > 0 or not skips


def test_halves_cover_their_cell_exactly() -> None:
    """A cell is cut in two along the lane of larger weighted width: the halves share the other
    lane's span and meet where the cut is; a cell with an open cap is cut at twice its floor."""
    model = model_of(random_profile(random.Random(3), 6, 3), [1.0, 1.0, 2.0])
    candidate = Candidate.of(model, 4, "never", 3)  # weights (3, 3)
    for cell, cut in (((9.0, 7.0, 5.0, 6.0), ("x", 7.0)), ((6.0, 20.0, 5.0, 10.0), ("y", 15.0)),
                      ((math.inf, 7.0, 5.0, 6.0), ("x", 10.0))):
        cells = Cells(candidate, *(np.array([v]) for v in cell), bound=np.zeros(1))
        cap_x, cap_y, low_x, low_y = cells.halves(100.0).cells
        assert len(cells.bound) == 0 and len(cap_x) == 2  # taken out, two halves back
        if cut[0] == "x":
            assert list(low_x) == [cell[2], cut[1]] and list(cap_x) == [cut[1], cell[0]]
            assert list(low_y) == [cell[3]] * 2 and list(cap_y) == [cell[1]] * 2
        else:
            assert list(low_y) == [cell[3], cut[1]] and list(cap_y) == [cut[1], cell[1]]
            assert list(low_x) == [cell[2]] * 2 and list(cap_x) == [cell[0]] * 2


def test_the_coarse_grid_has_a_level_more_on_short_chains() -> None:
    """Before a plan is known each lane gets 4 levels (the last its cap) on a chain of more than
    500 layers, 5 on a shorter one, where a cell costs less of the DP: the floors' multiples of
    1.03, 1.1 and 1.3, then 1.56 (1.3 x 1.2)."""
    for layers, expected in ((400, [1.03, 1.1, 1.3, 1.56]), (600, [1.03, 1.1, 1.3])):
        model = model_of(random_profile(random.Random(layers), layers, 4, per_pair=False), [1.0] * 4)
        candidate = Candidate.of(model, 4, "never", 4)
        caps = tuple(10 * floor for floor in candidate.floors)
        for levels, floor, cap in zip(grid_levels(candidate, 4, caps, None), candidate.floors, caps):
            assert list(levels[:-1] / floor) == pytest.approx(expected) and levels[-1] == cap


@pytest.mark.parametrize("seed", range(3))
def test_refined_bound_brackets_the_optimum_and_is_tight_without_memory_or_skips(seed: int) -> None:
    """No memory limit, no skips, no recomputation: the relaxation is the cost model, so the
    refined bound closes on the optimum (brute force); it never exceeds it."""
    rng = random.Random(seed)
    layers, devices = 9, 3
    profile = random_profile(rng, layers, devices, per_pair=False)
    model = model_of(profile, [1.0, 1.5, 2.0])
    candidates = [Candidate.of(model, m, "never", devices) for m in (1, 2, 4, 8)]
    optimum = min(model.evaluate(bounds, c.chunks, "never").iteration_ms
                  for c in candidates for bounds in all_splits(layers, devices))
    found: list[Cells] = []

    def scout(candidate, best, potentials):
        grid = Completions.grid(candidate, model.speeds, *grid_levels(candidate, devices, (math.inf, math.inf), None))
        found.append(Cells.of(grid, loose=False))
        return found[-1], price(candidate, grid.plans(3))

    def price(candidate, splits):
        times = [(model.evaluate(b, candidate.chunks, "never").iteration_ms, b) for b in splits]
        ms, bounds = min(times)
        return Choice(tuple(bounds), candidate.chunks, "never", ms)

    best, waiting, _ = refine(sorted(candidates, key=lambda c: c.lower_bound), scout, price, model.speeds,
                              None, Budget(None))
    least = min([waiting, *(cells.least() for cells in found)])
    assert best is not None and best.iteration_ms >= optimum * (1 - 1e-9)
    assert least <= optimum * (1 + 1e-9)
    assert least >= optimum * (1 - 1e-3)  # the cells left are narrow: within _NARROW of it


def test_filled_against_a_fine_search_over_caps() -> None:
    """The candidate's cheap bound: least over caps X of the fastest-first time sum plus
    weight·X, equal to a fine scan over X with the fastest-first fill worked out by hand."""
    from autopipe.planning.candidates import filled

    rng = np.random.default_rng(0)
    for _ in range(100):
        speeds = rng.choice([0.5, 1.0, 1.5, 2.0], rng.integers(1, 6))
        work, weight = rng.uniform(1, 100), int(rng.integers(0, 8))
        floor = rng.uniform(0, work / speeds.sum() * 1.5)
        best = math.inf
        for cap in np.linspace(max(floor, work / speeds.sum()), max(floor, work / speeds.max()) * 1.2 + 1, 4001):
            left, spent = work, 0.0
            for speed in sorted(speeds, reverse=True):
                busy = min(cap, left / speed)
                spent, left = spent + busy, left - busy * speed
            best = min(best, spent + weight * cap)
        assert best * (1 - 1e-2) <= filled(work, speeds, floor, weight)[-1] <= best + 1e-9
        assert filled(work, speeds, floor, weight)[0] == pytest.approx(filled(work, speeds[:1], floor, weight)[0])


class _FewFit(Budget):
    """The last moments of a time limit: a halving of a full batch never fits, one of a few
    cells always does (no clock, so the test does not depend on this machine's speed)."""

    def __init__(self) -> None:
        super().__init__(None)
        self.slowest.update(halving=1.0, few=0.1)

    def fits(self, expected: float) -> bool:
        return expected < 0.5

    def out(self, expected: float = 0.0) -> bool:
        return expected >= 0.5


def test_when_only_a_few_cells_fit_the_least_are_halved() -> None:
    """``halves(best, 2)`` takes out the two cells of least bound only; ``refine`` with time
    for no full halving halves a few cells at a time, and still closes on the optimum."""
    rng = random.Random(4)
    layers, devices = 9, 3
    model = model_of(random_profile(rng, layers, devices, per_pair=False), [1.0, 1.5, 2.0])
    candidate = Candidate.of(model, 4, "never", devices)
    cells = Cells.of(Completions.grid(candidate, model.speeds, *grid_levels(candidate, devices, (math.inf,) * 2, None)),
                     loose=False)
    count, least_two = len(cells.bound), np.sort(cells.bound)[:2]
    halves = cells.halves(100.0, 2)
    assert len(halves.bounds) == 4 and sorted(halves.bounds[:2]) == list(least_two)
    assert len(cells.bound) == count - 2 and np.all(cells.bound >= least_two[1])

    optimum = min(model.evaluate(bounds, 4, "never").iteration_ms for bounds in all_splits(layers, devices))
    found: list[Cells] = []

    def scout(candidate, best, potentials):
        grid = Completions.grid(candidate, model.speeds, *grid_levels(candidate, devices, (math.inf,) * 2, None))
        found.append(Cells.of(grid, loose=False))
        return found[-1], price(candidate, grid.plans(1))

    def price(candidate, splits):
        ms, bounds = min((model.evaluate(b, 4, "never").iteration_ms, b) for b in splits)
        return Choice(tuple(bounds), 4, "never", ms)

    budget = _FewFit()
    best, waiting, _ = refine([candidate], scout, price, model.speeds, None, budget)
    assert budget.slowest["halving"] == 1.0  # no full halving ran
    assert optimum * (1 - 1e-3) <= min(waiting, found[0].least()) <= optimum * (1 + 1e-9)
    assert best.iteration_ms >= optimum * (1 - 1e-9)


def _skipped(rng: random.Random, layers: int, devices: int):
    """A random chain with per-pair copies and 1-3 skips on ``devices`` of mixed speeds, and a
    candidate of it."""
    profile = random_profile(rng, layers, devices, skips=rng.randint(1, 3), per_pair=True)
    model = model_of(profile, [rng.choice([1.0, 1.5, 2.0]) for _ in range(devices)])
    chunks, mode = rng.choice([1, 2, 4, 8]), rng.choice(["never", "except_last", "always"])
    return model, Candidate.of(model, chunks, mode, devices)


def _random_potentials(rng: np.random.Generator, candidate: Candidate) -> np.ndarray:
    """Potentials of either sign, as large as the skips' copies."""
    scale = float(np.max(candidate.receive[np.isfinite(candidate.receive)], initial=1.0))
    return rng.normal(0.0, scale, candidate.receive.shape[:2])


@pytest.mark.parametrize("seed", range(3))
def test_cells_bound_every_plan_in_them_whatever_the_potentials(seed: int) -> None:
    """Brute force over every split of ≤ 8 layers × 4 devices with per-pair copies and skips:
    each cell's bound holds with random potentials, and after halvings whose potentials step
    towards the optimum (the refinement's ascent), with each half's bound at least its parent's."""
    rng, draw = random.Random(seed), np.random.default_rng(seed)
    for _ in range(8):
        layers, devices = rng.randint(3, 8), rng.randint(2, 4)
        model, candidate = _skipped(rng, layers, devices)
        speeds = model.speeds[:devices]
        times = {bounds: lanes_of(model, bounds, candidate.chunks, candidate.effective)
                 for bounds in all_splits(layers, devices)}
        optimum = min(time for time, _, _ in times.values())
        potentials = _random_potentials(draw, candidate)
        levels = grid_levels(candidate, devices, (math.inf, math.inf), None)
        cells = Cells.of(Completions.grid(candidate, speeds, *levels, skips=True, potentials=potentials))
        for _ in range(4):
            potentials = cells.step(potentials, optimum)
            halves = cells.halves(1e3)
            if halves is None:
                break
            cells.add(Completions(candidate, speeds, halves.cells, skips=True, potentials=potentials), halves.bounds)
        floor_x, floor_y = candidate.floors  # the lowest cells hold their floor too
        for time, x, y in times.values():
            inside = ((cells.low_x < x) | np.isclose(cells.low_x, floor_x)) & (x <= cells.cap_x * (1 + 1e-9))
            inside &= ((cells.low_y < y) | np.isclose(cells.low_y, floor_y)) & (y <= cells.cap_y * (1 + 1e-9))
            assert np.all(cells.bound[inside] <= time * (1 + 1e-9))


def _priced(model, candidate: Candidate, bounds: tuple[int, ...], sources: np.ndarray,
            potentials: np.ndarray) -> float:
    """What the DP charges split ``bounds`` with ``potentials``: its lanes without the caps'
    terms, and each skip popped by a later stage its stash's potential plus the copy from
    ``sources`` (the walk's) less that source's potential."""
    stages = model.evaluate(bounds, candidate.chunks, candidate.effective).stages
    owner = np.searchsorted(np.asarray(bounds), np.arange(model.layers), side="right") - 1
    paid = sum(s.forward + s.backward + s.recompute for s in stages)
    paid += sum(candidate.copy_forward[d, q] + candidate.copy_back[d, q] for d, q in enumerate(bounds[1:-1]))
    for t, (stash, pop) in enumerate(zip(candidate.skip_stash, candidate.skip_pop)):
        if owner[stash] != owner[pop]:
            source = sources[t]
            paid += potentials[t, owner[stash]] + candidate.receive[t, source, owner[pop]] - potentials[t, source]
    return float(paid)


def test_the_walk_pays_what_the_dp_charges_and_its_direction_is_a_subgradient() -> None:
    """The plan walked from a cell's DP, priced as the DP prices it (:func:`_priced`), costs
    the cell's ``rest``; it prices any other potentials too, so the DP's value there is at most
    that price, which moves by ``g · Δ``: ``directions`` is a subgradient (scaled by ``1/|g|²``)."""
    rng, draw = random.Random(5), np.random.default_rng(5)
    checked = 0
    for _ in range(20):
        layers, devices = rng.randint(4, 10), rng.randint(2, 4)
        model, candidate = _skipped(rng, layers, devices)
        speeds = model.speeds[:devices]
        potentials = _random_potentials(draw, candidate)
        grid = Completions.grid(candidate, speeds, *grid_levels(candidate, devices, (math.inf, math.inf), None),
                                skips=True, potentials=potentials)
        cells = np.flatnonzero(np.isfinite(grid.rest[0, :, 0]))
        for cell, direction in zip(cells, grid.directions(cells)):
            bounds, sources = grid._walk(int(cell))
            here = _priced(model, candidate, bounds, sources, potentials)
            assert grid.rest[0, cell, 0] == pytest.approx(here)
            other = potentials + _random_potentials(draw, candidate)
            caps = tuple(a[cell:cell + 1] for a in (grid.cap_x, grid.cap_y, grid.low_x, grid.low_y))
            there = _priced(model, candidate, bounds, sources, other)
            assert Completions(candidate, speeds, caps, skips=True, potentials=other).rest[0, 0, 0] <= there + 1e-9
            norm = float(np.sum(direction ** 2))
            slope = direction / norm if norm > 0 else direction
            assert there == pytest.approx(here + float(np.sum(slope * (other - potentials))))
            checked += 1
    assert checked > 20


@pytest.mark.parametrize("seed", range(3))
def test_the_band_of_starts_changes_no_bound_and_no_walk(seed: int, monkeypatch) -> None:
    """Where skips are charged the DP only works out the starts each device can reach within a
    cell's caps (Completions._band); with every start worked out instead, the bounds of whole
    plans and the plans walked are the same, on ≤ 12 layers × 5 devices of mixed speeds."""
    rng, draw = random.Random(seed), np.random.default_rng(seed)
    left_out = 0
    for _ in range(10):
        layers, devices = rng.randint(3, 12), rng.randint(2, 5)
        model, candidate = _skipped(rng, layers, devices)
        speeds = model.speeds[:devices]
        potentials = _random_potentials(draw, candidate) if rng.random() < 0.5 else None
        levels = grid_levels(candidate, devices, (math.inf, math.inf), None)
        banded = Completions.grid(candidate, speeds, *levels, skips=True, potentials=potentials)
        with monkeypatch.context() as patch:
            patch.setattr(Completions, "_band", lambda self, device: (np.zeros(len(self.cap_x), dtype=int),
                                                                      np.full(len(self.cap_x), len(self.work))))
            full = Completions.grid(candidate, speeds, *levels, skips=True, potentials=potentials)
        assert np.array_equal(banded.rest[0, :, 0], full.rest[0, :, 0])
        for cell in np.flatnonzero(np.isfinite(full.rest[0, :, 0])):
            assert banded._walk(int(cell))[0] == full._walk(int(cell))[0]
        left_out += int(np.sum(np.isinf(banded.rest) & np.isfinite(full.rest)))
    assert left_out > 0  # the band did leave starts out


def test_charged_candidates_far_from_the_best_time_are_halved_longer() -> None:
    """Where skips are charged the potentials keep raising the bound as halving goes on, so a
    candidate far under the best time keeps more cells and stalls before it is settled; near
    the best time, or without charged skips, the limits stay (the exact search closes the gap)."""
    from autopipe.planning import refinement

    rng = random.Random(2)
    while True:
        model, candidate = _skipped(rng, 8, 3)
        levels = grid_levels(candidate, 3, (math.inf, math.inf), None)
        charged = Cells.of(Completions.grid(candidate, model.speeds[:3], *levels, skips=True))
        if charged.directions is not None:
            break
    plain = Cells.of(Completions.grid(candidate, model.speeds[:3], *levels))
    least = charged.least()
    assert charged.patience(least * 1.5) == refinement._PATIENT > 1
    assert charged.patience(least * 1.001) == 1 and plain.patience(least * 1.5) == 1
