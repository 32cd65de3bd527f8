"""Atomic files and validated JSON reading, shared by profiles, plans and checkpoints.

Files are written to a temporary file beside the target and renamed over it, so a crash never
leaves half a file.  Reading goes through :class:`Fields`, which names the file and the exact
field (``layers[3].forward_ms``) in its one error when something is missing or of the wrong type.
"""
from __future__ import annotations

import errno
import hashlib
import json
import numbers
import math
import os
import sys
import tempfile
from pathlib import Path
from typing import IO, Any, Callable, TypeVar

from ._vocab import check_device_name
from .errors import DeviceError, FormatError, OptionError

__all__ = ["FormatError", "Fields", "check_path", "check_writable", "write_atomic", "write_json_atomic", "read_json",
           "digest", "is_finite"]

T = TypeVar("T")

_UMASK = os.umask(0)  # read once at import (os.umask can only be read by setting it) ...
os.umask(_UMASK)  # ... and put back at once


def check_path(path: object, what: str) -> Path:
    """``path`` as a :class:`Path`; raises :class:`OptionError` unless it is a ``str`` or an
    ``os.PathLike`` (``None`` or an open file would fail deep in :mod:`pathlib`)."""
    if not isinstance(path, (str, os.PathLike)):
        raise OptionError(f"path must name {what} (a str or os.PathLike such as pathlib.Path), got {path!r:.60}")
    return Path(path)


def check_writable(path: str | os.PathLike[str], example: str = "out.json", kind: str | None = None) -> Path:
    """``path`` if a file can be written there, else the reason it cannot, as an ``OSError``
    (``example`` is the file name suggested in place of a directory; an :class:`OptionError`
    if ``path`` is no file name at all).

    Callers run this before long work (profiling, a bench) so a bad output path costs nothing;
    :func:`write_atomic` runs it again, since the place may have changed meanwhile.  Only a
    regular file (or a symlink to one, which is written through) may be replaced: the rename
    would put a file in place of a device or a FIFO (``-o /dev/null`` run as root would replace
    ``/dev/null``); not one marked read-only, and given the ``kind`` of file written (``"plan"``,
    ``"png"``), only one of that kind: ``-o model.py`` would replace the model's source.
    """
    target = _written(check_path(path, "a file to write"))
    if target.is_dir():
        raise IsADirectoryError(f"cannot write {target}: it is a directory; give a file name such as "
                                f"{target / example}")
    if target.exists() and not target.is_file():
        raise FileExistsError(f"cannot write {target}: it exists and is not a regular file (a device, FIFO or "
                              "socket), which saving would replace with a file; choose another file name")
    if target.is_file():
        _check_replaceable(target, kind)
    existing = next(p for p in (target.parent, *target.parent.parents) if p.exists())  # missing ones are made
    if not existing.is_dir():
        raise NotADirectoryError(f"cannot write {target}: {existing} is a file, not a directory; "
                                 "choose another place")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise PermissionError(f"cannot write {target}: the directory {existing} is not writable; "
                              "choose a writable place")
    return target


def _written(target: Path) -> Path:
    """The file a write to ``target`` goes to: a symlink's target (the link stays a link)."""
    return Path(os.path.realpath(target)) if target.is_symlink() else target


def _check_replaceable(target: Path, kind: str | None) -> None:
    """Refuse to replace ``target`` if it is marked read-only, or if it is not a ``kind`` file."""
    if not os.stat(target).st_mode & 0o222:
        raise PermissionError(f"cannot write {target}: it exists and is read-only; choose another file name, or "
                              "make it writable first")
    if kind is None:
        return
    found = _kind_of(target)
    if found != kind:
        what = f"a '{found}' file" if found else "no autopipe file"
        raise FileExistsError(f"cannot write {target}: it exists and is {what}, not a {kind} file, which saving "
                              "would replace; choose another file name, or remove it first")


#: Largest file read to tell its kind: far above any profile or plan (a 1,000-layer profile on 64
#: devices is 2.2 MB), so that ``-o`` naming a checkpoint of gigabytes does not read it.
_LARGEST_KNOWN = 256 * 2**20


def _kind_of(target: Path) -> str | None:
    """What ``target`` holds: ``"png"``, the ``kind`` of an autopipe JSON file, or ``None``."""
    try:
        with open(target, "rb") as handle:
            head = handle.read(8)
            if head == b"\x89PNG\r\n\x1a\n":
                return "png"
            if os.fstat(handle.fileno()).st_size > _LARGEST_KNOWN:
                return None
            document = json.loads((head + handle.read()).decode("utf-8"))
    except (OSError, ValueError, RecursionError):  # unreadable or no JSON (UnicodeDecodeError is a ValueError)
        return None
    found = document.get("kind") if isinstance(document, dict) else None
    return found if isinstance(found, str) else None


def write_atomic(path: str | os.PathLike[str], write: Callable[[IO[bytes]], object], kind: str | None = None) -> Path:
    """Call ``write`` on a temporary file beside ``path``, then rename it over ``path``; an
    ``OSError`` meanwhile (a full disk) is raised again naming ``path``, which is left as it was.
    ``kind``: what is written, the only kind of file it may replace (:func:`check_writable`)."""
    target = check_writable(path, kind=kind)
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp")
    except OSError as error:  # OSError(errno, text) is the errno's subclass (PermissionError, ...)
        raise OSError(error.errno, f"cannot write {target} ({error.strerror or error}); choose a "
                                   "writable place") from None
    try:
        os.fchmod(fd, 0o666 & ~_UMASK)  # mkstemp makes 0600; a saved file is an ordinary file
        with os.fdopen(fd, "wb") as handle:
            write(handle)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, target)
    except BaseException as error:
        Path(tmp).unlink(missing_ok=True)
        if isinstance(error, OSError):
            advice = "free some space" if error.errno == errno.ENOSPC else "check the disk"
            raise OSError(error.errno, f"cannot write {target} ({error.strerror or error}); it is left as it was: "
                                       f"{advice} or choose another place") from None
        raise
    return target


def write_json_atomic(path: str | os.PathLike[str], document: dict[str, Any]) -> Path:
    """Write ``document`` to ``path`` as JSON, atomically; returns the path."""
    text = json.dumps(document, indent=1, allow_nan=False, default=plain_number) + "\n"
    return write_atomic(path, lambda handle: handle.write(text.encode("utf-8")), document.get("kind"))


def read_json(path: str | os.PathLike[str], kind: str, schema_version: int) -> Fields:
    """Parse ``path`` as a ``kind`` document of at most ``schema_version``."""
    file, source = check_path(path, f"a {kind} file"), str(path)
    try:
        text = file.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise FormatError(f"{source}: no such {kind} file") from None
    except (OSError, UnicodeDecodeError) as error:
        raise FormatError(f"{source}: cannot read {kind} file ({error})") from None
    document = _parse(text, source, kind)
    fields = Fields(document, source, "")
    if not isinstance(document, dict):
        raise fields.error(f"expected a JSON object at the top of a {kind} file")
    found_kind = fields.str("kind")
    if found_kind != kind:
        raise fields.error(f"this is a '{found_kind}' file, not a {kind} file", "kind")
    version = fields.int("schema_version")
    if version > schema_version:
        raise fields.error(
            f"schema version {version} is newer than this autopipe understands ({schema_version}); "
            "upgrade autopipe",
            "schema_version",
        )
    if version < 1:
        raise fields.error(f"schema version {version} is not valid", "schema_version")
    return fields


def _parse(text: str, source: str, kind: str) -> Any:
    """``text`` as JSON; :class:`FormatError` naming ``source`` if it is not JSON or is JSON that
    Python cannot hold (arrays nested past its recursion limit, an integer of thousands of digits)."""
    remake = f"the {kind} file is corrupt — make it again"
    try:
        return json.loads(text, object_pairs_hook=_unique_keys)
    except _RepeatedKey as repeated:
        raise FormatError(f"{source}: the key '{repeated.key}' appears twice in one object, and which value is meant "
                          f"is unclear (the file was edited?); remove one, or make the {kind} file again") from None
    except json.JSONDecodeError as error:
        raise FormatError(f"{source}: not valid JSON at line {error.lineno} column {error.colno} ({error.msg}); "
                          f"the {kind} file is corrupt or truncated — make it again") from None
    except RecursionError:
        raise FormatError(f"{source}: its JSON is nested too deeply to read (deeper than Python's recursion limit "
                          f"of {sys.getrecursionlimit()}); {remake}") from None
    except ValueError as error:  # an integer longer than sys.get_int_max_str_digits()
        raise FormatError(f"{source}: holds a number too long to read ({str(error).split(';')[0]}); "
                          f"{remake}") from None


class _RepeatedKey(ValueError):
    def __init__(self, key: str) -> None:
        super().__init__(key)
        self.key = key


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """An object's pairs as a dict, refusing a key given twice (JSON allows it; the last would win)."""
    value = dict(pairs)
    if len(value) != len(pairs):
        seen: set[str] = set()
        for key, _ in pairs:
            if key in seen:
                raise _RepeatedKey(key)
            seen.add(key)
    return value


class Fields:
    """A JSON value with the path that reached it, for errors that name the field."""

    def __init__(self, value: Any, source: str, path: str = "", parent: Fields | None = None,
                 key: str | int | None = None) -> None:
        self.value = value
        self.source = source
        self._path = path
        self._parent, self._key = parent, key  # the path is joined only for an error: reading stays cheap

    @property
    def path(self) -> str:
        return self._path if self._parent is None else self._parent._join(self._key)  # type: ignore[arg-type]

    def error(self, message: str, key: str | None = None) -> FormatError:
        where = self._join(key) if key is not None else self.path
        field = f" field '{where}':" if where else ""
        return FormatError(f"{self.source}:{field} {message}")

    def _join(self, key: str | int) -> str:
        path = self.path
        if isinstance(key, int):
            return f"{path}[{key}]"
        return f"{path}.{key}" if path else key

    def get(self, key: str) -> Fields:
        value = self.value
        if not isinstance(value, dict):
            raise self.error("expected an object")
        if key not in value:
            raise self.error("missing", key)
        return Fields(value[key], self.source, parent=self, key=key)

    def has(self, key: str) -> bool:
        return isinstance(self.value, dict) and key in self.value

    def items(self) -> list[Fields]:
        if not isinstance(self.value, list):
            raise self.error(f"expected a list, found {type(self.value).__name__}")
        return [Fields(v, self.source, parent=self, key=i) for i, v in enumerate(self.value)]

    def keys(self) -> list[str]:
        if not isinstance(self.value, dict):
            raise self.error(f"expected an object, found {type(self.value).__name__}")
        return list(self.value)

    def typed(self, key: str, check: Callable[[Any], bool], what: str) -> Any:
        value = self._value(key)
        if not check(value):
            raise self.get(key).error(f"expected {what}, found {json.dumps(value)[:60]}")
        return value

    def _value(self, key: str) -> Any:
        """The value at ``key`` (errors as :meth:`get`'s), without a :class:`Fields` for it."""
        if isinstance(self.value, dict) and key in self.value:
            return self.value[key]
        return self.get(key).value  # raises, naming what is wrong

    def str(self, key: str) -> str:
        return self.typed(key, _is_str, "a string")

    def int(self, key: str, minimum: int | None = None) -> int:
        value = self.typed(key, _is_int, "an integer")
        if minimum is not None and value < minimum:
            raise self.get(key).error(f"must be at least {minimum}, found {value}")
        return value

    def float(self, key: str, minimum: float | None = None) -> float:
        value = float(self.typed(key, is_finite, "a finite number"))
        if minimum is not None and value < minimum:
            raise self.get(key).error(f"must be at least {minimum}, found {value}")
        return value

    def list_of(self, key: str, read: Callable[[Fields], T]) -> list[T]:
        return [read(item) for item in self.get(key).items()]

    def str_list(self, key: str) -> list[str]:
        return self.typed(key, lambda v: isinstance(v, list) and all(isinstance(x, str) for x in v),
                          "a list of strings")

    def device_names(self) -> list[str]:
        """This value as a list of device names, each as every step reads one
        (:func:`~autopipe._vocab.check_device_name`): a wrong one is named here, with its field."""
        names = []
        for item in self.items():
            try:
                names.append(check_device_name(item.value))
            except DeviceError as error:
                raise item.error(f"{error}; correct it, or make the file again") from None
        return names

    def int_list(self, key: str) -> list[int]:
        return self.typed(
            key,
            lambda v: isinstance(v, list) and all(isinstance(x, int) and not isinstance(x, bool) for x in v),
            "a list of integers",
        )


def _is_str(value: Any) -> bool:
    return isinstance(value, str)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def is_finite(value: Any) -> bool:
    """Whether a JSON value is a finite number (not a boolean)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def plain_number(value: Any) -> int | float:
    """``json.dumps``'s ``default``: a number of another type (``numpy.int64(4)``, which a user
    may pass as ``chunks``) as the ``int`` or ``float`` it is; anything else is refused as
    ``json`` refuses it."""
    if isinstance(value, numbers.Integral) and not isinstance(value, bool):
        return int(value)
    if isinstance(value, numbers.Real):
        return float(value)
    raise TypeError(f"Object of type {type(value).__name__} is not JSON serializable")


def digest(document: Any) -> str:
    """A short, stable hash of a JSON-able value."""
    text = json.dumps(document, sort_keys=True, separators=(",", ":"), default=plain_number)
    return hashlib.sha256(text.encode()).hexdigest()[:16]
