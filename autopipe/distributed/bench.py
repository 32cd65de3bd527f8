"""Time a balance on torch.distributed.pipelining (one process per stage) against one device.

The runtime benchmark calls :func:`bench_distributed` to put this engine next to the in-process
runtime; ``python -m autopipe.distributed.bench --balance 7,8 --chunks 4`` prints one line.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Sequence

import torch
from torch import Tensor, nn

from .._vocab import Schedule
from .local import launch_local

__all__ = ["DistributedBench", "bench_distributed", "main"]


@dataclass
class DistributedBench:
    """Median training-step times (zero_grad, forward, backward, SGD step), in ms."""

    balance: list[int]
    chunks: int
    schedule: Schedule
    batch_size: int
    image_size: int
    single_ms: float
    pipeline_ms: float

    @property
    def speedup(self) -> float:
        return self.single_ms / self.pipeline_ms

    def line(self) -> str:
        return (f"torch.distributed.pipelining {self.schedule} balance {self.balance} chunks {self.chunks} "
                f"(B={self.batch_size}, 3x{self.image_size}x{self.image_size}, {len(self.balance)} processes "
                f"x 1 thread): {self.pipeline_ms:.0f} ms/step vs {self.single_ms:.0f} ms on one device "
                f"= {self.speedup:.2f}x")


def _resnet18() -> nn.Module:
    import torchvision

    torch.manual_seed(0)
    return torchvision.models.resnet18(weights=None)


def _data(batch_size: int, image_size: int) -> tuple[Tensor, Tensor]:
    generator = torch.Generator().manual_seed(1)
    return (torch.randn(batch_size, 3, image_size, image_size, generator=generator),
            torch.randint(0, 1000, (batch_size,), generator=generator))


def _plain_step(batch_size: int, image_size: int) -> Callable[[], None]:
    """One training step of the unpartitioned model: the speedup's denominator."""
    model, (x, y) = _resnet18(), _data(batch_size, image_size)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()

    return step


def bench_distributed(balance: Sequence[int], chunks: int, schedule: Schedule = "gpipe", *, batch_size: int = 64,
                      image_size: int = 128, steps: int = 5, warmup: int = 2,
                      timeout_s: float = 900.0) -> DistributedBench:
    """Run ``balance`` as one localhost process per stage (1 thread each) against the plain model."""
    with tempfile.TemporaryDirectory(prefix="autopipe-bench-") as directory:
        out = Path(directory)
        command = [sys.executable, "-m", "autopipe.distributed.bench", "--worker", str(out / "times.json"),
                   "--balance", ",".join(map(str, balance)), "--chunks", str(chunks), "--schedule", schedule,
                   "--batch-size", str(batch_size), "--image-size", str(image_size),
                   "--steps", str(steps), "--warmup", str(warmup)]
        launch_local(command, len(balance), out, timeout_s)
        times = json.loads((out / "times.json").read_text())
    return DistributedBench(list(balance), chunks, schedule, batch_size, image_size,
                            times["single_ms"], times["pipeline_ms"])


def _worker(args: argparse.Namespace) -> None:
    """One rank.  Rounds interleave a pipeline step (all ranks) with a plain step on rank 0 alone
    (the others wait at a barrier), so both see the same load on a shared machine."""
    import torch.distributed as dist

    from .pipeline import DistributedPipeline

    torch.set_num_threads(1)
    runner = DistributedPipeline(_resnet18(), balance=args.balance, chunks=args.chunks, schedule=args.schedule,
                                 batch_size=args.batch_size, loss_fn=nn.functional.cross_entropy)
    optimizer = torch.optim.SGD(runner.parameters(), lr=0.01)
    x, y = _data(args.batch_size, args.image_size)
    plain_step = _plain_step(args.batch_size, args.image_size) if runner.rank == 0 else None
    pipeline_ms, single_ms = [], []
    for _ in range(args.warmup + args.steps):
        dist.barrier()
        start = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        runner.step(x, target=y)
        optimizer.step()
        dist.barrier()
        pipeline_ms.append((time.perf_counter() - start) * 1e3)
        if plain_step is not None:
            start = time.perf_counter()
            plain_step()
            single_ms.append((time.perf_counter() - start) * 1e3)
    if runner.rank == 0:
        times = {"pipeline_ms": statistics.median(pipeline_ms[args.warmup:]),
                 "single_ms": statistics.median(single_ms[args.warmup:])}
        Path(args.worker).write_text(json.dumps(times))
    dist.barrier()
    dist.destroy_process_group()


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--balance", required=True, type=lambda text: [int(n) for n in text.split(",")],
                        help="layers per stage of the ResNet-18 chain, e.g. 7,8")
    parser.add_argument("--chunks", type=int, default=4)
    parser.add_argument("--schedule", choices=["gpipe", "1f1b"], default="gpipe")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--image-size", type=int, default=128)
    parser.add_argument("--steps", type=int, default=5, help="timed steps (median reported)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps first")
    parser.add_argument("--json", action="store_true", help="print the result as JSON")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    return parser


def main(argv: Sequence[str] | None = None) -> None:
    args = _parser().parse_args(argv)
    if args.worker:
        _worker(args)
        return
    result = bench_distributed(args.balance, args.chunks, args.schedule, batch_size=args.batch_size,
                               image_size=args.image_size, steps=args.steps, warmup=args.warmup)
    print(json.dumps(asdict(result) | {"speedup": result.speedup}) if args.json else result.line())


if __name__ == "__main__":
    main()
