"""Planning options checked and normalised: devices, memory limits with byte units, micro-batch
counts worth trying, checkpoint modes and interleave factors."""
from __future__ import annotations

import math
import numbers
import sys
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from .._vocab import (CHECKPOINT_CHOICES, SCHEDULES, CheckpointChoice, CheckpointMode, EngineName, Schedule,
                      check_device_name)
from .._checks import check_choice, check_device_list, is_positive_int, is_positive_number, positive_int
from ..errors import DeviceError, OptionError
from ..profiling.profiles import Profile
from .memory import optimizer_factor

__all__ = ["Options", "candidate_chunks", "check_replica_share", "device_names", "device_speeds", "memory_limits",
           "parse_bytes", "recorded_limit", "MAX_DEVICES"]


@dataclass(frozen=True)
class Options:
    """Checked planning options."""

    batch_size: int
    speeds: list[float]
    limits: np.ndarray
    candidates: list[int]
    modes: list[CheckpointMode]
    interleaves: list[int]
    given: dict[str, Any]
    schedules: list[str]

    @staticmethod
    def check(profile: Profile, names: list[str], batch_size: int | None, memory_limit: Any,
              checkpoint: CheckpointChoice, optimizer_state: str | float, schedule: Schedule,
              speeds: Sequence[float] | None, chunks: int | None, engine: EngineName,
              interleave: int | str = "auto") -> Options:
        schedules = _schedules(schedule, engine)
        check_choice(checkpoint, "checkpoint", CHECKPOINT_CHOICES)
        factor = optimizer_factor(optimizer_state)
        batch = plan_batch_size(profile, batch_size)
        rates = device_speeds(speeds, names)
        # 'always' is never chosen automatically: 'except_last' recomputes less and needs the
        # same memory, so it is at least as fast and as small.
        modes = ["never", "except_last"] if checkpoint == "auto" else [checkpoint]
        factors = _interleaves(interleave, profile.layers, len(names), engine)
        given = {"devices": names, "batch_size": batch, "memory_limit": memory_limit,
                 "checkpoint": checkpoint, "optimizer_state": optimizer_state, "optimizer_state_factor": factor,
                 "speeds": rates, "chunks": chunks, "engine": engine, "interleave": interleave,
                 "interleaves_searched": factors, "schedule": schedule}
        return Options(batch, rates, memory_limits(memory_limit, names),
                        candidate_chunks(batch, profile.batch_sizes, chunks, equal=engine == "distributed"),
                        modes, factors, given, schedules)

    @property
    def modes_1f1b(self) -> list[str]:
        """Checkpoint modes for 1F1B: with ``auto`` also ``always``, which there holds less than
        ``except_last`` (:func:`~autopipe.planning.schedules.saved_sets`)."""
        return [*self.modes, "always"] if self.given["checkpoint"] == "auto" else self.modes

    def record(self) -> dict[str, Any]:
        """The options as JSON for the plan file."""
        return {**self.given, "memory_limit": recorded_limit(self.given["memory_limit"]),
                "memory_limit_bytes": [None if math.isinf(v) else int(v) for v in self.limits]}


def recorded_limit(limit: Any) -> Any:
    """The ``memory_limit`` asked for (one, or one per device) as a plan file holds it: an
    infinite one (no limit) as ``None``, which JSON can hold."""
    if isinstance(limit, (list, tuple)):
        return [recorded_limit(v) for v in limit]
    return None if isinstance(limit, float) and math.isinf(limit) else limit


def _schedules(asked: Schedule | str, engine: EngineName) -> list[Schedule]:
    """The schedules to search: ``[asked]``, or both for ``"auto"`` on the local engine."""
    check_choice(asked, "schedule", ("auto", *SCHEDULES))
    if engine == "distributed":
        # the distributed engine's 1F1B is torch's, not the simulated one; a gpipe plan runs on it
        # with schedule='1f1b' when chunks ≥ stages, holding no more activations than planned
        if asked == "1f1b":
            raise OptionError("the planner prices schedule='1f1b' for the local engine only; use 'gpipe' "
                              "(the distributed engine can run a gpipe plan with schedule='1f1b' "
                              "when chunks >= stages)")
        return ["gpipe"]
    return list(SCHEDULES) if asked == "auto" else [asked]


def _interleaves(asked: int | str, layers: Sequence[Any], devices: int, engine: EngineName) -> list[int]:
    """The stages-per-device factors to search: ``[asked]``, or for ``"auto"`` 1 and, where it
    can run and be searched exactly, 2."""
    if asked == "auto":
        return [1, 2] if engine == "local" and devices > 1 and 2 * 2 <= len(layers) else [1]
    if not is_positive_int(asked):
        raise OptionError(f"interleave must be 'auto' or a positive integer (stages per device), got {asked!r}")
    if asked > 1:
        if engine != "local":
            raise OptionError(f"interleave={asked}: the distributed engine runs one stage per process; "
                              "use interleave=1 (or 'auto') with engine='distributed'")
        if devices < 2 or 2 * asked > len(layers):
            raise OptionError(f"interleave={asked} needs at least 2 devices in the pipeline (in each replica's, "
                              f"with replicas) and {2 * asked} layers; got {devices} device(s) a pipeline and "
                              f"{len(layers)} layers: give more devices, fewer replicas or interleave=1")
    return [asked]


def candidate_chunks(batch_size: int, sizes: Sequence[int], chunks: int | None = None,
                     equal: bool = False) -> list[int]:
    """Micro-batch counts worth trying: the least ``m`` for each distinct ``ceil(B/m)`` within
    the profiled sizes (for equal micro-batch size, fewer micro-batches is never slower); with
    ``equal`` (the distributed engine needs one micro-batch shape) only divisors of ``B`` —
    a divisor is always the least ``m`` of its size, so no better count is lost."""
    if batch_size < 1:
        raise OptionError(f"batch size must be at least 1, got {batch_size}")
    low, high = min(sizes), max(sizes)
    if chunks is not None:
        _check_chunks(positive_int(chunks, "chunks"), batch_size, low, high)
        if equal and batch_size % chunks:
            raise OptionError(f"chunks={chunks} does not divide batch size {batch_size}, and the distributed "
                              "engine needs equal micro-batches; choose a divisor of the batch size")
        return [chunks]
    usable = _usable_chunks(batch_size, low, high, equal)
    if not usable:
        shape = "equal micro-batches" if equal else "micro-batches"
        profiled = f"down to {batch_size}" if batch_size < low else f"up to {batch_size}"
        raise OptionError(f"batch size {batch_size} cannot be split into {shape} of the profiled "
                          f"sizes {low}..{high}; profile batch sizes {profiled} or use a batch "
                          f"size of at least {low}{' that a profiled size divides' if equal else ''}")
    return usable


def _usable_chunks(batch_size: int, low: int, high: int, equal: bool) -> list[int]:
    """In order, the least ``m`` for each distinct ``ceil(B/m)`` in ``low..high`` (with ``equal``,
    divisors of ``B`` only)."""
    # the least m whose ceil(B/m) is at most s is ceil(B/s): the least giving s, if it gives s
    least = {size: -(-batch_size // size) for size in range(max(low, 1), min(high, batch_size) + 1)}
    return sorted(m for size, m in least.items() if -(-batch_size // m) == size and not (equal and batch_size % m))


def check_replica_share(batch_size: int, replicas: int, sizes: Sequence[int], equal: bool = False) -> None:
    """Refuse ``replicas`` replicas when the largest share of ``batch_size`` (what the planner
    prices) cannot be split into micro-batches of the profiled ``sizes`` (``equal``: into equal
    ones, as the distributed engine needs), saying the least batch size they can take."""
    share, low, high = -(-batch_size // replicas), min(sizes), max(sizes)
    if replicas == 1 or _usable_chunks(share, low, high, equal):
        return
    least = low * replicas if equal else (low - 1) * replicas + 1  # the least whose share is low
    other = ("fewer replicas" if _usable_chunks(batch_size, low, high, equal)
             else f"profile micro-batch size {share} too")
    raise OptionError(f"batch size {batch_size} over {replicas} replicas gives each replica a share of up to {share} "
                      f"samples, which cannot be split into {'equal ' if equal else ''}micro-batches of the profiled "
                      f"sizes {low}..{high}; use a batch size of {least} (the least that {replicas} replicas can "
                      f"take), or {other}")


def _check_chunks(chunks: int, batch_size: int, low: int, high: int) -> None:
    """Refuse ``chunks`` unless each micro-batch has a sample and a size the profile measured
    (``low..high``): the planner prices only those."""
    size = -(-batch_size // chunks)
    if chunks > batch_size:
        raise OptionError(f"chunks={chunks} is more than the batch of {batch_size} samples; use at most "
                          f"{batch_size} micro-batches")
    if size > high:
        raise OptionError(f"chunks={chunks} with batch size {batch_size} gives micro-batches of {size} samples, but "
                          f"the profile measured micro-batches of at most {high}; use chunks >= "
                          f"{-(-batch_size // high)}, or profile with a sample batch of {size} or more")
    if size < low:
        raise OptionError(f"chunks={chunks} with batch size {batch_size} gives micro-batches of {size} samples, but "
                          f"the profile measured micro-batches of at least {low}; use fewer chunks, or profile "
                          f"batch sizes down to {size}")


def plan_batch_size(profile: Profile, batch_size: object) -> int:
    """The batch to plan for: ``batch_size`` checked (a positive integer, not truncated), or the profile's."""
    return profile.batch_size if batch_size is None else positive_int(batch_size, "batch_size")


_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_bytes(text: str | float | int) -> float:
    """``16GiB``, ``500MB``, ``1e9`` or a number → bytes (a number ``inf``: no limit).

    A string is a size as a user writes it: one that is not a whole number of bytes (``1.5B``)
    is refused rather than planned as the fraction and reported as its floor, and so is one too
    large to be finite (``1e400``), which would silently mean no limit.  A number is taken as
    it is (a limit computed from predicted bytes need not be whole)."""
    if isinstance(text, numbers.Real) and not isinstance(text, bool):
        if math.isnan(text):
            raise OptionError("memory limit nan is not a size; give bytes (e.g. 16e9) or '16GiB'")
        return float(text)
    if not isinstance(text, str):
        raise OptionError(f"memory_limit {text!r} is not a size; give bytes (e.g. 16e9) or a string such as '16GiB'")
    stripped = text.strip().lower().replace(" ", "")
    number = stripped.rstrip("abcdefghijklmnopqrstuvwxyz")
    unit = stripped[len(number):]
    try:
        value = float(stripped) if stripped in ("inf", "infinity", "nan") else float(number) * _UNITS[unit]
    except (ValueError, KeyError):
        raise OptionError(f"cannot read '{text}' as a memory size; write e.g. 16GiB, 500MB or 1e9") from None
    if not math.isfinite(value):
        raise OptionError(f"memory_limit '{text}' is not a finite size; give a size such as 16GiB, or no "
                          "memory_limit for none")
    whole = round(value)
    if abs(value - whole) > 1e-9 * max(abs(value), 1.0):  # a decimal unit's float error is whole: 0.3GB
        raise OptionError(f"memory_limit '{text}' is {value:g} bytes, not a whole number; give whole bytes "
                          f"(e.g. {math.floor(value)} or {math.ceil(value)})")
    return float(whole)


#: The most the fastest device may be faster than the slowest: beyond it the times divided by
#: the speeds lose their precision (a denormal speed such as 1e-320 made them inf, and the plan nan).
SPEED_RATIO = 1e6


def device_speeds(speeds: Sequence[float] | float | None, names: Sequence[str]) -> list[float]:
    """One relative speed per device: default 1 each, or one for all; raises :class:`OptionError`
    unless each is a positive, finite, normal number (a ``nan``, ``inf`` or denormal would become
    the plan's predicted time) and the fastest at most :data:`SPEED_RATIO` times the slowest."""
    if speeds is None or isinstance(speeds, numbers.Real):
        given = [1.0 if speeds is None else speeds] * len(names)
    else:
        given = list(speeds) if isinstance(speeds, Iterable) and not isinstance(speeds, str) else []
    if len(given) != len(names) or not all(is_positive_number(v) and v >= sys.float_info.min for v in given):
        raise OptionError(f"speeds must be {len(names)} finite positive numbers (one per device, each at least "
                          f"{sys.float_info.min:.3g}) or one for all, got {speeds!r}")
    rates = [float(v) for v in given]
    if max(rates) > SPEED_RATIO * min(rates):
        raise OptionError(f"speeds {rates} make the fastest device {max(rates) / min(rates):.3g} times the slowest; "
                          f"give speeds within a factor of {SPEED_RATIO:,.0f} of each other (e.g. 1 and 2)")
    return rates


def memory_limits(limit: Any, names: Sequence[str]) -> np.ndarray:
    """Bytes per device: one value for all, one per device, or the CUDA capacity / no limit."""
    if isinstance(limit, (list, tuple)):
        if len(limit) != len(names):
            raise OptionError(f"{len(limit)} memory limits for {len(names)} devices; give one, or one per device")
        values = [_default_limit(n) if v is None else parse_bytes(v) for v, n in zip(limit, names)]
    elif limit is None:
        values = [_default_limit(n) for n in names]
    else:
        values = [parse_bytes(limit)] * len(names)
    if min(values) <= 0:
        raise OptionError(f"memory_limit must be positive, got {limit!r}")
    return np.asarray(values, dtype=float)


def _default_limit(name: str) -> float:
    if not name.startswith("cuda"):
        return math.inf
    from ..device import DeviceError, ops_for

    try:
        capacity = ops_for(name).capacity()
    except DeviceError as error:
        raise DeviceError(f"cannot read the memory of {name} here ({error}); pass memory_limit "
                          "(e.g. '16GiB') to plan for it") from None
    return math.inf if capacity is None else float(capacity)


#: The most bytes of one table of a float per ordered pair of devices (copy latency, ms/byte, ...):
#: the planner holds several at once (planning on 4,096 CPU devices peaked at 0.7 GB).
PAIR_TABLE_BYTES = 2**27
#: The most devices one plan may name: their per-pair tables fit in :data:`PAIR_TABLE_BYTES` each.
MAX_DEVICES = math.isqrt(PAIR_TABLE_BYTES // 8)


def device_names(profile: Profile, devices: Sequence[Any] | int | None) -> list[str]:
    """Plan devices as names: the profile's, its first ``n``, or those given (at most :data:`MAX_DEVICES`)."""
    check_device_list(devices)
    if devices is None:
        return list(profile.devices)
    if isinstance(devices, int):
        if devices < 1:
            raise DeviceError(f"device count must be at least 1, got {devices}")
        _check_count(devices)
        if devices <= len(profile.devices):
            return list(profile.devices[:devices])
        if all(d.startswith("cpu") for d in profile.devices):
            return ["cpu"] * devices
        raise DeviceError(f"{devices} devices requested but the profile measured {len(profile.devices)} "
                          f"({', '.join(profile.devices)}); name the devices or profile on all of them")
    names = [f"cuda:{d}" if isinstance(d, int) and d >= 0 else check_device_name(str(d)) for d in devices]
    if not names:
        raise DeviceError("no devices given; pass e.g. ['cpu', 'cpu'] or 2")
    _check_count(len(names))
    return names


def _check_count(count: int) -> None:
    """Refuse more than :data:`MAX_DEVICES` devices before any per-pair table is allocated."""
    if count > MAX_DEVICES:
        need = 8 * count**2 / 2**30
        raise DeviceError(f"{count:,} devices are more than the planner takes ({MAX_DEVICES:,} at most): it keeps "
                          f"tables of a number per pair of devices, {need:,.3g} GiB each for {count:,}; plan for at "
                          f"most {MAX_DEVICES:,} devices (all replicas' together)")
