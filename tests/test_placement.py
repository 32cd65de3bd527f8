"""Searching which device each stage runs on: exact over every order of a few devices (brute
force over orders and splits), a few orders beyond, and the plan runs where it says."""
from __future__ import annotations

import itertools
import math
import random

import numpy as np
import pytest
from synthetic import random_profile
from helpers import brute_force

from autopipe.planning import placement
from autopipe.planning.cost import CostModel
from autopipe.planning.solver import candidate_chunks, plan


@pytest.mark.parametrize("seed", range(2))
def test_search_is_exact_over_every_order(seed: int) -> None:
    rng = random.Random(seed)
    for _ in range(6):
        layers, devices = rng.randint(2, 8), rng.randint(2, 3)
        profile = random_profile(rng, layers, devices, skips=rng.randint(0, 2), per_pair=True)
        speeds = [rng.choice([1.0, 1.5, 2.0]) for _ in range(devices)]
        model = CostModel(profile, profile.devices, speeds, profile.batch_size, 2.0)
        chunks = candidate_chunks(profile.batch_size, profile.batch_sizes)
        limits = np.full(devices, math.inf)
        expected = min(brute_force(placement.permuted(model, order), chunks, ["never", "except_last"], limits)
                       for order in itertools.permutations(range(devices)))
        chosen = plan(profile, speeds=speeds, placement="search", interleave=1, time_limit=None)
        assert chosen.predicted.iteration_ms == pytest.approx(expected, rel=1e-9)
        assert chosen.predicted.gap == 0 and chosen.options["placements_searched"] == "all"
        order = chosen.options["device_order"]
        given = plan(profile, speeds=speeds, interleave=1, time_limit=None)
        assert chosen.predicted.iteration_ms <= given.predicted.iteration_ms * (1 + 1e-12)
        # the plan's stages run at the speeds of the devices it names
        recosted = placement.permuted(model, order).evaluate([s.start for s in chosen.stages] + [layers],
                                                            chosen.chunks, chosen.checkpoint)
        assert recosted.iteration_ms == pytest.approx(chosen.predicted.iteration_ms, rel=1e-9)


def test_beyond_a_few_devices_some_orders_and_a_named_device_order() -> None:
    profile = random_profile(random.Random(4), 30, 7, per_pair=False)
    profile.devices = [f"cuda:{d}" for d in range(7)]
    speeds = [1.0, 1.0, 2.0, 1.0, 1.5, 1.0, 2.0]
    model = CostModel(profile, profile.devices, speeds, profile.batch_size, 2.0)
    orders, complete = placement.orders(model, "search")
    assert not complete and tuple(range(7)) in orders and (2, 6, 4, 0, 1, 3, 5) in orders
    chosen = plan(profile, speeds=speeds, placement="search", interleave=1, memory_limit="64GiB", time_limit=None)
    assert chosen.options["placements_searched"] == len(orders)
    assert chosen.devices == [f"cuda:{d}" for d in chosen.options["device_order"][: len(chosen.stages)]]
    # equal speeds and one copy fit: the order cannot matter, only the given one is searched
    same = CostModel(profile, profile.devices, [1.0] * 7, profile.batch_size, 2.0)
    assert placement.orders(same, "search") == ([tuple(range(7))], True)
    with pytest.raises(ValueError, match="placement 'random' is not one of"):
        plan(profile, placement="random")
