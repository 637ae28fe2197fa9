"""What a measured array size costs, and the choice of B from those measurements.

:class:`Measurement` records one size's throughput and peak memory; :class:`MemoryModel` fits
``peak(B) = base + per_member * B`` to the measured peaks; :func:`choose_size` picks the knee of
throughput under the memory budget (B = 1 when no larger array is faster).
"""

from __future__ import annotations

import math
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from fractions import Fraction

from ._units import _check_budget, _check_int, _check_knee, _check_real, _fmt_bytes, _fmt_rate

__all__ = ["Measurement", "MemoryModel", "choose_size"]


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
