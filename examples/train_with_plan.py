"""Train a model as a pipeline following a saved plan, then load its checkpoint into the plain model.

    python -m autopipe plan profiles/resnet18-128.json --devices 2 -o plans/resnet18-128.json
    python examples/train_with_plan.py --plan plans/resnet18-128.json
    python examples/train_with_plan.py --balance 7,8 --chunks 4  # without a plan
    python examples/train_with_plan.py --balance 3,2,4,6 --interleave 2   # two stages per device

A plan sets the model, batch size and stages; the model's class count is read from the plan's
record of its last layer, and the image size from the input shape a plan made from a
``python -m autopipe profile`` profile records (a plan made in Python records none: ``--size``,
default 64).  ``--classes``, ``--size`` or ``--model`` that contradict the plan are refused.
Data are synthetic (a few fixed random batches, so the loss visibly falls as the model fits
them).  The checkpoint is ``torch.save(pipe.state_dict())``: the plain model's own keys.
"""
from __future__ import annotations

import argparse
import time
from typing import Any

import torch
import torchvision
from torch import nn

import autopipe
from autopipe._jsonio import write_atomic


#: defaults of the options a plan sets (given with ``--plan``, they are refused)
MANUAL = {"balance": "7,8", "devices": None, "interleave": 1, "chunks": 4, "checkpoint": "except_last", "batch": 32}
MODEL, SIZE, CLASSES = "torchvision:resnet18", 64, 10


def main() -> None:
    args = _parser().parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(args.threads)
    try:
        pipe, batch = _pipeline(args)
    except autopipe.AutopipeError as error:  # a plan of another model, a bad balance, ...: one line
        where = args.plan or "train_with_plan"
        raise SystemExit(str(error) if str(error).startswith(where) else f"{where}: {error}") from None
    print(f"{args.model}: {pipe.replicas} replica(s) of stages {pipe.balance} on {[str(d) for d in pipe.devices]} "
          f"({pipe.interleave} per device), "
          f"{pipe.chunks} micro-batches, checkpoint={pipe.checkpoint}, batch {batch}, "
          f"input {'x'.join(map(str, args.shape))}, {args.classes} classes")

    data = [(torch.randn(batch, *args.shape), torch.randint(0, args.classes, (batch,)))
            for _ in range(args.batches)]
    optimizer = torch.optim.SGD(pipe.parameters(), lr=args.lr, momentum=0.9)
    loss_fn = nn.CrossEntropyLoss()
    for epoch in range(args.epochs):
        start, total = time.perf_counter(), 0.0
        for x, y in data:
            optimizer.zero_grad()
            out = pipe(x)
            loss = loss_fn(out, y.to(out.device))
            loss.backward()
            optimizer.step()
            total += loss.item()
        seconds = time.perf_counter() - start
        print(f"epoch {epoch + 1}: loss {total / len(data):.4f}, "
              f"{len(data) * batch / seconds:.1f} samples/s")

    state = pipe.state_dict()
    write_atomic(args.save, lambda handle: torch.save(state, handle))
    _check_checkpoint(args, pipe, data[0][0])


def _check_checkpoint(args: argparse.Namespace, pipe: autopipe.Pipeline, x: torch.Tensor) -> None:
    """Load the saved file (our own, so weights_only=True) into a fresh plain model."""
    plain = _build(args.model, args.classes)
    plain.load_state_dict(torch.load(args.save, weights_only=True))
    plain.eval(), pipe.eval()
    with torch.no_grad():
        difference = (plain(x) - pipe(x).to(x.device)).abs().max().item()
    print(f"saved {args.save}; loaded into the plain model: max output difference {difference:.2e}")


def _pipeline(args: argparse.Namespace) -> tuple[autopipe.Pipeline, int]:
    """The pipeline and batch size: from the plan, else from the manual options.  Sets
    ``args.model``, ``args.classes`` and ``args.shape`` (one sample's shape)."""
    if not args.plan:
        for name, default in MANUAL.items():
            setattr(args, name, default if getattr(args, name) is None else getattr(args, name))
        args.model, args.classes = _either(args.model, MODEL), _either(args.classes, CLASSES)
        args.shape = _image(args.size)
        try:
            balance = [int(n) for n in args.balance.split(",")]
        except ValueError:
            raise SystemExit(f"--balance takes layer counts per stage, such as 7,8; got {args.balance!r}") from None
        devices = args.devices.split(",") if args.devices else ["cpu"] * (len(balance) // args.interleave)
        pipe = autopipe.Pipeline(_build(args.model, args.classes), balance=balance, devices=devices,
                                 chunks=args.chunks, checkpoint=args.checkpoint,
                                 deferred_batch_norm=args.deferred_batch_norm, interleave=args.interleave)
        return pipe, args.batch
    given = [f"--{name}" for name in MANUAL if getattr(args, name) is not None]
    if given:
        raise SystemExit(f"{args.plan}: {', '.join(given)} would be ignored: the plan sets the stages, "
                         f"devices, micro-batches, checkpointing and batch size; drop {', '.join(given)}")
    plan = autopipe.Plan.load(args.plan)
    args.model = _either(_planned("--model", args.model, plan.model.get("spec"), args.plan), MODEL)
    args.classes = _either(_planned("--classes", args.classes, _planned_classes(plan), args.plan), CLASSES)
    recorded = plan.model.get("input_shape")
    if recorded is None:
        args.shape = _image(args.size)
        print(f"{args.plan} does not record its input shape (made in Python): training at "
              f"{'x'.join(map(str, args.shape))} (--size sets the side)")
    else:
        if args.size is not None and [3, args.size, args.size] != list(recorded):
            raise SystemExit(f"{args.plan}: --size {args.size} is not the input the plan was made for "
                             f"({'x'.join(map(str, recorded))}); drop --size")
        args.shape = list(recorded)
    model = _build(args.model, args.classes)
    return autopipe.Pipeline(model, plan, deferred_batch_norm=args.deferred_batch_norm), plan.batch_size


def _image(size: int | None) -> list[int]:
    """One sample's shape: an RGB image of side ``size`` (default :data:`SIZE`)."""
    side = _either(size, SIZE)
    return [3, side, side]


def _either(value: Any, default: Any) -> Any:
    return default if value is None else value


def _planned(option: str, given: object, recorded: object, path: str) -> object:
    """The option's value: the plan's, refused if the user gave another."""
    if given is not None and recorded is not None and given != recorded:
        raise SystemExit(f"{path}: {option} {given} is not what the plan was made for ({recorded}); drop {option}")
    return given if given is not None else recorded


def _planned_classes(plan: autopipe.Plan) -> int | None:
    """The class count of the planned model: the output size of the last layer with a weight
    matrix (a torchvision classifier's ``fc`` or ``classifier``), as the plan's fingerprint records it."""
    for layer in reversed(plan.model.get("layers", [])):
        shapes = [shape for name, shape, _ in layer.get("tensors", []) if name.endswith("weight") and len(shape) >= 2]
        if shapes:
            return int(shapes[-1][0])
    return None


def _build(name: str, classes: int) -> nn.Module:
    library, _, arch = name.partition(":")
    if library != "torchvision" or not arch:
        raise SystemExit(f"this script builds torchvision models: the model must be torchvision:NAME, got {name!r}")
    try:
        return torchvision.models.get_model(arch, weights=None, num_classes=classes)
    except ValueError as error:  # an unknown NAME
        raise SystemExit(f"--model {name}: {error}") from None


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--plan", help="a plan file from `python -m autopipe plan`: sets the model, its class "
                                           "count, the image size (where the plan records it) and the options below "
                                           "marked 'without a plan'")
    parser.add_argument("--model", help=f"torchvision:NAME (default: the plan's, else {MODEL})")
    parser.add_argument("--balance", help=f"layers per stage, without a plan (default {MANUAL['balance']})")
    parser.add_argument("--devices", help="comma-separated, one per device, without a plan (default: cpu each)")
    parser.add_argument("--interleave", type=int,
                        help="stages per device, without a plan: stage s on device s %% devices (default 1)")
    parser.add_argument("--chunks", type=int, help=f"micro-batches, without a plan (default {MANUAL['chunks']})")
    parser.add_argument("--checkpoint", choices=["never", "except_last", "always"],
                        help=f"without a plan (default {MANUAL['checkpoint']})")
    parser.add_argument("--batch", type=int, help=f"batch size, without a plan (default {MANUAL['batch']})")
    parser.add_argument("--deferred-batch-norm", action="store_true")
    parser.add_argument("--size", type=int, help=f"image side (default: the plan's input shape, else {SIZE})")
    parser.add_argument("--classes", type=int, help=f"classes (default: the plan's model's, else {CLASSES})")
    parser.add_argument("--batches", type=int, default=4, help="synthetic batches per epoch")
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--lr", type=float, default=0.01)
    parser.add_argument("--threads", type=int, default=1, help="intra-op threads (one core per stage)")
    parser.add_argument("--save", default="checkpoint.pt")
    return parser


if __name__ == "__main__":
    main()
