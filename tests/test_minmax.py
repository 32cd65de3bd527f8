"""The min-max split DP against brute force."""
from __future__ import annotations

import itertools
import math
import random

import numpy as np
from synthetic import random_profile
from helpers import model_of

from autopipe.planning._minmax import min_max_split
from autopipe.planning.cost import recomputations


def test_min_max_split_against_brute_force() -> None:
    rng = random.Random(5)
    for _ in range(40):
        layers, stages = rng.randint(1, 9), rng.randint(1, 4)
        model = model_of(random_profile(rng, layers, stages, skips=rng.randint(0, 2)),
                         [rng.choice([1.0, 1.5, 2.0]) for _ in range(stages)])
        chunks, mode = rng.choice([1, 2, 4]), rng.choice(["never", "except_last", "always"])
        costs = model.at(model.micro_batch_size(chunks))
        lane = costs.forward * (2.0 if recomputations(mode, chunks) else 1.0) + costs.backward
        def memory(a, b, model=model, costs=costs, chunks=chunks, mode=mode):
            return model.memory(costs, a, b, chunks, mode, model.held_bytes(costs, a, b))

        limit = float(memory(0, layers)) * rng.uniform(0.2, 1.2)

        def fits(s, start, stop, memory=memory, limit=limit):
            return memory(start, stop) <= limit

        best, expected = None, math.inf
        for cuts in itertools.combinations(range(1, layers), stages - 1):
            bounds = (0, *cuts, layers)
            pairs = list(zip(bounds, bounds[1:]))
            if all(memory(a, b) <= limit for a, b in pairs):
                value = max((lane[b] - lane[a]) / v for (a, b), v in zip(pairs, model.speeds))
                if value < expected:
                    best, expected = bounds, value
        found = min_max_split(model, chunks, mode, model.speeds[:stages], fits)
        if best is None:
            assert found is None
            continue
        pairs = list(zip(found, found[1:]))
        assert found[0] == 0 and found[-1] == layers and all(a < b for a, b in pairs)
        assert all(memory(a, b) <= limit for a, b in pairs)
        value = max((lane[b] - lane[a]) / v for (a, b), v in zip(pairs, model.speeds))
        assert np.isclose(value, expected, rtol=1e-12)
