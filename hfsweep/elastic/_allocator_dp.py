"""The allocator's dynamic program (:mod:`hfsweep.elastic.allocator`): the worker counts tried
per array, and the choice of one count per array that maximises the objective within the
cluster's workers."""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from ..sizing.scaling import ScalingProfile

__all__: list[str] = []


#: every worker count up to this is tried; above it only a profile's points and the bounds
_EVERY_UP_TO = 32


def _choices(profile: ScalingProfile, low: int, high: int, current: int) -> list[int]:
    """The worker counts tried for one array: every count from ``low`` to 32, and above that
    its profile's points, the bounds and its current count (a DP over every count up to 512
    for each of hundreds of arrays would take seconds per decision; past 32 workers a profile
    is known at powers of two only, straight lines between)."""
    high = min(high, profile.max_workers)
    if high < low:
        return [low]
    ks = set(range(low, min(high, _EVERY_UP_TO) + 1))
    ks |= {k for k in profile.points if low <= k <= high} | {low, high}
    if low <= current <= high:
        ks.add(current)
    return sorted(ks)


def _starts(chosen: Sequence[int], served: int) -> int:
    """How many new arrays ``chosen`` (served arrays first, then the pools' candidates) starts."""
    return sum(1 for k in chosen[served:] if k > 0)


def _best(
    options: list[list[int]],
    weights: list[float],
    profiles: list[ScalingProfile],
    total: int,
    resizes: Sequence[tuple[int, float]] = (),
) -> list[int] | None:
    """The DP: one choice per array from its options, using at most ``total`` workers, with the
    largest sum of ``weight * (2 - 1 / speedup(k))`` (0 for k = 0) less, for the running arrays
    (the first ``len(resizes)``, each ``(workers now, cost)``), ``cost`` wherever ``k`` is
    neither their workers now nor 0; None if even the smallest choices do not fit. Ties go to
    fewer workers (choices in ascending order, strict >)."""
    values = []
    for i, (choices, weight, profile) in enumerate(zip(options, weights, profiles, strict=True)):
        now, cost = resizes[i] if i < len(resizes) else (0, 0.0)
        values.append(
            [
                (0.0 if k == 0 else weight * (2.0 - 1.0 / profile.speedup(k)))
                - (cost if now > 0 and k not in (0, now) else 0.0)
                for k in choices
            ]
        )
    return _best_of(options, values, total)


def _best_of(
    options: Sequence[Sequence[int]], values: Sequence[Sequence[float]], total: int
) -> list[int] | None:
    """The DP itself: one of ``options[i]`` per array, using at most ``total`` workers, with the
    largest sum of the matching ``values[i]``; None if even the smallest choices do not fit.
    Ties go to fewer workers (choices in ascending order, strict >)."""
    if sum(min(o) for o in options) > total:
        return None
    neg = -math.inf
    best = np.full(total + 1, neg)
    best[0] = 0.0  # best[w]: the value using exactly w workers
    picks: list[np.ndarray] = []
    for choices, worth in zip(options, values, strict=True):
        new = np.full(total + 1, neg)
        pick = np.zeros(total + 1, dtype=np.int64)
        for k, value in zip(choices, worth, strict=True):
            if k > total:
                continue
            shifted = np.full(total + 1, neg)
            shifted[k:] = best[: total + 1 - k] + value
            better = shifted > new
            new[better] = shifted[better]
            pick[better] = k
        best = new
        picks.append(pick)
    w = int(np.argmax(best))  # argmax returns the first, i.e. fewest workers, among ties
    if best[w] == neg:
        return None
    chosen = []
    for pick in reversed(picks):
        k = int(pick[w])
        chosen.append(k)
        w -= k
    return chosen[::-1]
