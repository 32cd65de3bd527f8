"""Planning time and proven gap on random instances of every kind the planner takes.

Run: ``.venv/bin/python examples/bench_planner_random.py [--count N] [--seed S] [--time-limit SECONDS]``.

``examples/bench_planner.py`` measures twelve fixed cases; this draws ``N`` random ones (seeds
``S … S+N-1``): 6 to 300 layers on 2 to 32 devices, one copy fit or one per device pair, 0 to
30 skips, equal or mixed speeds (1, 1.5, 2), no memory limit or 2, 5 or 20 MB per device, each
checkpoint choice, ``interleave`` 1, 2 or ``"auto"``, schedule ``"gpipe"``, ``"1f1b"`` or
``"auto"`` and sometimes ``placement="search"``; ``--fixed-chunks`` also gives each a micro-batch
count (from its own random stream: the instances stay the same).  Each call is timed end to
end.  It prints, per kind of search, how many plans were found, how many within a gap of 2%,
the median and largest gap, and the slowest call as a share of the limit; then the calls that
took more than 10% over their limit (with their seed, to rerun one) and those that raised
anything but the planner's documented errors.

To compare two versions of the planner, ``--save FILE`` writes each plan's predicted time and
bound by seed (JSON), and a run of the other version with ``--against FILE`` prints, per kind,
on how many instances its plan takes less or more time than the saved one, and the ratios.
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from synthetic import random_profile  # noqa: E402

from autopipe.errors import PlanningError  # noqa: E402
from autopipe.planning.solver import plan  # noqa: E402


def instance(seed: int, fixed_chunks: bool = False) -> tuple[Any, dict[str, Any]]:
    """The profile and ``plan()`` options of one random instance (with ``fixed_chunks``, also
    a micro-batch count, drawn after the rest)."""
    rng = random.Random(seed)
    layers, devices = rng.choice([6, 20, 60, 150, 300]), rng.choice([2, 4, 8, 16, 32])
    profile = random_profile(rng, layers, devices, per_pair=rng.random() < 0.6,
                             skips=rng.choice([0, 2, 5, 15, 30]), sizes=(1, 2, 4, 8, 16, 32))
    profile.batch_size = 32
    options: dict[str, Any] = {}
    if rng.random() < 0.4:
        options["speeds"] = [rng.choice([1.0, 1.5, 2.0]) for _ in range(devices)]
    if rng.random() < 0.3:
        options["memory_limit"] = rng.choice([2e6, 5e6, 2e7])
    options["interleave"] = rng.choice([1, "auto", 2])
    options["schedule"] = rng.choice(["gpipe", "gpipe", "auto", "1f1b"])
    options["checkpoint"] = rng.choice(["auto", "never", "always", "except_last"])
    if rng.random() < 0.2 and devices <= 8:
        options["placement"] = "search"
    if fixed_chunks:
        options["chunks"] = random.Random(-1 - seed).choice([2, 4, 8, 16, 32])
    return profile, options


def kind(options: dict[str, Any]) -> str:
    """Which searches bound the plan: fill-drain alone, with interleaved splits, or with 1F1B."""
    if options["schedule"] != "gpipe":
        return "with 1F1B"
    return "fill-drain" if options["interleave"] == 1 else "fill-drain + interleaved"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--count", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--time-limit", type=float, default=1.0)
    parser.add_argument("--fixed-chunks", action="store_true", help="also fix each instance's micro-batch count")
    parser.add_argument("--save", help="write each plan's predicted time and bound by seed to this JSON file")
    parser.add_argument("--against", help="compare the plans' times with those --save wrote to this file")
    args = parser.parse_args()
    times: dict[str, tuple[str, float, float]] = {}  # by seed: kind, predicted ms, lower bound ms
    gaps: dict[str, list[float]] = {}
    slowest: dict[str, float] = {}
    over, failed, refused = [], [], 0
    for seed in range(args.seed, args.seed + args.count):
        profile, options = instance(seed, args.fixed_chunks)
        start = time.perf_counter()
        try:
            chosen = plan(profile, time_limit=args.time_limit, **options)
        except PlanningError:  # no plan fits the memory limit, or none was found in time
            chosen = None
            refused += 1
        except Exception as error:  # noqa: BLE001 - reported, not hidden
            chosen = None
            failed.append(f"seed {seed}: {type(error).__name__}: {error}")
        seconds = time.perf_counter() - start
        group = kind(options)
        slowest[group] = max(slowest.get(group, 0.0), seconds)
        if seconds > 1.1 * args.time_limit:
            over.append(f"seed {seed}: {seconds:.2f} s ({len(profile.layers)} layers x {len(profile.devices)} devices, "
                        f"{options})")
        if chosen is not None:
            gaps.setdefault(group, []).append(chosen.predicted.gap or 0.0)
            times[str(seed)] = (group, chosen.predicted.iteration_ms, float(chosen.predicted.lower_bound_ms))
    print(f"{args.count} random instances (seeds {args.seed}-{args.seed + args.count - 1}), "
          f"time_limit={args.time_limit} s{', chunks fixed' if args.fixed_chunks else ''}; "
          f"{refused} refused with a PlanningError")
    for group in ("fill-drain", "fill-drain + interleaved", "with 1F1B"):
        found = sorted(gaps.get(group, []))
        if found:
            print(f"{group:>25}: {len(found):3} plans, {sum(g <= 0.02 for g in found):3} with gap <= 2%, "
                  f"median gap {100 * statistics.median(found):5.1f}%, largest {100 * found[-1]:5.1f}%, "
                  f"slowest call {slowest[group] / args.time_limit:4.2f} x the limit")
    print(f"calls more than 10% over the limit: {len(over)}")
    for line in over:
        print("  " + line)
    print(f"calls that failed otherwise: {len(failed)}")
    for line in failed:
        print("  " + line)
    if args.save:
        Path(args.save).write_text(json.dumps(times))
    if args.against:
        compare(times, json.loads(Path(args.against).read_text()))


def compare(times: dict[str, tuple[str, float, float]], saved: dict[str, list]) -> None:
    """Per kind, the instances planned by both runs whose plan takes less (or more) time in this
    one, by more than 0.1%, and the ratios of plan times and of bounds (this run's over the saved)."""
    print(f"against the saved plans ({len(saved)}):")
    for group in ("fill-drain", "fill-drain + interleaved", "with 1F1B"):
        both = [(times[seed], saved[seed]) for seed in times if seed in saved and times[seed][0] == group]
        if not both:
            continue
        ratios = sorted(mine[1] / theirs[1] for mine, theirs in both)
        bounds = [mine[2] / theirs[2] for mine, theirs in both if theirs[2] > 0]
        print(f"{group:>25}: {len(both):3} plans, {sum(r < 0.999 for r in ratios):3} take less time, "
              f"{sum(r > 1.001 for r in ratios):3} more; time ratio {ratios[0]:.3f}-{ratios[-1]:.3f} "
              f"(median {statistics.median(ratios):.3f}); bound higher on {sum(b > 1.001 for b in bounds)}, "
              f"lower on {sum(b < 0.999 for b in bounds)}")


if __name__ == "__main__":
    main()
