"""What a profile was measured under, and how a reused one is shown.

The profile cache is shared by every process of a user on a machine (and by every user of a
shared ``HFSWEEP_CACHE_DIR``), so a profile found there may have been measured by another
process, hours ago, while the machine was busy. Timings taken under load can invert the choice
(B=1 slower than B=4). The cache key holds what changes the answer in a way that can be named
(:func:`~hfsweep.sizing.cache.cache_key`); what cannot be keyed, the machine's load and the
time, is recorded here with each profile and shown whenever a cached one is used, with the way
to measure again.
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Mapping

import torch

from .. import _version
from .device import _cpu_count

__all__: list[str] = []

#: set to 1 (or true, yes) to measure again instead of reusing a cached profile
REFRESH_ENV = "HFSWEEP_PROFILE_REFRESH"


def refresh_requested() -> bool:
    """Whether ``HFSWEEP_PROFILE_REFRESH`` asks every profile of this process to be measured
    again (how a sweep with ``fusion: {size: auto}`` refreshes its profiles)."""
    return os.environ.get(REFRESH_ENV, "").strip().lower() in ("1", "true", "yes", "on")


def _load() -> float | None:
    """The machine's 1-minute load average, or ``None`` where the system has none."""
    try:
        return round(os.getloadavg()[0], 2)
    except (AttributeError, OSError):
        return None


def conditions(device_description: str) -> dict[str, str]:
    """The conditions a profile is measured under now: versions, hardware, threads, load."""
    found = {
        "hfsweep": _version.__version__,
        "torch": torch.__version__,
        "device": device_description,
        "threads": str(torch.get_num_threads()),
        "cores": str(_cpu_count()),
        "host": socket.gethostname(),
        "pid": str(os.getpid()),
    }
    load = _load()
    if load is not None:
        found["load"] = f"{load:.2f}"
    return found


def _age(seconds: float) -> str:
    """``seconds`` as a rough age: ``40 s``, ``12 min``, ``3.5 h``, ``2.0 days``."""
    seconds = max(seconds, 0.0)
    if seconds < 90:
        return f"{seconds:.0f} s"
    if seconds < 90 * 60:
        return f"{seconds / 60:.0f} min"
    if seconds < 48 * 3600:
        return f"{seconds / 3600:.1f} h"
    return f"{seconds / 86400:.1f} days"


def describe_cached(
    path: str, measured_at: float | None, measured_under: Mapping[str, str] | None
) -> str:
    """One sentence on a cached profile: its file, its age and what it was measured under
    (with the load then against the load now), and how to measure again."""
    if measured_at is None:
        when = "at an unknown time"
    else:
        stamp = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(measured_at))
        when = f"{_age(time.time() - measured_at)} ago ({stamp})"
    parts: list[str] = []
    under = dict(measured_under or {})
    if under:
        parts.append(f"hfsweep {under.get('hfsweep', '?')}, torch {under.get('torch', '?')}")
        parts.append(under.get("device", "?"))
        parts.append(f"{under.get('threads', '?')} threads")
        load = under.get("load")
        if load is not None:
            now = _load()
            parts.append(
                f"load {load} then"
                + (f", {now:.2f} now" if now is not None else "")
                + f" on {under.get('cores', '?')} cores"
            )
        if "host" in under:
            parts.append(f"by process {under.get('pid', '?')} on {under['host']}")
    what = f" under {'; '.join(parts)}" if parts else ""
    return (
        f"cached profile from {path}, measured {when}{what}; measure again with "
        f"`hfsweep profile ... --refresh` (a sweep: {REFRESH_ENV}=1)"
    )
