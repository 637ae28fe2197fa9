"""The device an array trains on: which one ``auto`` means, the dtype names a sweep accepts, how
much memory arrays may use there, and the hardware's name for the profile cache's key."""

from __future__ import annotations

import os
import platform

import torch

from .._devices import DTYPES, resolve_device
from ._units import _GIB, _MIB

__all__ = ["DTYPES", "describe_device", "device_budget", "resolve_device"]


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


def describe_device(device: str | torch.device) -> str:
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
