"""Train with a saved plan on torch.distributed.pipelining, one stage per torchrun process
(replicas × stages processes for a plan with replicas).

    torchrun --nproc-per-node 2 examples/distributed_train.py --plan plans/resnet18.json
    torchrun --nproc-per-node 2 examples/distributed_train.py --balance 7,8 --chunks 4 --image-size 64

Every rank builds the same model (same seed), keeps its stage and trains it on synthetic data;
rank 0 prints the loss the last rank computed, and the stages' weights are gathered into one
checkpoint that loads into the plain model.
"""
from __future__ import annotations

import argparse

import torch
import torchvision
from torch import nn

from autopipe.distributed import DistributedPipeline
from autopipe.planning.plans import Plan


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--plan", help="plan file (from 'autopipe plan'); sets balance, chunks, schedule, batch size")
    parser.add_argument("--balance", help="layers per stage without a plan, e.g. 7,8")
    parser.add_argument("--chunks", type=int, help="micro-batches per step (default: the plan's, else 4)")
    parser.add_argument("--schedule", choices=["gpipe", "1f1b"], help="default: the plan's, else gpipe")
    parser.add_argument("--batch-size", type=int, help="default: the plan's, else 32")
    parser.add_argument("--image-size", type=int, default=128, help="synthetic images are 3 x N x N")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--threads", type=int, default=1, help="intra-op threads per process")
    parser.add_argument("--save", default="checkpoints/distributed_resnet18.pt", help="merged checkpoint path")
    args = parser.parse_args()
    if (args.plan is None) == (args.balance is None):
        parser.error("give exactly one of --plan or --balance")
    return args


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)  # every rank builds identical initial weights
    model = torchvision.models.resnet18(weights=None)
    plan = Plan.load(args.plan) if args.plan else None
    balance = [int(n) for n in args.balance.split(",")] if args.balance else None
    runner = DistributedPipeline(
        model, plan, balance=balance, chunks=args.chunks or (None if plan else 4), schedule=args.schedule,
        batch_size=args.batch_size or (None if plan else 32), loss_fn=nn.functional.cross_entropy,
    )
    optimizer = torch.optim.SGD(runner.parameters(), lr=args.lr, momentum=0.9)
    generator = torch.Generator().manual_seed(1)
    whole = runner.batch_size * runner.replicas  # each replica trains on its share of the batch
    images = torch.randn(whole, 3, args.image_size, args.image_size, generator=generator)
    labels = torch.randint(0, 1000, (whole,), generator=generator)
    images, labels = runner.shard(images), runner.shard(labels)
    first = runner.rank == 0 and runner.replica == 0
    if first:
        print(f"{runner.replicas} x {runner.num_stages} stages, balance {runner.balance}, {runner.schedule_name} with "
              f"{runner.chunks} micro-batches of {runner.batch_size // runner.chunks}", flush=True)
    for step in range(args.steps):
        optimizer.zero_grad()
        loss = runner.broadcast_loss(runner.step(images, target=labels))
        optimizer.step()
        if first:
            print(f"step {step}: loss {loss:.4f}", flush=True)
    path = runner.save_checkpoint(args.save)
    if path is not None:
        plain = torchvision.models.resnet18(weights=None)
        plain.load_state_dict(torch.load(path), strict=True)
        print(f"saved {path}: loads into the plain model (strict=True)", flush=True)
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
