"""How far one cell's own skip potentials raise its bound: the relaxation's strength where the gap stays.

Run: ``.venv/bin/python examples/cell_potentials.py [LAYERSxDEVICES] [--steps N] [--width W]``.
The ``pairs`` case of ``examples/bench_planner.py`` (per-pair copies, L/20 skips) is planned with
``time_limit=1.0``; then one cell of lane caps is taken around that plan's largest forward and
backward lanes (``W`` either side, relative) and the subgradient ascent of
:mod:`autopipe.planning.refinement` (Polyak's step scaled by its ``_STEP``, aimed at the plan's
time) is run on that cell alone, with potentials of its own, printing the cell's lower bound
every 20 steps.  The planner shares one set of potentials between all cells; this shows what a
set per cell would reach, and at what cost in DPs (one per step).
"""
from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from synthetic import random_profile  # noqa: E402

from autopipe.planning.candidates import Candidate  # noqa: E402
from autopipe.planning.completion import Completions  # noqa: E402
from autopipe.planning.cost import CostModel  # noqa: E402
from autopipe.planning.refinement import _STEP  # noqa: E402
from autopipe.planning.solver import plan  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("size", nargs="?", default="400x32", help="LAYERSxDEVICES")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--width", type=float, default=0.002, help="the cell's caps, relative, either side")
    args = parser.parse_args()
    layers, devices = (int(v) for v in args.size.lower().split("x"))
    rng = random.Random(layers * 1000 + devices)  # the benchmark's instance
    profile = random_profile(rng, layers, devices, per_pair=True, skips=max(2, layers // 20),
                             sizes=(1, 2, 4, 8, 16, 32, 64))
    profile.batch_size = 64
    chosen = plan(profile, time_limit=1.0, interleave=1)
    model = CostModel(profile, list(profile.devices), np.ones(devices), 64)
    candidate = Candidate.all(model, [chosen.chunks], [chosen.checkpoint], devices)[0]
    stages = model.evaluate([0] + [stage.stop for stage in chosen.stages], chosen.chunks, chosen.checkpoint).stages
    lane_x = max(max(s.forward, s.copy_in) for s in stages)
    lane_y = max(max(s.backward + s.recompute, s.copy_grad) for s in stages)
    best = chosen.predicted.iteration_ms
    print(f"{args.size}: plan {best:.1f} ms (m={chosen.chunks}), its 1 s bound {chosen.predicted.lower_bound_ms:.1f}; "
          f"one cell of caps {args.width:.2%} either side of its lanes ({lane_x:.2f}, {lane_y:.2f} ms)")
    # caps then lower caps, forward lane then backward
    cell = tuple(np.array([lane * (1 + side * args.width)]) for side in (1, -1) for lane in (lane_x, lane_y))
    potentials = np.zeros(candidate.receive.shape[:2])
    highest, start = -np.inf, time.perf_counter()
    for step in range(args.steps + 1):
        completions = Completions(candidate, model.speeds[:devices], cell, skips=True, potentials=potentials)
        bound = float(completions.cell_bounds()[0])
        highest = max(highest, bound)
        if step % 20 == 0:
            print(f"  step {step:4d}: bound {highest:8.1f} ms, {(best - highest) / best:6.2%} under the plan, "
                  f"{time.perf_counter() - start:5.1f} s")
        direction = completions.directions(np.array([0]))[0]
        potentials = potentials + _STEP * max(best - bound, 0.0) * direction


if __name__ == "__main__":
    main()
