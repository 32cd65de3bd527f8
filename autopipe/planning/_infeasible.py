"""When no plan is found: the error, with the smallest per-device memory limit that would fit
when none does.

The limit named is, over the plans of every schedule and stages per device the options ask
for (a *family*: fill-drain or 1F1B, one stage per device or interleaved), the least largest
memory a device of a plan holds: for one stage per device a min-max DP over stages (a stage's
memory depends on its layers and, under 1F1B, on how many stages follow it), and for several
every split, as the interleaved search lists them, while a device count has at most
:data:`~autopipe.planning.interleaved.EXACT` splits (beyond, the limit is the least over the
splits listed: one that fits, not proven the smallest, and the error says so).  Memory does not
depend on the device a stage runs on, so one limit for every device fits in every device order.

What the error may claim: that *no plan fits* only where that is proven, every family's least
limit being above every device's limit (or, for fill-drain with one stage per device, its
exact search having found none on every device order that could differ); else that *no plan
was found* (and, where the limits differ per device, on which device orders).  Where a family's
least limit is within every device's, one of its plans fits that the search missed (1F1B and
interleaved plans beyond listing are searched by heuristics): the error says so.
"""
from __future__ import annotations

import itertools
import math
from typing import NamedTuple, Sequence

import numpy as np

from .._vocab import CHECKPOINT_MODES, CheckpointMode
from . import interleaved
from ._arrays import all_splits
from ._budget import Budget
from ._options import Options
from .cost import CostModel

__all__ = ["infeasible", "smallest_memory", "unfound"]


class _Need(NamedTuple):
    """The least per-device memory limit a family's plans fit in (``inf``: none tried), the
    micro-batch count and mode that reach it, whether every pair was tried within the budget and
    whether every split was listed (else the limit fits, but may not be the least)."""

    bytes: float
    chunks: int
    mode: str
    tried: bool
    listed: bool
    schedule: str
    interleave: int

    @property
    def exact(self) -> bool:
        """Whether the limit is the family's least (else one of its plans fits it)."""
        return self.tried and self.listed

    @property
    def plan(self) -> str:
        """One of the family's plans, for an error: ``"a 1F1B plan"``, ``"an interleaved fill-drain plan"``, ..."""
        kind = "1F1B" if self.schedule == "1f1b" else "fill-drain"
        return f"an interleaved {kind} plan" if self.interleave > 1 else f"a {kind} plan"

    def shown(self) -> str:
        """The limit with what reaches it, for an error."""
        how = f"chunks={self.chunks}, checkpoint={self.mode}"
        how += ", schedule=1f1b" if self.schedule == "1f1b" else ""
        how += f", interleave={self.interleave}" if self.interleave > 1 else ""
        return f"{int(math.ceil(self.bytes))} bytes ({self.bytes / 2**30:.3f} GiB, with {how})"


def infeasible(model: CostModel, options: Options, budget: Budget | None = None, orders: int | None = None) -> str:
    """Why no plan was found: the memory limits given, whether that is proven of every plan or
    what the searches found (module docstring), and the smallest limit that would fit (the least
    found, if ``budget`` ran out before every micro-batch count and mode was tried); ``orders``
    is how many device orders were searched where not all that could differ were."""
    needs = [_least(model, options, schedule, factor, budget)
             for schedule in options.schedules for factor in options.interleaves]
    best = min(needs, key=lambda need: need.bytes)
    fix = "raise memory_limit, add devices or allow checkpointing"
    least, most = float(np.min(options.limits)), float(np.max(options.limits))
    if best.bytes <= least:  # one of its plans fits every device: the search missed it
        return (f"no plan was found within the memory limits ({_limits(options)}), though one fits them: "
                f"{best.plan} needs {best.shown()}; {_missed(best)}" + _fill_drain_hint(model, options, budget))
    searched = orders is None and (budget is None or not budget.crowded)  # the exact search found none anywhere
    proven = all((need.exact and need.bytes > most) or (need.schedule, need.interleave, searched) == ("gpipe", 1, True)
                 for need in needs)
    plans = "plan" if "gpipe" in options.schedules else "1F1B plan"  # of the schedules asked
    head = (f"no {plans} fits the memory limits ({_limits(options)})" if proven else
            f"no {plans} was found within the memory limits ({_limits(options)}){_orders(options, orders)}")
    return f"{head}; {_named(best, needs, fix)}" + _fill_drain_hint(model, options, budget)


def _missed(need: _Need) -> str:
    """Why the search of ``need``'s family can miss a plan that fits."""
    if need.schedule == "1f1b":
        return "the 1F1B search is a heuristic, and capped"
    if need.interleave > 1:
        return "the interleaved search lists every split only where that fits the time left, else it is a heuristic"
    return "the exact search stopped where its partial plans would outgrow the planner's memory (a few GB)"


def _named(best: _Need, needs: Sequence[_Need], fix: str) -> str:
    """The limit that would fit, as the error names it, and how sure it is; with the ``fix``."""
    if not best.tried and math.isinf(best.bytes):
        return f"{fix} (with time_limit=None the error also names the smallest per-device limit that would fit)"
    if math.isinf(best.bytes):
        return f"{fix} (no limit that fits is named: the interleaved splits are too many to list)"
    if not all(need.tried for need in needs):
        return (f"a per-device memory limit that would fit (the least found within the time limit; time_limit=None "
                f"finds the smallest) is {best.shown()}; {fix}")
    if not all(need.listed for need in needs):
        return (f"a per-device memory limit that would fit is {best.shown()} (the least over the splits listed; "
                f"interleaved plans on more devices have too many splits to list, and may fit in less); {fix}")
    return f"the smallest per-device memory limit that would fit is {best.shown()}; {fix}"


def _orders(options: Options, orders: int | None) -> str:
    """Which device orders were searched, where the memory limits differ and not every order was."""
    if orders is None or len(set(options.limits.tolist())) == 1:
        return ""
    if orders == 1:
        return " with the devices in the order given (placement='search' also tries other orders)"
    return f" on the {orders} device orders searched"


def _fill_drain_hint(model: CostModel, options: Options, budget: Budget | None) -> str:
    """Without a fill-drain search (``schedule="1f1b"``), whether a fill-drain plan fits the
    limits: then they are not too small, only for the schedule asked."""
    if "gpipe" in options.schedules or 1 not in options.interleaves:
        return ""
    need = _least(model, options, "gpipe", 1, budget)
    if need.bytes > float(np.min(options.limits)):
        return ""
    return f"; a fill-drain plan fits them, needing {need.shown()}: plan with schedule='auto' or 'gpipe'"


def _least(model: CostModel, options: Options, schedule: str, factor: int, budget: Budget | None) -> _Need:
    """:func:`smallest_memory` of one family of the options (1F1B: with its own modes)."""
    modes = options.modes_1f1b if schedule == "1f1b" else options.modes
    return _smallest(model, options.candidates, modes, len(options.limits), budget, schedule, factor)


def _limits(options: Options) -> str:
    """The memory limits given, for an error."""
    named = ["none" if math.isinf(v) else f"{int(v)}" for v in options.limits]
    return f"{named[0]} bytes on every device" if len(set(named)) == 1 else f"{', '.join(named)} bytes per device"


def unfound(options: Options, time_limit: float | None) -> str:
    """Why no plan was found before the time ran out: where memory limits are given, they may
    be what no plan fits (naming the smallest that would takes longer than the search)."""
    if np.all(np.isinf(options.limits)):
        if time_limit is None:  # only the 1F1B search's cap on its DP work stops it then
            return ("no plan was found within the 1F1B search's cap on its work; plan with schedule='gpipe' "
                    "(its search always finds one) or schedule='auto'")
        return f"no plan was found within time_limit={time_limit} s; allow more time (time_limit=None: no limit)"
    return (f"no plan that fits the memory limits ({_limits(options)}) was found within time_limit={time_limit} s; "
            "they may be too small for any plan: raise memory_limit, or allow more time (with time_limit=None "
            "the error names the smallest limit that fits)")


def smallest_memory(model: CostModel, candidates: Sequence[int], modes: Sequence[CheckpointMode], devices: int,
                    budget: Budget | None = None, schedule: str = "gpipe",
                    interleave: int = 1) -> tuple[float, int, str, bool]:
    """Min over plans of ``schedule`` with ``interleave`` stages per device of the largest
    memory a device holds, with the micro-batch count and mode that reach it (``inf`` if none
    was tried), and whether that is the least: only while ``budget`` lasts, the likely least
    first (more checkpointing, more micro-batches), and over the splits listed (module docstring)."""
    need = _smallest(model, candidates, modes, devices, budget, schedule, interleave)
    return need.bytes, need.chunks, need.mode, need.exact


def _smallest(model: CostModel, candidates: Sequence[int], modes: Sequence[str], devices: int,
              budget: Budget | None, schedule: str, interleave: int) -> _Need:
    """:func:`smallest_memory` as a :class:`_Need`."""
    best, listed = (math.inf, 0, ""), True
    frugal = sorted(modes, key=lambda mode: -CHECKPOINT_MODES.index(mode))
    listings: dict[int, np.ndarray] = {}  # every split of each stage count listed so far
    for chunks, mode in itertools.product(sorted(candidates, reverse=True), frugal):
        if budget is not None and budget.out():
            return _Need(*best, False, listed, schedule, interleave)
        tables = _Tables(model, chunks, mode, schedule)
        if interleave == 1:
            answer = _one_per_device(tables, model.layers, devices)
        else:
            answer, whole = _interleaved(tables, model.layers, devices, interleave, listings)
            listed = listed and whole
        if answer < best[0]:
            best = (answer, chunks, mode)
    return _Need(*best, True, listed, schedule, interleave)


class _Tables:
    """The memory of every stage ``[start, stop)`` (``inf`` where ``start >= stop``) of one
    ``(chunks, mode)`` under ``schedule``, by its *depth*: how many stages run from it to the end
    of the chain, itself included (under 1F1B what it holds depends on that alone; under
    fill-drain on nothing but its layers, so one table, kept, serves every depth; under 1F1B each
    is worked out when asked for, as keeping one per depth could take gigabytes)."""

    def __init__(self, model: CostModel, chunks: int, mode: str, schedule: str) -> None:
        self.model, self.chunks, self.mode, self.schedule = model, chunks, mode, schedule
        self.costs = model.at(model.micro_batch_size(chunks))
        self.varies = schedule != "gpipe"
        self.kept: np.ndarray | None = None

    def __call__(self, depth: int) -> np.ndarray:
        if self.varies:
            return self._table(depth)
        if self.kept is None:
            self.kept = self._table(1)
        return self.kept

    def _table(self, depth: int) -> np.ndarray:
        layers = self.model.layers
        start, stop = np.triu_indices(layers + 1, k=1)
        table = np.full((layers + 1, layers + 1), math.inf)
        table[start, stop] = self.model.schedule_memory(self.costs, start, stop, self.chunks, self.mode,
                                                        self.schedule, 0, depth)  # the first of depth stages
        return table


def _one_per_device(tables: _Tables, layers: int, devices: int) -> float:
    """Min over ``k ≤ devices`` and splits into ``k`` stages of the largest stage memory: a
    min-max DP over the suffixes of the chain, ``reach[c]`` the least largest stage over splits
    of layers ``[c, L)`` into the stages of the rounds so far, the stage added each round the
    first, one deeper than the round before.  Where memory does not depend on depth the rounds
    take at most as many stages, until one changes nothing; else exactly as many."""
    reach = np.full(layers + 1, math.inf)
    reach[layers] = 0.0
    least = math.inf
    for depth in range(1, min(devices, layers) + 1):
        grown = np.min(np.maximum(tables(depth), reach[None, :]), axis=1)
        if not tables.varies:
            grown = np.minimum(grown, reach)
            if np.array_equal(grown, reach):
                break
        reach = grown
        least = min(least, float(reach[0]))
    return least


def _interleaved(tables: _Tables, layers: int, devices: int, interleave: int,
                 listings: dict[int, np.ndarray]) -> tuple[float, bool]:
    """Min over ``k`` of 2 to ``devices`` devices and splits into ``k · interleave`` stages (stage
    ``s`` on device ``s % k``) of the largest device's memory, the sum of its stages'; and
    whether every split was listed (a device count of more than ``EXACT`` splits is not)."""
    least, listed = math.inf, True
    for k in range(2, min(devices, layers // interleave) + 1):
        stages = k * interleave
        if math.comb(layers - 1, stages - 1) > interleaved.EXACT:
            listed = False
            continue
        if stages not in listings:
            listings[stages] = all_splits(layers, stages)
        bounds = listings[stages]
        memory = np.stack([tables(stages - s)[bounds[:, s], bounds[:, s + 1]] for s in range(stages)], axis=1)
        held = memory.reshape(len(bounds), interleave, k).sum(axis=1)  # stage s is on device s % k
        least = min(least, float(held.max(axis=1).min()))
    return least, listed
