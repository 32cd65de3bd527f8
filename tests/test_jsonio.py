"""``write_atomic``: the one temp-file-and-rename writer behind profiles, plans and checkpoints."""
from __future__ import annotations

from pathlib import Path
from typing import IO

import pytest
import torch

from autopipe._jsonio import write_atomic


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
