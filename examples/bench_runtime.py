"""Benchmark the runtime: a 2-stage ResNet-18 pipeline on two CPU "devices" vs the plain model.

Every configuration runs one training step (forward + backward, no optimizer) per round and
rounds interleave the configurations, so machine load drifts hit all of them alike; the
figures are medians after warm-up.  One intra-op thread, so each stage has one core.

The "schedule ms" column is the iteration time that the stages' own measured compute times
(the pipeline's last trace, per micro-batch means) give in its ideal schedule (fill-drain or 1F1B)
(simulated, with stages on one device taking turns as the runtime does); the
"overhead" column is how much slower the pipeline really was, i.e. what the runtime itself
costs (waits, copies, Python) beyond the schedule's bubbles and the split's imbalance.

Pipelines only (``replicas=1``; ``bench_parallelism.py`` puts them next to data parallelism).
Splits come from the planner on the committed profile (``profiles/resnet18-128.json``): for each
micro-batch count m the planner's best split at that m under fill-drain and under 1F1B
(``1f1b``, trained with ``Pipeline.train_step``), and the planner's own choice of split,
m, checkpointing and stages per device (it may interleave two stages on each device), and its
best plan with one stage per device; each row prints the planner's predicted time next to the
measured one.  ``--memory-limit`` (default ``auto``: the peak stage memory of the fastest 1F1B
plan without checkpointing) adds two rows planned under that limit per device: the best
fill-drain plan (which must checkpoint to fit) and the planner's choice with
``schedule="auto"`` (1F1B, holding at most ``stages - s`` micro-batches on stage ``s``).
``--balance 7,8`` runs a fixed split instead; ``--distributed`` adds the planner's choice for
torch.distributed.pipelining (one stage per process: 2 processes, 1 thread each), run there, as
speedup over its own single-device run.

Speedups are medians of per-round ratios (each configuration against the plain step of the same
round), which drifts in machine speed between rounds do not move; the "of medians" column is
the plain model's median step over the configuration's, which they do move, printed beside it
because on a noisy machine the two can differ by several percent.  Memory is allocated alike on
every thread (:mod:`autopipe._allocator`), so that the plain model (on the main thread) and the
stages (on worker threads) differ only in what they compute.

    python examples/bench_runtime.py [--rounds 7] [--chunks 1,2,4,8] [--balance 7,8] [--distributed]
                                     [--memory-limit auto|none|BYTES]
"""
from __future__ import annotations

import argparse
import os
import statistics
import threading
import time
from typing import Callable

from autopipe._allocator import steady_memory

MEMORY = steady_memory()  # before torch is imported

import torch  # noqa: E402
import torchvision  # noqa: E402
from torch import nn  # noqa: E402

import autopipe  # noqa: E402
from autopipe.planning.cost import StageLanes  # noqa: E402
from autopipe.planning.plans import placement  # noqa: E402
from autopipe.planning.simulate import simulate  # noqa: E402
from autopipe.planning.solver import PlanningError  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--profile", default="profiles/resnet18-128.json", help="profile to plan from")
    parser.add_argument("--balance", default=None, help="fixed layers per stage instead of the planner's")
    parser.add_argument("--distributed", action="store_true", help="also run the torch.distributed engine")
    parser.add_argument("--chunks", default="1,2,4,8", help="micro-batch counts to run")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--size", type=int, default=128, help="image side")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--checkpoint", default="never", choices=["never", "except_last", "always"])
    parser.add_argument("--memory-limit", default="auto",
                        help="per-device limit for the memory-limit rows: auto, none (no such rows) or bytes")
    args = parser.parse_args()

    torch.set_num_threads(1)
    torch.manual_seed(0)
    x = torch.randn(args.batch, 3, args.size, args.size)
    y = torch.randint(0, 1000, (args.batch,))
    model = torchvision.models.resnet18(weights=None)
    nets, predicted = _pipelines(model, args)
    steps = {"plain": _step(model, x, y), **{name: _step(net, x, y) for name, net in nets.items()}}

    print(f"ResNet-18 chain, batch {args.batch}, 3x{args.size}x{args.size}, 1 thread per stage, "
          f"checkpoint={args.checkpoint}, {MEMORY}, "
          f"load average {os.getloadavg()[0]:.2f} at start")
    print(f"cores available: two threads ran two plain steps {_concurrency(x[:16]):.2f}x as fast as "
          "one thread (a quiet 2-core machine gives ~2x; less means other load)")
    samples = _interleaved(steps, nets, args.rounds)
    times = {name: statistics.median(ms for ms, _ in values) for name, values in samples.items()}
    speedups = {name: statistics.median(p / ms for (p, _), (ms, _) in zip(samples["plain"], values))
                for name, values in samples.items()}
    print(f"{'configuration':44s} {'median ms':>10s} {'speedup':>8s} {'of medians':>10s} {'predicted':>10s} "
          f"{'error':>7s} {'schedule ms':>14s} {'overhead':>9s}")
    for name, ms in times.items():
        ideal = prediction = ""
        if name in nets:
            fill_drain = statistics.median(f for _, f in samples[name])
            overhead = statistics.median(ms / f for ms, f in samples[name]) - 1
            ideal = f"{fill_drain:14.1f} {overhead:+9.1%}"
        if name in predicted:
            prediction = f"{predicted[name]:10.1f} {predicted[name] / ms - 1:+7.1%}"
        print(f"{name:44s} {ms:10.1f} {speedups[name]:7.2f}x {times['plain'] / ms:9.2f}x {prediction:>18s} {ideal}")
    best = max((speedup, name) for name, speedup in speedups.items() if name in nets and "1 stage" not in name)
    one_stage = 1 / speedups["pipeline 1 stage, m=1"] - 1
    print(f"best: {best[1]} at {best[0]:.2f}x; one-stage pipeline vs plain: {one_stage:+.1%}; "
          f"load average {os.getloadavg()[0]:.2f} at end; cores available: {_concurrency(x[:16]):.2f}x")
    choice = next((name for name in nets if name.startswith("planner's choice")), None)
    if choice:
        print(f"the cost model's own ceiling: the planner's choice is predicted at "
              f"{predicted['plain'] / predicted[choice]:.2f}x the predicted one-device step; measured "
              f"{speedups[choice]:.2f}x")


def _pipelines(model: nn.Module, args: argparse.Namespace) -> tuple[dict[str, autopipe.Pipeline], dict[str, float]]:
    """The pipelines to time (they share the model's modules and run one at a time) and the
    planner's predicted iteration ms of each planned one."""
    nets = {"pipeline 1 stage, m=1": autopipe.Pipeline(model, balance=[15], chunks=1, checkpoint=args.checkpoint)}
    predicted: dict[str, float] = {}
    chunk_counts = [int(c) for c in args.chunks.split(",")]
    if args.balance:
        balance = [int(n) for n in args.balance.split(",")]
        for m in chunk_counts:
            nets[f"pipeline {balance}, m={m}"] = autopipe.Pipeline(
                model, balance=balance, devices=["cpu", "cpu"], chunks=m, checkpoint=args.checkpoint)
        return nets, predicted
    profile = autopipe.Profile.load(args.profile)
    plans = {f"planned m={m}": autopipe.plan(profile, ["cpu", "cpu"], batch_size=args.batch, chunks=m,
                                              checkpoint=args.checkpoint, replicas=1) for m in chunk_counts}
    plans["planner's choice"] = autopipe.plan(profile, ["cpu", "cpu"], batch_size=args.batch, replicas=1)
    plans["best not interleaved"] = autopipe.plan(profile, ["cpu", "cpu"], batch_size=args.batch, interleave=1,
                                                  replicas=1)
    plans.update({f"planned 1f1b m={m}": autopipe.plan(profile, ["cpu", "cpu"], batch_size=args.batch, chunks=m,
                                                        checkpoint=args.checkpoint, schedule="1f1b", replicas=1)
                  for m in chunk_counts})
    plans.update(_limited_plans(profile, args))
    predicted["plain"] = autopipe.plan(profile, ["cpu"], batch_size=args.batch, chunks=1).predicted.iteration_ms
    for label, plan in plans.items():
        shared = f" x{plan.interleave}/device" if plan.interleave > 1 else ""
        name = f"{label} {plan.balance}{shared} m={plan.chunks} {plan.checkpoint} {plan.schedule}"
        nets[name] = autopipe.Pipeline(model, plan)
        predicted[name] = plan.predicted.iteration_ms
    if args.distributed:
        choice = autopipe.plan(profile, ["cpu", "cpu"], batch_size=args.batch, engine="distributed")
        from autopipe.distributed.bench import bench_distributed
        result = bench_distributed(choice.balance, choice.chunks, batch_size=args.batch, image_size=args.size)
        print(f"planner's choice for it on {result.line()}")
    return nets, predicted


def _limited_plans(profile: autopipe.Profile, args: argparse.Namespace) -> dict[str, autopipe.Plan]:
    """Fill-drain's best plan and the planner's choice under ``--memory-limit`` per device."""
    if args.memory_limit == "none":
        return {}
    limit = float(args.memory_limit) if args.memory_limit != "auto" else _forcing_limit(profile, args)
    if limit is None:
        print("memory-limit rows left out: no 1F1B plan without checkpointing fits where fill-drain "
              "must checkpoint, at these micro-batch counts")
        return {}
    tag = f"limit {limit / 2**20:.0f} MiB:"
    options = {"batch_size": args.batch, "memory_limit": limit, "replicas": 1}
    return {f"{tag} fill-drain": autopipe.plan(profile, ["cpu", "cpu"], schedule="gpipe", **options),
            f"{tag} planner's choice": autopipe.plan(profile, ["cpu", "cpu"], schedule="auto", **options)}


def _forcing_limit(profile: autopipe.Profile, args: argparse.Namespace) -> float | None:
    """The peak device memory of a 1F1B plan without checkpointing (most micro-batches first)
    under which no fill-drain plan fits without checkpointing, or ``None``."""
    for m in sorted((int(c) for c in args.chunks.split(",")), reverse=True):
        one = autopipe.plan(profile, ["cpu", "cpu"], batch_size=args.batch, chunks=m, checkpoint="never",
                            schedule="1f1b", replicas=1)
        limit = float(max(one.device_memory_bytes))
        try:
            autopipe.plan(profile, ["cpu", "cpu"], batch_size=args.batch, checkpoint="never", memory_limit=limit,
                          replicas=1)
        except PlanningError:
            return limit
    return None


def _step(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> Callable[[], None]:
    """One training step (no optimizer): ``train_step`` on a 1F1B pipeline, else a caller's loss
    and backward."""
    loss_fn = nn.CrossEntropyLoss()

    def step() -> None:
        for p in model.parameters():
            p.grad = None
        if isinstance(model, autopipe.Pipeline) and model.schedule != "gpipe":
            model.train_step(x, target=y, loss_fn=loss_fn)
        else:
            loss_fn(model(x), y).backward()

    return step


def _concurrency(x: torch.Tensor) -> float:
    """How much faster two threads run two independent ResNet-18 steps than one thread runs
    them in turn: the parallelism the machine offers right now."""
    models = [torchvision.models.resnet18(weights=None) for _ in range(2)]

    def step(model: nn.Module) -> None:
        model(x).sum().backward()

    for model in models:
        step(model)
    start = time.perf_counter()
    for model in models:
        step(model)
    sequential = time.perf_counter() - start
    start = time.perf_counter()
    threads = [threading.Thread(target=step, args=(model,)) for model in models]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return sequential / (time.perf_counter() - start)


def _fill_drain_ms(pipe: autopipe.Pipeline) -> float:
    """The iteration time of the pipeline's schedule (fill-drain or 1F1B) over the stage compute
    times in ``pipe``'s last trace: what the pipeline would take with no runtime overhead at
    all (its per-micro-batch means)."""
    events = pipe.last_trace()
    chunks = max(e.micro_batch for e in events) + 1

    def mean(stage: int, kind: str) -> float:
        return sum(e.duration_ms for e in events if e.stage == stage and e.kind == kind) / chunks

    stages = len(pipe.stages)
    lanes = [StageLanes(mean(s, "F"), mean(s, "B"), mean(s, "R"), 0.0, 0.0, 0.0) for s in range(stages)]
    return simulate(lanes, chunks, pipe.checkpoint, placement(stages, pipe.interleave), pipe.schedule).iteration_ms


def _interleaved(steps: dict[str, Callable[[], None]], nets: dict[str, autopipe.Pipeline],
                 rounds: int) -> dict[str, list[tuple[float, float]]]:
    """Per configuration and round: the step's ms and, for a pipeline, the fill-drain ms of
    that same step's trace (0 for the plain model)."""
    for step in steps.values():  # warm-up
        step()
    samples: dict[str, list[tuple[float, float]]] = {name: [] for name in steps}
    for _ in range(rounds):
        for name, step in steps.items():
            start = time.perf_counter()
            step()
            ms = (time.perf_counter() - start) * 1e3
            samples[name].append((ms, _fill_drain_ms(nets[name]) if name in nets else 0.0))
    return samples


if __name__ == "__main__":
    main()
