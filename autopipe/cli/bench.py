"""``python -m autopipe bench``: run a plan and print predicted against measured times."""
from __future__ import annotations

import argparse

import torch

from ..bench import BenchResult, bench_plan, format_bench, synthetic_batch
from ..device import resolve_devices
from ..model.fingerprint import environment_fingerprint
from .._jsonio import write_json_atomic
from ..planning.plans import Plan
from ..profiling.profiler import profile
from ..profiling.profiles import Profile
from ..planning.solver import plan as choose_plan
from ..timeline import render
from .profile import load_model, parse_ints

__all__ = ["add_arguments", "run"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", nargs="?",
                        help="torchvision:NAME (random weights) or package.module:factory; profiled "
                             "and planned first unless --plan is given (default: the plan's model)")
    parser.add_argument("--plan", help="a saved plan (python -m autopipe plan ... -o plans/X.json) to run "
                                       "instead of planning; a plan made from a CLI profile names its "
                                       "model and input shape itself")
    parser.add_argument("--profile", help="plan from this saved profile instead of profiling MODEL")
    parser.add_argument("--input-shape", help="one sample's shape (default: the plan's, else 3,64,64)")
    parser.add_argument("--batch-size", type=int, help="the training batch (default: the plan's, else 32)")
    parser.add_argument("--devices", help="comma-separated, e.g. cpu,cpu (default: all CUDA devices, "
                                          "else two CPU devices)")
    parser.add_argument("--chunks", type=int, help="fix the micro-batch count when planning")
    parser.add_argument("--checkpoint", default="auto", help="auto, never, except_last or always")
    parser.add_argument("--steps", type=int, default=5, help="measured steps of each (default 5)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps first (default 1)")
    parser.add_argument("--timeline", action="store_true",
                        help="also draw the predicted timeline and the measured one of the last step")
    parser.add_argument("--json", metavar="FILE", help="also write the figures as JSON (atomically)")


def run(args: argparse.Namespace) -> int:
    saved = Plan.load(args.plan) if args.plan else None
    known = saved.model if saved is not None else {}
    spec = args.model or known.get("spec")
    if spec is None:
        raise ValueError("name the model: python -m autopipe bench MODEL [--plan plans/X.json]")
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = load_model(spec)
    shape = (parse_ints(args.input_shape, "--input-shape") if args.input_shape
             else known.get("input_shape", [3, 64, 64]))
    chosen = _plan(args, saved, model, shape)
    batch, target = synthetic_batch(model, shape, chosen.batch_size)
    result = bench_plan(model, chosen, batch, target, steps=args.steps, warmup=args.warmup)
    print(format_bench(result))
    if args.timeline:
        print(f"\npredicted timeline:\n{render(result.predicted_events)}")
        print(f"\nmeasured timeline (last step):\n{render(result.measured_events)}")
    if args.json:
        print(f"wrote {write_json_atomic(args.json, _document(result, spec, shape))}")
    return 0


def _plan(args: argparse.Namespace, saved: Plan | None, model: torch.nn.Module, shape: list[int]) -> Plan:
    """The saved plan, or one made now from a saved or fresh profile."""
    if saved is not None:
        if args.batch_size not in (None, saved.batch_size):
            raise ValueError(f"the plan is for batch size {saved.batch_size}, not {args.batch_size}; "
                             "plan again for another batch")
        _check_unused(args, saved)
        return saved
    devices = resolve_devices(args.devices.split(",") if args.devices else None)
    batch_size = args.batch_size or 32
    if args.profile:
        measured = Profile.load(args.profile)
    else:
        measured = profile(model, torch.randn(batch_size, *shape), devices, quiet=True)
    chosen = choose_plan(measured, [str(d) for d in devices], batch_size=batch_size,
                         checkpoint=args.checkpoint, chunks=args.chunks)
    print(f"planned: balance {chosen.balance} on {', '.join(chosen.devices)}, {chosen.chunks} "
          f"micro-batches, checkpoint {chosen.checkpoint}, predicted {chosen.predicted.iteration_ms:.1f} ms")
    return chosen


def _check_unused(args: argparse.Namespace, saved: Plan) -> None:
    """Refuse planning options that a saved plan would silently override."""
    planned = ",".join(saved.devices[: saved.device_count])
    asked = {"--devices": args.devices if args.devices and args.devices.replace(" ", "") != planned else None,
             "--profile": args.profile, "--chunks": args.chunks,
             "--checkpoint": None if args.checkpoint == "auto" else args.checkpoint}
    given = [option for option, value in asked.items() if value is not None]
    if given:
        raise ValueError(f"{', '.join(given)} would be ignored: the plan fixes its devices ({planned}), "
                         f"chunks ({saved.chunks}) and checkpointing ({saved.checkpoint}); drop "
                         f"{'them' if len(given) > 1 else 'it'} or plan again with them")


def _document(result: BenchResult, spec: str, shape: list[int]) -> dict[str, object]:
    return {**result.to_json(), "model_spec": spec, "input_shape": shape,
            "environment": environment_fingerprint(resolve_devices(result.plan.devices))}
