"""The seed experiment on our devices: ResNet-50 (3x128x128) over two devices, by hand and by the planner.

The PyTorch model-parallel tutorial splits ResNet-50 after ``layer2`` over two GPUs, pipelines
it with a swept "split size" (micro-batch size) and finds the best by hand.  Here the same rows
run on two devices (two CPU cores, one thread each, when there is no GPU), with the planner's
choice, found from the profile alone, beside them.  Every row trains in the same rounds
(one step of each row per round, warm-up rounds dropped), so load from elsewhere falls on all
rows alike; step times are medians, speedups are over the single-device row.

The exhaustive sweep is pruned to fit a few minutes: for each micro-batch count m in
``--grid``, the ``--cuts`` split points whose first stage holds closest to half the profiled
forward+backward time at that micro-batch size (balance by time, as torchgpipe does, but per
micro-batch size: small micro-batches shift the balance towards the late, wide layers).  m = 1
cannot overlap the stages and m = batch is the tutorial sweep's end; both are measured at the
tutorial's split.  The planner's cost model plays no part in the pruning.

    python examples/seed_resnet50.py [--batch-size 32] [--steps 3] [--fresh] [--json results/seed.json]
    python examples/seed_resnet50.py --quick        # a smoke test in under a minute
"""
from __future__ import annotations

import argparse
import copy
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from autopipe._allocator import steady_memory

MEMORY = steady_memory()  # before torch is imported

import torch  # noqa: E402
import torchvision  # noqa: E402
from torch import nn  # noqa: E402

import autopipe  # noqa: E402
from autopipe.bench import Trainer, medians, plan_of, round_robin, synthetic_batch
from autopipe.planning.cost import interpolate
from autopipe.device import resolve_devices
from autopipe.model.fingerprint import environment_fingerprint, first_difference, model_fingerprint
from autopipe._jsonio import write_json_atomic

COMMITTED_PROFILE = Path(__file__).resolve().parent.parent / "profiles" / "resnet50-128.json"
TUTORIAL_CUT = "layer3.0"  # the tutorial's seq1 = conv1..layer2, seq2 = layer3..fc


@dataclass(frozen=True)
class Row:
    """One line of the table: its section and its plan.  The single-device row runs the plain
    model; its one-stage plan only predicts it."""

    section: str
    plan: autopipe.Plan
    single: bool = False

    @property
    def key(self) -> tuple[object, ...]:
        """Rows with equal keys are one measurement; the planner's row is always its own."""
        if self.single:
            return ("single",)
        own = self.section if self.section == "planner's choice" else ""
        return (tuple(self.plan.balance), self.plan.chunks, self.plan.checkpoint, own)


def main(argv: list[str] | None = None) -> int:
    args = _arguments(argv)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    started = time.perf_counter()
    devices = [str(d) for d in resolve_devices(args.devices.split(",") if args.devices else None)][:2]
    if len(devices) != 2:
        raise SystemExit("the seed experiment needs two devices")
    model = torchvision.models.resnet50(weights=None)
    shape = [3, args.image, args.image]
    profile = _profile(model, shape, args, devices)
    rows = _rows(profile, devices, args)
    batch, target = synthetic_batch(model, shape, args.batch_size)
    distinct = {row.key: row.plan.predicted.iteration_ms for row in rows}
    estimate = (args.warmup + args.steps) * sum(distinct.values()) / 1e3
    print(f"ResNet-50, batch {args.batch_size} of {'x'.join(map(str, shape))}, devices {', '.join(devices)} "
          f"(1 thread each), {len(rows)} rows in {len(distinct)} measurements, about {estimate:.0f} s "
          f"predicted; {MEMORY}; load average {os.getloadavg()[0]:.2f}", flush=True)
    steps = _measure(model, rows, batch, target, devices[0], args)
    print(_table(rows, steps))
    verdict = _goals(rows, steps)
    print(verdict["text"])
    print(f"total {time.perf_counter() - started:.0f} s; load average {os.getloadavg()[0]:.2f} at end")
    if args.json:
        document = _document(rows, steps, verdict, args, devices, shape)
        print(f"wrote {write_json_atomic(args.json, document)}")
    return 0


def _arguments(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--image", type=int, default=128, help="image side (default 128)")
    parser.add_argument("--steps", type=int, default=3, help="measured rounds (default 3)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed rounds first (default 1)")
    parser.add_argument("--cuts", type=int, default=4, help="split points in the sweep (default 4)")
    parser.add_argument("--grid", default="2,4,8,16", help="micro-batch counts in the sweep")
    parser.add_argument("--devices", help="two devices, e.g. cpu,cpu or cuda:0,cuda:1")
    parser.add_argument("--profile", default=str(COMMITTED_PROFILE),
                        help="a saved profile to plan from when its batch and model match")
    parser.add_argument("--fresh", action="store_true", help="profile afresh even when --profile matches")
    parser.add_argument("--json", help="also write the table and verdict as JSON")
    parser.add_argument("--quick", action="store_true",
                        help="smoke test: batch 8 of 3x64x64, 2 cuts, m in 2,4, one measured round")
    args = parser.parse_args(argv)
    if args.quick:
        args.batch_size, args.image, args.steps, args.cuts, args.grid = 8, 64, 1, 2, "2,4"
    args.grid = [int(m) for m in args.grid.split(",") if 1 <= int(m) <= args.batch_size]
    return args


def _profile(model: nn.Module, shape: list[int], args: argparse.Namespace, devices: list[str]) -> autopipe.Profile:
    """The committed profile if it was made for this model, input and batch; else a fresh one."""
    path = Path(args.profile)
    if path.exists() and not args.fresh:
        saved = autopipe.Profile.load(path)
        mismatch = first_difference(saved.model, model_fingerprint(autopipe.layer_chain(model)))
        if mismatch is None and saved.batch_size == args.batch_size and saved.input_shape == shape:
            print(f"profile: {path} (batch {saved.batch_size}, measured on {saved.environment.get('cpu')})")
            return saved
        print(f"profile: {path} is for batch {saved.batch_size} of {saved.input_shape}"
              f"{'' if mismatch is None else ' and another model'}; profiling afresh")
    started = time.perf_counter()
    fresh = autopipe.profile(model, torch.randn(args.batch_size, *shape), devices, quiet=args.quick)
    print(f"profile: measured now in {time.perf_counter() - started:.0f} s")
    return fresh


def _rows(profile: autopipe.Profile, devices: list[str], args: argparse.Namespace) -> list[Row]:
    names = [layer.name for layer in profile.layers]
    tutorial = names.index(TUTORIAL_CUT)
    batch = args.batch_size
    split = lambda cut, m: plan_of(profile, devices, [cut, len(names) - cut], m, "never", batch)  # noqa: E731
    one = plan_of(profile, devices, [len(names)], 1, "never", batch)
    rows = [Row("single device", one, single=True), Row("model parallel (tutorial split)", split(tutorial, 1))]
    rows += [Row("tutorial split, split size swept", split(tutorial, m)) for m in _powers(batch) if m > 1]
    rows += [Row("sweep (split point x micro-batches)", split(cut, m))
             for m in args.grid for cut in _balanced_cuts(profile, -(-batch // m), args.cuts)]
    started = time.perf_counter()
    chosen = autopipe.plan(profile, devices, batch_size=batch)
    print(f"planner: balance {chosen.balance}, {chosen.chunks} x {chosen.micro_batch_size}, checkpoint "
          f"{chosen.checkpoint}, chosen from the profile alone in {time.perf_counter() - started:.2f} s")
    return rows + [Row("planner's choice", chosen)]


def _powers(batch: int) -> list[int]:
    """1, 2, 4, … up to the batch: the tutorial's split sizes, scaled to our batch."""
    return sorted({min(1 << k, batch) for k in range(batch.bit_length() + 1)})


def _balanced_cuts(profile: autopipe.Profile, size: int, count: int) -> list[int]:
    """The ``count`` cuts whose first stage holds closest to half the profiled forward+backward
    time at micro-batch size ``size`` (the pruning rule of the sweep)."""
    times = [interpolate({b: s.median_ms for b, s in layer.forward.items()}, size)
             + interpolate({b: s.median_ms for b, s in layer.backward.items()}, size)
             for layer in profile.layers]
    total, running, shares = sum(times), 0.0, []
    for cut in range(1, len(times)):
        running += times[cut - 1]
        shares.append((abs(running / total - 0.5), cut))
    return sorted(cut for _, cut in sorted(shares)[:count])


def _measure(model: nn.Module, rows: list[Row], batch: torch.Tensor, target: torch.Tensor, device: str,
             args: argparse.Namespace) -> dict[tuple[object, ...], Trainer]:
    """One trainer per distinct measurement, all in the same rounds.  Pipelines of one split
    share a model copy (their layers sit on the same devices); each split has its own."""
    copies: dict[tuple[int, ...], nn.Module] = {}
    trainers: dict[tuple[object, ...], Trainer] = {}
    for row in rows:
        if row.key in trainers:
            continue
        if row.single:
            plain = copy.deepcopy(model).to(device)
            trainers[row.key] = Trainer(plain, batch.to(device), target, devices=[device])
            continue
        shared = copies.setdefault(tuple(row.plan.balance), copy.deepcopy(model))
        trainers[row.key] = Trainer(autopipe.Pipeline(shared, row.plan), batch.to(device), target,
                                    devices=row.plan.devices)
    round_robin({str(key): trainer for key, trainer in trainers.items()}, args.steps, args.warmup)
    for trainer in trainers.values():
        if isinstance(trainer.module, autopipe.Pipeline):
            trainer.module.close()
    return trainers


def _describe(row: Row) -> tuple[str, str]:
    plan = row.plan
    if row.single:
        return "-", "-"
    cuts = " | ".join(stage.first_layer for stage in plan.stages[1:])
    mode = "" if plan.checkpoint == "never" else f", ckpt {plan.checkpoint}"
    return f"before {cuts}" if cuts else "one stage", f"{plan.chunks} x {plan.micro_batch_size}{mode}"


def _table(rows: list[Row], trainers: dict[tuple[object, ...], Trainer]) -> str:
    single = medians(trainers[("single",)].times).step_ms
    header = (f"{'row':<36} {'split':<18} {'m x size':<12} {'step ms':>9} {'speedup':>8} "
              f"{'iter ms':>9} {'predicted':>9} {'error':>7}")
    lines = [header, "-" * len(header)]
    for row in rows:
        step = medians(trainers[row.key].times)
        split, micro = _describe(row)
        lines.append(f"{row.section:<36.36} {split:<18.18} {micro:<12} {step.step_ms:9.0f} "
                     f"{single / step.step_ms:7.2f}x {step.iteration_ms:9.0f} "
                     f"{row.plan.predicted.iteration_ms:9.0f} {_error(row.plan, step.iteration_ms):+6.0f}%")
    lines.append("step = zero_grad + forward + loss + backward + SGD step; iter = forward + backward "
                 "(what is predicted); error = (predicted - measured) / measured")
    return "\n".join(lines)


def _error(plan: autopipe.Plan, measured_ms: float) -> float:
    return 100.0 * (plan.predicted.iteration_ms - measured_ms) / measured_ms


def _goals(rows: list[Row], trainers: dict[tuple[object, ...], Trainer]) -> dict[str, object]:
    """The two goals: the planner's choice within 5% of the best hand-swept row, and its
    predicted iteration within 10% of the measured one."""
    step = {row.key: medians(trainers[row.key].times) for row in rows}
    swept = [row for row in rows if not row.single and row.section != "planner's choice"]
    best = min(swept, key=lambda row: step[row.key].step_ms)
    planner = rows[-1]
    behind = 100.0 * (step[planner.key].step_ms / step[best.key].step_ms - 1)
    error = _error(planner.plan, step[planner.key].iteration_ms)
    split, micro = _describe(best)
    text = "\n".join([
        f"best hand-swept row: {best.section}, {split}, {micro}: {step[best.key].step_ms:.0f} ms/step",
        f"goal 1, planner's choice within 5% of it: {behind:+.1f}% -> {'met' if behind <= 5 else 'NOT met'}",
        f"goal 2, planner's prediction within 10% of measured: {error:+.1f}% -> "
        f"{'met' if abs(error) <= 10 else 'NOT met'}",
    ])
    return {"text": text, "planner_vs_best_pct": behind, "prediction_error_pct": error,
            "goal_within_5pct": behind <= 5, "goal_prediction_10pct": abs(error) <= 10}


def _document(rows: list[Row], trainers: dict[tuple[object, ...], Trainer], verdict: dict[str, object],
              args: argparse.Namespace, devices: list[str], shape: list[int]) -> dict[str, object]:
    single = medians(trainers[("single",)].times).step_ms
    table = []
    for row in rows:
        step = medians(trainers[row.key].times)
        table.append({"section": row.section, "step_ms": step.step_ms, "iteration_ms": step.iteration_ms,
                      "speedup": single / step.step_ms, "balance": row.plan.balance, "chunks": row.plan.chunks,
                      "checkpoint": row.plan.checkpoint,
                      "predicted_iteration_ms": row.plan.predicted.iteration_ms})
    goals = {k: v for k, v in verdict.items() if k != "text"}
    return {"kind": "seed_resnet50", "batch_size": args.batch_size, "input_shape": shape, "devices": devices,
            "steps": args.steps, "warmup": args.warmup, "rows": table, "goals": goals,
            "environment": environment_fingerprint(resolve_devices(devices))}


if __name__ == "__main__":
    sys.exit(main())
