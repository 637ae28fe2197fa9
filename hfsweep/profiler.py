"""Sizing: how many trials (B) go into one fused array on a device.

Fusing more members into one array is not free and does not always pay: past some size the device
is saturated and throughput stops growing while memory keeps growing, and on some devices (grouped
convolutions on many CPUs) an array of two is already slower than training the two trials one after
the other. So B is chosen from measurements, not as "the largest array that fits":

1. :func:`profile_sizes` measures member-samples/s and peak memory at B = 1, 2, 4, 8, ... through
   a callable the trainer provides, and stops as soon as more sizes cannot help: the memory model
   predicts the next size will not fit, the device ran out of memory, or throughput stopped growing.
2. :class:`MemoryModel` fits ``peak(B) = base + per_member * B`` to the measured peaks.
3. :func:`choose_size` picks the *knee*: the smallest B whose throughput is within ``knee`` (90% by
   default) of the best measured throughput that fits the memory budget. Smaller arrays lose little
   throughput, leave memory for the data pipeline and let a sweep start more, smaller arrays.
   If no B > 1 beats B = 1, B = 1 is chosen: fusion must never be slower than serial training.
4. A :class:`Profile` records all of it; :class:`ProfileCache` keeps profiles in a JSON file keyed
   by :func:`cache_key` (architecture :func:`signature`, batch size, dtype, device hardware), so a
   sweep profiles each kind of array once per machine, not once per run.

This module does not train anything itself and does not import the trainer; matplotlib is imported
only by :func:`plot`.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import math
import os
import platform
import sys
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ._io import new_temporary

__all__ = [
    "Measurement",
    "MemoryModel",
    "Profile",
    "ProfileCache",
    "cache_key",
    "choose_size",
    "device_budget",
    "plot",
    "profile_sizes",
    "signature",
]

_log = logging.getLogger("hfsweep.profiler")

_MIB = 2**20
_GIB = 2**30
_FORMAT = 1  # version of the JSON layout written by Profile.to_dict and ProfileCache

# Dropout's probability is a per-member setting of a fused array (it varies between the trials of
# one array), and it changes neither shapes nor cost, so it is left out of an architecture's
# signature: trials that differ only in dropout share one profile.
_DROPOUT_TYPES: tuple[type[nn.Module], ...] = (
    nn.Dropout,
    nn.Dropout1d,
    nn.Dropout2d,
    nn.Dropout3d,
    nn.AlphaDropout,
    nn.FeatureAlphaDropout,
)


# --------------------------------------------------------------------------------------------------
# validation and formatting helpers


def _check_int(name: str, value: object, minimum: int) -> int:
    """``value`` as an int >= ``minimum``, else a ValueError naming it and the valid range."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value}")
    return value


def _check_real(name: str, value: object, *, minimum: float = 0.0, strict: bool = False) -> float:
    """``value`` as a finite float >= ``minimum`` (> with ``strict``), else a ValueError."""
    bound = f"> {minimum:g}" if strict else f">= {minimum:g}"
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name} must be a finite number {bound}, got {value!r}")
    number = float(value)
    if not math.isfinite(number) or number < minimum or (strict and number == minimum):
        raise ValueError(f"{name} must be a finite number {bound}, got {value!r}")
    return number


def _check_knee(knee: object) -> float:
    if isinstance(knee, bool) or not isinstance(knee, (int, float)) or not 0.0 < knee <= 1.0:
        raise ValueError(f"knee must be a number in (0, 1], got {knee!r}")
    return float(knee)


def _check_budget(budget_bytes: object) -> float:
    return _check_real("budget_bytes", budget_bytes, strict=True)


def _fmt_bytes(n: float) -> str:
    """Bytes in GiB from 1 GiB up, else in MiB."""
    if abs(n) >= _GIB:
        return f"{n / _GIB:.2f} GiB"
    return f"{n / _MIB:.1f} MiB"


def _fmt_rate(x: float) -> str:
    return f"{x:,.1f}"


# --------------------------------------------------------------------------------------------------
# measurements and the memory model


@dataclass(frozen=True)
class Measurement:
    """One measured array size: what a few training steps of an array of ``size`` members cost.

    ``samples_per_s`` counts *member*-samples, ``size * batch_size / step_s`` (``step_s`` the
    measured seconds per step; :func:`hfsweep.profile_task` takes the median of the timed
    steps): the rate at which the sweep as a whole consumes training samples, comparable across
    sizes. ``peak_bytes`` is the peak memory of one training step at this size (0 where the
    device cannot report it).
    """

    size: int
    samples_per_s: float
    peak_bytes: int
    step_s: float

    def __post_init__(self) -> None:
        _check_int("Measurement.size", self.size, 1)
        _check_real("Measurement.samples_per_s", self.samples_per_s)
        _check_int("Measurement.peak_bytes", self.peak_bytes, 0)
        _check_real("Measurement.step_s", self.step_s)


def _check_measurements(measurements: Sequence[Measurement]) -> list[Measurement]:
    """The measurements sorted by size; ValueError if empty, of a wrong type or with duplicates."""
    items = list(measurements)
    if not items:
        raise ValueError("measurements is empty: at least one measured size is needed")
    for m in items:
        if not isinstance(m, Measurement):
            raise ValueError(f"measurements must hold Measurement objects, got {m!r}")
    sizes = [m.size for m in items]
    duplicates = sorted({s for s in sizes if sizes.count(s) > 1})
    if duplicates:
        raise ValueError(f"measurements repeat the size(s) {duplicates}: each size may appear once")
    return sorted(items, key=lambda m: m.size)


@dataclass(frozen=True)
class MemoryModel:
    """Peak memory of an array as a line in its size: ``peak(B) = base_bytes + per_member_bytes * B``.

    ``base_bytes`` is what does not grow with B (the shared input batch, workspaces, the CUDA
    caching allocator's slack); ``per_member_bytes`` is each member's parameters, gradients,
    optimizer state and activations. Both are >= 0.
    """

    base_bytes: float
    per_member_bytes: float

    def __post_init__(self) -> None:
        _check_real("MemoryModel.base_bytes", self.base_bytes)
        _check_real("MemoryModel.per_member_bytes", self.per_member_bytes)

    def predict(self, size: int) -> float:
        """Predicted peak bytes of an array of ``size`` members (``size`` >= 0; 0 gives the base)."""
        _check_int("size", size, 0)
        return self.base_bytes + self.per_member_bytes * size

    def max_size(self, budget_bytes: float) -> int:
        """The largest B with ``predict(B) <= budget_bytes``; 0 if not even one member fits.

        A model whose per-member cost is 0 puts no bound on B and returns ``sys.maxsize``; callers
        cap the result at the largest size they would try.
        """
        budget = _check_budget(budget_bytes)
        if self.base_bytes + self.per_member_bytes > budget:
            return 0
        if self.per_member_bytes == 0:
            return sys.maxsize
        # Exact rational arithmetic for the first guess, then step so that predict() agrees.
        exact = (Fraction(budget) - Fraction(self.base_bytes)) / Fraction(self.per_member_bytes)
        size = min(math.floor(exact), sys.maxsize)
        while size > 0 and self.predict(size) > budget:
            size -= 1
        while size < sys.maxsize and self.predict(size + 1) <= budget:
            size += 1
        return size

    @classmethod
    def fit(cls, measurements: Sequence[Measurement]) -> MemoryModel:
        """Least-squares line through the measured peaks, with slope and intercept kept >= 0.

        With two or more sizes this is non-negative least squares: the ordinary fit when both
        coefficients come out >= 0, else the better of the flat line at the mean peak and the
        line through the origin. With a single size there is no way to split base from per-member
        memory, so the line goes through the origin (``base_bytes = 0``,
        ``per_member_bytes = peak / size``): all memory is charged to the members, which
        over-predicts larger sizes rather than under-predicting them.
        The arithmetic is exact (rationals), so peaks that lie on a line are fitted exactly.
        """
        points = [
            (Fraction(m.size), Fraction(m.peak_bytes)) for m in _check_measurements(measurements)
        ]
        if len(points) == 1:
            ((x, y),) = points
            return cls(base_bytes=0.0, per_member_bytes=float(y / x))
        zero = Fraction(0)
        n = len(points)
        mean_x = sum((x for x, _ in points), zero) / n
        mean_y = sum((y for _, y in points), zero) / n
        sxx = sum(((x - mean_x) ** 2 for x, _ in points), zero)
        sxy = sum(((x - mean_x) * (y - mean_y) for x, y in points), zero)
        slope = sxy / sxx  # sizes are distinct, so sxx > 0
        base = mean_y - slope * mean_x
        if slope < 0 or base < 0:
            through_origin = sum((x * y for x, y in points), zero) / sum(
                (x * x for x, _ in points), zero
            )
            candidates: list[tuple[Fraction, Fraction]] = [
                (mean_y, zero),  # flat: memory does not grow with B
                (zero, through_origin),
            ]

            def sse(line: tuple[Fraction, Fraction]) -> Fraction:
                b, s = line
                return sum(((y - b - s * x) ** 2 for x, y in points), zero)

            base, slope = min(candidates, key=sse)
        return cls(base_bytes=float(base), per_member_bytes=float(slope))


# --------------------------------------------------------------------------------------------------
# choosing B


def _fits(m: Measurement, budget: float) -> bool:
    return m.peak_bytes <= budget


def _knee_of(candidates: list[Measurement], knee: float) -> tuple[Measurement, Measurement]:
    """(the smallest size within ``knee`` of the best throughput, the best); sorted input."""
    best = max(candidates, key=lambda m: (m.samples_per_s, -m.size))
    threshold = knee * best.samples_per_s
    chosen = next(m for m in candidates if m.samples_per_s >= threshold)
    return chosen, best


def choose_size(
    measurements: Sequence[Measurement], budget_bytes: float, *, knee: float = 0.9
) -> tuple[int, str]:
    """Pick the array size B from measurements: the knee of throughput under the memory budget.

    Among the measured sizes whose measured peak memory fits ``budget_bytes``, choose the smallest
    B whose member-samples/s is at least ``knee`` times the best of those sizes. Smaller arrays
    lose little throughput, leave headroom and let a sweep start more, smaller arrays. If B = 1
    fits and no larger fitting size is faster than it, B = 1 is chosen ("fusion does not pay").
    If no measured size fits, B = 1 is returned with a reason saying so. A measured peak of 0
    (a device that does not report memory) always fits.

    Returns ``(B, reason)``: ``reason`` is one sentence for logs and the profile table.
    """
    items = _check_measurements(measurements)
    budget = _check_budget(budget_bytes)
    knee = _check_knee(knee)

    feasible = [m for m in items if _fits(m, budget)]
    if not feasible:
        smallest = min(items, key=lambda m: (m.peak_bytes, m.size))
        return 1, (
            f"no measured size fits the memory budget of {_fmt_bytes(budget)} (the smallest peak is "
            f"{_fmt_bytes(smallest.peak_bytes)} at B={smallest.size}), so B=1 is the fallback"
        )
    if len(items) == 1:
        only = items[0]
        return only.size, f"only B={only.size} was measured"

    single = next((m for m in feasible if m.size == 1), None)
    larger = [m for m in feasible if m.size > 1]
    if (
        single is not None
        and larger
        and all(m.samples_per_s <= single.samples_per_s for m in larger)
    ):
        fastest = max(larger, key=lambda m: (m.samples_per_s, -m.size))
        return 1, (
            f"fusion does not pay on this device: no array that fits beats B=1's "
            f"{_fmt_rate(single.samples_per_s)} member-samples/s (the best, B={fastest.size}, "
            f"reaches {_fmt_rate(fastest.samples_per_s)})"
        )

    chosen, best = _knee_of(feasible, knee)
    free_choice, _ = _knee_of(items, knee)
    speedup = ""
    if single is not None and single.samples_per_s > 0 and chosen.size > 1:
        speedup = f", {chosen.samples_per_s / single.samples_per_s:.2f}x B=1"
    if not _fits(free_choice, budget):
        return chosen.size, (
            f"memory cap: B={free_choice.size} would be the knee but peaks at "
            f"{_fmt_bytes(free_choice.peak_bytes)}, over the budget of {_fmt_bytes(budget)}; "
            f"B={chosen.size} is the knee of the sizes that fit "
            f"({_fmt_rate(chosen.samples_per_s)} member-samples/s{speedup})"
        )
    if len(feasible) == 1:
        return chosen.size, (
            f"only B={chosen.size} of the measured sizes fits the budget of {_fmt_bytes(budget)}"
        )
    if chosen.size == best.size:
        return chosen.size, (
            f"B={chosen.size} is the fastest size that fits: "
            f"{_fmt_rate(chosen.samples_per_s)} member-samples/s{speedup}"
        )
    return chosen.size, (
        f"B={chosen.size} is the knee: {_fmt_rate(chosen.samples_per_s)} member-samples/s is at "
        f"least {knee:.0%} of the best, {_fmt_rate(best.samples_per_s)} at B={best.size}{speedup}"
    )


# --------------------------------------------------------------------------------------------------
# measuring


def _oom_types() -> tuple[type[BaseException], ...]:
    types: list[type[BaseException]] = [MemoryError]
    for owner in (torch, torch.cuda):
        cls = getattr(owner, "OutOfMemoryError", None)
        if isinstance(cls, type) and issubclass(cls, BaseException):
            types.append(cls)
    return tuple(types)


def _is_oom(exc: BaseException) -> bool:
    """Whether ``exc`` says the device ran out of memory (CUDA, CPU allocator or Python)."""
    if isinstance(exc, _oom_types()):
        return True
    if isinstance(exc, RuntimeError):
        text = str(exc).lower()
        return "out of memory" in text or "can't allocate memory" in text
    return False


def _release_cached_memory() -> None:
    """Return the CUDA caching allocator's blocks after an OOM, so the next size starts clean."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()


def _doubling_sizes(max_size: int) -> list[int]:
    """1, 2, 4, ... up to ``max_size``, with ``max_size`` itself last when not a power of two."""
    sizes = []
    size = 1
    while size <= max_size:
        sizes.append(size)
        size *= 2
    if sizes[-1] != max_size:
        sizes.append(max_size)
    return sizes


def profile_sizes(
    measure: Callable[[int], Measurement],
    *,
    budget_bytes: float,
    max_size: int = 64,
    sizes: Sequence[int] | None = None,
    knee: float = 0.9,
    plateau: float = 1.05,
    on_measure: Callable[[Measurement], None] | None = None,
) -> tuple[list[Measurement], MemoryModel]:
    """Measure array sizes through ``measure(B)`` and fit the memory model to the results.

    ``measure(B)`` trains an array of B members for a few steps and returns its
    :class:`Measurement` (``size`` must equal B). With ``sizes=None`` the sizes are 1, 2, 4, 8, ...
    up to ``max_size`` (and ``max_size`` itself last when it is not a power of two), and the search
    stops as soon as larger sizes cannot help:

    * **memory**: a measured peak exceeded ``budget_bytes``; or the memory model, once fitted on
      two or more sizes, predicts the next size exceeds the budget. In that case the largest size
      the model says fits, if it lies between the last measured size and the next, is measured
      last (an array of 6 when 8 will not fit), so a memory-capped choice loses little.
    * **plateau**: two doublings in a row each raised throughput by less than ``plateau`` times.
    * **past the knee**: throughput fell below ``knee`` times the best so far.
    * **out of memory**: ``measure`` raised ``torch.OutOfMemoryError``, ``MemoryError``, or a
      ``RuntimeError`` saying "out of memory" / "can't allocate memory". Nothing is recorded for
      that size; it and larger sizes are treated as not fitting; the CUDA cache is emptied. If the
      very first size runs out of memory the error is re-raised: there is nothing to choose from.

    With explicit ``sizes`` every size is measured in ascending order, except that the memory and
    out-of-memory stops still apply (no plateau or knee stop, no in-between size).

    ``on_measure`` is called with each measurement as it arrives (progress output). Other
    exceptions from ``measure`` propagate. Returns the measurements sorted by size and the
    :class:`MemoryModel` fitted on them.
    """
    budget = _check_budget(budget_bytes)
    max_size = _check_int("max_size", max_size, 1)
    knee = _check_knee(knee)
    plateau = _check_real("plateau", plateau, minimum=1.0)
    explicit = sizes is not None
    if sizes is None:
        todo = _doubling_sizes(max_size)
    else:
        todo = [_check_int("sizes[]", s, 1) for s in sizes]
        if not todo:
            raise ValueError("sizes is empty: give at least one size >= 1, or None to double")
        duplicates = sorted({s for s in todo if todo.count(s) > 1})
        if duplicates:
            raise ValueError(f"sizes repeat {duplicates}: each size may appear once")
        todo.sort()

    measured: list[Measurement] = []
    slow_doublings = 0

    def run(size: int) -> Measurement | None:
        """Measure one size; None when it ran out of memory."""
        try:
            result = measure(size)
        except BaseException as exc:
            if not _is_oom(exc):
                raise
            if not measured:
                _log.warning("B=%d ran out of memory: not even the smallest size fits", size)
                raise
            _log.info("B=%d ran out of memory; it and larger sizes do not fit", size)
            oom = True
        else:
            oom = False
        if oom:
            _release_cached_memory()
            return None
        if not isinstance(result, Measurement):
            raise ValueError(f"measure({size}) must return a Measurement, got {result!r}")
        if result.size != size:
            raise ValueError(f"measure({size}) returned a Measurement of size {result.size}")
        measured.append(result)
        if on_measure is not None:
            on_measure(result)
        return result

    for index, size in enumerate(todo):
        if len(measured) >= 2:
            model = MemoryModel.fit(measured)
            if model.predict(size) > budget:
                _log.info(
                    "B=%d is predicted to peak at %s, over the budget of %s",
                    size,
                    _fmt_bytes(model.predict(size)),
                    _fmt_bytes(budget),
                )
                cap = min(model.max_size(budget), max_size)
                if not explicit and cap > measured[-1].size:
                    run(cap)
                break
        result = run(size)
        if result is None:
            break
        if result.peak_bytes > budget:
            _log.info(
                "B=%d peaked at %s, over the budget of %s",
                size,
                _fmt_bytes(result.peak_bytes),
                _fmt_bytes(budget),
            )
            break
        if explicit or index == 0:
            continue
        previous = measured[-2]
        gain = (
            result.samples_per_s / previous.samples_per_s
            if previous.samples_per_s > 0
            else math.inf
        )
        slow_doublings = slow_doublings + 1 if gain < plateau else 0
        if slow_doublings >= 2:
            _log.info("throughput stopped growing at B=%d (x%.3f per doubling)", size, gain)
            break
        best = max(m.samples_per_s for m in measured)
        if result.samples_per_s < knee * best:
            _log.info("throughput fell past the knee at B=%d", size)
            break

    measured.sort(key=lambda m: m.size)
    return measured, MemoryModel.fit(measured)


# --------------------------------------------------------------------------------------------------
# the device: budget and identity


def _check_fraction(fraction: object) -> float:
    if (
        isinstance(fraction, bool)
        or not isinstance(fraction, (int, float))
        or not 0.0 < fraction <= 1.0
    ):
        raise ValueError(f"fraction must be a number in (0, 1], got {fraction!r}")
    return float(fraction)


def _meminfo_available(path: str = "/proc/meminfo") -> int | None:
    """MemAvailable from ``/proc/meminfo`` in bytes; None where the file or the line is missing."""
    try:
        with open(path, encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    parts = line.split()
                    unit = parts[2].lower() if len(parts) > 2 else "b"
                    scale = {"kb": 1024, "mb": _MIB, "gb": _GIB, "b": 1}.get(unit, 1)
                    return int(parts[1]) * scale
    except (OSError, ValueError, IndexError):
        return None
    return None


def _available_ram_bytes() -> int:
    """RAM available to new allocations: MemAvailable, else free pages from ``os.sysconf``."""
    available = _meminfo_available()
    if available is not None:
        return available
    try:
        return int(os.sysconf("SC_AVPHYS_PAGES")) * int(os.sysconf("SC_PAGE_SIZE"))
    except (AttributeError, ValueError, OSError) as exc:
        raise RuntimeError(
            "cannot tell how much RAM is available: /proc/meminfo has no MemAvailable and "
            "os.sysconf('SC_AVPHYS_PAGES') failed; pass an explicit budget in bytes"
        ) from exc


def _cuda_index(dev: torch.device, given: str | torch.device) -> int:
    if not torch.cuda.is_available():
        raise ValueError(f"device {str(given)!r} is a CUDA device but CUDA is not available here")
    return dev.index if dev.index is not None else torch.cuda.current_device()


def device_budget(device: str | torch.device, fraction: float = 0.8) -> float:
    """Memory budget in bytes for arrays on ``device``: ``fraction`` of the memory it can use.

    * CUDA: ``fraction`` of the GPU's total memory, less what other processes hold (from
      ``torch.cuda.mem_get_info``; memory this process has reserved counts as usable).
    * CPU: ``fraction`` of the available RAM (MemAvailable in ``/proc/meminfo``, falling back to
      ``os.sysconf``), since arrays share the machine with the data pipeline and everything else.
    * MPS: ``fraction`` of ``torch.mps.recommended_max_memory()``.

    The remaining ``1 - fraction`` is headroom for fragmentation, workspaces and the measurements'
    noise. ``fraction`` must be in (0, 1].
    """
    fraction = _check_fraction(fraction)
    dev = torch.device(device)
    if dev.type == "cuda":
        index = _cuda_index(dev, device)
        free, total = torch.cuda.mem_get_info(index)
        usable = min(total, free + torch.cuda.memory_reserved(index))
        return fraction * float(usable)
    if dev.type == "cpu":
        return fraction * float(_available_ram_bytes())
    if dev.type == "mps":
        return fraction * float(torch.mps.recommended_max_memory())
    raise ValueError(f"device type {dev.type!r} is not supported; valid types: cpu, cuda, mps")


def _cpu_model_name() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() in ("model name", "Processor", "cpu model") and value.strip():
                    return value.strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown-cpu"


def _cpu_count() -> int:
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def _describe_device(device: str | torch.device) -> str:
    """The device's hardware in words, e.g. ``cuda:NVIDIA H100 80GB HBM3:79GiB``."""
    dev = torch.device(device)
    if dev.type == "cuda":
        index = _cuda_index(dev, device)
        name = torch.cuda.get_device_name(index)
        total = torch.cuda.get_device_properties(index).total_memory
        return f"cuda:{name}:{round(total / _GIB)}GiB"  # the memory tells MIG slices apart
    if dev.type == "cpu":
        return f"cpu:{_cpu_model_name()}:{_cpu_count()}cores"
    return f"{dev.type}:{platform.machine() or 'unknown'}"


def _dtype_name(dtype: torch.dtype | str) -> str:
    if isinstance(dtype, torch.dtype):
        return str(dtype).removeprefix("torch.")
    if isinstance(dtype, str) and dtype.strip():
        return dtype.strip().removeprefix("torch.")
    raise ValueError(f"dtype must be a torch.dtype or a non-empty string, got {dtype!r}")


def signature(model: nn.Module) -> str:
    """A short stable hash of ``model``'s architecture, independent of its parameter values.

    It covers the module tree (paths and classes), each module's ``extra_repr()`` (where layers
    keep hyperparameters such as kernel sizes, strides and widths), and every parameter and buffer:
    name, shape, dtype, whether it trains, and which tensors are shared (tied weights change the
    memory of an array). Two independently initialised models of one architecture have the same
    signature; changing a width, a kernel size or a dtype changes it. Dropout probabilities are
    left out: they are per-member settings of a fused array and change neither shapes nor cost.
    Returns 16 hex digits of a SHA-256.
    """
    if not isinstance(model, nn.Module):
        raise ValueError(f"signature() needs a torch.nn.Module, got {type(model).__name__}")
    lines: list[str] = []
    first_seen: dict[int, str] = {}

    def tensor_line(kind: str, path: str, tensor: torch.Tensor | None) -> str:
        if tensor is None:
            return f"{kind} {path} None"
        owner = first_seen.setdefault(id(tensor), path)
        if owner != path:
            return f"{kind} {path} shares {owner}"
        grad = f" grad={tensor.requires_grad}" if kind == "param" else ""
        return f"{kind} {path} {tuple(tensor.shape)} {tensor.dtype!s}{grad}"

    for path, module in model.named_modules(remove_duplicate=False):
        cls = type(module)
        if isinstance(module, _DROPOUT_TYPES):
            extra = f"inplace={getattr(module, 'inplace', False)}"
        else:
            extra = module.extra_repr()
        lines.append(f"module {path} {cls.__module__}.{cls.__qualname__} ({extra})")
        prefix = f"{path}." if path else ""
        for name, param in module._parameters.items():
            lines.append(tensor_line("param", prefix + name, param))
        for name, buffer in module._buffers.items():
            lines.append(tensor_line("buffer", prefix + name, buffer))
    return hashlib.sha256("\n".join(lines).encode("utf-8")).hexdigest()[:16]


def cache_key(
    model_signature: str,
    batch_size: int,
    dtype: torch.dtype | str,
    device: str | torch.device,
) -> str:
    """The key under which a profile is cached: architecture, batch size, dtype, hardware, torch.

    The device part names the hardware, not the index: for CUDA the GPU's name and memory, for
    the CPU its model name and the cores this process may use. The torch version (major.minor)
    is part of the key too, since new releases change kernels and memory use. ``dtype`` is a
    ``torch.dtype`` or a string (``"float32"`` and ``"torch.float32"`` are the same; other strings,
    such as an autocast mode, are kept as given).
    """
    if not isinstance(model_signature, str) or not model_signature:
        raise ValueError(f"model_signature must be a non-empty string, got {model_signature!r}")
    batch_size = _check_int("batch_size", batch_size, 1)
    torch_version = ".".join(torch.__version__.split("+")[0].split(".")[:2])
    return (
        f"{model_signature}|batch={batch_size}|{_dtype_name(dtype)}|{_describe_device(device)}"
        f"|torch={torch_version}"
    )


# --------------------------------------------------------------------------------------------------
# profiles and their cache


@dataclass(frozen=True)
class Profile:
    """Everything measured and decided about one kind of array on one device.

    ``chosen`` is the array size to use and ``reason`` says why in one sentence. ``key`` is the
    :func:`cache_key`; ``device`` describes the hardware. ``measurements`` may be given as any
    sequence and is stored as a tuple sorted by size.
    """

    key: str
    device: str
    batch_size: int
    dtype: str
    measurements: tuple[Measurement, ...]
    memory: MemoryModel
    budget_bytes: float
    chosen: int
    reason: str

    def __post_init__(self) -> None:
        object.__setattr__(self, "measurements", tuple(_check_measurements(self.measurements)))
        _check_int("Profile.batch_size", self.batch_size, 1)
        _check_int("Profile.chosen", self.chosen, 1)
        _check_budget(self.budget_bytes)
        if not isinstance(self.memory, MemoryModel):
            raise ValueError(f"Profile.memory must be a MemoryModel, got {self.memory!r}")
        for name in ("key", "device", "dtype", "reason"):
            if not isinstance(getattr(self, name), str):
                raise ValueError(f"Profile.{name} must be a string, got {getattr(self, name)!r}")

    def table(self) -> str:
        """The measurements as a plain-text table; ``*`` marks the chosen size's row."""
        single = next((m for m in self.measurements if m.size == 1), None)
        header = (
            "", "B", "step ms", "member-samples/s", "speed-up vs B=1", "peak MiB", "predicted MiB",
            "fits",
        )  # fmt: skip
        rows: list[tuple[str, ...]] = [header]
        for m in self.measurements:
            speedup = (
                f"{m.samples_per_s / single.samples_per_s:.2f}x"
                if single is not None and single.samples_per_s > 0
                else "-"
            )
            rows.append(
                (
                    "*" if m.size == self.chosen else "",
                    str(m.size),
                    f"{m.step_s * 1e3:.2f}",
                    _fmt_rate(m.samples_per_s),
                    speedup,
                    f"{m.peak_bytes / _MIB:.1f}",
                    f"{self.memory.predict(m.size) / _MIB:.1f}",
                    "yes" if _fits(m, self.budget_bytes) else "no",
                )
            )
        widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
        lines = [
            "  ".join(
                cell.ljust(w) if i == 0 else cell.rjust(w)
                for i, (cell, w) in enumerate(zip(row, widths, strict=True))
            ).rstrip()
            for row in rows
        ]
        lines.insert(1, "-" * len(lines[0]))
        lines.append(
            f"budget {_fmt_bytes(self.budget_bytes)}; memory model "
            f"{_fmt_bytes(self.memory.base_bytes)} + {_fmt_bytes(self.memory.per_member_bytes)} x B"
        )
        lines.append(f"* chosen B={self.chosen}: {self.reason}")
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-safe dict (plain numbers, strings, lists) that :meth:`from_dict` reads back."""
        return {
            "format": _FORMAT,
            "key": self.key,
            "device": self.device,
            "batch_size": self.batch_size,
            "dtype": self.dtype,
            "measurements": [
                {
                    "size": m.size,
                    "samples_per_s": m.samples_per_s,
                    "peak_bytes": m.peak_bytes,
                    "step_s": m.step_s,
                }
                for m in self.measurements
            ],
            "memory": {
                "base_bytes": self.memory.base_bytes,
                "per_member_bytes": self.memory.per_member_bytes,
            },
            "budget_bytes": self.budget_bytes,
            "chosen": self.chosen,
            "reason": self.reason,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Profile:
        """The profile :meth:`to_dict` wrote; ValueError naming what is missing or malformed."""
        if not isinstance(d, dict):
            raise ValueError(f"a profile must be a dict, got {type(d).__name__}")
        if d.get("format", _FORMAT) != _FORMAT:
            raise ValueError(f"profile format {d.get('format')!r} is not supported (valid: 1)")
        try:
            return cls(
                key=d["key"],
                device=d["device"],
                batch_size=d["batch_size"],
                dtype=d["dtype"],
                measurements=tuple(
                    Measurement(
                        size=m["size"],
                        samples_per_s=m["samples_per_s"],
                        peak_bytes=m["peak_bytes"],
                        step_s=m["step_s"],
                    )
                    for m in d["measurements"]
                ),
                memory=MemoryModel(
                    base_bytes=d["memory"]["base_bytes"],
                    per_member_bytes=d["memory"]["per_member_bytes"],
                ),
                budget_bytes=d["budget_bytes"],
                chosen=d["chosen"],
                reason=d["reason"],
            )
        except KeyError as exc:
            raise ValueError(f"profile is missing the field {exc.args[0]!r}") from exc
        except TypeError as exc:
            raise ValueError(f"profile is malformed: {exc}") from exc


def _default_cache_path() -> Path:
    explicit = os.environ.get("HFSWEEP_CACHE_DIR")
    if explicit:
        return Path(explicit).expanduser() / "profiles.json"
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "hfsweep" / "profiles.json"


class ProfileCache:
    """Profiles kept in one JSON file, keyed by :func:`cache_key`.

    The default file is ``$HFSWEEP_CACHE_DIR/profiles.json``, else
    ``$XDG_CACHE_HOME/hfsweep/profiles.json``, else ``~/.cache/hfsweep/profiles.json``. The cache
    only saves time, so it never stops a sweep: a corrupt or unreadable file (or entry) reads as
    empty with a logged warning, and a failed write is logged and skipped. Writes go to a
    temporary file in the same folder that replaces the old file in one ``os.replace``, so a crash
    leaves the old file or the new one, never half of one; where ``fcntl`` exists, a lock file
    keeps processes that write at once from losing each other's entries.
    """

    def __init__(self, path: str | os.PathLike[str] | None = None) -> None:
        self.path = Path(path) if path is not None else _default_cache_path()

    def __repr__(self) -> str:
        return f"ProfileCache({str(self.path)!r})"

    def _read(self) -> dict[str, Any]:
        """The file's ``{key: profile dict}``; empty (with a warning) if it cannot be read."""
        try:
            text = self.path.read_text(encoding="utf-8")
        except FileNotFoundError:
            return {}
        except (OSError, UnicodeDecodeError) as exc:
            _log.warning(
                "cannot read the profile cache %s (%s); treating it as empty", self.path, exc
            )
            return {}
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            _log.warning(
                "the profile cache %s is not valid JSON (%s); treating it as empty", self.path, exc
            )
            return {}
        if (
            not isinstance(data, dict)
            or data.get("format") != _FORMAT
            or not isinstance(data.get("profiles"), dict)
        ):
            _log.warning(
                "the profile cache %s does not hold hfsweep profiles (format %s); treating it as "
                "empty",
                self.path,
                _FORMAT,
            )
            return {}
        profiles: dict[str, Any] = data["profiles"]
        return profiles

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        """An exclusive lock on ``<path>.lock`` where ``fcntl`` exists; nothing elsewhere."""
        try:
            import fcntl
        except ImportError:  # Windows: writes stay atomic, concurrent writers may drop an entry
            yield
            return
        with open(self.path.with_name(self.path.name + ".lock"), "a") as lock:
            fcntl.flock(lock.fileno(), fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(lock.fileno(), fcntl.LOCK_UN)

    def get(self, key: str) -> Profile | None:
        """The profile stored under ``key``, or None (also for an entry that cannot be read)."""
        entry = self._read().get(key)
        if entry is None:
            return None
        try:
            return Profile.from_dict(entry)
        except ValueError as exc:
            _log.warning("ignoring the unreadable profile %r in %s: %s", key, self.path, exc)
            return None

    def put(self, profile: Profile) -> None:
        """Store ``profile`` under its key, replacing an older one; the file is written atomically."""
        if not isinstance(profile, Profile):
            raise ValueError(f"put() needs a Profile, got {type(profile).__name__}")
        tmp_name: str | None = None
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with self._locked():
                profiles = self._read()
                profiles[profile.key] = profile.to_dict()
                text = json.dumps(
                    {"format": _FORMAT, "profiles": profiles}, indent=1, sort_keys=True
                )
                fd, tmp_name = new_temporary(self.path.parent, self.path.name + ".", ".tmp")
                with os.fdopen(fd, "w", encoding="utf-8") as f:
                    f.write(text)
                    f.flush()
                    os.fsync(f.fileno())
                os.replace(tmp_name, self.path)
                tmp_name = None
        except OSError as exc:
            _log.warning("could not write the profile cache %s (%s); not cached", self.path, exc)
        finally:
            if tmp_name is not None:
                with contextlib.suppress(OSError):
                    os.unlink(tmp_name)


# --------------------------------------------------------------------------------------------------
# plotting


def plot(profile: Profile, path: str | os.PathLike[str]) -> None:
    """Write a PNG of ``profile``: throughput and memory against the array size B.

    Top panel: member-samples/s per measured B, the chosen B marked. Bottom panel: measured peak
    memory, the memory model's line and the budget. The x axis (B) is log2 and shared. Uses
    matplotlib's Agg canvas directly (no pyplot, no global backend change); matplotlib is imported
    here only, and a missing one raises ImportError saying how to install it.
    """
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as exc:
        raise ImportError(
            "hfsweep.profiler.plot() needs matplotlib: pip install matplotlib"
        ) from exc

    ms = profile.measurements
    sizes = [m.size for m in ms]
    model = profile.memory
    # The model's line runs from B=1 to past the largest size measured, and on to where it crosses
    # the budget when that is near; it is sampled densely because the x axis is logarithmic.
    upper = max(*sizes, profile.chosen)
    crossing = model.max_size(profile.budget_bytes)
    if upper < crossing <= 2 * upper:
        upper = crossing + 1
    xs = [upper ** (i / 64) for i in range(65)]
    line = [model.base_bytes + model.per_member_bytes * x for x in xs]
    shown = max(max(m.peak_bytes for m in ms), max(line), 1)
    # A budget far above everything measured would squash the data to the floor: name it instead.
    budget_on_scale = profile.budget_bytes <= 3 * shown
    top_bytes = max(shown, profile.budget_bytes) if budget_on_scale else shown
    unit, scale = ("GiB", _GIB) if top_bytes >= _GIB else ("MiB", _MIB)

    fig = Figure(figsize=(7.0, 6.5), layout="constrained")
    FigureCanvasAgg(fig)
    top, bottom = fig.subplots(2, 1, sharex=True)

    top.plot(sizes, [m.samples_per_s for m in ms], "o-", color="tab:blue", label="measured")
    over = [m for m in ms if not _fits(m, profile.budget_bytes)]
    if over:
        top.plot(
            [m.size for m in over], [m.samples_per_s for m in over], "x", color="tab:red",
            markersize=10, label="over the budget",
        )  # fmt: skip
    chosen = [m for m in ms if m.size == profile.chosen]
    if chosen:
        top.plot(
            [chosen[0].size], [chosen[0].samples_per_s], "*", color="tab:red", markersize=16,
            label=f"chosen B={profile.chosen}",
        )  # fmt: skip
    top.axvline(profile.chosen, color="tab:red", linestyle=":", linewidth=1)
    top.set_ylabel("member-samples/s")
    top.set_ylim(bottom=0)
    top.legend(loc="best")
    top.set_title(f"{profile.device}, batch {profile.batch_size}, {profile.dtype}", fontsize=10)

    bottom.plot(
        sizes, [m.peak_bytes / scale for m in ms], "o", color="tab:green", label="measured peak"
    )
    bottom.plot(
        xs, [y / scale for y in line], "-", color="tab:gray",
        label=f"model: {_fmt_bytes(model.base_bytes)} + {_fmt_bytes(model.per_member_bytes)} x B",
    )  # fmt: skip
    budget_label = f"budget {_fmt_bytes(profile.budget_bytes)}"
    if budget_on_scale:
        bottom.axhline(
            profile.budget_bytes / scale, color="tab:red", linestyle="--", label=budget_label
        )
    else:
        bottom.plot([], [], " ", label=f"{budget_label} (off the scale)")
    bottom.axvline(profile.chosen, color="tab:red", linestyle=":", linewidth=1)
    bottom.set_ylabel(f"peak memory ({unit})")
    bottom.set_xlabel("array size B")
    bottom.set_xscale("log", base=2)
    ticks = sorted({*sizes, profile.chosen})
    bottom.set_xticks(ticks, labels=[str(t) for t in ticks])
    bottom.minorticks_off()
    bottom.set_ylim(0, top_bytes * 1.1 / scale)
    bottom.legend(loc="best")
    fig.suptitle(f"Chosen: {profile.reason}", fontsize=8, wrap=True)
    fig.savefig(os.fspath(path), format="png", dpi=100)
