"""Train a model as a pipeline following a saved plan, then load its checkpoint into the plain model.

    python -m autopipe plan ... --out plans/resnet18.json      # made by the planner
    python examples/train_with_plan.py --plan plans/resnet18.json
    python examples/train_with_plan.py --balance 7,8 --chunks 4  # without a plan
    python examples/train_with_plan.py --balance 3,2,4,6 --interleave 2   # two stages per device

Data are synthetic (a few fixed random batches, so the loss visibly falls as the model fits
them).  The checkpoint is ``torch.save(pipe.state_dict())``: the plain model's own keys.
"""
from __future__ import annotations

import argparse
import time

import torch
import torchvision
from torch import nn

import autopipe
from autopipe._jsonio import write_atomic


def main() -> None:
    args = _parser().parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(args.threads)
    model = _build(args.model, args.classes)
    if args.plan:
        plan = autopipe.Plan.load(args.plan)
        pipe = autopipe.Pipeline(model, plan, deferred_batch_norm=args.deferred_batch_norm)
        batch = plan.batch_size
    else:
        balance = [int(n) for n in args.balance.split(",")]
        devices = args.devices.split(",") if args.devices else ["cpu"] * (len(balance) // args.interleave)
        pipe = autopipe.Pipeline(model, balance=balance, devices=devices, chunks=args.chunks,
                                 checkpoint=args.checkpoint, deferred_batch_norm=args.deferred_batch_norm,
                                 interleave=args.interleave)
        batch = args.batch
    print(f"{args.model}: {pipe.replicas} replica(s) of stages {pipe.balance} on {[str(d) for d in pipe.devices]} "
          f"({pipe.interleave} per device), "
          f"{pipe.chunks} micro-batches, checkpoint={pipe.checkpoint}, batch {batch}")

    data = [(torch.randn(batch, 3, args.size, args.size), torch.randint(0, args.classes, (batch,)))
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


def _build(name: str, classes: int) -> nn.Module:
    library, _, arch = name.partition(":")
    if library != "torchvision" or not arch:
        raise SystemExit(f"--model must look like torchvision:NAME, got {name!r}")
    return torchvision.models.get_model(arch, weights=None, num_classes=classes)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--plan", help="a plan file from `python -m autopipe plan`")
    parser.add_argument("--model", default="torchvision:resnet18")
    parser.add_argument("--balance", default="7,8", help="layers per stage, without a plan")
    parser.add_argument("--devices", help="comma-separated, one per device (default: cpu each)")
    parser.add_argument("--interleave", type=int, default=1,
                        help="stages per device, without a plan: stage s on device s %% devices")
    parser.add_argument("--chunks", type=int, default=4, help="micro-batches, without a plan")
    parser.add_argument("--checkpoint", default="except_last", choices=["never", "except_last", "always"])
    parser.add_argument("--batch", type=int, default=32, help="batch size, without a plan")
    parser.add_argument("--deferred-batch-norm", action="store_true")
    parser.add_argument("--size", type=int, default=64, help="image side")
    parser.add_argument("--classes", type=int, default=10)
    parser.add_argument("--batches", type=int, default=4, help="synthetic batches per epoch")
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--lr", type=float, default=0.01)
    parser.add_argument("--threads", type=int, default=1, help="intra-op threads (one core per stage)")
    parser.add_argument("--save", default="checkpoint.pt")
    return parser


if __name__ == "__main__":
    main()
