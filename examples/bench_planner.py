"""Planning time and proven gap on synthetic chains (goal: every case under 1 s, gap ≤ 2%).

Run: ``.venv/bin/python examples/bench_planner.py [--time-limit SECONDS] [--cases NAMES]
[--chunks M,...] [--auto] [LAYERSxDEVICES ...]``.  Each instance is a random chain (tests/synthetic.py:
uneven layer times, batch 64, profiled sizes 1..64) planned with checkpoint="auto", the
micro-batch count chosen and ``plan(..., time_limit=...)``.  Cases:

* ``equal``: one copy fit for every device pair, equal speeds (the original benchmark);
* ``pairs``: a copy fit per device pair and L/20 skips (at least 2);
* ``speeds``: device speeds 1, 1.5 and 2 in turn, one copy fit;
* ``interleaved``: two stages per device (``interleave=2``), one copy fit, equal speeds;
* ``small``: ten random chains of at most 12 layers × 4 devices with per-pair copies, skips and
  mixed speeds (tests/synthetic.py ``small_hard``, which the tests check against brute force
  without a time limit): the slowest and the largest gap (goal: gap 0), once, not per size.

Each line prints the wall time of ``plan()`` end to end, the plan and its gap to the proven lower
bound (0: optimal for the cost model).  ``--placement search`` also searches which device each
stage runs on (a few orders at these sizes; the gap then covers the orders searched).
``--chunks 5,11`` plans each case once per micro-batch count given (``plan(..., chunks=m)``)
instead of choosing it: the exact search then gets most of the time, which is where a step
could run past the limit.  ``--auto`` leaves the stages per device to ``plan()``'s default
(``interleave="auto"``: one and two stages per device, each search a share of the time), as a
user who passes nothing gets: the gap then covers both, and the interleaved search's bound is
the weaker (a chain bound: one micro-batch through the stages, the least copy at each cut over
the device counts searched, no skips).
"""
from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from synthetic import random_profile, small_hard  # noqa: E402

from autopipe.planning.solver import plan  # noqa: E402

DEFAULT = ["100x8", "400x32", "1000x64"]
CASES = ["equal", "pairs", "speeds", "interleaved", "small"]


def bench(case: str, layers: int, devices: int, time_limit: float | None, placement: str,
          chunks: int | None = None, auto: bool = False) -> str:
    rng = random.Random(layers * 1000 + devices)
    pairs = case == "pairs"
    profile = random_profile(rng, layers, devices, per_pair=pairs, skips=max(2, layers // 20) if pairs else 0,
                             sizes=(1, 2, 4, 8, 16, 32, 64))
    profile.batch_size = 64
    speeds = [(1.0, 1.5, 2.0)[d % 3] for d in range(devices)] if case == "speeds" else None
    start = time.perf_counter()
    chosen = plan(profile, speeds=speeds, time_limit=time_limit, placement=placement, chunks=chunks,
                  interleave="auto" if auto else 2 if case == "interleaved" else 1)
    seconds = time.perf_counter() - start
    gap = chosen.predicted.gap or 0.0
    shared = "" if chosen.interleave == 1 else f" ({chosen.interleave} a device)"
    return (f"{case:>11} {layers:>5} x {devices:>3}: {seconds:6.2f} s  gap {100 * gap:6.2f}%  -> "
            f"{len(chosen.stages)} stages{shared}, m={chosen.chunks}, {chosen.checkpoint}, "
            f"{chosen.predicted.iteration_ms:.1f} ms (bound {chosen.predicted.lower_bound_ms:.1f})")


def bench_small(time_limit: float | None) -> str:
    slowest, widest = 0.0, 0.0
    for profile, speeds in small_hard(random.Random(17)):
        start = time.perf_counter()
        chosen = plan(profile, speeds=speeds, interleave=1, time_limit=time_limit)
        slowest, widest = max(slowest, time.perf_counter() - start), max(widest, chosen.predicted.gap or 0.0)
    return f"{'small':>11}  <=12 x <=4: {slowest:6.2f} s  gap {100 * widest:6.2f}%  (slowest and widest of 10)"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("sizes", nargs="*", default=DEFAULT, help="LAYERSxDEVICES, e.g. 1000x64")
    parser.add_argument("--time-limit", type=float, default=1.0, help="plan()'s time_limit (0: none)")
    parser.add_argument("--cases", default=",".join(CASES), help=f"comma-separated, of {CASES}")
    parser.add_argument("--placement", default="given", choices=["given", "search"],
                        help="plan()'s placement: also search which device each stage runs on")
    parser.add_argument("--chunks", default="", help="comma-separated micro-batch counts to fix, one run each")
    parser.add_argument("--auto", action="store_true", help="plan()'s default interleave='auto' for every case")
    args = parser.parse_args()
    counts = [int(m) for m in args.chunks.split(",") if m] or [None]
    for case in args.cases.split(","):
        if case == "small":
            print(bench_small(args.time_limit or None), flush=True)
            continue
        for size in args.sizes:
            layers, devices = (int(v) for v in size.lower().split("x"))
            for chunks in counts:
                print(bench(case, layers, devices, args.time_limit or None, args.placement, chunks, args.auto),
                      flush=True)
    print("goal: every case under 1 s with gap <= 2%")


if __name__ == "__main__":
    main()
