"""What the profiler measured: the :class:`Profile` and its JSON file.

Times are in milliseconds and kept per micro-batch size (``forward[b]``); byte counts that grow
with the batch are kept per sample (outputs, stashed skips) or per batch size (bytes saved for
backward, which need not be linear).  The cost model reads only this.
"""
from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, TypeVar

from .._jsonio import digest
from .._jsonio import Fields, is_finite, read_json, write_json_atomic

__all__ = ["Stat", "LayerProfile", "CopyFit", "ReductionFit", "Profile", "PROFILE_SCHEMA_VERSION", "REDUCTION_ENGINES",
           "read_model", "read_shape"]

#: where gradients are reduced: between replicas in one process, or by a process group's all_reduce.
REDUCTION_ENGINES = ("local", "distributed")

T = TypeVar("T")

PROFILE_SCHEMA_VERSION = 1


@dataclass(frozen=True)
class Stat:
    """A repeated measurement: its median and the range of the repeats, in ms."""

    median_ms: float
    min_ms: float
    max_ms: float
    repeats: int

    @property
    def spread_ms(self) -> float:
        return self.max_ms - self.min_ms

    def to_json(self) -> dict[str, Any]:
        return {"median_ms": self.median_ms, "min_ms": self.min_ms, "max_ms": self.max_ms,
                "repeats": self.repeats}

    @staticmethod
    def read(value: Any) -> Stat | None:
        """A well-formed stat (floats in order, a count), as files hold them, read at once;
        ``None`` for anything else, which :meth:`from_json` reads field by field."""
        if type(value) is dict:
            get = value.get
            median, low, high, repeats = get("median_ms"), get("min_ms"), get("max_ms"), get("repeats")
            if (type(median) is type(low) is type(high) is float and type(repeats) is int
                    and 0.0 <= low <= median <= high < math.inf and repeats >= 0):
                return Stat(median, low, high, repeats)
        return None

    @staticmethod
    def from_json(f: Fields) -> Stat:
        quick = Stat.read(f.value)
        if quick is not None:
            return quick
        stat = Stat(f.float("median_ms", 0.0), f.float("min_ms", 0.0), f.float("max_ms", 0.0),
                    f.int("repeats", 0))
        if not stat.min_ms <= stat.median_ms <= stat.max_ms:
            raise f.error(f"needs min_ms <= median_ms <= max_ms, found {stat.min_ms}, "
                          f"{stat.median_ms}, {stat.max_ms}")
        return stat


@dataclass
class LayerProfile:
    """One layer's measured costs.

    ``forward`` and ``backward`` map a micro-batch size to its timing, measured on the layer
    alone in train mode.  ``backward`` is the layer's whole autograd work for a given output
    gradient (and the gradients of the skip tensors it stashed): parameter gradients and the
    gradient of its input and popped skip tensors, except for the chain's first layer, whose
    input needs no gradient (a pipeline's first stage does not compute it either).

    ``output_bytes`` is per sample: of the tensors the layer returns (what crosses a stage
    boundary after it), the larger of the new storages they keep alive (each once; a view holds
    its whole storage; a slice of the layer's own buffer or of its input counts its elements) and
    their elements (their gradients and a copy to another device are dense).
    ``output_fixed_bytes`` is the part of the output that does not grow with the micro-batch (a
    mean over the batch, a parameter returned), per micro-batch whatever its size, so the
    output of a micro-batch of ``b`` is ``b * output_bytes + output_fixed_bytes``; ``0`` (and
    absent from the file) where there is none, and in profiles made before it was recorded,
    whose ``output_bytes`` then holds such bytes divided per sample.  ``stash_bytes`` is per
    sample per skip name (``str(SkipKey)``), counted as outputs are; ``stash_fixed_bytes`` the
    bytes of a skip whose size does not grow with the micro-batch (a weight stashed for a tied
    head), per micro-batch, whatever its size.  ``stash_params`` names
    the skips that are the stashing layer's own parameters or buffers (the weight of a tied
    head, or a view of it): the same memory, so no new bytes per micro-batch where they are made
    or on a device sharing memory; absent (``[]``) in profiles made before it was recorded,
    whose fixed-size skips are then charged as new tensors.

    ``saved_bytes[b]`` is what autograd keeps alive for this layer's backward at micro-batch
    size ``b`` (measured with ``saved_tensors_hooks``; each storage counted once), such that the
    sum over a run of consecutive layers is what that run keeps per micro-batch, apart from its
    input.  Precisely, it holds:

    - tensors the layer creates and saves (BatchNorm's per-channel mean and inverse std,
      MaxPool's indices, a ReLU's output);
    - its output, if it or a later layer saves it (a Linear saves its input: that tensor is
      counted with the layer that made it; in-place and view layers such as
      ``ReLU(inplace=True)`` or ``Flatten`` pass their input's storage on, so it stays with
      the layer that first made it).

    It never holds parameters or buffers (``param_bytes``, ``buffer_bytes``), the input of the
    chain's first layer, nor popped skip tensors (count them with ``stash_bytes``).
    ``grad_param_bytes`` is the part of ``param_bytes`` whose parameters need gradients
    (``requires_grad``): what gradients and optimizer state are charged for; ``None`` in
    profiles made before it was recorded, which then charge them for every parameter.  So a
    stage's activations per micro-batch are its layers' ``saved_bytes`` plus its own input
    (``b * output_bytes + output_fixed_bytes`` of the layer before it, or
    ``b * Profile.input_bytes``), which a
    pipeline holds until backward anyway and which is what checkpointing keeps.

    ``workspace_bytes[b]`` is the most the layer holds beyond what its forward keeps, in its
    forward or backward at size ``b`` (temporaries, gradients before they are passed on or
    accumulated); ``output_saved`` whether the layer's output is among the saved bytes of the
    layer that made it; ``aliases_input`` whether its output is its input's memory (an in-place
    or view layer such as ``ReLU(inplace=True)``).  They are absent (``{}``, ``None``) in profiles made before they were
    measured; the cost model then estimates them (:mod:`autopipe.planning.memory`).
    """

    name: str
    type: str
    forward: dict[int, Stat]
    backward: dict[int, Stat]
    output_bytes: int
    saved_bytes: dict[int, int]
    param_bytes: int
    buffer_bytes: int
    param_count: int
    stash: list[str] = field(default_factory=list)
    pop: list[str] = field(default_factory=list)
    stash_bytes: dict[str, int] = field(default_factory=dict)
    stash_fixed_bytes: dict[str, int] = field(default_factory=dict)
    workspace_bytes: dict[int, int] = field(default_factory=dict)
    output_saved: bool | None = None
    aliases_input: bool | None = None
    stash_params: list[str] = field(default_factory=list)
    grad_param_bytes: int | None = None
    output_fixed_bytes: int = 0

    @property
    def trainable_bytes(self) -> int:
        """Bytes of the parameters that get gradients (all of them where not recorded)."""
        return self.param_bytes if self.grad_param_bytes is None else self.grad_param_bytes

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "type": self.type,
            "forward": {str(b): s.to_json() for b, s in sorted(self.forward.items())},
            "backward": {str(b): s.to_json() for b, s in sorted(self.backward.items())},
            "output_bytes": self.output_bytes,
            "saved_bytes": {str(b): n for b, n in sorted(self.saved_bytes.items())},
            "param_bytes": self.param_bytes,
            "buffer_bytes": self.buffer_bytes,
            "param_count": self.param_count,
            "stash": self.stash,
            "pop": self.pop,
            "stash_bytes": self.stash_bytes,
            **({"stash_fixed_bytes": self.stash_fixed_bytes} if self.stash_fixed_bytes else {}),
            **({"workspace_bytes": {str(b): n for b, n in sorted(self.workspace_bytes.items())}}
               if self.workspace_bytes else {}),
            **({} if self.output_saved is None else {"output_saved": self.output_saved}),
            **({} if self.aliases_input is None else {"aliases_input": self.aliases_input}),
            **({"stash_params": self.stash_params} if self.stash_params else {}),
            **({} if self.grad_param_bytes is None else {"grad_param_bytes": self.grad_param_bytes}),
            **({"output_fixed_bytes": self.output_fixed_bytes} if self.output_fixed_bytes else {}),
        }

    @staticmethod
    def from_json(f: Fields) -> LayerProfile:
        return LayerProfile(
            name=f.str("name"),
            type=f.str("type"),
            forward=_by_batch(f.get("forward"), Stat.from_json, Stat.read),
            backward=_by_batch(f.get("backward"), Stat.from_json, Stat.read),
            output_bytes=f.int("output_bytes", 0),
            saved_bytes=_by_batch(f.get("saved_bytes"), _bad, _count),
            param_bytes=f.int("param_bytes", 0),
            buffer_bytes=f.int("buffer_bytes", 0),
            param_count=f.int("param_count", 0),
            stash=f.str_list("stash"),
            pop=f.str_list("pop"),
            stash_bytes=_by_name(f.get("stash_bytes")),
            stash_fixed_bytes=_by_name(f.get("stash_fixed_bytes")) if f.has("stash_fixed_bytes") else {},
            workspace_bytes=(_by_batch(f.get("workspace_bytes"), _bad, _count)
                             if f.has("workspace_bytes") else {}),
            output_saved=_flag(f, "output_saved"),
            aliases_input=_flag(f, "aliases_input"),
            stash_params=f.str_list("stash_params") if f.has("stash_params") else [],
            grad_param_bytes=f.int("grad_param_bytes", 0) if f.has("grad_param_bytes") else None,
            output_fixed_bytes=f.int("output_fixed_bytes", 0) if f.has("output_fixed_bytes") else 0,
        )


def _by_name(f: Fields) -> dict[str, int]:
    """A table of non-negative byte counts by skip name."""
    return {name: f.int(name, 0) for name in f.keys()}


def _flag(f: Fields, key: str) -> bool | None:
    """An optional true/false field: ``None`` where a profile predates it."""
    return f.typed(key, lambda v: isinstance(v, bool), "true or false") if f.has(key) else None


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _count(value: Any) -> int | None:
    """``value`` if it is a non-negative integer, else ``None``."""
    return value if _is_count(value) else None


def _bad(f: Fields) -> Any:
    raise f.error("expected a non-negative integer")


def _by_batch(f: Fields, read: Callable[[Fields], T], quick: Callable[[Any], T | None]) -> dict[int, T]:
    """A table by micro-batch size: each value as ``quick`` reads it, or where that gives
    ``None`` as ``read`` does (which raises the error that names the field)."""
    out: dict[int, T] = {}
    f.keys()  # an object, or the error that says so
    for key, value in f.value.items():
        if not key.isdigit() or int(key) < 1:
            raise f.error(f"micro-batch size keys must be positive integers, found '{key}'")
        found = quick(value)
        out[int(key)] = read(Fields(value, f.source, parent=f, key=key)) if found is None else found
    return out


@dataclass(frozen=True)
class CopyFit:
    """Copy time from device ``src`` to device ``dst`` (indices into ``Profile.devices``):
    ``latency_ms + bytes * ms_per_byte``, with the measured ``(bytes, ms)`` points it was fit to."""

    src: int
    dst: int
    latency_ms: float
    ms_per_byte: float
    points: list[tuple[int, float]]

    def to_json(self) -> dict[str, Any]:
        return {"src": self.src, "dst": self.dst, "latency_ms": self.latency_ms,
                "ms_per_byte": self.ms_per_byte, "points": [list(p) for p in self.points]}

    @staticmethod
    def read(value: Any) -> CopyFit | None:
        """A well-formed fit (device indices, finite non-negative floats, ``[bytes, ms]``
        points), as files hold them, read at once; ``None`` for anything else, which
        :meth:`from_json` reads field by field."""
        if type(value) is not dict:
            return None
        get = value.get
        src, dst, points = get("src"), get("dst"), get("points")
        latency, per_byte = get("latency_ms"), get("ms_per_byte")
        if (type(src) is type(dst) is int and src >= 0 and dst >= 0 and type(latency) is type(per_byte) is float
                and 0.0 <= latency < math.inf and 0.0 <= per_byte < math.inf and type(points) is list
                and all(type(p) is list and len(p) == 2 and type(p[0]) is int and p[0] >= 0
                        and type(p[1]) is float and math.isfinite(p[1]) for p in points)):
            return CopyFit(src, dst, latency, per_byte, [(p[0], p[1]) for p in points])
        return None

    @staticmethod
    def from_json(f: Fields) -> CopyFit:
        quick = CopyFit.read(f.value)
        if quick is not None:
            return quick
        return CopyFit(f.int("src", 0), f.int("dst", 0), f.float("latency_ms", 0.0),
                       f.float("ms_per_byte", 0.0), _points(f))


def _points(f: Fields) -> list[tuple[int, float]]:
    points = []
    for point in f.get("points").items():
        value = point.value
        if not (isinstance(value, list) and len(value) == 2 and _is_count(value[0]) and is_finite(value[1])):
            raise point.error(f"expected [bytes, ms] (a non-negative integer and a finite "
                              f"number), found {json.dumps(value)[:60]}")
        points.append((value[0], float(value[1])))
    return points


@dataclass(frozen=True)
class ReductionFit:
    """Time to reduce ``bytes`` of gradients across ``replicas`` replicas on the profile's devices
    with ``engine`` (``"local"``: the in-process runtime's reduction; ``"distributed"``: the
    process group's ``all_reduce``): ``latency_ms + bytes * ms_per_byte``, fit to the measured
    ``(bytes, ms)`` points."""

    engine: str
    replicas: int
    latency_ms: float
    ms_per_byte: float
    points: list[tuple[int, float]]

    def time_ms(self, nbytes: float) -> float:
        return 0.0 if nbytes <= 0 else self.latency_ms + nbytes * self.ms_per_byte

    def to_json(self) -> dict[str, Any]:
        return {"engine": self.engine, "replicas": self.replicas, "latency_ms": self.latency_ms,
                "ms_per_byte": self.ms_per_byte, "points": [list(p) for p in self.points]}

    @staticmethod
    def from_json(f: Fields) -> ReductionFit:
        engine = f.str("engine")
        if engine not in REDUCTION_ENGINES:
            raise f.error(f"'{engine}' is not one of {list(REDUCTION_ENGINES)}", "engine")
        return ReductionFit(engine, f.int("replicas", 2), f.float("latency_ms", 0.0),
                            f.float("ms_per_byte", 0.0), _points(f))


@dataclass
class Profile:
    """Everything measured about one model on one machine.

    ``model`` and ``environment`` are the fingerprints of :mod:`autopipe.model.fingerprint`, so a
    plan can refuse a profile of another model or machine.  ``input_shape`` is one sample's
    shape (no batch dimension) of the first input tensor; ``input_bytes`` is one sample's bytes
    over all input tensors.  ``batch_size`` is the sample input's batch, ``batch_sizes`` the
    micro-batch sizes every layer was measured at.  ``copies`` holds one fit per ordered pair
    of distinct entries of ``devices``.  ``reductions`` holds the gradient-reduction fits
    measured (none in profiles made before they were: the cost model then estimates them from
    the copy fits, :func:`autopipe.planning.replicas.reduction_time`).
    """

    model: dict[str, Any]
    environment: dict[str, Any]
    devices: list[str]
    input_shape: list[int]
    input_dtype: str
    input_bytes: int
    batch_size: int
    batch_sizes: list[int]
    layers: list[LayerProfile]
    copies: list[CopyFit]
    reductions: list[ReductionFit] = field(default_factory=list)

    def reduction_fit(self, engine: str) -> ReductionFit | None:
        """The measured reduction fit for ``engine``, ``None`` if this profile has none."""
        return next((fit for fit in self.reductions if fit.engine == engine), None)

    def copy_fit(self, src: int, dst: int) -> CopyFit | None:
        """The fit for devices ``src`` → ``dst``, ``None`` for the same device index."""
        for fit in self.copies:
            if fit.src == src and fit.dst == dst:
                return fit
        return None

    @property
    def digest(self) -> str:
        return digest(self.to_json())

    def to_json(self) -> dict[str, Any]:
        return {
            "kind": "profile",
            "schema_version": PROFILE_SCHEMA_VERSION,
            "model": self.model,
            "environment": self.environment,
            "devices": self.devices,
            "input_shape": self.input_shape,
            "input_dtype": self.input_dtype,
            "input_bytes": self.input_bytes,
            "batch_size": self.batch_size,
            "batch_sizes": self.batch_sizes,
            "layers": [layer.to_json() for layer in self.layers],
            "copies": [fit.to_json() for fit in self.copies],
            # written only when measured, so that an old profile's digest (named by its plans) stays
            **({"reductions": [fit.to_json() for fit in self.reductions]} if self.reductions else {}),
        }

    def save(self, path: str | os.PathLike[str]) -> Path:
        """Validate (:meth:`validate`) and write the profile as JSON, atomically."""
        self.validate()
        return write_json_atomic(path, self.to_json())

    def validate(self) -> None:
        """Check a profile built or changed in memory as :meth:`load` checks a file (finite,
        non-negative times and sizes, consistent tables); raises :class:`FormatError` naming
        the field.  Planning calls it, so what is planned is what a file could hold."""
        self.checked_digest()

    def checked_digest(self) -> str:
        """:meth:`validate`, then :attr:`digest`, from one serialisation (planning needs both)."""
        document = self.to_json()
        Profile._read(Fields(document, "in-memory profile", ""))
        return digest(document)

    @staticmethod
    def load(path: str | os.PathLike[str]) -> Profile:
        """Read and validate a profile file; raises :class:`FormatError` naming file and field (an
        :class:`OptionError` if ``path`` is no file name)."""
        return Profile._read(read_json(path, "profile", PROFILE_SCHEMA_VERSION))

    @staticmethod
    def _read(f: Fields) -> Profile:
        f.get("environment").keys()
        profile = Profile(
            model=read_model(f.get("model")),
            environment=f.get("environment").value,
            devices=f.get("devices").device_names(),
            input_shape=read_shape(f.get("input_shape")),
            input_dtype=f.str("input_dtype"),
            input_bytes=f.int("input_bytes", 0),
            batch_size=f.int("batch_size", 1),
            batch_sizes=_batch_size_list(f),
            layers=f.list_of("layers", LayerProfile.from_json),
            copies=f.list_of("copies", CopyFit.from_json),
            reductions=f.list_of("reductions", ReductionFit.from_json) if f.has("reductions") else [],
        )
        _check_consistent(profile, f)
        return profile


def read_model(f: Fields) -> dict[str, Any]:
    """A model fingerprint as profiles and plans hold it (:func:`~autopipe.model.fingerprint.model_fingerprint`,
    with the ``spec`` and ``input_shape`` that ``profile`` records), checked field by field: the
    fingerprint check and ``bench`` read it without checking again."""
    f.str("digest")
    for layer in f.get("layers").items():
        layer.str("name")
        layer.str("type")
        for tensor in layer.get("tensors").items():
            value = tensor.value
            if not (isinstance(value, list) and len(value) == 3 and isinstance(value[0], str)
                    and isinstance(value[2], str)):
                raise tensor.error(f"expected [name, shape, dtype], found {json.dumps(value)[:60]}")
            read_shape(Fields(value[1], f.source, parent=tensor, key=1), least=0)
    if f.has("spec"):
        f.str("spec")
    if f.has("input_shape"):
        read_shape(f.get("input_shape"))
    return f.value


def read_shape(f: Fields, least: int = 1) -> list[int]:
    """A shape: a list of dimensions of at least ``least`` (an empty one for a scalar per
    sample); torch would refuse anything else far from the file, or take it for another shape."""
    shape = f.value
    if not (isinstance(shape, list) and all(isinstance(d, int) and not isinstance(d, bool) for d in shape)):
        raise f.error(f"expected a shape (a list of integers), found {json.dumps(shape)[:60]}")
    if any(d < least for d in shape):
        raise f.error(f"expected dimensions of at least {least}, found {shape}")
    return shape


def _batch_size_list(f: Fields) -> list[int]:
    sizes = f.int_list("batch_sizes")
    if not sizes or sizes != sorted(set(sizes)) or sizes[0] < 1:
        raise f.error(f"expected increasing positive micro-batch sizes, found {sizes}", "batch_sizes")
    return sizes


def _check_consistent(profile: Profile, f: Fields) -> None:
    if not profile.layers:
        raise f.error("a profile needs at least one layer", "layers")
    if len(profile.layers) != len(profile.model["layers"]):
        raise f.error(f"{len(profile.layers)} layers but the model fingerprint lists "
                      f"{len(profile.model['layers'])}", "layers")
    for index, (layer, entry) in enumerate(zip(profile.layers, profile.model["layers"])):
        if (layer.name, layer.type) != (entry["name"], entry["type"]):
            raise f.error(f"is {layer.name} ({layer.type}) but the model fingerprint lists {entry['name']} "
                          f"({entry['type']}) there: the timings are of another model; profile this one again",
                          f"layers[{index}]")
        for table in ("forward", "backward", "saved_bytes", "workspace_bytes"):
            sizes = sorted(getattr(layer, table))
            # the workspace may be absent (a profile made before it was measured: estimated), never partial
            if sizes != profile.batch_sizes and (sizes or table != "workspace_bytes"):
                raise f.error(f"has sizes {sizes}, expected the profile's batch_sizes {profile.batch_sizes}"
                              + (" (or none)" if table == "workspace_bytes" else ""), f"layers[{index}].{table}")
        if sorted(layer.stash_bytes) != sorted(layer.stash):
            raise f.error(f"has names {sorted(layer.stash_bytes)}, expected the layer's stash "
                          f"{sorted(layer.stash)}", f"layers[{index}].stash_bytes")
        if not set(layer.stash_fixed_bytes) <= set(layer.stash):
            raise f.error(f"has names {sorted(layer.stash_fixed_bytes)} that are not in the layer's stash "
                          f"{sorted(layer.stash)}", f"layers[{index}].stash_fixed_bytes")
        if not set(layer.stash_params) <= set(layer.stash):
            raise f.error(f"has names {sorted(layer.stash_params)} that are not in the layer's stash "
                          f"{sorted(layer.stash)}", f"layers[{index}].stash_params")
        if layer.trainable_bytes > layer.param_bytes:
            raise f.error(f"is {layer.trainable_bytes}, more than the layer's param_bytes {layer.param_bytes}",
                          f"layers[{index}].grad_param_bytes")
    _check_copies(profile, f)
    engines: dict[str, int] = {}
    for index, fit in enumerate(profile.reductions):
        first = engines.setdefault(fit.engine, index)
        if first != index:  # Profile.reduction_fit takes the first: the other would be ignored
            raise f.error(f"is a second reduction fit for the engine '{fit.engine}' (the first is "
                          f"reductions[{first}]); keep one fit per engine: remove one, or profile again",
                          f"reductions[{index}]")


def _check_copies(profile: Profile, f: Fields) -> None:
    """One fit per ordered pair of distinct devices: a second fit for a pair would be ignored
    (:meth:`Profile.copy_fit` takes the first), and one from a device to itself is never read
    (nothing is copied within a device), so either means a damaged or hand-merged file whose
    copies are not what was measured: refused rather than half used."""
    seen: dict[tuple[int, int], int] = {}
    for index, fit in enumerate(profile.copies):
        where = f"copies[{index}]"
        if not (0 <= fit.src < len(profile.devices) and 0 <= fit.dst < len(profile.devices)):
            raise f.error(f"device index out of range 0..{len(profile.devices) - 1}", where)
        if fit.src == fit.dst:
            raise f.error(f"is a copy fit from device {fit.src} to itself; a profile holds fits between distinct "
                          "devices only: remove it", where)
        first = seen.setdefault((fit.src, fit.dst), index)
        if first != index:
            raise f.error(f"is a second copy fit for devices {fit.src} -> {fit.dst} (the first is copies[{first}]); "
                          "keep one fit per pair: remove one, or profile again", where)

