"""The median stopping rule, decided jointly per call."""

from __future__ import annotations

import bisect
import math
import statistics
from collections.abc import Mapping, Sequence
from typing import Any

from ._base import (
    RESOURCE_RTOL,
    Decision,
    Report,
    TrialScheduler,
    check_int,
    check_positive,
    decode_float,
    encode_float,
    reached,
)

__all__ = ["MedianStoppingScheduler"]


class _Curve:
    """One trial's reports: resources (non-decreasing) and the running best score."""

    __slots__ = ("best", "resources", "values")

    def __init__(self) -> None:
        self.resources: list[float] = []
        self.values: list[float] = []
        self.best: list[float] = []  # running best *score* (larger is better, nan -> -inf)

    def add(self, resource: float, value: float, score: float) -> None:
        self.resources.append(resource)
        self.values.append(value)
        self.best.append(max(score, self.best[-1]) if self.best else score)

    def best_up_to(self, t: float) -> float | None:
        """The best score among reports at resources ``<= t``; ``None`` if the trial has not
        reached ``t`` or reported nothing up to it."""
        if not self.resources or not reached(self.resources[-1], t):
            return None
        i = bisect.bisect_right(self.resources, t * (1 + RESOURCE_RTOL))
        return self.best[i - 1] if i else None


class MedianStoppingScheduler(TrialScheduler):
    """Stop a trial whose best value so far is worse than the median of the others' at that point.

    After *all* reports of a :meth:`decide` call are recorded, a trial reporting at resource
    ``t >= grace_period`` is stopped iff its best value up to ``t`` is strictly worse than the
    median of the other trials' best values up to ``t``, taken over every other trial that has
    reached ``t`` (reported at some resource ``>= t``, and at least once at ``<= t``), running,
    completed, stopped or failed alike, and only when there are at least ``min_samples`` such
    trials. Ties go on; ``nan`` counts as the worst value; a report at or beyond
    ``max_resource`` is never stopped. Members of one array reporting together are compared
    with each other as well as with the trials before them, in whatever order they come.

    Args:
        mode: ``"max"`` or ``"min"``.
        max_resource: a trial's full budget (epochs by default).
        grace_period: no trial is stopped before this resource.
        min_samples: how many other trials must have reached ``t`` before anything is stopped
            at ``t``.
    """

    def __init__(
        self,
        *,
        mode: str = "max",
        max_resource: float,
        grace_period: float = 1,
        min_samples: int = 3,
    ) -> None:
        super().__init__(mode=mode, max_resource=max_resource)
        self._grace = check_positive("grace_period", grace_period)
        self._min_samples = check_int("min_samples", min_samples, 1)
        self._curves: dict[str, _Curve] = {}

    def decide(self, reports: Sequence[Report]) -> dict[str, Decision]:
        """Record every report, then compare each trial with the median of the others."""
        reports = self._check_reports(reports)
        for r in reports:
            curve = self._curves.get(r.trial)
            if curve is not None and curve.resources and r.resource < curve.resources[-1]:
                raise ValueError(
                    f"trial {r.trial!r} reports resource {r.resource!r} after "
                    f"{curve.resources[-1]!r}: resources must not decrease"
                )
        for r in reports:
            self._curves.setdefault(r.trial, _Curve()).add(
                r.resource, r.value, self._score(r.value)
            )
        return {r.trial: self._decide_one(r) for r in reports}

    def _decide_one(self, r: Report) -> Decision:
        if not reached(r.resource, self._grace) or self._at_budget(r.resource):
            return Decision.CONTINUE
        own = self._curves[r.trial].best[-1]
        others = []
        for trial, curve in self._curves.items():
            if trial != r.trial:
                best = curve.best_up_to(r.resource)
                if best is not None:
                    others.append(best)
        if len(others) < self._min_samples:
            return Decision.CONTINUE
        median = statistics.median(others)
        if math.isnan(median):  # -inf and +inf averaged: no verdict
            return Decision.CONTINUE
        return Decision.STOP if own < median else Decision.CONTINUE

    def _config(self) -> dict[str, Any]:
        return {**super()._config(), "grace_period": self._grace, "min_samples": self._min_samples}

    def state_dict(self) -> dict[str, Any]:
        """Config, ended trials and every trial's reports as ``[resource, value]`` pairs."""
        state = super().state_dict()
        state["reports"] = {
            trial: [[res, encode_float(v)] for res, v in zip(c.resources, c.values, strict=True)]
            for trial, c in self._curves.items()
        }
        return state

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore a :meth:`state_dict` of a scheduler built with the same arguments."""
        super().load_state_dict(state)
        curves: dict[str, _Curve] = {}
        for trial, pairs in state["reports"].items():
            curve = curves[str(trial)] = _Curve()
            for res, v in pairs:
                value = decode_float(v)
                curve.add(float(res), value, self._score(value))
        self._curves = curves
