"""``python -m autopipe plan``: choose split points, micro-batches and checkpointing from a profile."""
from __future__ import annotations

import argparse
import re
from contextlib import contextmanager
from typing import Iterator

from ..errors import OptionError, PlanningError
from ..planning.plans import Plan
from ..profiling.profiles import Profile
from ._arguments import device_names, output_path

__all__ = ["add_arguments", "run", "summary"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("profile", help="profile JSON written by 'python -m autopipe profile'")
    parser.add_argument("--devices", default=None,
                        help="a count (4) or names (cpu,cpu or cuda:0,cuda:1); default: the profile's")
    parser.add_argument("--memory-limit", default=None,
                        help="bytes per device (16GiB, 500MB) or one per device (8GiB,16GiB); "
                             "default: CUDA capacity, none on CPU")
    parser.add_argument("--batch-size", type=int, default=None, help="default: the profile's batch size")
    parser.add_argument("--checkpoint", default="auto", choices=["auto", "never", "except_last", "always"])
    parser.add_argument("--chunks", type=int, default=None, help="fix the micro-batch count (default: chosen)")
    parser.add_argument("--speeds", default=None, help="relative speed per device, e.g. 1,2")
    parser.add_argument("--optimizer-state", default="momentum",
                        help="what the optimizer keeps per parameter: sgd (nothing), momentum (SGD "
                             "with momentum, 1x the parameters; default), adam (2x) or a factor")
    parser.add_argument("--engine", default="local", choices=["local", "distributed"],
                        help="what will run the plan: the in-process runtime (local) or "
                             "torch.distributed.pipelining under torchrun (distributed)")
    parser.add_argument("--schedule", default="gpipe", choices=["auto", "gpipe", "1f1b"],
                        help="gpipe (fill-drain: pipe(x), loss.backward()), 1f1b (fewer micro-batches in "
                             "flight; train with pipe.train_step) or auto (the faster prediction)")
    parser.add_argument("--interleave", default="auto",
                        help="stages per device, placed round-robin: auto (1 or 2, chosen), 1, 2, ...")
    parser.add_argument("--replicas", default="auto",
                        help="copies of the pipeline trained side by side (data parallel): auto (chosen among "
                             "the divisors of the device count) or a count dividing it; 1 = pipeline only")
    parser.add_argument("--placement", default="given", choices=["given", "search"],
                        help="given: stage s on the s-th device; search: also choose which device each "
                             "stage runs on (where speeds or copy costs differ)")
    parser.add_argument("--time-limit", type=float, default=1.0,
                        help="seconds to search (default 1): the best plan found and a proven lower bound; "
                             "0 for no limit")
    parser.add_argument("-o", "--output", default=None, help="write the plan JSON here")
    parser.add_argument("--compare", action="store_true",
                        help="also price pure data parallel, the best pipeline-only plan and equal-layer, "
                             "parameter-balanced and time-only min-max splits")


def run(args: argparse.Namespace) -> int:
    from ..planning.compare import compare, format_comparison
    from ..planning.replicas import parallelism, plan

    output = output_path(args.output, "--output", [args.profile], kind="plan")
    devices = _devices(args.devices)
    profile = Profile.load(args.profile)
    options = dict(batch_size=args.batch_size, memory_limit=_limits(args.memory_limit), checkpoint=args.checkpoint,
                   optimizer_state=_optimizer_state(args.optimizer_state), speeds=_speeds(args.speeds),
                   chunks=args.chunks, engine=args.engine, interleave=_auto_or_count(args.interleave, "--interleave"),
                   schedule=args.schedule, time_limit=args.time_limit or None, placement=args.placement)
    with in_option_terms():
        chosen = plan(profile, devices, replicas=_auto_or_count(args.replicas, "--replicas"), **options)
    written = None if output is None else chosen.save(output)  # before printing: a closed stdout loses nothing
    print(summary(chosen))
    if args.compare:
        print()
        with in_option_terms():
            print(parallelism(profile, chosen, devices, **options))
        if chosen.replicas == 1:
            print()
            print(format_comparison(compare(profile, chosen, args.chunks)))
    if written is not None:
        print(f"\nplan written to {written}")
    return 0


#: The planner's parameters named in its errors, as ``name=value`` (``chunks=4``), as the subject
#: of a check (``chunks must be a positive integer``) or, for those that are no ordinary word,
#: alone (``raise memory_limit``).
_SET = ("time_limit", "memory_limit", "optimizer_state", "batch_size", "speeds", "chunks", "checkpoint",
        "schedule", "interleave", "replicas", "engine", "placement")
_ALONE = ("time_limit", "memory_limit", "optimizer_state", "batch_size", "speeds")
_NAMED = re.compile(rf"\b(?:(?P<set>{'|'.join(_SET)})=(?P<quote>'?)(?P<value>[^\s,;:)']+)(?P=quote)"
                    rf"|(?P<name>{'|'.join(_SET)})(?= must\b)|(?P<alone>{'|'.join(_ALONE)})\b)")


def option_terms(message: str) -> str:
    """A planner's error as the command line's: its parameters (``time_limit=None``,
    ``chunks must``, ``memory_limit``) named as the options that set them (``--time-limit 0``,
    ``--chunks must``, ``--memory-limit``)."""
    message = message.replace("time_limit=None", "--time-limit 0").replace("None for no limit", "0 for no limit")

    def option(match: re.Match[str]) -> str:
        if match["set"]:
            return f"--{match['set'].replace('_', '-')} {match['value']}"
        return "--" + (match["name"] or match["alone"]).replace("_", "-")

    return _NAMED.sub(option, message)


@contextmanager
def in_option_terms() -> Iterator[None]:
    """Re-raise the planner's errors about options worded by :func:`option_terms`."""
    try:
        yield
    except (OptionError, PlanningError) as error:
        raise type(error)(option_terms(str(error))) from None


def _devices(text: str | None) -> int | list[str] | None:
    """``--devices``: a count (``4``), names (``cpu,cpu``) or ``None`` for the profile's."""
    names = device_names(text, "--devices cpu,cpu or --devices 2")
    return int(names[0]) if names is not None and len(names) == 1 and names[0].isdigit() else names


def _auto_or_count(text: str, option: str) -> int | str:
    """``--replicas`` and ``--interleave``: ``auto`` (the planner chooses) or a count."""
    if text != "auto" and not text.isdigit():
        raise ValueError(f"{option} '{text}' must be 'auto' or a positive integer, e.g. 2")
    return text if text == "auto" else int(text)


def _limits(text: str | None) -> str | list[str] | None:
    if text is None:
        return None
    parts = [p.strip() for p in text.split(",")]
    return parts[0] if len(parts) == 1 else parts


def _speeds(text: str | None) -> list[float] | None:
    if text is None:
        return None
    try:
        return [float(v) for v in text.split(",")]
    except ValueError:
        raise ValueError(f"--speeds '{text}' must be numbers separated by commas, e.g. 1,2") from None


def summary(chosen: Plan) -> str:
    """What was chosen and what it predicts, in a few lines."""
    predicted = chosen.predicted
    split = ", ".join(f"{name} (#{index})" for index, name in chosen.split_points) or "none (one stage)"
    reduction = chosen.options.get("reduction", "estimated from copy fits")
    groups = " | ".join(", ".join(group[:chosen.device_count]) for group in chosen.replica_devices)
    replicas = ([f"replicas:      {chosen.replicas} (data parallel), on {groups}, each with "
                 f"{chosen.replica_batch_size} of the batch; gradient reduction adds "
                 f"{predicted.reduction_ms:.2f} ms (cost {reduction})"] if chosen.replicas > 1 else [])
    return "\n".join(replicas + [
        f"stages:        {len(chosen.stages)} on {', '.join(chosen.devices)}"
        + (f" ({chosen.interleave} per device: stage s on device s % {chosen.device_count})"
           if chosen.interleave > 1 else ""),
        f"balance:       {chosen.balance}",
        f"split before:  {split}",
        f"micro-batches: {chosen.chunks} of {chosen.micro_batch_size} (batch {chosen.batch_size}"
        + (f", {chosen.replica_batch_size} per replica)" if chosen.replicas > 1 else ")"),
        f"checkpoint:    {chosen.checkpoint}   schedule: {chosen.schedule}   "
        f"engine: {chosen.options.get('engine', 'local')}",
        f"predicted:     {predicted.iteration_ms:.2f} ms per iteration (forward {predicted.forward_ms:.2f}, "
        f"backward {predicted.backward_ms:.2f}), bubble {100 * predicted.bubble_fraction:.1f}%",
        *([] if predicted.gap is None else [_bound_line(chosen)]),
    ])


#: Gaps below this are the rounding of sums taken in another order, not a weak bound.
ROUNDING_GAP = 1e-6


def _bound_line(chosen: Plan) -> str:
    """The proven lower bound and the gap: 0 says the plan is optimal for the cost model."""
    gap = chosen.predicted.gap or 0.0
    if gap < ROUNDING_GAP:
        verdict = "optimal (search finished)"
    elif chosen.options.get("time_limit_reached"):
        verdict = "time limit reached; --time-limit for more"
    elif chosen.options.get("memory_limit_reached"):
        verdict = "the exact search stopped where its partial plans would outgrow memory"
    else:
        verdict = "search finished; the 1F1B and large interleaved searches prove only weak bounds"
    return f"lower bound:   {chosen.predicted.lower_bound_ms:.2f} ms, gap {100 * gap:.2f}% — {verdict}"


def _optimizer_state(text: str) -> str | float:
    """An optimizer name as given, a number as a factor (checked by the planner)."""
    try:
        return float(text)
    except ValueError:
        return text
