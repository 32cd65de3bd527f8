"""Searching which device each stage runs on: exact over every order of a few devices (brute
force over orders and splits), a few orders beyond, and the plan runs where it says."""
from __future__ import annotations

import itertools
import math
import random

import numpy as np
import pytest
from synthetic import make_profile, random_profile
from helpers import brute_force

from autopipe.planning import placement
from autopipe.planning.cost import CostModel
from autopipe.planning.solver import PlanningError, candidate_chunks, plan


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
    orders, complete = placement.orders(model, "search", np.full(7, 2.0**36))
    assert not complete and tuple(range(7)) in orders and (2, 6, 4, 0, 1, 3, 5) in orders
    chosen = plan(profile, speeds=speeds, placement="search", interleave=1, memory_limit="64GiB", time_limit=None)
    assert chosen.options["placements_searched"] == len(orders)
    assert chosen.devices == [f"cuda:{d}" for d in chosen.options["device_order"][: len(chosen.stages)]]
    # equal speeds and one copy fit: the order cannot matter, only the given one is searched
    same = CostModel(profile, profile.devices, [1.0] * 7, profile.batch_size, 2.0)
    assert placement.orders(same, "search", np.full(7, 2.0**36)) == ([tuple(range(7))], True)
    # memory limits that differ make it matter: most memory first and least first are among the orders
    limits = np.array([2.0, 8.0, 1.0, 8.0, 4.0, 2.0, 1.0]) * 2**30
    orders, complete = placement.orders(same, "search", limits)
    assert not complete and {(1, 3, 4, 0, 5, 2, 6), (2, 6, 0, 5, 4, 1, 3)} <= set(orders)
    with pytest.raises(ValueError, match="placement 'random' is not one of"):
        plan(profile, placement="random")


def test_memory_limits_that_differ_make_the_order_matter() -> None:
    """Equal devices with one copy fit but per-device memory limits: the stage holding the
    parameters needs the large device, so the order is searched, each device's limit moving
    with it (only the given order was searched: a plan 48% slower was called optimal, and a
    limit the swapped order fits was refused)."""
    profile = make_profile([1.0] * 4, devices=2, saved_bytes=[20000, 1000, 1000, 1000],
                           param_bytes=[100000, 0, 0, 0], output_bytes=10)
    swapped = plan(profile, 2, memory_limit=[10**12, 450000], interleave=1, time_limit=None)
    for small in (450000, 400000):
        chosen = plan(profile, 2, memory_limit=[small, 10**12], placement="search", interleave=1, time_limit=None)
        assert chosen.predicted.iteration_ms == pytest.approx(swapped.predicted.iteration_ms, rel=1e-12)
        assert chosen.options["device_order"] == [1, 0] and chosen.predicted.gap == 0
    # in the order given none fits, but that is not all plans: the error says so (it said none fits)
    with pytest.raises(PlanningError, match=r"^no plan was found within the memory limits \(400000, 1000000000000 "
                                            r"bytes per device\) with the devices in the order given \(placement="):
        plan(profile, 2, memory_limit=[400000, 10**12], interleave=1, time_limit=None)
    rng = random.Random(3)
    for _ in range(12):
        layers, devices = rng.randint(2, 6), rng.randint(2, 3)
        profile = random_profile(rng, layers, devices, skips=rng.randint(0, 2), per_pair=False)
        model = CostModel(profile, profile.devices, [1.0] * devices, profile.batch_size, "momentum")
        chunks = candidate_chunks(profile.batch_size, profile.batch_sizes)
        peak = model.evaluate((0, layers), 1, "never").peak_memory
        limits = np.array([peak * rng.uniform(0.2, 0.8) if rng.random() < 0.7 else math.inf for _ in range(devices)])
        assert placement.orders(model, "search", limits)[1] is True
        expected = min(brute_force(placement.permuted(model, order), chunks, ["never", "except_last"],
                                   limits[list(order)]) for order in itertools.permutations(range(devices)))
        if math.isinf(expected):
            with pytest.raises(PlanningError, match="no plan fits"):
                plan(profile, memory_limit=limits.tolist(), placement="search", interleave=1, time_limit=None)
            continue
        chosen = plan(profile, memory_limit=limits.tolist(), placement="search", interleave=1, time_limit=None)
        assert chosen.predicted.iteration_ms == pytest.approx(expected, rel=1e-9) and chosen.predicted.gap == 0
        given = limits[chosen.options["device_order"]]
        assert all(stage.memory_bytes <= limit for stage, limit in zip(chosen.stages, given))
