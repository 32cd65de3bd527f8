"""``write_atomic``: the one temp-file-and-rename writer behind profiles, plans and checkpoints;
``read_json``'s errors for files that are no JSON autopipe can read."""
from __future__ import annotations

import errno
import json
import os
import re
import stat
from pathlib import Path
from typing import IO, Callable

import pytest
import torch

from autopipe._jsonio import check_writable, read_json, write_atomic, write_json_atomic
from autopipe.errors import FormatError, OptionError


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


def test_a_fifo_is_never_replaced_but_a_link_to_a_file_is_written_through(tmp_path: Path) -> None:
    """The rename would put a regular file in place of a FIFO or a device (``-o /dev/null`` run
    as root would replace ``/dev/null``); a symlink to a regular file is written through, and
    stays a link (the rename put a file in its place)."""
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    for target in (fifo, tmp_path / "link-to-pipe"):
        if target != fifo:
            target.symlink_to(fifo)
        with pytest.raises(OSError, match="it exists and is not a regular file"):
            write_json_atomic(target, {"kind": "plan"})
    assert stat.S_ISFIFO(fifo.stat().st_mode)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["link-to-pipe", "pipe"]  # no temporary left
    (tmp_path / "file.json").write_text('{"kind": "plan", "chunks": 2}')
    (tmp_path / "link.json").symlink_to(tmp_path / "file.json")
    write_json_atomic(tmp_path / "link.json", {"kind": "plan"})
    assert (tmp_path / "link.json").is_symlink()
    assert json.loads((tmp_path / "file.json").read_text()) == {"kind": "plan"}


def test_only_a_writable_file_of_the_kind_written_is_replaced(tmp_path: Path) -> None:
    """``-o model.py`` replaced the model's source with a plan, and a file marked read-only was
    replaced too (the rename ignores its mode): both refused, naming the file, and left as they
    were; a plan replaces a plan, and a write of no kind (a checkpoint) any writable file."""
    source = tmp_path / "model.py"
    source.write_text("import torch\n")
    profile = tmp_path / "profile.json"
    profile.write_text('{"kind": "profile"}')
    for existing, what in ((source, "no autopipe file"), (profile, "a 'profile' file")):
        with pytest.raises(FileExistsError, match=f"cannot write {re.escape(str(existing))}: it exists and is {what}, "
                                                  "not a plan file, which saving would replace"):
            write_json_atomic(existing, {"kind": "plan"})
    assert source.read_text() == "import torch\n" and profile.read_text() == '{"kind": "profile"}'
    plan = write_json_atomic(tmp_path / "plan.json", {"kind": "plan", "chunks": 2})
    write_json_atomic(plan, {"kind": "plan", "chunks": 4})
    assert json.loads(plan.read_text())["chunks"] == 4
    write_atomic(source, lambda handle: handle.write(b"state"))
    assert source.read_bytes() == b"state"
    plan.chmod(0o444)
    with pytest.raises(PermissionError, match="it exists and is read-only"):
        write_json_atomic(plan, {"kind": "plan", "chunks": 8})
    assert json.loads(plan.read_text())["chunks"] == 4


def test_a_key_repeated_in_an_object_is_refused_naming_it(tmp_path: Path) -> None:
    """JSON allows it and Python's reader keeps the last: a hand-edited plan with two "chunks" ran
    with the second, without a word."""
    path = tmp_path / "plan.json"
    path.write_text('{"kind": "plan", "schema_version": 1, "stages": [{"a": 1, "a": 2}]}')
    with pytest.raises(FormatError, match=f"^{re.escape(str(path))}: the key 'a' appears twice in one object"):
        read_json(path, "plan", 1)


@pytest.mark.parametrize(("text", "problem"), [
    ("[" * 100_000 + "]" * 100_000, "nested too deeply to read"),
    ('{"kind": "profile", "schema_version": ' + "9" * 5000 + "}", "a number too long to read"),
])
def test_json_python_cannot_hold_is_a_format_error_naming_the_file(tmp_path: Path, text: str, problem: str) -> None:
    """Valid JSON can still be beyond Python (its recursion limit, its 4300-digit integers):
    one FormatError naming the file, not a RecursionError or a ValueError without it."""
    path = tmp_path / "bad.json"
    path.write_text(text)
    with pytest.raises(FormatError, match=f"^{re.escape(str(path))}: .*{problem}.*the profile file is corrupt — make "
                                          "it again$"):
        read_json(path, "profile", 1)


@pytest.mark.parametrize("call", [lambda: read_json(None, "plan", 1),  # type: ignore[arg-type]
                                  lambda: write_json_atomic(None, {}),  # type: ignore[arg-type]
                                  lambda: check_writable(3)])  # type: ignore[arg-type]
def test_a_path_that_is_no_file_name_is_named(call: Callable[[], object]) -> None:
    with pytest.raises(OptionError, match=r"^path must name a (plan file|file to write) \(a str or os.PathLike"):
        call()


def test_a_full_disk_names_the_file_and_keeps_the_old_one(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    target = write_json_atomic(tmp_path / "plan.json", {"kind": "plan"})

    def full(descriptor: int) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "fsync", full)
    message = (f"[Errno {errno.ENOSPC}] cannot write {target} (No space left on device); it is left as it was: "
               "free some space or choose another place")
    with pytest.raises(OSError, match=f"^{re.escape(message)}$"):
        write_json_atomic(target, {"kind": "plan", "more": 1})
    assert json.loads(target.read_text()) == {"kind": "plan"}
    assert [p.name for p in tmp_path.iterdir()] == ["plan.json"]
