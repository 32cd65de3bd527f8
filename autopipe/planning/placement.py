"""Which device each stage runs on, when the order of the devices matters.

The searches place stage ``s`` on the ``s``-th device given.  With equal speeds and one copy fit
for every pair that loses nothing; with mixed speeds or copies that differ per pair (NVLink
inside a node, network between nodes) the order matters, and ``plan(..., placement="search")``
searches it too: every order of up to :data:`EXHAUSTIVE` devices (each order's searches are
exact, so the best over all orders is — stages use a prefix of an order, so every placement of
``k ≤ devices`` stages on distinct devices is some order's prefix), and beyond that a few
orders that tend to be good: as given, fastest first, slowest first, and chains that take the
cheapest copy next from each device.  The plan's bound then covers only the orders searched,
and its options say how many (``placements_searched``); so does it when the time limit leaves
orders out.
"""
from __future__ import annotations

import copy
import itertools
from typing import Literal, Sequence

import numpy as np

from .cost import CostModel

__all__ = ["Placement", "PLACEMENTS", "EXHAUSTIVE", "orders", "permuted"]

Placement = Literal["given", "search"]
#: how the planner places stages on devices.
PLACEMENTS: tuple[Placement, ...] = ("given", "search")
#: up to this many devices, every order is searched.
EXHAUSTIVE = 5


def orders(model: CostModel, asked: str) -> tuple[list[tuple[int, ...]], bool]:
    """Device orders to search and whether they are all the orders that could differ."""
    count = len(model.devices)
    given = tuple(range(count))
    if asked == "given" or not _matters(model):
        return [given], not _matters(model)
    if count <= EXHAUSTIVE:
        return list(itertools.permutations(given)), True
    speed = model.speeds[:count]
    found = [given, tuple(np.argsort(-speed, kind="stable").tolist()), tuple(np.argsort(speed, kind="stable").tolist())]
    found += [_cheapest_chain(model, start) for start in range(count)]
    return list(dict.fromkeys(found)), False


def permuted(model: CostModel, order: Sequence[int]) -> CostModel:
    """``model`` with plan device ``i`` being the given device ``order[i]`` (speeds and copy
    costs follow; the per-size costs do not depend on devices and are shared)."""
    index = np.asarray(order)
    moved = copy.copy(model)
    moved.devices = [model.devices[i] for i in order]
    moved.speeds = model.speeds[index]
    moved.latency = model.latency[np.ix_(index, index)]
    moved.per_byte = model.per_byte[np.ix_(index, index)]
    return moved


def _matters(model: CostModel) -> bool:
    """Whether device order can change a plan's time: speeds or copy fits that differ."""
    count = len(model.devices)
    off = ~np.eye(count, dtype=bool)
    uniform = all(np.ptp(table[off]) == 0 for table in (model.latency, model.per_byte)) if count > 1 else True
    return not uniform or np.ptp(model.speeds[:count]) > 0


def _cheapest_chain(model: CostModel, start: int) -> tuple[int, ...]:
    """From ``start``, each next device the one of cheapest copy (latency plus a megabyte)."""
    cost = model.latency + 1e6 * model.per_byte
    chain, left = [start], set(range(len(model.devices))) - {start}
    while left:
        nearest = min(left, key=lambda d: (cost[chain[-1], d], d))
        chain.append(nearest)
        left.remove(nearest)
    return tuple(chain)
