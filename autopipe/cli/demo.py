"""``python -m autopipe demo``: profile, plan and train a ResNet here, then hold predictions to the clock."""
from __future__ import annotations

import argparse
import time

import torch

from ..bench import BenchResult, bench_plan, describe_plan, format_bench, synthetic_batch
from ..device import resolve_devices
from ..planning.plans import Plan
from ..profiling.profiler import profile
from ..planning.replicas import plan as choose_plan
from ..timeline import render
from .profile import load_model, parse_ints
from .show import stage_table
from ._arguments import at_least, device_names, fill_defaults, given

__all__ = ["add_arguments", "run"]

#: The full demo's sizes, and what --quick shrinks them to (a smoke test of every step in seconds).
FULL = {"input_shape": "3,128,128", "batch_size": 64, "steps": 5, "repeats": 5}
QUICK = {"input_shape": "3,64,64", "batch_size": 4, "steps": 1, "repeats": 1}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="torchvision:resnet18",
                        help="torchvision:NAME (random weights, no download) or package.module:factory")
    parser.add_argument("--input-shape", help=f"one sample's shape (default {FULL['input_shape']})")
    parser.add_argument("--batch-size", type=int, help=f"the training batch (default {FULL['batch_size']})")
    parser.add_argument("--steps", type=int, help=f"measured training steps (default {FULL['steps']})")
    parser.add_argument("--repeats", type=int,
                        help=f"profiler repeats per layer and size (default {FULL['repeats']})")
    parser.add_argument("--devices", help="comma-separated, e.g. cpu,cpu (default: all CUDA devices, "
                                          "else two CPU devices)")
    parser.add_argument("--quick", action="store_true",
                        help="a tiny version (batch 4 of 3x64x64, one step) that checks every step; "
                             "it sets the four options above")


def run(args: argparse.Namespace) -> int:
    shape, names = _settings(args)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    started = time.perf_counter()
    devices = resolve_devices(names)
    model = load_model(args.model)
    batch, target = synthetic_batch(model, shape, args.batch_size)
    print(f"autopipe demo: {args.model}, batch {args.batch_size} of {'x'.join(map(str, shape))}, on "
          f"{', '.join(map(str, devices))} (one thread per device)\n", flush=True)
    chosen = _profile_and_plan(model, batch, devices, args)
    result = bench_plan(model, chosen, batch, target, steps=args.steps, warmup=1)
    _report(result)
    print(f"\ndemo done in {time.perf_counter() - started:.0f} s")
    return 0


def _settings(args: argparse.Namespace) -> tuple[list[int], list[str] | None]:
    """Check every option before any work and fill in the sizes (``--quick``'s or the full
    demo's); returns one sample's shape and the device names given."""
    at_least(args, {"--batch-size": 1, "--steps": 1, "--repeats": 1})
    options = {f"--{name.replace('_', '-')}": value for name, value in QUICK.items()}
    overridden = given(args, options) if args.quick else []
    if overridden:
        sets = ", ".join(f"{option} {value}" for option, value in options.items())
        raise ValueError(f"{', '.join(overridden)} would be ignored: --quick sets {sets}; drop "
                         f"{'them' if len(overridden) > 1 else 'it'} or --quick")
    fill_defaults(args, QUICK if args.quick else FULL)
    return parse_ints(args.input_shape, "--input-shape"), device_names(args.devices)


def _profile_and_plan(model: torch.nn.Module, batch: torch.Tensor, devices: list[torch.device],
                      args: argparse.Namespace) -> Plan:
    started = time.perf_counter()
    measured = profile(model, batch, devices, warmup=1, repeats=args.repeats, quiet=args.quick)
    print(f"1. profiled {len(measured.layers)} layers at micro-batch sizes {measured.batch_sizes} and the "
          f"copies between devices in {time.perf_counter() - started:.1f} s")
    started = time.perf_counter()
    chosen = choose_plan(measured)  # as `python -m autopipe plan PROFILE` plans: the profile's devices and batch
    print(f"2. planned in {time.perf_counter() - started:.2f} s: {describe_plan(chosen)}, "
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
