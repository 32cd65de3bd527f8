"""Start a job's ranks as processes on this machine (localhost only), for tests and benchmarks."""
from __future__ import annotations

import os
import socket
import subprocess
import time
from pathlib import Path
from typing import Sequence

from ..errors import LaunchError

__all__ = ["LaunchError", "free_port", "launch_local"]


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def launch_local(command: Sequence[str], nprocs: int, log_dir: Path, timeout_s: float,
                 threads: int = 1) -> None:
    """Run ``command`` as ranks ``0..nprocs-1`` with torchrun's environment, then return.

    Every rank is killed as soon as one fails or the time is up, so a rank blocked on a peer
    that died never outlives the job; each rank's output is in ``log_dir/rank{r}.log``.
    """
    port = str(free_port())
    procs: list[subprocess.Popen[bytes]] = []
    try:
        for rank in range(nprocs):
            env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=port, RANK=str(rank),
                       LOCAL_RANK=str(rank), WORLD_SIZE=str(nprocs), LOCAL_WORLD_SIZE=str(nprocs),
                       OMP_NUM_THREADS=str(threads))
            with open(log_dir / f"rank{rank}.log", "wb") as log:
                procs.append(subprocess.Popen(list(command), env=env, stdout=log, stderr=subprocess.STDOUT))
        _wait(procs, time.monotonic() + timeout_s)
        failed = [rank for rank, proc in enumerate(procs) if proc.poll() != 0]
        if failed:
            logs = "\n".join(f"--- rank {r} ---\n{(log_dir / f'rank{r}.log').read_text()[-3000:]}" for r in failed)
            raise LaunchError(f"ranks {failed} failed or ran out of {timeout_s:.0f} s:\n{logs}")
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def _wait(procs: Sequence[subprocess.Popen[bytes]], deadline: float) -> None:
    while time.monotonic() < deadline:
        codes = [proc.poll() for proc in procs]
        if all(code is not None for code in codes) or any(code not in (None, 0) for code in codes):
            return
        time.sleep(0.05)
