"""``python -m autopipe bench``: run a plan and print predicted against measured times."""
from __future__ import annotations

import argparse

import torch

from ..bench import BenchResult, bench_plan, check_local, describe_plan, format_bench, plan_devices, synthetic_batch
from ..device import resolve_devices
from ..model.fingerprint import environment_fingerprint
from .._jsonio import write_json_atomic
from ..planning.plans import Plan
from ..profiling.profiler import profile
from ..profiling.profiles import Profile
from ..planning.replicas import plan as choose_plan
from ..timeline import render
from ..model import layer_chain
from ..model.fingerprint import check_made_for
from .plan import in_option_terms
from .profile import load_model, parse_ints, spec_from_file
from ._arguments import at_least, device_names, output_path

__all__ = ["add_arguments", "run"]

#: Without a plan or profile to say otherwise: one sample's shape, and the batch profiled.
DEFAULT_SHAPE = [3, 64, 64]
DEFAULT_BATCH = 32


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", nargs="?",
                        help="torchvision:NAME (random weights) or package.module:factory; profiled "
                             "and planned first unless --plan is given (default: the plan's or profile's "
                             "model if it is torchvision:NAME: autopipe imports no code a file names)")
    parser.add_argument("--plan", help="a saved plan (python -m autopipe plan ... -o plans/X.json) to run "
                                       "instead of planning; a plan made from a CLI profile names its "
                                       "input shape, and its model (used if torchvision:NAME)")
    parser.add_argument("--profile", help="plan from this saved profile instead of profiling MODEL, as "
                                          "'python -m autopipe plan' does")
    parser.add_argument("--input-shape", help="one sample's shape (default: the plan's or profile's, else 3,64,64)")
    parser.add_argument("--batch-size", type=int,
                        help="the training batch (default: the plan's or profile's, else 32)")
    parser.add_argument("--devices", help="comma-separated, e.g. cpu,cpu (default: with --profile, the "
                                          "profile's; else all CUDA devices, else two CPU devices)")
    parser.add_argument("--chunks", type=int, help="fix the micro-batch count when planning")
    parser.add_argument("--checkpoint", default="auto", choices=["auto", "never", "except_last", "always"])
    parser.add_argument("--steps", type=int, default=5, help="measured steps of each (default 5)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps first (default 1)")
    parser.add_argument("--timeline", action="store_true",
                        help="also draw the predicted timeline and the measured one of the last step")
    parser.add_argument("--json", metavar="FILE", help="also write the figures as JSON (atomically)")


def run(args: argparse.Namespace) -> int:
    at_least(args, {"--batch-size": 1, "--chunks": 1, "--steps": 1, "--warmup": 0})
    output = output_path(args.json, "--json", [args.plan, args.profile], kind="bench")
    devices = device_names(args.devices)
    saved, measured = _inputs(args)
    known = saved if saved is not None else measured
    spec = _spec(args, known)
    shape = _shape(args.input_shape, known)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = _model(spec, known)
    batch, target = synthetic_batch(model, shape, _batch_size(args, known),
                                    shape_source=_shape_source(args.input_shape, known))
    chosen = saved if saved is not None else _plan(args, measured, model, batch, devices)
    result = bench_plan(model, chosen, batch, target, steps=args.steps, warmup=args.warmup)
    written = None if output is None else write_json_atomic(output, _document(result, spec, shape))  # before printing
    print(format_bench(result))
    if args.timeline:
        print(f"\npredicted timeline:\n{render(result.predicted_events)}")
        print(f"\nmeasured timeline (last step):\n{render(result.measured_events)}")
    if written is not None:
        print(f"wrote {written}")
    return 0


def _inputs(args: argparse.Namespace) -> tuple[Plan | None, Profile | None]:
    """The saved plan and profile given, the plan checked against the options it would ignore."""
    saved = Plan.load(args.plan) if args.plan else None
    if saved is not None:
        check_local(saved, args.plan)
        _check_unused(args, saved)
        plan_devices(saved)  # as the pipeline will, before the model is built
    return saved, Profile.load(args.profile) if args.profile else None


def _what(known: Plan | Profile) -> str:
    return "plan" if isinstance(known, Plan) else "profile"


def _spec(args: argparse.Namespace, known: Plan | Profile | None) -> str:
    """MODEL as typed, else the model the plan or profile names if autopipe may build it
    (:func:`~autopipe.cli.profile.spec_from_file`)."""
    if args.model is not None:
        return args.model
    spec = known.model.get("spec") if known is not None else None
    if spec is None:
        raise ValueError("name the model: python -m autopipe bench MODEL [--plan plans/X.json]")
    option, path = ("--plan", args.plan) if isinstance(known, Plan) else ("--profile", args.profile)
    return spec_from_file(spec, path, "bench", option)


def _batch_size(args: argparse.Namespace, known: Plan | Profile | None) -> int:
    """The training batch: the plan's (``--batch-size`` is checked against it), else
    ``--batch-size``, else the profile's, else :data:`DEFAULT_BATCH` to profile with."""
    if isinstance(known, Plan):
        return known.batch_size
    if args.batch_size is not None:
        return args.batch_size
    return DEFAULT_BATCH if known is None else known.batch_size


def _recorded_shape(known: Plan | Profile | None) -> list[int] | None:
    """The sample shape the plan or profile was made with, if it records one."""
    return known.input_shape if isinstance(known, Profile) else known.model.get("input_shape") if known else None


def _shape(text: str | None, known: Plan | Profile | None) -> list[int]:
    """One sample's shape: ``--input-shape``, else the one the plan or profile was made with;
    refused if the two differ (the plan's times and memory are those of its own shape)."""
    recorded = _recorded_shape(known)
    if text is None:
        return DEFAULT_SHAPE if recorded is None else recorded  # [] is a shape: a scalar per sample
    shape = parse_ints(text, "--input-shape")
    if known is not None and recorded not in (None, shape):
        raise ValueError(f"--input-shape {text} is not the shape the {_what(known)} was made for "
                         f"({','.join(map(str, recorded))}); drop it, or profile and plan again with it")
    return shape


def _shape_source(text: str | None, known: Plan | Profile | None) -> str | None:
    """Where the sample shape came from when it is bench's default (neither given nor recorded),
    for the error of a model that does not take it; ``None`` otherwise."""
    if text is not None or _recorded_shape(known) is not None:
        return None
    records = f", as the {_what(known)} records none" if known is not None else ""
    return f"bench's default{records}: give the model's with --input-shape"


def _model(spec: str, known: Plan | Profile | None) -> torch.nn.Module:
    """The model ``spec`` builds, refused before any forward if the plan or profile is of
    another one (a batch of the other model's shape would fail deep inside it)."""
    model = load_model(spec)
    if known is not None:
        named = f" ({known.model['spec']})" if "spec" in known.model else ""
        check_made_for(known.model, layer_chain(model), _what(known),
                       f"bench the {_what(known)}'s own model{named}, or profile and plan this one")
    return model


def _plan(args: argparse.Namespace, measured: Profile | None, model: torch.nn.Module, batch: torch.Tensor,
          names: list[str] | None) -> Plan:
    """A plan made now, as ``python -m autopipe plan`` makes one (its planner, its defaults: data
    parallel and pipelines searched, the profile's devices and batch), from the saved profile,
    else from profiling ``model`` on ``batch``."""
    if measured is None:
        measured = profile(model, batch, names, quiet=True)
    with in_option_terms():
        chosen = choose_plan(measured, names, batch_size=args.batch_size, checkpoint=args.checkpoint,
                             chunks=args.chunks)
    print(f"planned: {describe_plan(chosen)}, predicted {chosen.predicted.iteration_ms:.1f} ms")
    return chosen


def _check_unused(args: argparse.Namespace, saved: Plan) -> None:
    """Refuse planning options that a saved plan would silently override."""
    if args.batch_size not in (None, saved.batch_size):
        raise ValueError(f"the plan is for batch size {saved.batch_size}, not {args.batch_size}; "
                         "plan again for another batch")
    planned = ",".join(saved.used_devices)
    asked = {"--devices": args.devices if args.devices and args.devices.replace(" ", "") != planned else None,
             "--profile": args.profile, "--chunks": args.chunks,
             "--checkpoint": None if args.checkpoint == "auto" else args.checkpoint}
    given = [option for option, value in asked.items() if value is not None]
    if given:
        raise ValueError(f"{', '.join(given)} would be ignored: the plan fixes its devices ({planned}"
                         + (f": {saved.replicas} replicas" if saved.replicas > 1 else "") + "), "
                         f"chunks ({saved.chunks}) and checkpointing ({saved.checkpoint}); drop "
                         f"{'them' if len(given) > 1 else 'it'} or plan again with them")


def _document(result: BenchResult, spec: str, shape: list[int]) -> dict[str, object]:
    return {**result.to_json(), "model_spec": spec, "input_shape": shape,
            "environment": environment_fingerprint(resolve_devices(result.plan.used_devices))}
