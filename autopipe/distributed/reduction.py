"""Profile the process group's ``all_reduce`` for the planner's replicas on this engine.

``python -m autopipe.distributed.reduction PROFILE --processes 2`` starts that many local ranks
(gloo on CPU, NCCL with ``--backend nccl``), times ``dist.all_reduce`` of float32 gradients
at several sizes, fits ``latency_ms + bytes * ms_per_byte`` and adds the fit to the profile
(as its ``"distributed"`` reduction; the file is rewritten, so plans made from the old file
name an old digest).  Under your own torchrun job, :func:`measure_all_reduce` does the same
on the job's process group.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Sequence

import torch
import torch.distributed as dist

from .._jsonio import Fields
from ..profiling._copies import fit_copy
from ..profiling._reduction import DEFAULT_REDUCTION_SIZES
from ..profiling.profiles import Profile, ReductionFit
from .local import launch_local

__all__ = ["measure_all_reduce", "main"]


def measure_all_reduce(group: dist.ProcessGroup | None = None, sizes: Sequence[int] = DEFAULT_REDUCTION_SIZES,
                       repeats: int = 5, warmup: int = 2, device: torch.device | None = None) -> ReductionFit:
    """Collective: the fit of ``all_reduce`` times over ``group`` (every rank gets rank 0's)."""
    where = device or torch.device("cpu")
    points: list[tuple[int, float]] = []
    for nbytes in sizes:
        tensor = torch.ones(nbytes // 4, device=where)
        for run in range(warmup + repeats):
            dist.barrier(group)
            start = time.perf_counter()
            dist.all_reduce(tensor, group=group)
            if where.type == "cuda":
                torch.cuda.synchronize(where)
            if run >= warmup:
                points.append((nbytes, (time.perf_counter() - start) * 1e3))
    shared = [points]
    dist.broadcast_object_list(shared, src=dist.get_global_rank(group, 0) if group else 0, group=group)
    fit = fit_copy(0, 0, shared[0])
    return ReductionFit("distributed", dist.get_world_size(group), fit.latency_ms, fit.ms_per_byte, fit.points)


def _worker(out: Path, backend: str) -> None:
    dist.init_process_group(backend)
    device = torch.device("cuda", dist.get_rank() % torch.cuda.device_count()) if backend == "nccl" else None
    fit = measure_all_reduce(device=device)
    if dist.get_rank() == 0:
        out.write_text(json.dumps(fit.to_json()))
    dist.barrier()
    dist.destroy_process_group()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("profile", help="profile JSON to add the fit to")
    parser.add_argument("--processes", type=int, default=2, help="ranks (replicas) to time it over")
    parser.add_argument("--backend", choices=["gloo", "nccl"], default="gloo")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        _worker(Path(args.worker), args.backend)
        return 0
    profile = Profile.load(args.profile)
    with tempfile.TemporaryDirectory(prefix="autopipe-allreduce-") as directory:
        out = Path(directory) / "fit.json"
        launch_local([sys.executable, "-m", "autopipe.distributed.reduction", args.profile, "--backend", args.backend,
                      "--worker", str(out)], args.processes, Path(directory), timeout_s=600)
        fit = ReductionFit.from_json(Fields(json.loads(out.read_text()), str(out), ""))
    profile.reductions = [r for r in profile.reductions if r.engine != "distributed"] + [fit]
    profile.save(args.profile)
    print(f"all_reduce over {fit.replicas} {args.backend} processes: {fit.latency_ms:.3f} ms + "
          f"{fit.ms_per_byte * 2**20:.3f} ms/MiB; added to {args.profile}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
