"""One exact DP of the planner: the least predicted iteration time over the splits of the layers
onto the devices in order, for one micro-batch count and checkpoint mode, strictly under an upper
bound (:mod:`autopipe.planning.solver` runs it over those and supplies the bound).

Why a label-setting DP and not a min-max DP: the iteration time ``S + (m-1)·X + V`` (see
:mod:`autopipe.planning.cost`) mixes a sum ``S`` that depends on the split (speeds differ, copies come
and go) with two bottlenecks (forward lane maximum ``X``, backward lanes through ``M`` and ``V``).
So the DP over (layers covered, stages used) keeps, per state, labels ``(X, M, V, S)``.  Every
component only ever raises the final time, and the layers after a state add the same lanes to
all of its labels, so label ``a`` is never worse than ``b`` when

    S_a + (m-1)·(X_a - X_b)⁺ + max((V_a - V_b)⁺, (m-2)·(M_a - M_b)⁺) ≤ S_b

(a later lane ``x`` adds ``(m-1)·max(X, x)``, which grows by at most ``(m-1)·(X_a - X_b)⁺``
from ``b`` to ``a``; ``V`` by the recurrence of :mod:`autopipe.planning.cost` likewise): ``b`` is
dropped (:func:`_led` for the likely ``a``, then :func:`_dominated` for all).  This is stronger
than Pareto dominance — a little more ``X`` can be worth much less ``S`` — and still only drops
a label that some kept label beats however the plan goes on.  Before that, ``X`` is raised to
what the later lanes reach anyway, and ``M`` too unless ``except_last``
(:meth:`Search._raise`): no final time changes, more labels become comparable.

Labels are also cut by a lower bound against the best plan found so far (branch and bound): a
cheap one from averages (:meth:`Search._lower_bound`), then the grid of lane caps of
:class:`~autopipe.planning.completion.Completions`, which sees that cheap cuts unbalance the lanes; and a
stage whose lanes alone would rule out beating the bound (:meth:`Search._caps`) or that
overflows its device's memory is never formed.  Each stage is a few numpy operations over flat
arrays: every label of every state × every stop its start allows, then the new labels grouped
by state and filtered.

Skips whose copy cost depends on the device pair need state: a label's key records, for each skip
still open, its producer stage and the consumer stage it is committed to (the producer's gradient
lane is known only with the consumer); a stage that does not pop a skip committed to it is
invalid.  With one copy fit for every pair the cost depends only on the cut positions and the key
stays empty.  Relayed skips (``engine="distributed"``) never need it: each hop's copy is
charged to the neighbours it joins, known from the stage index and the cut positions.
"""
from __future__ import annotations

import itertools
import math
import time
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import Callable, Iterator

import numpy as np

from ._budget import Budget
from ._arrays import Columns, largest_after, pairs, prefix_argmin, ragged_arange, states, uniform
from .candidates import Candidate, Choice, reach
from .completion import Completions
from .cost import CostModel

__all__ = ["Search"]

# Key: ((skip index, producer, consumer), ...).
_Key = tuple
# Label pairs compared at once by _dominated.
_PAIRS = 2_000_000


# Most label-move pairs (or moves) one stage of the DP may list, at about 80 bytes each.  Beyond,
# the keyed search (per-pair copies with skips on many devices) stops as out of time.
_MOST = 10_000_000


# Seconds per row a step of the DP is foreseen to take before one of its kind has been timed
# (measured: 5-7e-7 for the moves of per-pair copies with skips at 300 layers x 4 devices).
_PER_ROW = 3e-7
# Rows from which a step's time is mostly per row (a stage of the DP also costs a few
# milliseconds whatever its size): only such steps set the rate.  The moves of a stage are also
# priced in blocks of this many rows, the time checked between them: a rate learned on other
# moves can be a third of theirs (memory-limited moves at 300 layers x 4 devices).
_RATED = 100_000
# What a step is foreseen to take, in its kind's slowest seconds per row so far: the rate varies
# with the labels per state, whose dominance tests grow as their square (at 400 layers x 32
# devices a stage of 3.2M label-move pairs took at least 1.7 times the rate of the one before).
_SLACK = 2.0


class _OutOfTime(Exception):
    """The budget ran out in the middle of a stage of the DP, or the stage would not fit in
    memory (:data:`_MOST`)."""


@dataclass(frozen=True)
class _Labels(Columns):
    """The labels after some stage as parallel arrays, sorted by state ``(start, key)``: where
    the next stage starts, the key's index in :attr:`Search.keys`, forward lane maximum ``X``,
    backward lane maximum ``M``, ``V``, lane sum ``S`` and the label's index in this stage's
    trace (``-1`` for the empty start)."""

    start: np.ndarray
    key: np.ndarray
    x: np.ndarray
    peak: np.ndarray
    v: np.ndarray
    total: np.ndarray
    ref: np.ndarray


@dataclass(frozen=True)
class _Moves(Columns):
    """Stages that may follow the labels of a state (``state``: its index among the states),
    sorted by state: their stop, lanes and the key after them."""

    state: np.ndarray
    stop: np.ndarray
    copy_in: np.ndarray
    forward: np.ndarray
    back: np.ndarray
    skipped: np.ndarray
    copy_grad: np.ndarray
    key: np.ndarray


class Search:
    """One DP over splits for one :class:`Candidate`, cut by an upper bound ``best`` and the
    lower bounds of ``completions`` (built with caps no smaller than ``best`` allows)."""

    def __init__(self, model: CostModel, candidate: Candidate, limits: np.ndarray, best: float,
                 completions: Completions, budget: Budget | None = None) -> None:
        self.model = model
        self.budget = budget
        self.finished = False  # whether run() searched every split (else the budget ran out)
        self.candidate = candidate
        self.m = candidate.chunks
        self.mode = candidate.effective
        self.costs = candidate.costs
        self.limits = limits
        self.best = best
        self.completions = completions
        self.bounds: tuple[int, ...] | None = None
        self.devices = len(limits)
        self.keyed = (bool(model.chain.skips) and not model.relayed
                      and not uniform(model.latency, model.per_byte))
        self.keys: list[_Key] = [()]
        self.key_index: dict[_Key, int] = {(): 0}
        speeds = model.speeds[: self.devices]
        self.rest_forward = self.costs.forward[-1] - self.costs.forward
        self.rest_back = candidate.back[-1] - candidate.back
        self.layer_forward = largest_after(np.diff(self.costs.forward))
        self.layer_back = largest_after(np.diff(candidate.back))
        self.speed_after = np.concatenate((np.cumsum(speeds[::-1])[::-1], [0.0]))
        self.speed_prefix = np.concatenate(([0.0], np.cumsum(speeds)))
        self.top_after = np.concatenate((np.maximum.accumulate(speeds[::-1])[::-1], [0.0]))
        self.trace: list[tuple[np.ndarray, np.ndarray]] = []
        # per kind of step (Search._rated), the most seconds per row it took so far, in every
        # search of this budget: a step over millions of rows takes seconds, so one foreseen to
        # end past the time limit is not started
        self.rates: dict[str, float] = {} if budget is None else budget.rates

    def run(self) -> Choice | None:
        """The best split strictly better than ``best``, or ``None``; :attr:`finished` says
        whether every split was searched before the budget ran out."""
        one = np.zeros(1, dtype=int)
        labels = _Labels(one, one, np.zeros(1), np.zeros(1), np.full(1, -math.inf), np.zeros(1), one - 1)
        try:
            for stage in range(self.devices):
                self._check_time()
                labels = self._step(stage, labels)
                if not len(labels.x):
                    break
            self.finished = True
        except _OutOfTime:
            pass
        if self.bounds is None:
            return None
        return Choice(self.bounds, self.m, self.candidate.mode, self.best)

    def _check_time(self, expected: float = 0.0) -> None:
        """Stop if the time is up, or would be after a step ``expected`` to take that long (the
        time left then goes to the other searches)."""
        if self.budget is not None and not self.budget.fits(expected):
            raise _OutOfTime

    @contextmanager
    def _rated(self, kind: str, rows: int) -> Iterator[None]:
        """Run a step over ``rows`` rows only if, at :data:`_SLACK` times the most seconds per row
        of its ``kind`` so far, it is foreseen to end within the time limit (else stop as out of
        time); time it."""
        rate = self.rates.get(kind, _PER_ROW)
        self._check_time(rows * rate * _SLACK)
        start = time.perf_counter()
        yield
        if rows >= _RATED:
            self.rates[kind] = max(rate, (time.perf_counter() - start) / rows)

    def _check_size(self, count: int) -> None:
        """Stop (as out of time) before listing ``count`` rows, if more than :data:`_MOST`."""
        if count > _MOST:
            if self.budget is not None:
                self.budget.crowded = True
            raise _OutOfTime

    def _step(self, stage: int, labels: _Labels) -> _Labels:
        """Every label × every stage ``[start, stop)`` on device ``stage`` its state allows:
        record a finished plan that beats ``best``, return the labels that can still beat it."""
        state, first = states(labels.start, labels.key)
        moves = self._moves(stage, labels.start[first], labels.key[first])
        count = int(np.dot(np.bincount(state, minlength=len(first)), np.bincount(moves.state, minlength=len(first))))
        self._check_size(count)
        with self._rated("pairs", count):
            return self._pair(stage, labels, state, len(first), moves)

    def _pair(self, stage: int, labels: _Labels, state: np.ndarray, count: int, moves: _Moves) -> _Labels:
        """:meth:`_step` on each label (of state ``state[i]``, of ``count``) paired with each
        of its state's moves."""
        label, move = pairs(state, moves.state, count)
        lanes = moves.take(move)
        x, peak, v, total = self._grow(labels, label, lanes)
        parent = labels.ref[label]
        self._finish(stage, lanes.stop, x, v, total, parent)
        if stage + 1 >= self.devices:
            return labels.take(move[:0])
        going = np.flatnonzero(lanes.stop < self.model.layers)
        stops = lanes.stop[going]
        x, peak, v = self._raise(stage, stops, x[going], peak[going], v[going])
        grown = _Labels(stops, lanes.key[going], x, peak, v, total[going], parent[going])
        return self._settle(stage, grown.take(np.flatnonzero(self._lower_bound(stage, grown) < self.best)))

    def _caps(self) -> tuple[float, float]:
        """:meth:`Candidate.caps` with the least lane sum of any plan within the caps the
        completions were built for (every plan better than ``best`` is)."""
        return self.candidate.caps(self.best, self.completions.floor)

    def _moves(self, stage: int, starts: np.ndarray, keys: np.ndarray) -> _Moves:
        """The stages on device ``stage`` from each state ``(starts[i], keys[i])`` whose lanes
        are within :meth:`_caps` and whose memory fits the device."""
        state, stops = self._windows(stage, starts)
        blocks = []
        for lo in range(0, max(len(stops), 1), _RATED):  # a block at a time: the time is checked between
            rows = slice(lo, lo + _RATED)
            with self._rated("moves", len(stops[rows])):
                blocks.append(self._priced(stage, starts, keys, state[rows], stops[rows]))
            self._check_size(sum(len(block.stop) for block in blocks))  # committed skips multiply the rows
        return _Moves.joined(blocks)

    def _priced(self, stage: int, starts: np.ndarray, keys: np.ndarray, state: np.ndarray,
                stops: np.ndarray) -> _Moves:
        """:meth:`_moves` of the stages from ``starts[state[i]]`` to ``stops[i]``."""
        model, costs, speed = self.model, self.costs, self.model.speeds[stage]
        start = starts[state]
        forward = costs.sum(costs.forward, start, stops) / speed
        back = costs.sum(costs.backward, start, stops) / speed
        if self.mode != "never":
            back = back + forward
        forward_cap, backward_cap = self._caps()
        within = np.flatnonzero((forward <= forward_cap) & (back <= backward_cap))
        state, stops, start, forward, back = state[within], stops[within], start[within], forward[within], back[within]
        if math.isfinite(self.limits[stage]):  # pricing memory loops over the skips: only where it may not fit
            memory = model.memory(costs, start, stops, self.m, self.mode, model.held_bytes(costs, start, stops))
            fits = np.flatnonzero(memory <= self.limits[stage])
            state, stops, start, forward, back = state[fits], stops[fits], start[fits], forward[fits], back[fits]
        copy_in = self.candidate.copy_forward[stage - 1, start] if stage else np.zeros(len(stops))
        copy_grad = self.candidate.copy_back[stage, stops]
        skipped = forward if self.mode == "except_last" else np.zeros(len(stops))
        moves = _Moves(state, stops, copy_in, forward, back, skipped, copy_grad, np.zeros(len(stops), dtype=int))
        if self.keyed:
            return self._commit(stage, starts, keys, moves)
        self._add_skips(stage, start, stops, copy_in, copy_grad)
        return moves

    def _windows(self, stage: int, starts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``(state, stop)`` for every stop after each start whose lanes may be within
        :meth:`_caps` (:func:`reach`, which :meth:`_moves` then checks exactly); only the last
        layer on the last device."""
        layers = self.model.layers
        if stage + 1 >= self.devices:
            return np.arange(len(starts)), np.full(len(starts), layers)
        speed = self.model.speeds[stage]
        forward_cap, backward_cap = self._caps()
        last = np.minimum(reach(self.costs.forward, starts, forward_cap * speed),
                          reach(self.candidate.back, starts, backward_cap * speed))
        counts = np.maximum(last - starts, 0)
        total = int(counts.sum())
        self._check_size(total)
        self._check_time(total * self.rates.get("moves", _PER_ROW) * _SLACK)
        state = np.repeat(np.arange(len(starts)), counts)
        return state, starts[state] + 1 + ragged_arange(counts)

    def _add_skips(self, stage: int, start: np.ndarray, stops: np.ndarray, copy_in: np.ndarray,
                   copy_grad: np.ndarray) -> None:
        """Skip copies that depend only on the cuts, in place.  Relayed: every skip crossing the
        cut before ``start`` comes in from ``stage - 1``, every one crossing ``stop`` sends its
        gradient back from ``stage + 1``.  Straight, with one copy fit for all pairs: skips
        received (stash before ``start``, pop before ``stop``) and sent on (stash in the stage,
        pop at or after ``stop``)."""
        model = self.model
        for skip, nbytes in zip(model.chain.skips, self.costs.skip_bytes):
            crosses_start = (skip.stash < start) & (start <= skip.pop)
            crosses_stop = (skip.stash < stops) & (stops <= skip.pop)
            if model.relayed:
                if stage:
                    copy_in += model.copy_ms(stage - 1, stage, nbytes) * crosses_start
                if stage + 1 < self.devices:
                    copy_grad += model.copy_ms(stage + 1, stage, nbytes) * crosses_stop
                continue
            cost = model.copy_ms(0, 1, nbytes) if self.devices > 1 else 0.0
            copy_in += cost * (crosses_start & (skip.pop < stops))
            copy_grad += cost * ((start <= skip.stash) & crosses_stop)

    def _commit(self, stage: int, starts: np.ndarray, keys: np.ndarray, moves: _Moves) -> _Moves:
        """Each move once per way to keep its state's skip commitments, with those copies added
        and the key after.  What a move receives depends on its key and stop, what it sends on
        its start and stop, the key after on what it keeps open and sends: each is worked out
        once per distinct pair (a stage has many more moves than pairs)."""
        span = self.model.layers + 1
        codes, by_key = _distinct(keys[moves.state] * span + moves.stop)
        self._check_time()
        copy_in, kept_id, kept = self._receipts(stage, codes // span, codes % span)
        codes, by_start = _distinct(starts[moves.state] * span + moves.stop)
        count, copy_grad, sent_id, sent = self._sendings(stage, codes // span, codes % span)
        ways = np.where(kept_id[by_key] >= 0, count[by_start], 0)
        total = int(ways.sum())
        self._check_size(total)
        with self._rated("commits", total):  # the ways multiply the rows: foreseen on their own
            row = np.repeat(np.arange(len(ways)), ways)
            choice = np.repeat(np.cumsum(count)[by_start] - count[by_start], ways) + ragged_arange(ways)
            taken = moves.take(row)
            return replace(taken, copy_in=taken.copy_in + copy_in[by_key[row]],
                           copy_grad=taken.copy_grad + copy_grad[choice],
                           key=self._keys_after(kept, sent, kept_id[by_key[row]], sent_id[choice]))

    def _receipts(self, stage: int, keys: np.ndarray, stops: np.ndarray) -> tuple[np.ndarray, np.ndarray, list[_Key]]:
        """Per ``(key, stop)``: the copies in (:meth:`_received`) and the index of the
        commitments kept open in the list returned (``-1`` where the stage breaks one)."""
        kept: dict[_Key, int] = {}
        copy_in, kept_id = np.zeros(len(keys)), np.full(len(keys), -1)
        for index, (key, stop) in enumerate(zip(keys.tolist(), stops.tolist())):
            self._tick(index)
            found = self._received(stage, stop, self.keys[key])
            if found is not None:
                copy_in[index], kept_id[index] = found[0], kept.setdefault(found[1], len(kept))
        return copy_in, kept_id, list(kept)

    def _sendings(self, stage: int, starts: np.ndarray,
                  stops: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, list[_Key]]:
        """Per ``(start, stop)``, its ways to commit the skips it sends (:meth:`_sent`), listed
        one after another: their count; per way the copy of gradients and the index of its
        commitments in the list returned."""
        consumers: dict[tuple[int, int], range] = {}
        sent: dict[_Key, int] = {}
        count, copy_grad, sent_id = np.zeros(len(starts), dtype=int), [], []
        listed = 0  # commitments in the ways listed so far
        for index, (start, stop) in enumerate(zip(starts.tolist(), stops.tolist())):
            self._tick(index)
            ways = self._sent(stage, start, stop, consumers, listed)
            listed += sum(len(entries) for _, entries in ways)
            count[index] = len(ways)
            for copy, entries in ways:
                copy_grad.append(copy)
                sent_id.append(sent.setdefault(entries, len(sent)))
        return count, np.array(copy_grad), np.array(sent_id, dtype=int), list(sent)

    def _keys_after(self, kept: list[_Key], sent: list[_Key], kept_id: np.ndarray, sent_id: np.ndarray) -> np.ndarray:
        """The index in :attr:`keys` of each ``kept[kept_id[i]]`` joined with ``sent[sent_id[i]]``."""
        width = max(len(sent), 1)
        codes, index = _distinct(kept_id * width + sent_id)
        ids = []
        for step, code in enumerate(codes.tolist()):
            self._tick(step)
            ids.append(self._key_id(tuple(sorted(kept[code // width] + sent[code % width]))))
        return np.array(ids, dtype=int).reshape(-1)[index]

    def _tick(self, index: int) -> None:
        """Check the time every 256 steps of a loop."""
        if index % 256 == 0:
            self._check_time()

    def _key_id(self, key: _Key) -> int:
        """The index of ``key`` in :attr:`keys` (labels hold indices: arrays, not tuples)."""
        if key not in self.key_index:
            self.key_index[key] = len(self.keys)
            self.keys.append(key)
        return self.key_index[key]

    def _received(self, stage: int, stop: int, key: _Key) -> tuple[float, _Key] | None:
        """The copies into stage ``stage`` ending at ``stop`` of the skips ``key`` commits to it
        and the commitments kept open; ``None`` if the stage breaks one (it pops a skip committed
        to another stage, or does not pop one committed to it)."""
        copy_in = 0.0
        kept = []
        for entry in key:
            index, producer, consumer = entry
            if self.model.chain.skips[index].pop < stop:
                if consumer != stage:
                    return None
                copy_in += self.model.copy_ms(producer, stage, self.costs.skip_bytes[index])
            elif consumer == stage:
                return None
            else:
                kept.append(entry)
        return copy_in, tuple(kept)

    def _sent(self, stage: int, start: int, stop: int, consumers: dict[tuple[int, int], range],
              listed: int) -> list[tuple[float, _Key]]:
        """One ``(copy of gradients, commitments)`` per choice of consumer stage for each skip
        stage ``[start, stop)`` sends on (``consumers`` caches :meth:`_consumers` by stop and
        pop), after ``listed`` commitments of other stages' ways.  The choices multiply (a
        stage sending ten skips with ten consumers each has 10¹⁰ ways), so their commitments
        are counted (:meth:`_check_size`) before they are listed and the time is checked while
        they are."""
        model, skips, nbytes = self.model, self.model.chain.skips, self.costs.skip_bytes
        sent = [i for i, s in enumerate(skips) if start <= s.stash < stop <= s.pop]
        for i in sent:
            if (stop, skips[i].pop) not in consumers:
                consumers[stop, skips[i].pop] = self._consumers(stage, stop, skips[i].pop)
        options = [consumers[stop, skips[i].pop] for i in sent]
        self._check_size(listed + math.prod(len(choices) for choices in options) * max(len(sent), 1))
        ways = []
        for chosen in itertools.product(*options):
            self._tick(len(ways))
            ways.append((sum(model.copy_ms(u, stage, nbytes[i]) for i, u in zip(sent, chosen)),
                         tuple((i, stage, u) for i, u in zip(sent, chosen))))
        return ways

    def _consumers(self, stage: int, stop: int, pop: int) -> range:
        """The stages that can pop at layer ``pop`` a skip sent on by stage ``stage`` ending at
        ``stop``, in a plan within :meth:`_caps`: stages ``stage+1 … c`` hold layers ``[stop,
        pop]`` and stages ``c …`` (on the devices left) ``[pop, L)``, each at most a cap's work
        at its speed and at least one layer."""
        speeds = self.speed_prefix  # speed of devices 0 … i-1
        loose = 1 + 1e-9  # rounding widens the range
        need = [(prefix[pop + 1] - prefix[stop], prefix[-1] - prefix[pop], cap * loose)
                for prefix, cap in zip((self.costs.forward, self.candidate.back), self._caps())]
        least = max(int(np.searchsorted(speeds, speeds[stage + 1] + between / cap, side="left")) - 1
                    for between, _, cap in need)
        most = min(int(np.searchsorted(speeds, speeds[-1] - after / cap, side="right")) - 1 for _, after, cap in need)
        return range(max(least, stage + 1), min(most, stage + 1 + pop - stop, self.devices - 1) + 1)

    def _grow(self, labels: _Labels, label: np.ndarray,
              lanes: _Moves) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """``X, M, V, S`` of each label ``label[i]`` followed by stage ``i``'s lanes: forward
        ``C, F``; backward (reversed, see :mod:`autopipe.planning.cost`) ``W+R, G``."""
        m2 = self.m - 2
        x = np.maximum(labels.x[label], np.maximum(lanes.copy_in, lanes.forward))
        peak = np.maximum(labels.peak[label], lanes.back)
        v = np.maximum(labels.v[label] - lanes.skipped, lanes.back - lanes.skipped + m2 * peak)
        peak = np.maximum(peak, lanes.copy_grad)
        v = np.maximum(v, lanes.copy_grad + m2 * peak)
        total = labels.total[label] + (lanes.copy_in + lanes.forward + lanes.back + lanes.copy_grad)
        return x, peak, v, total

    def _finish(self, stage: int, stops: np.ndarray, x: np.ndarray, v: np.ndarray, total: np.ndarray,
                parent: np.ndarray) -> None:
        """Record the best plan ending with this stage if it beats ``best``."""
        done = np.flatnonzero(stops == self.model.layers)
        if not len(done):
            return
        final = total[done] + (self.m - 1) * x[done] + v[done]
        best = int(np.argmin(final))
        if final[best] < self.best:
            self.best = float(final[best])
            self.bounds = self._bounds(stage, int(parent[done[best]]))

    def _floors(self, stage: int, stops: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """What the lanes after each stop (``< L``) reach in every completion — forward: the
        least for the whole chain, the work left over the devices left, the largest layer left,
        the copy of the next stage's input; backward likewise without the copy — and that copy."""
        after = stage + 1
        spread, top = self.speed_after[after], self.top_after[after]
        (floor_x, floor_m), next_copy = self.candidate.floors, self.candidate.copy_forward[stage, stops]
        forward = np.maximum(np.maximum(self.rest_forward[stops] / spread, self.layer_forward[stops] / top),
                             np.maximum(floor_x, next_copy))
        back = np.maximum(np.maximum(self.rest_back[stops] / spread, self.layer_back[stops] / top), floor_m)
        return forward, back, next_copy

    def _raise(self, stage: int, stops: np.ndarray, x: np.ndarray, peak: np.ndarray,
               v: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``X`` raised to :meth:`_floors`, which changes no final time (``X`` enters it only
        through ``max(X, later lanes)``) but makes more labels comparable; ``M`` likewise, with
        ``V = (m-1)·M`` along, unless ``except_last`` (whose ``V`` depends on the order of the
        lanes)."""
        forward, back, _ = self._floors(stage, stops)
        x = np.maximum(x, forward)
        if self.mode == "except_last":
            return x, peak, v
        peak = np.maximum(peak, back)
        return x, peak, np.maximum(v, (self.m - 1) * peak)

    def _lower_bound(self, stage: int, labels: _Labels) -> np.ndarray:
        """A cheap lower bound on the final time: the work left at the top speed of the devices
        left and the next stage's input copy add to the sum; each lane maximum is at least its
        :meth:`_floors`."""
        stops = labels.start
        forward, back, next_copy = self._floors(stage, stops)
        weight_x, weight_m = self.candidate.weights
        rest = (self.rest_forward[stops] + self.rest_back[stops]) / self.top_after[stage + 1] + next_copy
        return labels.total + rest + weight_x * np.maximum(labels.x, forward) + weight_m * np.maximum(labels.peak, back)

    def _settle(self, stage: int, labels: _Labels) -> _Labels:
        """The new labels sorted by state and, within one, by their time if nothing followed
        (so only an earlier label can dominate, see :func:`_dominated`); without those an
        earlier leader dominates (cheap), those whose completions cannot beat ``best``, and
        those any earlier label dominates; recorded as the stage's trace."""
        corner = labels.total + (self.m - 1) * labels.x + labels.v
        labels = labels.take(np.lexsort((labels.total, corner, labels.start * len(self.keys) + labels.key)))
        labels = labels.take(np.flatnonzero(~_led(labels, self.m)))
        least = (labels.total + self.candidate.copy_forward[stage, labels.start]
                 + self.completions.lower_bound(stage + 1, labels.start, labels.x, labels.peak))
        labels = labels.take(np.flatnonzero(least < self.best))
        labels = labels.take(np.flatnonzero(~_dominated(labels, self.m, self._check_time)))
        self.trace.append((labels.start, labels.ref))
        return replace(labels, ref=np.arange(len(labels.x)))

    def _bounds(self, stage: int, ref: int) -> tuple[int, ...]:
        """Stage bounds of the plan whose last stage ``stage`` follows the label ``ref`` of the
        stage before, read back through the trace."""
        stops = [self.model.layers]
        for past in range(stage - 1, -1, -1):
            stops.append(int(self.trace[past][0][ref]))
            ref = int(self.trace[past][1][ref])
        return (0, *reversed(stops))


def _distinct(codes: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The distinct values of ``codes`` and, for each code, the index of its value among them."""
    values, index = np.unique(codes, return_inverse=True)
    return values, index.reshape(-1)


def _beats(labels: _Labels, a: np.ndarray, b: np.ndarray, chunks: int) -> np.ndarray:
    """Whether label ``a[i]`` dominates label ``b[i]`` by the module docstring's rule."""
    return (labels.total[a] + (chunks - 1) * np.maximum(labels.x[a] - labels.x[b], 0)
            + np.maximum(np.maximum(labels.v[a] - labels.v[b], 0),
                         (chunks - 2) * np.maximum(labels.peak[a] - labels.peak[b], 0)) <= labels.total[b])


def _led(labels: _Labels, chunks: int) -> np.ndarray:
    """Which labels the first of their state or the earlier one of least sum dominates: most
    of :func:`_dominated`'s, in a few passes."""
    state = states(labels.start, labels.key)[0]
    later = np.flatnonzero(state[1:] == state[:-1]) + 1
    first = np.searchsorted(state, state, side="left")
    cheapest = prefix_argmin(labels.total, state)
    led = np.zeros(len(state), dtype=bool)
    for leader in (first[later], cheapest[later - 1]):
        led[later] |= _beats(labels, leader, later, chunks)
    return led


def _dominated(labels: _Labels, chunks: int, check_time: Callable[[], None]) -> np.ndarray:
    """Which labels an earlier label of their state dominates, comparing every pair,
    :data:`_PAIRS` at a time, ``check_time`` called before each batch (the pairs grow as the
    square of a state's labels: seconds of them at 400 layers x 32 devices).  Sorted within a
    state by the time if nothing followed, then the sum: a dominating label has neither larger,
    so one after ``b`` that dominates it equals it (and the copy before ``b`` dominates it too)."""
    state = states(labels.start, labels.key)[0]
    count = len(state)
    first = np.searchsorted(state, state, side="left")
    earlier = np.arange(count) - first
    ends = np.cumsum(earlier)
    dominated = np.zeros(count, dtype=bool)
    lo = 0
    while lo < count:
        check_time()
        hi = max(int(np.searchsorted(ends, ends[lo] - earlier[lo] + _PAIRS, side="right")), lo + 1)
        b = np.repeat(np.arange(lo, hi), earlier[lo:hi])
        a = np.repeat(first[lo:hi], earlier[lo:hi]) + ragged_arange(earlier[lo:hi])
        dominated[lo:hi] = np.bincount(b[_beats(labels, a, b, chunks)] - lo, minlength=hi - lo) > 0
        lo = hi
    return dominated
