"""``write_atomic``: the one temp-file-and-rename writer behind profiles, plans and checkpoints."""
from __future__ import annotations

import json
import os
import stat
from pathlib import Path
from typing import IO

import pytest
import torch

from autopipe._jsonio import write_atomic, write_json_atomic


def test_a_failed_write_keeps_the_old_file_and_leaves_no_temporary(tmp_path: Path) -> None:
    target = tmp_path / "ckpt.pt"
    state = {"w": torch.arange(4.0)}
    write_atomic(target, lambda handle: torch.save(state, handle))

    def fail_halfway(handle: IO[bytes]) -> None:
        handle.write(b"half")
        raise RuntimeError("disk full")

    with pytest.raises(RuntimeError, match="disk full"):
        write_atomic(target, fail_halfway)
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt.pt"]
    assert torch.equal(torch.load(target, weights_only=True)["w"], state["w"])


def test_a_fifo_is_never_replaced_but_a_link_to_a_file_is_written(tmp_path: Path) -> None:
    """The rename would put a regular file in place of a FIFO or a device (``-o /dev/null`` run
    as root would replace ``/dev/null``); a symlink to a regular file is written as before."""
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    for target in (fifo, tmp_path / "link-to-pipe"):
        if target != fifo:
            target.symlink_to(fifo)
        with pytest.raises(OSError, match="it exists and is not a regular file"):
            write_json_atomic(target, {"kind": "plan"})
    assert stat.S_ISFIFO(fifo.stat().st_mode)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["link-to-pipe", "pipe"]  # no temporary left
    (tmp_path / "file.json").write_text("{}")
    (tmp_path / "link.json").symlink_to(tmp_path / "file.json")
    write_json_atomic(tmp_path / "link.json", {"kind": "plan"})
    assert json.loads((tmp_path / "link.json").read_text()) == {"kind": "plan"}
