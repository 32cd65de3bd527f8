"""Planning time of the exact solver on synthetic chains (goal: 1,000 layers x 64 devices < 1 s).

Run: ``.venv/bin/python examples/bench_planner.py [--limit SECONDS] [LAYERSxDEVICES ...]``.
Each instance is a random chain (tests/synthetic.py: uneven layer times, one copy fit for every
device pair, batch 64, profiled sizes 1..64) planned with checkpoint="auto" and the micro-batch
count chosen.  Each time is of ``plan()`` end to end: the cost model, the search and the plan
record (the profile's digest included).  An instance still running after ``--limit`` seconds is
reported as not finished.
"""
from __future__ import annotations

import argparse
import random
import signal
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from synthetic import random_profile  # noqa: E402

from autopipe.planning.solver import plan  # noqa: E402

DEFAULT = ["100x8", "200x16", "400x32", "1000x64", "10000x8"]


class OutOfTime(Exception):
    """The instance ran past the time limit."""


def _alarm(signum: int, frame: object) -> None:
    raise OutOfTime


def bench(layers: int, devices: int, limit: int) -> str:
    profile = random_profile(random.Random(layers * 1000 + devices), layers, devices, per_pair=False,
                             sizes=(1, 2, 4, 8, 16, 32, 64))
    profile.batch_size = 64
    signal.signal(signal.SIGALRM, _alarm)
    signal.alarm(limit)
    start = time.perf_counter()
    try:
        chosen = plan(profile)
    except OutOfTime:
        return f"{layers:>6} layers x {devices:>3} devices: not finished after {limit} s"
    finally:
        signal.alarm(0)
    seconds = time.perf_counter() - start
    return (f"{layers:>6} layers x {devices:>3} devices: {seconds:8.2f} s  -> {len(chosen.stages)} stages, "
            f"m={chosen.chunks}, checkpoint={chosen.checkpoint}, {chosen.predicted.iteration_ms:.1f} ms")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("sizes", nargs="*", default=DEFAULT, help="LAYERSxDEVICES, e.g. 1000x64")
    parser.add_argument("--limit", type=int, default=120, help="seconds per instance before giving up")
    args = parser.parse_args()
    for size in args.sizes:
        layers, devices = (int(v) for v in size.lower().split("x"))
        print(bench(layers, devices, args.limit), flush=True)
    print("goal: 1000 layers x 64 devices under 1 s")


if __name__ == "__main__":
    main()
