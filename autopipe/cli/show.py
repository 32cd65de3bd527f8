"""``python -m autopipe show``: a plan's stages and the simulated timeline of its schedule."""
from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from .._jsonio import write_atomic
from ..planning.plans import Plan, StagePlan
from ..planning.replicas import plan_events
from ..timeline import MIN_WIDTH, Event, render
from ._arguments import at_least, output_path

__all__ = ["add_arguments", "run", "stage_table"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("plan", help="plan JSON written by 'python -m autopipe plan -o'")
    parser.add_argument("--width", type=int, default=72, help="timeline width in characters")
    parser.add_argument("--png", default=None, help="also draw the timeline to this PNG (needs matplotlib)")


def run(args: argparse.Namespace) -> int:
    at_least(args, {"--width": MIN_WIDTH})
    png = output_path(args.png, "--png", [args.plan], "timeline.png", kind="png")
    pyplot = _pyplot() if png is not None else None
    plan = Plan.load(args.plan)
    events = plan_events(plan)
    _check_width(args.width, events)
    drawn = None if png is None else draw_png(pyplot, events, png)  # before printing: a closed stdout loses nothing
    print(stage_table(plan))
    print()
    each = f" of each replica, all {plan.replicas} at once" if plan.replicas > 1 else ""
    print(f"timeline of one iteration{each} ({plan.chunks} micro-batches, checkpoint={plan.checkpoint}; "
          "F/f forward, B/b backward, C/c copy in, G/g gradient copy, A reduction, . idle):")
    print(render(events, args.width))
    if drawn is not None:
        print(f"\ntimeline drawn to {drawn}")
    return 0


def _check_width(width: int, events: list[Event]) -> None:
    """Refuse a timeline too narrow for its axis labels: ``0`` under its first column and the end
    time (``1789.0 ms``) flush with its last would run into each other."""
    axis = render(events, MIN_WIDTH).splitlines()[-1].lstrip()  # "0" and the end time, nothing between
    end = axis[1:]
    if width < len(end):
        raise ValueError(f"--width {width} is too narrow for the timeline's axis labels (0 and {end}): "
                         f"give at least --width {len(end)}")


def stage_table(plan: Plan) -> str:
    """One row per stage: device (index:name; stages of an interleaved plan share an index),
    layers, per-micro-batch times, predicted memory and its largest term
    (:mod:`autopipe.planning.memory`); then each replica's devices."""
    lines = [f"{'stage':>5}  {'device':<10} {'layers':<24} {'F ms':>8} {'B ms':>8} {'R ms':>8} "
             f"{'copy in':>8} {'grad in':>8} {'memory':>10}  largest memory term"]
    for s in plan.stages:
        layers = f"{s.start}-{s.stop - 1} {s.first_layer}..{s.last_layer}"
        device = f"{plan.placement[s.index]}:{s.device}"
        lines.append(f"{s.index:>5}  {device:<10} {layers[:24]:<24} {s.forward_ms:>8.2f} {s.backward_ms:>8.2f} "
                     f"{s.recompute_ms:>8.2f} {s.copy_in_ms:>8.2f} {s.copy_grad_ms:>8.2f} "
                     f"{s.memory_bytes / 2**20:>7.1f} MiB  {_dominant(s)}")
    p = plan.predicted
    lines.append(f"predicted iteration {p.iteration_ms:.2f} ms (forward {p.forward_ms:.2f} + backward "
                 f"{p.backward_ms:.2f}), bubble {100 * p.bubble_fraction:.1f}%, "
                 f"{plan.chunks} x {plan.micro_batch_size} samples"
                 + (f" per replica, reduction +{p.reduction_ms:.2f} ms" if plan.replicas > 1 else ""))
    if plan.replicas > 1:
        lines.append(f"{plan.replicas} replicas (data parallel), {plan.replica_batch_size} samples each; "
                     "stage s of every replica reduces its gradients with the others' (A lane):")
        lines += [f"  replica {r}: stages on {', '.join(group)}" for r, group in enumerate(plan.replica_devices)]
    return "\n".join(lines)


def _dominant(stage: StagePlan) -> str:
    found = stage.dominant_memory()
    if found is None:
        return "- (plan made before memory terms were recorded)"
    name, share = found
    return f"{name} ({share:.0%})"


def _pyplot() -> Any:
    """matplotlib's pyplot on a file backend, or an error saying how to install it."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ValueError("--png needs matplotlib: pip install 'autopipe[plot]' (or pip install matplotlib)") from None
    return plt


def draw_png(plt: Any, events: list[Event], path: str | Path) -> Path:
    """Draw the timeline as horizontal bars, one row per stage lane, to ``path`` (atomically: a
    failed drawing leaves any earlier file whole); returns the path."""
    colours = {"F": "tab:blue", "B": "tab:orange", "R": "tab:red", "C": "tab:green", "G": "tab:purple",
               "A": "tab:brown"}
    rows = sorted({(e.stage, e.lane) for e in events})
    figure, axes = plt.subplots(figsize=(12, 0.5 * len(rows) + 1))
    for y, (stage, lane) in enumerate(rows):
        for e in (e for e in events if (e.stage, e.lane) == (stage, lane)):
            axes.barh(y, e.duration_ms, left=e.start_ms, color=colours.get(e.kind, "grey"), edgecolor="white")
    axes.set_yticks(range(len(rows)), [f"stage {s} {lane}" for s, lane in rows])
    axes.invert_yaxis()
    axes.set_xlabel("ms")
    figure.tight_layout()
    try:
        return write_atomic(path, lambda handle: figure.savefig(handle, format="png"), "png")
    finally:
        plt.close(figure)
