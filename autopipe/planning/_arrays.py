"""Numpy helpers of the planner's DP: parallel-array records and index arithmetic on sorted
and ragged arrays."""
from __future__ import annotations

import itertools
import math
from dataclasses import fields
from typing import Any, Callable

import numpy as np

__all__ = ["Columns", "RangeMin", "all_splits", "largest_after", "pairs", "power_spans", "prefix_argmin",
           "ragged_arange", "states", "uniform"]


class Columns:
    """Parallel arrays of a dataclass, one row per item: :meth:`take` keeps the same rows of
    each, :meth:`joined` puts records' rows one after another."""

    def take(self, index: np.ndarray) -> Any:
        return type(self)(*(getattr(self, f.name)[index] for f in fields(self)))  # type: ignore[arg-type]

    @classmethod
    def joined(cls, parts: list[Any]) -> Any:
        """The rows of ``parts`` (at least one), one after another."""
        if len(parts) == 1:
            return parts[0]
        return cls(*(np.concatenate([getattr(part, f.name) for part in parts]) for f in fields(parts[0])))


def largest_after(values: np.ndarray) -> np.ndarray:
    """The largest value at or after each position, and 0 past the end."""
    return np.concatenate((np.maximum.accumulate(values[::-1])[::-1], [0.0]))


def all_splits(layers: int, stages: int) -> np.ndarray:
    """Every split of ``layers`` into ``stages`` stages of a layer at least, as bounds: one row
    ``0, cut…, layers`` each, in lexicographic order of the cuts."""
    cuts = np.fromiter(itertools.chain.from_iterable(itertools.combinations(range(1, layers), stages - 1)),
                       dtype=np.int64).reshape(-1, stages - 1)
    return np.pad(cuts, ((0, 0), (1, 1)), constant_values=((0, 0), (0, layers)))


def ragged_arange(counts: np.ndarray) -> np.ndarray:
    """``0 … counts[0]-1, 0 … counts[1]-1, …`` in one array."""
    ends = np.cumsum(counts)
    return np.arange(ends[-1] if len(ends) else 0) - np.repeat(ends - counts, counts)


def states(starts: np.ndarray, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """For arrays sorted by ``(start, key)``: each entry's state index and each state's first entry."""
    change = np.flatnonzero((starts[1:] != starts[:-1]) | (keys[1:] != keys[:-1])) + 1
    first = np.concatenate(([0], change)) if len(starts) else change
    state = np.zeros(len(starts), dtype=int)
    state[change] = 1
    return np.cumsum(state), first


def pairs(label_state: np.ndarray, move_state: np.ndarray, states: int) -> tuple[np.ndarray, np.ndarray]:
    """Every ``(label, move)`` of the same state, as two index arrays (moves sorted by state)."""
    counts = np.bincount(move_state, minlength=states)
    repeat = counts[label_state]
    label = np.repeat(np.arange(len(label_state)), repeat)
    move = np.repeat((np.cumsum(counts) - counts)[label_state], repeat) + ragged_arange(repeat)
    return label, move


def prefix_argmin(values: np.ndarray, state: np.ndarray) -> np.ndarray:
    """At each position, the position of the least value so far within its state (the earliest
    of equals); ``state`` is non-decreasing.  One running minimum over ranks shifted down by
    ``state · n``, so that no earlier state's rank can be the least."""
    count = len(values)
    order = np.argsort(values, kind="stable")
    rank = np.empty(count, dtype=np.int64)
    rank[order] = np.arange(count)
    shift = state.astype(np.int64) * count
    return order[np.minimum.accumulate(rank - shift) + shift]


def uniform(latency: np.ndarray, per_byte: np.ndarray) -> bool:
    """Whether one copy fit serves every pair of distinct devices."""
    off = ~np.eye(len(latency), dtype=bool)
    return len(latency) < 2 or (np.ptp(latency[off]) == 0 and np.ptp(per_byte[off]) == 0)


class RangeMin:
    """Minima of ``values[row, lo … hi]`` for fixed queries ``(row, lo, hi)`` (``inf`` when
    empty), over any ``values``: minima over power-of-two spans, every span length kept, each
    range answered as the two (overlapping) spans of the largest length that fits in it (one
    gather for all queries)."""

    def __init__(self, row: np.ndarray, lo: np.ndarray, hi: np.ndarray, shape: tuple[int, int]) -> None:
        width = shape[1] + 1  # a last column of inf, for empty ranges
        empty = hi < lo
        level = np.where(empty, 0, np.floor(np.log2(np.maximum(hi - lo + 1, 1))).astype(np.intp))
        base = level * (shape[0] * width) + row * width
        self.left = np.where(empty, base + width - 1, base + lo)
        self.right = np.where(empty, base + width - 1, base + hi - (1 << level) + 1)
        # per span length 2^k, its minima from each column (inf where the span would run past the end)
        self.spans = np.full((int(level.max(initial=0)) + 1, shape[0], width), math.inf)

    def of(self, values: np.ndarray, plus: np.ndarray, queries: np.ndarray | None = None,
           columns: tuple[int, int] | None = None) -> np.ndarray:
        """Each query's minimum of ``values + plus`` (of the ``queries`` given, else all); given
        ``columns`` (first, last), the queries lie within them and only those are read."""
        spans = self.spans
        if columns is None:
            lo, hi = 0, spans.shape[2] - 2
            np.add(values, plus, out=spans[0, :, :-1])
        else:
            lo, hi = columns
            np.add(values[:, lo:hi + 1], plus[:, lo:hi + 1], out=spans[0, :, lo:hi + 1])
        for level in range(1, len(spans)):
            half = 1 << (level - 1)
            end = hi - 2 * half + 2  # one past the last span of this length within the columns
            if end <= lo:
                break  # no query within the columns is that long
            below = spans[level - 1]
            np.minimum(below[:, lo:end], below[:, lo + half:end + half], out=spans[level, :, lo:end])
        flat = spans.reshape(-1)
        if queries is None:
            return np.minimum(flat[self.left], flat[self.right])
        return np.minimum(flat[self.left[queries]], flat[self.right[queries]])


def power_spans(values: Any, combine: Callable[[np.ndarray, np.ndarray], np.ndarray], fill: float,
                axis: int = 0) -> np.ndarray:
    """``[level, …]``: ``combine`` of ``values`` over the ``2^level`` entries from each index
    along ``axis`` (``fill`` where a span runs past the end), for every span no longer than that
    axis: a sparse table, whose range queries take two overlapping spans."""
    first = np.asarray(values, dtype=float)
    length = first.shape[axis]
    table = np.empty((max(length.bit_length(), 1), *first.shape))
    table[0] = first
    along = lambda lo, hi: (slice(None),) * axis + (slice(lo, hi),)  # noqa: E731 (a range along axis)
    for level in range(1, len(table)):
        half, last, span = 1 << (level - 1), table[level - 1], table[level]
        combine(last[along(None, -half)], last[along(half, None)], out=span[along(None, -half)])
        combine(last[along(-half, None)], fill, out=span[along(-half, None)])  # past the end: as if with fill
    return table
