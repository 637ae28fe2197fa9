"""``fusion: {size: auto, offload: auto}``: array sizes beyond what the device holds, offloaded
(:func:`offload_beyond`).

The profiler measures arrays on the device up to the largest size its memory budget holds. Where
that budget, not throughput, stopped it, an array larger than the device holds may still train
faster offloaded (its shards stream through the device; the step's fixed costs are shared by more
members). :func:`offload_beyond` measures such sizes offloaded, doubling from the first size that
did not fit, and keeps the fastest of them where it trains more member-samples/s than every size
that fits on the device (the largest included); otherwise the on-device choice stands.

The measuring itself is a callable (:func:`hfsweep.sizing.task.profile_task` passes the trainer's
step offloaded, with the engine's budget); this module only decides which sizes to measure and
which wins.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

from ..offload import OffloadChoice, OffloadError
from ._units import _fmt_rate
from .measure import _doubling_sizes, _is_oom
from .model import Measurement, MemoryModel

__all__ = ["offload_beyond"]

_log = logging.getLogger("hfsweep.profiler")


def offload_beyond(
    measure_offloaded: Callable[[int], Measurement],
    measurements: Sequence[Measurement],
    memory: MemoryModel | None,
    budget: float,
    *,
    max_size: int,
    knee: float = 0.9,
    plateau: float = 1.05,
) -> tuple[OffloadChoice | None, list[Measurement]]:
    """Whether an offloaded array of more members than the device holds beats every array that
    fits: ``(choice, offloaded measurements)``.

    ``measurements`` are the profiler's on-device sizes, ``memory`` the line fitted to their
    peaks (none: not one member fit, even B = 1 ran out of memory) and ``budget`` the device's
    memory budget in bytes. Nothing is measured (``None``)
    where the budget did not cap the sizes (every size up to ``max_size`` fits). Otherwise the
    sizes 2, 4, 8... (and ``max_size``) above the largest that fits are measured offloaded
    (``measure_offloaded(B)``), while each doubling raises the rate by at least ``plateau``
    times; an array the engine cannot run within the budget (:class:`OffloadError`, an
    out-of-memory error) ends the search, larger ones would not run either. The choice is
    ``"host"`` at the smallest offloaded size within ``knee`` of the fastest offloaded rate
    that still trains more member-samples/s than the fastest size that fits (``fit_size`` is
    that size, 0 where none fits), else ``None`` (the on-device choice stands); the
    measurements made are returned either way, for the log.
    """
    fitting = [m for m in measurements if m.peak_bytes <= budget]
    largest = max((m.size for m in fitting), default=0)
    capped = (
        memory is None or len(fitting) < len(measurements) or memory.max_size(budget) < max_size
    )
    if not capped or largest >= max_size:
        return None, []
    measured: list[Measurement] = []
    for size in (s for s in _doubling_sizes(max_size) if s > largest):
        try:
            m = measure_offloaded(size)
        except OffloadError as exc:
            _log.info("B=%d cannot run offloaded in %d bytes: %s", size, int(budget), exc)
            break
        except Exception as exc:
            if not _is_oom(exc):
                raise
            _log.info("B=%d offloaded ran out of memory", size)
            break
        _log.info(
            "B=%d offloaded: %s member-samples/s (%.2f ms a step)",
            size,
            _fmt_rate(m.samples_per_s),
            m.step_s * 1e3,
        )
        measured.append(m)
        if len(measured) > 1 and m.samples_per_s < plateau * measured[-2].samples_per_s:
            break
    if not measured:
        return None, []
    fastest = max(m.samples_per_s for m in measured)
    device = max(fitting, key=lambda m: (m.samples_per_s, -m.size), default=None)
    rate = device.samples_per_s if device is not None else 0.0
    faster = [m for m in measured if m.samples_per_s > rate]
    if not faster:
        return None, measured
    best = min(
        (m for m in faster if m.samples_per_s >= knee * fastest),
        key=lambda m: m.size,
        default=max(faster, key=lambda m: m.samples_per_s),
    )
    against = (
        f"{_fmt_rate(rate)} for B={device.size}, the fastest array that fits"
        if device is not None
        else "no array that fits"
    )
    reason = (
        f"B={best.size} offloaded (offload: auto): it trains {_fmt_rate(best.samples_per_s)} "
        f"member-samples/s against {against} the {int(budget)} bytes of device memory"
    )
    choice = OffloadChoice(
        best.size,
        device.size if device is not None else 0,
        int(budget),
        "host",
        reason,
        best.samples_per_s,
        rate if device is not None else None,
    )
    return choice, measured
