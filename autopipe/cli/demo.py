"""``python -m autopipe demo``: profile, plan and train a ResNet here, then hold predictions to the clock."""
from __future__ import annotations

import argparse
import time

import torch

from ..bench import BenchResult, bench_plan, format_bench, synthetic_batch
from ..device import resolve_devices
from ..planning.plans import Plan
from ..profiling.profiler import profile
from ..planning.solver import plan as choose_plan
from ..timeline import render
from .profile import load_model, parse_ints
from .show import stage_table

__all__ = ["add_arguments", "run"]

#: What --quick shrinks the demo to: a smoke test of every step in seconds.
QUICK = {"input_shape": "3,64,64", "batch_size": 4, "steps": 1, "repeats": 1}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="torchvision:resnet18",
                        help="torchvision:NAME (random weights, no download) or package.module:factory")
    parser.add_argument("--input-shape", default="3,128,128", help="one sample's shape (default 3,128,128)")
    parser.add_argument("--batch-size", type=int, default=64, help="the training batch (default 64)")
    parser.add_argument("--steps", type=int, default=5, help="measured training steps (default 5)")
    parser.add_argument("--repeats", type=int, default=5, help="profiler repeats per layer and size")
    parser.add_argument("--devices", help="comma-separated, e.g. cpu,cpu (default: all CUDA devices, "
                                          "else two CPU devices)")
    parser.add_argument("--quick", action="store_true",
                        help="a tiny version (batch 4 of 3x64x64, one step) that checks every step")


def run(args: argparse.Namespace) -> int:
    if args.quick:
        for name, value in QUICK.items():
            setattr(args, name, value)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    started = time.perf_counter()
    devices = resolve_devices(args.devices.split(",") if args.devices else None)
    model = load_model(args.model)
    shape = parse_ints(args.input_shape, "--input-shape")
    batch, target = synthetic_batch(model, shape, args.batch_size)
    print(f"autopipe demo: {args.model}, batch {args.batch_size} of {'x'.join(map(str, shape))}, on "
          f"{', '.join(map(str, devices))} (one thread per device)\n", flush=True)
    chosen = _profile_and_plan(model, batch, devices, args)
    result = bench_plan(model, chosen, batch, target, steps=args.steps, warmup=1)
    _report(result)
    print(f"\ndemo done in {time.perf_counter() - started:.0f} s")
    return 0


def _profile_and_plan(model: torch.nn.Module, batch: torch.Tensor, devices: list[torch.device],
                      args: argparse.Namespace) -> Plan:
    started = time.perf_counter()
    measured = profile(model, batch, devices, warmup=1, repeats=args.repeats, quiet=args.quick)
    print(f"1. profiled {len(measured.layers)} layers at micro-batch sizes {measured.batch_sizes} and the "
          f"copies between devices in {time.perf_counter() - started:.1f} s")
    started = time.perf_counter()
    chosen = choose_plan(measured, [str(d) for d in devices], batch_size=args.batch_size)
    print(f"2. planned in {time.perf_counter() - started:.2f} s: balance {chosen.balance}, "
          f"micro-batches {chosen.chunks} x {chosen.micro_batch_size}, checkpoint {chosen.checkpoint}, "
          f"predicted {chosen.predicted.iteration_ms:.0f} ms per iteration\n")
    print(stage_table(chosen))
    return chosen


def _report(result: BenchResult) -> None:
    losses = ", ".join(f"{loss:.4f}" for loss in result.losses)
    print(f"\n3. trained {len(result.losses)} steps beside the unpartitioned model (first one untimed); "
          f"losses {losses}\n")
    print("predicted timeline:")
    print(render(result.predicted_events))
    print("\nmeasured timeline (last step):")
    print(render(result.measured_events))
    print("\n4. predicted against measured:")
    print(format_bench(result))
