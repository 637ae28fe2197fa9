"""Scaling profiles: how fast one array trains on k data-parallel workers.

An elastic array trains on k workers, each holding every member and 1/k of every batch, the
gradients averaged by an all-reduce. :class:`ScalingProfile` is what the allocator needs to know
about one compatibility key: member-samples/s at k = 1, 2, 4, ... workers, each point either
*measured* or *modelled*. :func:`model_scaling` models the points from what the sizing code
already measures (the one-worker step time of the array, :class:`~hfsweep.profiler.Measurement`)
and an :class:`AllReduceCost` measured on this machine (:mod:`hfsweep.sizing.allreduce`)::

    step(k) = serial_s + (step_s - serial_s) / k + allreduce(gradient_bytes, k)
    rate(k) = members * batch_size / step(k)

``serial_s`` is the part of a step that every worker repeats whatever k (the optimizer step of
every member's parameters, the evaluation); ``gradient_bytes`` is every member's gradients (all
are averaged). The model assumes compute scales as 1/k with the per-worker batch (it does not
for batches so small that kernels stop being efficient) and no overlap of communication with the
backward pass; :meth:`ScalingProfile.with_measured` replaces modelled points by measured ones,
and ``benchmarks/scaling_profile.py`` says how far the model is from a real k = 2 run.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ._units import _check_int, _check_real
from .measure import _doubling_sizes
from .model import Measurement, _check_measurements

__all__ = ["AllReduceCost", "ScalingProfile", "model_scaling", "step_s_at"]


@dataclass(frozen=True)
class AllReduceCost:
    """What averaging ``n`` bytes across k workers costs, as a ring all-reduce.

    A ring all-reduce sends ``2 (k - 1)`` messages per worker, each of ``n / k`` bytes:
    ``time(n, k) = 2 (k - 1) * latency_s + 2 (k - 1) / k * n / bandwidth_bytes_per_s`` (0 for
    k = 1). ``source`` says where the two numbers came from (a measurement on this machine,
    or an assumption such as a cluster's network).
    """

    latency_s: float
    bandwidth_bytes_per_s: float
    source: str = "given"

    def __post_init__(self) -> None:
        _check_real("AllReduceCost.latency_s", self.latency_s)
        _check_real("AllReduceCost.bandwidth_bytes_per_s", self.bandwidth_bytes_per_s, strict=True)

    def time(self, nbytes: float, workers: int) -> float:
        """Seconds to all-reduce ``nbytes`` across ``workers`` workers (0 for one worker)."""
        _check_real("nbytes", nbytes)
        _check_int("workers", workers, 1)
        if workers == 1:
            return 0.0
        hops = 2 * (workers - 1)
        return hops * self.latency_s + hops / workers * nbytes / self.bandwidth_bytes_per_s

    @classmethod
    def fit(
        cls, points: Sequence[tuple[float, float]], *, workers: int = 2, source: str = "fitted"
    ) -> AllReduceCost:
        """The cost whose :meth:`time` fits measured ``(nbytes, seconds)`` points of ``workers``.

        Least squares of ``seconds = a + b * nbytes`` in *relative* error (each point weighted
        by ``1 / seconds**2``, so the small sizes that show the latency count as much as the
        large ones that show the bandwidth), at least two distinct sizes, ``a`` and ``b`` kept
        >= 0 (a tiny positive slope stands for "bandwidth beyond measuring"); then
        ``latency = a / (2 (k-1))`` and ``bandwidth = 2 (k-1) / k / b``.
        """
        _check_int("workers", workers, 2)
        pts = [(float(n), float(t)) for n, t in points]
        if len({n for n, _ in pts}) < 2:
            raise ValueError(f"fit needs points of at least two distinct sizes, got {pts!r}")
        if any(t <= 0 for _, t in pts):
            raise ValueError(f"fit needs positive times, got {pts!r}")
        # weighted normal equations for t = a + b n with weights w = 1 / t^2
        w = [1.0 / (t * t) for _, t in pts]
        sw = sum(w)
        swn = sum(wi * n for wi, (n, _) in zip(w, pts, strict=True))
        swt = sum(wi * t for wi, (_, t) in zip(w, pts, strict=True))
        swnn = sum(wi * n * n for wi, (n, _) in zip(w, pts, strict=True))
        swnt = sum(wi * n * t for wi, (n, t) in zip(w, pts, strict=True))
        det = sw * swnn - swn * swn
        slope = (sw * swnt - swn * swt) / det
        intercept = (swt - slope * swn) / sw
        if intercept < 0:  # through the origin
            intercept, slope = 0.0, swnt / swnn
        if slope <= 0:  # flat: all latency
            intercept, slope = swt / sw, 1e-15
        hops = 2 * (workers - 1)
        return cls(
            latency_s=intercept / hops,
            bandwidth_bytes_per_s=hops / workers / slope,
            source=source,
        )

    def to_dict(self) -> dict[str, Any]:
        """A JSON-safe dict that :meth:`from_dict` reads back."""
        return {
            "latency_s": self.latency_s,
            "bandwidth_bytes_per_s": self.bandwidth_bytes_per_s,
            "source": self.source,
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> AllReduceCost:
        """The cost :meth:`to_dict` wrote; ValueError naming a missing field."""
        try:
            return cls(
                latency_s=d["latency_s"],
                bandwidth_bytes_per_s=d["bandwidth_bytes_per_s"],
                source=str(d.get("source", "given")),
            )
        except KeyError as exc:
            raise ValueError(f"an all-reduce cost is missing the field {exc.args[0]!r}") from None


@dataclass(frozen=True)
class ScalingProfile:
    """Member-samples/s of one kind of array at k workers, for the allocator.

    ``points`` maps worker counts to member-samples/s (at least k = 1); ``measured`` names the
    counts that were measured rather than modelled. :meth:`rate` interpolates linearly between
    points and stays flat past the last one (no gain is assumed that nobody measured or
    modelled). ``key`` is the compatibility key (or sizing cache key) it belongs to.
    """

    key: str
    points: Mapping[int, float]
    measured: frozenset[int] = frozenset()

    def __post_init__(self) -> None:
        clean: dict[int, float] = {}
        for k, rate in sorted(dict(self.points).items()):
            _check_int("ScalingProfile.points key (workers)", k, 1)
            clean[k] = _check_real(f"ScalingProfile.points[{k}]", rate, strict=True)
        if 1 not in clean:
            raise ValueError(
                f"ScalingProfile {self.key!r} has no point at 1 worker (points at {sorted(clean)})"
            )
        unknown = sorted(set(self.measured) - set(clean))
        if unknown:
            raise ValueError(f"ScalingProfile.measured names {unknown}, which have no point")
        object.__setattr__(self, "points", clean)
        object.__setattr__(self, "measured", frozenset(self.measured))

    @property
    def max_workers(self) -> int:
        """The largest worker count with a point."""
        return max(self.points)

    def rate(self, workers: int) -> float:
        """Member-samples/s at ``workers`` workers (interpolated; flat past the last point)."""
        _check_int("workers", workers, 1)
        if workers in self.points:
            return self.points[workers]
        ks = sorted(self.points)
        if workers > ks[-1]:
            return self.points[ks[-1]]
        hi = next(k for k in ks if k > workers)
        lo = max(k for k in ks if k < workers)
        f = (workers - lo) / (hi - lo)
        return self.points[lo] + f * (self.points[hi] - self.points[lo])

    def speedup(self, workers: int) -> float:
        """``rate(workers) / rate(1)``."""
        return self.rate(workers) / self.points[1]

    def efficiency(self, workers: int) -> float:
        """``speedup(workers) / workers``: 1.0 is perfect scaling."""
        return self.speedup(workers) / workers

    def with_measured(self, points: Mapping[int, float]) -> ScalingProfile:
        """This profile with ``points`` (workers -> measured member-samples/s) replacing or
        adding to the modelled ones; the measured ones are marked as such."""
        merged = {**self.points, **points}
        return ScalingProfile(self.key, merged, frozenset(self.measured | set(points)))

    def describe(self) -> str:
        """``1: 1,000/s, 2: 1,800/s (m)...``: each point, ``(m)`` where measured."""
        parts = [
            f"{k}: {r:,.0f}/s{' (m)' if k in self.measured else ''}"
            for k, r in sorted(self.points.items())
        ]
        return ", ".join(parts)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-safe dict that :meth:`from_dict` reads back."""
        return {
            "key": self.key,
            "points": {str(k): r for k, r in sorted(self.points.items())},
            "measured": sorted(self.measured),
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> ScalingProfile:
        """The profile :meth:`to_dict` wrote; ValueError naming what is missing or malformed."""
        try:
            points = {int(k): float(v) for k, v in d["points"].items()}
            return cls(str(d["key"]), points, frozenset(int(k) for k in d.get("measured", ())))
        except KeyError as exc:
            raise ValueError(f"a scaling profile is missing the field {exc.args[0]!r}") from None
        except (TypeError, AttributeError) as exc:
            raise ValueError(f"a scaling profile is malformed: {exc}") from None


def step_s_at(measurements: Sequence[Measurement], size: int) -> float:
    """Seconds per step of an array of ``size`` members, from the sizing measurements.

    A measured size gives its own step time; between two measured sizes the step time is
    interpolated linearly; below the smallest it is that size's (a smaller array is not assumed
    faster than measured); above the largest it grows in proportion to the size (every member
    costs what the largest array's members cost on average).
    """
    _check_int("size", size, 1)
    items = _check_measurements(measurements)
    for m in items:
        if m.size == size:
            return m.step_s
    if size < items[0].size:
        return items[0].step_s
    if size > items[-1].size:
        return items[-1].step_s * size / items[-1].size
    hi = next(m for m in items if m.size > size)
    lo = max((m for m in items if m.size < size), key=lambda m: m.size)
    f = (size - lo.size) / (hi.size - lo.size)
    return lo.step_s + f * (hi.step_s - lo.step_s)


def model_scaling(
    key: str,
    *,
    step_s: float,
    members: int,
    batch_size: int,
    gradient_bytes: float,
    allreduce: AllReduceCost,
    serial_s: float = 0.0,
    max_workers: int = 64,
    measured: Mapping[int, float] | None = None,
) -> ScalingProfile:
    """A modelled :class:`ScalingProfile` at k = 1, 2, 4, ... ``max_workers`` workers.

    ``step_s`` is one worker's measured seconds per step of an array of ``members`` members on
    batches of ``batch_size`` (the sizing profile's :class:`Measurement`, or :func:`step_s_at`);
    ``gradient_bytes`` the bytes of all members' gradients; ``serial_s`` the part of ``step_s``
    every worker repeats (<= ``step_s``). Worker counts beyond ``batch_size`` (less than one
    sample per worker) are left out. ``measured`` points override the model's.
    """
    step_s = _check_real("step_s", step_s, strict=True)
    members = _check_int("members", members, 1)
    batch_size = _check_int("batch_size", batch_size, 1)
    gradient_bytes = _check_real("gradient_bytes", gradient_bytes)
    serial_s = _check_real("serial_s", serial_s)
    if serial_s > step_s:
        raise ValueError(f"serial_s ({serial_s}) must not exceed step_s ({step_s})")
    max_workers = _check_int("max_workers", max_workers, 1)
    points: dict[int, float] = {}
    for k in _doubling_sizes(min(max_workers, batch_size)):
        step_k = serial_s + (step_s - serial_s) / k + allreduce.time(gradient_bytes, k)
        points[k] = members * batch_size / step_k if step_k > 0 else math.inf
    profile = ScalingProfile(key, points)
    return profile.with_measured(measured) if measured else profile
