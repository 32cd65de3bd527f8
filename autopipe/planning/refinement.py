"""Best-first refinement of cells of lane caps: lower bounds within a few per cent of the
optimum, fast, and the plans that come with them.

A grid of caps (:mod:`autopipe.planning.completion`) bounds the plans of a cell by its lower
edges, ``rest + (m-1)·x⁻ + w·y⁻``, so a wide cell bounds loosely; a fine grid everywhere costs
too much.  Here each candidate's cells are kept as a list, and the cells of least bound (over
all candidates) are halved along the lane whose width weighs more, as in a branch and bound:
a half's bound is never below its parent's, and a cell whose bound reaches the best time found
is dropped.  Refining stops when every cell is dropped (the best plan is then optimal — the
bounds hold for every plan), when the time is up, or when the cells left are too narrow to
halve (the relaxation, not the cells, is what is loose there: memory limits, ``except_last``
and most of what skips cost are left out of it, so an exact search must settle those).  Each
refined cell's DP also walks a plan (:meth:`Completions.plans`), priced by the cost model:
upper bounds come with the lower.

Where skips are charged, the potentials that move their cost from pop to stash
(:mod:`autopipe.planning.completion`) are a subgradient ascent run along the refinement: each
scout or halving takes a step along the directions of its least cells, and every DP after it
uses the new potentials.  One set serves all candidates: their devices and skips are the same,
and the cheap device pairs with them (at 400 layers × 32 devices, potentials raised on the
cells of 13 micro-batches gave those of 8, 11 and 16 at once what four steps of their own
did).  A step never lowers a bound that holds: halves keep their parent's bound when theirs
comes out lower.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np

from ._budget import Budget
from .candidates import Candidate, Choice, better
from .completion import Completions

__all__ = ["Cells", "Halves", "refine"]

# Cells halved at once (their halves share one DP over the devices).
_BATCH = 16
# When the time left is too short for a halving of _BATCH cells, the _LAST cells of least bound
# are halved if that is foreseen to fit: as the slowest such halving so far, or before one,
# _LAST_SHARE of the slowest full one.  A DP costs a part per device whatever the cells, and a
# halving also walks and prices plans: measured, a halving of 2 cells took 25-30% of a full
# one's time at 1000 layers x 64 devices of mixed speeds, 63% with per-pair copies and skips.
_LAST = 2
_LAST_SHARE = 0.75
# A cell narrower than this (weighted lane widths, relative to the best time) is not halved.
_NARROW = 2e-4
# Plans walked from each batch of halves (those of least bound).
_WALKS = 1
# Most cells a candidate keeps open: beyond, its relaxation is what is loose (the cells left
# would only multiply), and it is settled.
_MOST = 128
# Halvings in a row that may leave a candidate's least bound where it was (risen by less than
# _NARROW of the best time) before it is settled, where the relaxation is loose (Cells.loose):
# that, not its cells, is then what holds the bound down.
_STALLS = 12
# Where skips are charged and a candidate's bound lies more than _WIDE of the best time under it,
# both limits above times _PATIENT: each halving also steps the potentials, which raise the bound
# where halving alone stalls, and an exact search (keyed by the skips) is not what will close so
# wide a gap.  At 400 x 32, 128 cells and 12 stalls settled every candidate at a 3021 bound after
# about 40 steps, and the rest of a 3 s limit went unused; with 4x, 3046 after 90 steps, whose walks
# found a 3080 ms plan (gap 1.1% in 2 s).  Near the best time the limits stay: at 100 x 8 the
# exact search, started once every candidate is settled, closes the last 0.6%.
_PATIENT = 4
_WIDE = 0.01

# The step of the skips' potentials at each scout or halving, relative to Polyak's (the gap to the
# best time): the target, the best time, lies above what the potentials can reach, so a full step
# overshoots (at 400 x 32, 0.25 reached a 3% gap in 1 s where 0.5 and 1 left 5-7%).
_STEP = 0.25
# Cells of least bound whose directions that step averages (each is a walk of the DP).
_AIMED = 2
# The columns of Cells, one row per cell.
_COLUMNS = ("cap_x", "cap_y", "low_x", "low_y", "bound")

#: prices stage bounds for a candidate: the best plan among them that fits in memory, or ``None``.
Price = Callable[[Candidate, Sequence[tuple[int, ...]]], "Choice | None"]
#: a candidate's first cells of caps and its best plan found there (given the best so far and
#: the potentials to charge skips with, :class:`Completions`).
Scout = Callable[[Candidate, "Choice | None", np.ndarray], "tuple[Cells, Choice | None]"]


@dataclass
class Cells:
    """One candidate's cells still open: caps, lower caps and bounds as parallel arrays, and
    whether it is settled: every cell too narrow to halve (:data:`_NARROW`), too many cells
    (:data:`_MOST`) or its bound stalled (:data:`_STALLS`)."""

    candidate: Candidate
    cap_x: np.ndarray
    cap_y: np.ndarray
    low_x: np.ndarray
    low_y: np.ndarray
    bound: np.ndarray
    settled: bool = False
    stalls: int = 0
    loose: bool = True  # whether the relaxation leaves out something of this candidate's plans
    # where skips are charged: the directions that raise the bounds of the least of the latest
    # cells (Completions.directions) and those bounds, for the next step of the potentials
    directions: np.ndarray | None = None
    aims: np.ndarray | None = None

    @staticmethod
    def of(completions: Completions, loose: bool = True, floors: np.ndarray | float = -math.inf) -> Cells:
        """The cells of ``completions`` in which some plan fits; ``loose``: whether the
        relaxation leaves out memory limits, skips or ``except_last`` that these plans have;
        ``floors``: bounds known to hold for them (their parents')."""
        # a cell's own bound loses what lies between its lower and upper caps; the candidate's
        # cheap bound (no caps) holds for every cell too
        bound = np.maximum(np.maximum(completions.cell_bounds(), completions.candidate.lower_bound), floors)
        keep = np.flatnonzero(np.isfinite(bound))
        cells = Cells(completions.candidate, completions.cap_x[keep], completions.cap_y[keep],
                      completions.low_x[keep], completions.low_y[keep], bound[keep], loose=loose)
        if completions.skips:
            own = completions.cell_bounds()
            least = keep[np.argsort(own[keep], kind="stable")[:_AIMED]]
            cells.directions, cells.aims = completions.directions(least), own[least]
        return cells

    def patience(self, best: float) -> int:
        """What :data:`_MOST` and :data:`_STALLS` are multiplied by while ``best`` is the best
        time (:data:`_PATIENT` where skips are charged and the gap is wide)."""
        wide = self.directions is not None and self.least() < best * (1 - _WIDE)
        return _PATIENT if wide else 1

    def least(self) -> float:
        """A lower bound on every plan of the candidate (``inf``: none is left open)."""
        return float(np.min(self.bound, initial=math.inf))

    def prune(self, best: float) -> None:
        """Drop the cells whose bound reaches ``best``."""
        self._keep(np.flatnonzero(self.bound < best))

    def _keep(self, index: np.ndarray) -> None:
        for name in _COLUMNS:
            setattr(self, name, getattr(self, name)[index])

    def step(self, potentials: np.ndarray, best: float) -> np.ndarray:
        """``potentials`` a step along the directions of the latest cells, each weighted by its
        cell's gap to ``best`` (Polyak's step, scaled by :data:`_STEP`; none for a cell whose
        bound reaches ``best``: it is dropped)."""
        if self.directions is None or self.aims is None or not math.isfinite(best):
            return potentials
        gaps = np.maximum(best - self.aims, 0.0)
        return potentials + _STEP * np.sum(gaps[:, None, None] * self.directions, axis=0) / max(len(gaps), 1)

    def halves(self, best: float, batch: int = _BATCH) -> Halves | None:
        """Take the (up to ``batch``) cells of least bound out and return their halves,
        each cut along the lane of larger weighted width; ``None`` if those are too narrow."""
        (weight_x, weight_m) = self.candidate.weights
        width_x = weight_x * np.where(np.isfinite(self.cap_x), self.cap_x - self.low_x, self.low_x)
        width_y = weight_m * np.where(np.isfinite(self.cap_y), self.cap_y - self.low_y, self.low_y)
        wide = (width_x + width_y) > _NARROW * best
        order = np.flatnonzero(wide)[np.argsort(self.bound[wide], kind="stable")[:batch]]
        if not len(order) or len(self.bound) > _MOST * self.patience(best):
            self.settled = True
            return None
        along_x = width_x[order] >= width_y[order]
        cap_x, cap_y, low_x, low_y, bound = (t[order] for t in (self.cap_x, self.cap_y, self.low_x, self.low_y,
                                                                 self.bound))
        mid_x = np.where(np.isfinite(cap_x), (low_x + cap_x) / 2, 2 * low_x)
        mid_y = np.where(np.isfinite(cap_y), (low_y + cap_y) / 2, 2 * low_y)
        self._keep(np.setdiff1d(np.arange(len(self.bound)), order))
        lower = (np.where(along_x, mid_x, cap_x), np.where(along_x, cap_y, mid_y), low_x, low_y)
        upper = (cap_x, cap_y, np.where(along_x, mid_x, low_x), np.where(along_x, low_y, mid_y))
        return Halves(tuple(np.concatenate(pair) for pair in zip(lower, upper)), np.tile(bound, 2))

    def add(self, completions: Completions, floors: np.ndarray | float = -math.inf) -> None:
        """Take in the cells of ``completions`` in which some plan fits (``floors``: bounds
        known to hold for them)."""
        more = Cells.of(completions, floors=floors)
        for name in _COLUMNS:
            setattr(self, name, np.concatenate((getattr(self, name), getattr(more, name))))
        self.directions, self.aims = more.directions, more.aims


@dataclass(frozen=True)
class Halves:
    """Cells cut from others: their caps and lower caps (as :class:`Completions` takes them)
    and their parents' bounds (which hold for them too)."""

    cells: tuple[np.ndarray, ...]
    bounds: np.ndarray


def refine(pending: Sequence[Candidate], scout: Scout, price: Price, speeds: np.ndarray, best: Choice | None,
           budget: Budget) -> tuple[Choice | None, float, float]:
    """Best first over all candidates: scout the candidate of least cheap bound
    (``pending``, in that order) while it is under every open cell's bound, else halve the
    open cells of least bound; until no cell is open (each dropped or settled), or ``budget``
    runs out.

    Returns:
        The best plan found (``best`` or a faster one), the least cheap bound of the
        candidates not scouted (``inf``: none) and the halvings' DP seconds per cell, all told
        (to foresee larger grids; 0 if none was halved); each scouted candidate's :class:`Cells` (from ``scout``) keep
        what is still open.
    """
    cells: list[Cells] = []
    waiting = list(pending)
    # the halvings' DP seconds and cells so far: a halving of few cells costs per cell up to 40
    # times one of 32 (each device's steps cost the same for any number of cells)
    spent, halved = 0.0, 0
    # what a stage pays per skip it stashes, by device: one for all candidates, whose devices
    # and skips are the same (so are the cheap pairs, though the bytes differ)
    potentials = np.zeros(pending[0].receive.shape[:2] if pending else (0, 0))
    while True:
        upper = math.inf if best is None else best.iteration_ms
        for group in cells:
            group.prune(upper)
        waiting = [candidate for candidate in waiting if candidate.lower_bound < upper]
        open_ = [group for group in cells if len(group.bound) and not group.settled]
        least = min(open_, key=Cells.least, default=None)
        scouts = bool(waiting) and (least is None or waiting[0].lower_bound <= least.least())
        # one more step may fit if it is no slower than the slowest of its kind (a first
        # halving: twice a scout, as it prices twice the cells)
        slowest = budget.slowest
        expected = slowest.get("scout", 0.0) if scouts else slowest.get("halving", 2 * slowest.get("scout", 0.0))
        batch = _BATCH
        if not scouts and least is not None and not budget.fits(expected):
            few = slowest.get("few", _LAST_SHARE * expected)
            batch = _LAST if budget.fits(few) else _BATCH  # the time left fits a few cells' halving
        if least is None and not waiting or batch == _BATCH and budget.out(expected):
            return best, waiting[0].lower_bound if waiting else math.inf, spent / max(halved, 1)
        if scouts:
            with budget.step("scout"):
                group, found = scout(waiting.pop(0), best, potentials)
            cells.append(group)
            best = better(best, found)
            potentials = group.step(potentials, math.inf if best is None else best.iteration_ms)
            continue
        with budget.step("halving" if batch == _BATCH else "few"):
            start = time.perf_counter()
            halves = least.halves(upper, batch)
            if halves is not None:
                before = least.least()
                completions = Completions(least.candidate, speeds, halves.cells, skips=True, potentials=potentials)
                spent, halved = spent + time.perf_counter() - start, halved + len(halves.bounds)
                least.add(completions, halves.bounds)
                least.prune(upper)
                least.stalls = 0 if least.least() > before + _NARROW * upper else least.stalls + 1
                least.settled = least.loose and least.stalls >= _STALLS * least.patience(upper)
                best = better(best, price(least.candidate, completions.plans(_WALKS)))
                potentials = least.step(potentials, math.inf if best is None else best.iteration_ms)
