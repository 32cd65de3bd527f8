"""``python -m autopipe profile``: measure a model's layers and copies, print them, save a profile."""
from __future__ import annotations

import argparse
import importlib
import shlex
from pathlib import Path

import torch
from torch import nn

from ..bench import random_batch
from ..profiling.profiler import profile
from ..profiling.profiles import LayerProfile, Profile
from ._arguments import at_least, device_names, fill_defaults, given, output_path

__all__ = ["add_arguments", "run", "load_model", "spec_from_file", "parse_ints"]

#: The measuring options' defaults, filled in once ``--bytes-of`` (which measures with the saved
#: profile's own) has refused any given option.
DEFAULTS = {"model": "torchvision:resnet18", "input_shape": "3,64,64", "batch_size": 32, "warmup": 2, "repeats": 5}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", nargs="?",
                        help="torchvision:NAME (random weights, never downloaded) or "
                             f"package.module:factory returning an nn.Module (default {DEFAULTS['model']})")
    parser.add_argument("--input-shape", help=f"one sample's shape (default {DEFAULTS['input_shape']})")
    parser.add_argument("--batch-size", type=int, help=f"the full training batch (default {DEFAULTS['batch_size']})")
    parser.add_argument("--batch-sizes", help="micro-batch sizes to measure, e.g. 1,2,4 "
                                              "(default: powers of two below the batch, and the batch)")
    parser.add_argument("--devices", help="comma-separated, e.g. cpu,cpu or cuda:0,cuda:1 "
                                          "(default: all CUDA devices, else two CPU devices)")
    parser.add_argument("--warmup", type=int, help=f"untimed runs per layer and size (default {DEFAULTS['warmup']})")
    parser.add_argument("--repeats", type=int,
                        help=f"timed runs per layer and size, median kept (default {DEFAULTS['repeats']})")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch intra-op threads (default 1: one core per CPU pipeline device)")
    parser.add_argument("--alone", action="store_true",
                        help="time layers on an idle machine even on several CPU devices (by default "
                             "they are timed beside a twin of the chain, as pipeline stages run there)")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    parser.add_argument("-o", "--output", help="where to save the profile JSON (not saved if absent)")
    parser.add_argument("--bytes-of", metavar="PROFILE",
                        help="measure only the bytes (saved, workspace) of this saved profile again, "
                             "keeping its times; its model, shape, batch and sizes are used, so give "
                             "MODEL only for a profile that does not name its model or names one other "
                             "than torchvision:NAME (autopipe imports no code a file names)")


def run(args: argparse.Namespace) -> int:
    at_least(args, {"--threads": 1, "--batch-size": 1, "--warmup": 0, "--repeats": 1})
    # --bytes-of may write over its own profile: the same document with its bytes measured again
    output = output_path(args.output, "--output", kind="profile")
    torch.set_num_threads(args.threads)
    if args.bytes_of:
        return _bytes_of(args, output)
    fill_defaults(args, DEFAULTS)
    shape = parse_ints(args.input_shape, "--input-shape")
    sizes = parse_ints(args.batch_sizes, "--batch-sizes", "1,2,4") if args.batch_sizes else None
    devices = device_names(args.devices)
    torch.manual_seed(0)
    model = load_model(args.model)
    sample = random_batch(args.batch_size, shape)
    measured = profile(model, sample, devices, sizes, warmup=args.warmup, repeats=args.repeats,
                       quiet=args.quiet, under_load=False if args.alone else None)
    measured.model.update(spec=args.model, input_shape=shape)  # lets bench rebuild it from a plan
    _report(measured, output, "not saved (pass -o profiles/NAME.json to keep it)")
    return 0


def _report(measured: Profile, output: Path | None, unsaved: str = "") -> None:
    """Save the profile (first: a closed stdout then loses nothing), then print its table and
    where it went (or ``unsaved``)."""
    written = None if output is None else measured.save(output)
    print(format_table(measured))
    if written is not None or unsaved:
        print(f"saved {written}" if written is not None else unsaved)


def _bytes_of(args: argparse.Namespace, output: Path | None) -> int:
    """``--bytes-of``: the saved profile with its bytes measured again."""
    from ..profiling.remeasure import remeasure_memory

    saved = Profile.load(args.bytes_of)
    spec = _bytes_of_model(args, saved)
    torch.manual_seed(0)
    model = load_model(spec)
    measured = remeasure_memory(saved, model, torch.randn(saved.batch_size, *saved.input_shape), quiet=args.quiet)
    _report(measured, output)
    return 0


def _bytes_of_model(args: argparse.Namespace, saved: Profile) -> str:
    """The model spec to measure for ``--bytes-of``, after refusing every measuring option it
    would ignore: the profile fixes the shape, batch, sizes and device, and times nothing."""
    spec = saved.model.get("spec")
    if spec not in (None, args.model) and args.model is not None:
        own = not spec.startswith("torchvision:")  # a file's module is imported only when named on the command line
        raise ValueError(f"MODEL {args.model} is not the model of {args.bytes_of}: --bytes-of measures the "
                         f"profile's own model, {spec}; give {spec if own else 'no MODEL'}")
    ignored = given(args, ["--input-shape", "--batch-size", "--batch-sizes", "--devices", "--warmup",
                           "--repeats", "--alone"])
    if ignored:
        named = f" ({spec})" if spec is not None else ""
        raise ValueError(f"{', '.join(ignored)} would be ignored: --bytes-of measures the profile's own "
                         f"model{named} on a batch of {saved.batch_size} x {saved.input_shape} "
                         f"at sizes {saved.batch_sizes} on {saved.devices[0]}, timing nothing; drop "
                         f"{'them' if len(ignored) > 1 else 'it'}")
    if args.model is not None:
        return args.model
    if spec is None:
        raise ValueError(f"{args.bytes_of} does not name its model (a profile made in Python); name it: "
                         "python -m autopipe profile MODEL --bytes-of PROFILE")
    return spec_from_file(spec, args.bytes_of, "profile", "--bytes-of")


def parse_ints(text: str, option: str, example: str = "3,128,128") -> list[int]:
    """``"3,128,128"`` → ``[3, 128, 128]``; positive integers only (``example`` shows the form)."""
    try:
        values = [int(part) for part in text.split(",")]
    except ValueError:
        values = []
    if not values or any(v < 1 for v in values):
        raise ValueError(f"{option} expects comma-separated positive integers like {example}, got '{text}'")
    return values


def spec_from_file(spec: str, path: str, command: str, option: str) -> str:
    """``spec``, read from the plan or profile file ``path``, if it is ``torchvision:NAME``, which
    autopipe builds itself.  Any other spec is refused: building it imports the module the file
    names and calls its function, so a shared file could run any code.  The error shows the
    ``command`` with the spec as MODEL and ``option`` naming the file, for a user who trusts it."""
    if spec.partition(":")[0] == "torchvision":
        return spec
    model = shlex.quote(spec) if spec.isprintable() else "MODEL"
    raise ValueError(f"{path} names the model {spec!r}, and autopipe does not import code a file names; if you "
                     f"trust it, give it on the command line as MODEL: python -m autopipe {command} {model} "
                     f"{option} {shlex.quote(path)}")


def load_model(spec: str) -> nn.Module:
    """Build the model a ``torchvision:NAME`` or ``package.module:factory`` spec names."""
    source, sep, name = spec.partition(":")
    if not sep or not source or not name:
        raise ValueError(f"MODEL must be torchvision:NAME or package.module:factory, got '{spec}'")
    if source == "torchvision":
        return _torchvision_model(name)
    try:
        module = importlib.import_module(source)
    except ImportError as error:
        raise ValueError(f"cannot import '{source}' for MODEL '{spec}': {error}; check the module "
                         "path (run from the directory that contains the package)") from None
    except Exception as error:  # the user's module failed as it ran (a syntax error, a typo): theirs to read
        raise ValueError(f"importing '{source}' for MODEL '{spec}' failed: {type(error).__name__}: {error}") from None
    factory = getattr(module, name, None)
    if not callable(factory):
        raise ValueError(f"'{source}' has no callable '{name}' (MODEL '{spec}'); name a function or "
                         "class that returns an nn.Module")
    try:
        model = factory()
    except Exception as error:  # the user's code: its failure is theirs to read, in one line
        raise ValueError(f"building the model {spec} failed: {type(error).__name__}: {error}") from error
    if not isinstance(model, nn.Module):
        raise TypeError(f"{spec}() returned {type(model).__name__}, not an nn.Module")
    return model


def _torchvision_model(name: str) -> nn.Module:
    import torchvision

    if name not in torchvision.models.list_models():
        raise ValueError(f"torchvision has no model '{name}'; choose one of "
                         "torchvision.models.list_models(), e.g. resnet18, resnet50")
    return torchvision.models.get_model(name, weights=None)


def format_table(measured: Profile) -> str:
    """Per layer: forward and backward ms at the largest measured size, bytes and parameters."""
    b = max(measured.batch_sizes)
    header = (f"{'layer':<14} {'type':<12} {'fwd ms':>9} {'bwd ms':>9} {'out/sample':>11} "
              f"{'saved':>10} {'params':>11}")
    rows = [f"micro-batch {b} of batch {measured.batch_size} on {measured.devices[0]}; "
            f"saved = activations kept for backward at {b}", header, "-" * len(header)]
    for layer in measured.layers:
        rows.append(f"{layer.name:<14.14} {layer.type:<12.12} {layer.forward[b].median_ms:9.3f} "
                    f"{layer.backward[b].median_ms:9.3f} {_output(layer):>11} "
                    f"{_size(layer.saved_bytes[b]):>10} {layer.param_count:>11,}")
    rows.append("-" * len(header))
    rows.append(f"{'total':<27} {sum(x.forward[b].median_ms for x in measured.layers):9.3f} "
                f"{sum(x.backward[b].median_ms for x in measured.layers):9.3f} {'':>11} "
                f"{_size(sum(x.saved_bytes[b] for x in measured.layers)):>10} "
                f"{sum(x.param_count for x in measured.layers):>11,}")
    for fit in measured.copies:
        rows.append(f"copy {fit.src}:{measured.devices[fit.src]} -> {fit.dst}:{measured.devices[fit.dst]}: "
                    f"{fit.latency_ms:.4f} ms + {fit.ms_per_byte * 2**20:.4f} ms/MiB")
    return "\n".join(rows)


def _output(layer: LayerProfile) -> str:
    """A layer's output bytes per sample, and what does not grow with the batch after a '+'."""
    fixed = f"+{_size(layer.output_fixed_bytes)}" if layer.output_fixed_bytes else ""
    return _size(layer.output_bytes) + fixed


def _size(nbytes: float) -> str:
    for unit in ("B", "KiB", "MiB"):
        if nbytes < 1024:
            return f"{nbytes:.0f} {unit}" if unit == "B" else f"{nbytes:.1f} {unit}"
        nbytes /= 1024
    return f"{nbytes:.1f} GiB"
