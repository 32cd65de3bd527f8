"""Benchmark the runtime: a 2-stage ResNet-18 pipeline on two CPU "devices" vs the plain model.

Every configuration runs one training step (forward + backward, no optimizer) per round and
rounds interleave the configurations, so machine load drifts hit all of them alike; the
figures are medians after warm-up.  One intra-op thread, so each stage has one core.

    python examples/bench_runtime.py [--balance 6,9] [--rounds 5] [--chunks 1,2,4,8]
"""
from __future__ import annotations

import argparse
import os
import statistics
import time
from typing import Callable

import torch
import torchvision
from torch import nn

import autopipe


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--balance", default="6,9", help="layers per stage (ResNet-18 has 15)")
    parser.add_argument("--chunks", default="1,2,4,8", help="micro-batch counts to run")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--size", type=int, default=128, help="image side")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--checkpoint", default="never", choices=["never", "except_last", "always"])
    args = parser.parse_args()

    torch.set_num_threads(1)
    torch.manual_seed(0)
    balance = [int(n) for n in args.balance.split(",")]
    x = torch.randn(args.batch, 3, args.size, args.size)
    y = torch.randint(0, 1000, (args.batch,))
    model = torchvision.models.resnet18(weights=None)
    steps: dict[str, Callable[[], None]] = {"plain": _step(model, x, y)}
    one = autopipe.Pipeline(model, balance=[15], devices=["cpu"], chunks=1, checkpoint=args.checkpoint)
    steps["pipeline 1 stage, m=1"] = _step(one, x, y)
    for m in (int(c) for c in args.chunks.split(",")):
        # Every pipeline shares the model's modules; they run one at a time, so that is fine.
        pipe = autopipe.Pipeline(model, balance=balance, devices=["cpu", "cpu"], chunks=m,
                                 checkpoint=args.checkpoint)
        steps[f"pipeline {balance}, m={m}"] = _step(pipe, x, y)

    print(f"ResNet-18 chain, batch {args.batch}, 3x{args.size}x{args.size}, 1 thread per stage, "
          f"checkpoint={args.checkpoint}, load average {os.getloadavg()[0]:.2f} at start")
    times = _interleaved(steps, args.rounds)
    plain = times["plain"]
    print(f"{'configuration':34s} {'median ms':>10s} {'speedup':>8s}")
    for name, ms in times.items():
        print(f"{name:34s} {ms:10.1f} {plain / ms:7.2f}x")
    best = min((ms, name) for name, ms in times.items() if "m=" in name and "1 stage" not in name)
    one_stage = times["pipeline 1 stage, m=1"] / plain - 1
    print(f"best: {best[1]} at {plain / best[0]:.2f}x; one-stage pipeline vs plain: {one_stage:+.1%}; "
          f"load average {os.getloadavg()[0]:.2f} at end")


def _step(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> Callable[[], None]:
    loss_fn = nn.CrossEntropyLoss()

    def step() -> None:
        for p in model.parameters():
            p.grad = None
        loss_fn(model(x), y).backward()

    return step


def _interleaved(steps: dict[str, Callable[[], None]], rounds: int) -> dict[str, float]:
    for step in steps.values():  # warm-up
        step()
    samples: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(rounds):
        for name, step in steps.items():
            start = time.perf_counter()
            step()
            samples[name].append((time.perf_counter() - start) * 1e3)
    return {name: statistics.median(values) for name, values in samples.items()}


if __name__ == "__main__":
    main()
