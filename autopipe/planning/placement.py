"""Which device each stage runs on, when the order of the devices matters.

The searches place stage ``s`` on the ``s``-th device given.  With equal speeds, one copy fit
for every pair and one memory limit for all that loses nothing; with mixed speeds, copies that
differ per pair (NVLink inside a node, network between nodes) or memory limits that differ per
device (a stage that holds the parameters needs the large device) the order matters, and
``plan(..., placement="search")`` searches it too: every order of up to :data:`EXHAUSTIVE`
devices (each order's searches are exact, so the best over all orders is — stages use a prefix
of an order, so every placement of ``k ≤ devices`` stages on distinct devices is some order's
prefix), and beyond that a few orders that tend to be good: as given, fastest first, slowest
first, most memory first, least memory first, and chains that take the cheapest copy next from
each device.  The plan's bound then covers only the orders searched, and its options say how
many (``placements_searched``); so does it when the time limit leaves orders out.  An order
moves each device's speed, copies and memory limit together (:func:`permuted`, and the limits
indexed by the order where it is priced).
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


def orders(model: CostModel, asked: str, limits: np.ndarray) -> tuple[list[tuple[int, ...]], bool]:
    """Device orders to search (``limits``: each given device's memory limit) and whether they
    are all the orders that could differ."""
    count = len(model.devices)
    given = tuple(range(count))
    matters = _matters(model, limits)
    if asked == "given" or not matters:
        return [given], not matters
    if count <= EXHAUSTIVE:
        return list(itertools.permutations(given)), True
    found = [given]
    for key in (model.speeds[:count], np.asarray(limits, dtype=float)):  # the largest first, then the least
        found += [tuple(np.argsort(-key, kind="stable").tolist()), tuple(np.argsort(key, kind="stable").tolist())]
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


def _matters(model: CostModel, limits: np.ndarray) -> bool:
    """Whether device order can change a plan's time or whether it fits: speeds, copy fits or
    memory limits that differ."""
    count = len(model.devices)
    off = ~np.eye(count, dtype=bool)
    uniform = all(np.ptp(table[off]) == 0 for table in (model.latency, model.per_byte)) if count > 1 else True
    return not uniform or np.ptp(model.speeds[:count]) > 0 or len(set(np.asarray(limits).tolist())) > 1


def _cheapest_chain(model: CostModel, start: int) -> tuple[int, ...]:
    """From ``start``, each next device the one of cheapest copy (latency plus a megabyte)."""
    cost = model.latency + 1e6 * model.per_byte
    chain, left = [start], set(range(len(model.devices))) - {start}
    while left:
        nearest = min(left, key=lambda d: (cost[chain[-1], d], d))
        chain.append(nearest)
        left.remove(nearest)
    return tuple(chain)
