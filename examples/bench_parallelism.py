"""Which parallelism? Data parallel, pipeline or both on ResNet-18 over two CPU devices.

Rows, each one training step (zero_grad, forward, backward, SGD step) per round, rounds
interleaved in this process (one intra-op thread; each device is one core), medians after a
warm-up round:

* plain model: the unpartitioned model on one device, the whole batch;
* autopipe data parallel: the planner's best plan with one replica per device;
* best pipeline-only plan: the planner's best plan with one replica;
* planner's choice: ``autopipe.plan(..., replicas="auto")``;
* with ``--memory-limit`` (default: one byte under the least that one whole replica needs on a
  device, over micro-batch counts and checkpoint modes) the planner's choice under that limit;
  every row says whether it fits.

Each planned row prints the planner's prediction and its error against the measured median;
the plain row's prediction is the planner's one-device, one-micro-batch plan.  Speedups are
medians of per-round ratios to the plain step of the same round.

Then ``torch.nn.parallel.DistributedDataParallel`` over two processes (gloo, 1 thread each,
half the batch each, started like torchrun by :func:`autopipe.distributed.local.launch_local`),
its rounds interleaved with a plain whole-batch step on rank 0 while rank 1 waits: its speedup
is against that plain step, in that job.

Plans come from the committed profile (``profiles/resnet18-128.json``, made for batch 64 of
3x128x128); a profile without a gradient-reduction fit gets one measured here first.

    python examples/bench_parallelism.py [--rounds 7] [--batch 64] [--size 128] [--memory-limit 150MB] [--no-ddp]
"""
from __future__ import annotations

import argparse
import copy
import json
import math
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

from autopipe._allocator import steady_memory

MEMORY = steady_memory()  # before torch is imported

import torch  # noqa: E402
import torchvision  # noqa: E402
from torch import nn  # noqa: E402

import autopipe  # noqa: E402
from autopipe.planning._infeasible import smallest_memory  # noqa: E402
from autopipe.planning._options import candidate_chunks  # noqa: E402
from autopipe.planning.cost import CostModel  # noqa: E402
from autopipe.planning.replicas import best_pipeline, pure_data_parallel  # noqa: E402
from autopipe.profiling._reduction import measure_reduction  # noqa: E402

Step = Callable[[], None]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--profile", default="profiles/resnet18-128.json", help="profile to plan from")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--size", type=int, default=128, help="image side")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--memory-limit", default=None,
                        help="per-device limit for the second table (default: just under one replica's need)")
    parser.add_argument("--no-ddp", action="store_true", help="skip the torch DDP job")
    parser.add_argument("--ddp-worker", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.ddp_worker:
        _ddp_worker(args)
        return

    profile = autopipe.Profile.load(args.profile)
    if profile.reduction_fit("local") is None:
        profile.reductions = measure_reduction([torch.device("cpu")] * 2)
        print("the profile has no gradient-reduction fit: measured one now "
              f"({profile.reductions[0].ms_per_byte * 2**20:.3f} ms/MiB)")
    devices = ["cpu", "cpu"]
    plans = {
        "autopipe data parallel": pure_data_parallel(profile, devices, batch_size=args.batch),
        "best pipeline-only plan": best_pipeline(profile, devices, batch_size=args.batch),
        "planner's choice": autopipe.plan(profile, devices, batch_size=args.batch),
    }
    single = autopipe.plan(profile, ["cpu"], batch_size=args.batch, chunks=1)
    need = _replica_need(profile, args.batch // 2)
    limit = need - 1 if args.memory_limit is None else args.memory_limit
    plans["choice under the limit"] = autopipe.plan(profile, devices, batch_size=args.batch, memory_limit=limit)

    torch.manual_seed(0)
    x = torch.randn(args.batch, 3, args.size, args.size)
    y = torch.randint(0, 1000, (args.batch,))
    model = torchvision.models.resnet18(weights=None)
    steps = {"plain model": _step(copy.deepcopy(model), x, y)}
    for name, plan in plans.items():
        steps[name] = _step(autopipe.Pipeline(copy.deepcopy(model), plan), x, y)
    print(f"ResNet-18, batch {args.batch} of 3x{args.size}x{args.size}, 2 cpu devices x 1 thread, "
          f"{args.rounds} rounds interleaved, {MEMORY}, load average {os.getloadavg()[0]:.2f} at start")
    samples = _interleaved(steps, args.rounds)
    predicted = {"plain model": single.predicted.iteration_ms,
                 **{name: plan.predicted.iteration_ms for name, plan in plans.items()}}
    memory = {"plain model": max(single.device_memory_bytes),
              **{name: max(plan.device_memory_bytes) for name, plan in plans.items()}}
    described = {"plain model": "1 device", **{name: _describe(plan) for name, plan in plans.items()}}
    print(_table(samples, predicted, memory, described, [n for n in samples if n != "choice under the limit"]))
    print(f"load average {os.getloadavg()[0]:.2f} at end")
    if not args.no_ddp:
        print(_ddp_line(args))
    limit_bytes = plans["choice under the limit"].options["memory_limit_bytes"][0]
    print(f"\nwith a memory limit of {limit_bytes} bytes per device (one data-parallel replica needs {need}):")
    print(_table(samples, predicted, memory, described, list(samples), limit_bytes))


def _replica_need(profile: autopipe.Profile, share: int) -> int:
    """The least memory a whole replica needs on one device for ``share`` samples, over
    micro-batch counts and checkpoint modes."""
    model = CostModel(profile, ["cpu"], [1.0], share)  # the planner's default optimizer state
    chunks = candidate_chunks(share, profile.batch_sizes)
    return int(math.ceil(smallest_memory(model, chunks, ["never", "except_last", "always"], 1)[0]))


def _describe(plan: autopipe.Plan) -> str:
    shared = f" x{plan.interleave}/device" if plan.interleave > 1 else ""
    return f"R={plan.replicas} {plan.balance}{shared} m={plan.chunks} {plan.checkpoint}"


def _table(samples: dict[str, list[float]], predicted: dict[str, float], memory: dict[str, int],
           described: dict[str, str], names: list[str], limit: int | None = None) -> str:
    plain = samples["plain model"]
    lines = [f"{'row':26s} {'plan':44s} {'median ms':>10s} {'speedup':>8s} {'predicted':>10s} {'pred. x':>8s} "
             f"{'error':>7s} {'device MiB':>10s}" + (" fits" if limit else "")]
    for name in names:
        ms = statistics.median(samples[name])
        speedup = statistics.median(p / t for p, t in zip(plain, samples[name]))
        fits = "" if limit is None else ("  yes" if memory[name] <= limit else "   no")
        lines.append(f"{name:26s} {described[name]:44s} {ms:10.1f} {speedup:7.2f}x {predicted[name]:10.1f} "
                     f"{predicted['plain model'] / predicted[name]:7.2f}x {predicted[name] / ms - 1:+7.1%} "
                     f"{memory[name] / 2**20:10.1f}{fits}")
    return "\n".join(lines)


def _step(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> Step:
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()

    return step


def _interleaved(steps: dict[str, Step], rounds: int) -> dict[str, list[float]]:
    for step in steps.values():  # warm-up
        step()
    samples: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(rounds):
        for name, step in steps.items():
            start = time.perf_counter()
            step()
            samples[name].append((time.perf_counter() - start) * 1e3)
    return samples


def _ddp_line(args: argparse.Namespace) -> str:
    from autopipe.distributed.local import launch_local

    with tempfile.TemporaryDirectory(prefix="autopipe-ddp-") as directory:
        out = Path(directory) / "times.json"
        command = [sys.executable, __file__, "--ddp-worker", str(out), "--batch", str(args.batch),
                   "--size", str(args.size), "--rounds", str(args.rounds)]
        launch_local(command, 2, Path(directory), timeout_s=1800)
        times = json.loads(out.read_text())
    ratio = statistics.median(p / d for p, d in zip(times["plain"], times["ddp"]))
    return (f"{'torch DDP, 2 processes':26s} {'gloo, batch ' + str(args.batch // 2) + ' each':44s} "
            f"{statistics.median(times['ddp']):10.1f} {ratio:7.2f}x   (against the plain step in that job: "
            f"{statistics.median(times['plain']):.1f} ms)")


def _ddp_worker(args: argparse.Namespace) -> None:
    """One rank: rounds of a DDP step (both ranks) then a plain whole-batch step on rank 0."""
    import torch.distributed as dist

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    x = torch.randn(args.batch, 3, args.size, args.size)
    y = torch.randint(0, 1000, (args.batch,))
    model = torchvision.models.resnet18(weights=None)
    plain = _step(copy.deepcopy(model), x, y) if rank == 0 else None
    share = torch.tensor_split(torch.arange(args.batch), 2)[rank]
    ddp = _step(nn.parallel.DistributedDataParallel(model), x[share], y[share])
    times: dict[str, list[float]] = {"ddp": [], "plain": []}
    for round_ in range(args.rounds + 1):
        dist.barrier()
        start = time.perf_counter()
        ddp()
        dist.barrier()
        elapsed = (time.perf_counter() - start) * 1e3
        if plain is not None:
            start = time.perf_counter()
            plain()
            if round_ > 0:  # the first round warms up
                times["plain"].append((time.perf_counter() - start) * 1e3)
                times["ddp"].append(elapsed)
    if rank == 0:
        Path(args.ddp_worker).write_text(json.dumps(times))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
