"""Measuring array sizes one after another until larger ones cannot help (:func:`profile_sizes`).

The measuring itself is a callable the caller provides (``hfsweep.sizing.task`` trains the task's
arrays); this module decides which sizes to try, when to stop, and treats an out-of-memory error
as "this size does not fit".
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence

import torch

from ._units import _check_budget, _check_int, _check_knee, _check_real, _fmt_bytes
from .model import Measurement, MemoryModel

__all__ = ["profile_sizes"]

# Every sizing module logs under ``hfsweep.profiler``, the one name users configure for them.
_log = logging.getLogger("hfsweep.profiler")


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
