"""Asynchronous successive halving (ASHA) and asynchronous Hyperband, decided jointly per call."""

from __future__ import annotations

import math
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

__all__ = ["ASHAScheduler", "HyperbandScheduler"]


class ASHAScheduler(TrialScheduler):
    """Asynchronous successive halving: stop trials that are not in the top ``1/rf`` of a rung.

    **Rungs.** Bracket ``s`` (``0 <= s < brackets``) has rungs at the resources
    ``grace_period * reduction_factor ** (s + k)``, ``k = 0, 1, ...``, that lie below
    ``max_resource``. With the defaults and ``max_resource=27``: rungs at 1, 3 and 9 epochs.

    **Recording.** When a trial's report reaches a rung of its bracket (``resource >= rung``, up
    to float rounding) that it has not reached before, the report's value is recorded at that
    rung; a report that jumps over several rungs at once is recorded at each of them. Values
    stay recorded when a trial ends, whatever its status.

    **Promotion.** After *all* reports of a :meth:`decide` call are recorded, each trial that
    reached a new rung in this call is promoted (``CONTINUE``) iff its value is at least the
    ``k``-th best value recorded at that rung, with ``k = max(1, floor(n / reduction_factor))``
    and ``n`` the number of values recorded there, this call's included; otherwise it is
    stopped. So a trial goes on when it is within the top ``floor(n/rf)``; ties with the ``k``-th
    best go on too; and while a rung holds fewer than ``rf`` values, only a trial that is at
    least as good as every value recorded there goes on. That is asynchronous SHA's promotion
    rule ("top ``1/rf`` of the rung so far") made to decide at once instead of pausing trials
    (a trial here cannot wait at a rung until enough others arrive): the first trial to reach
    a rung goes on (nobody to compare with yet), and a later one must equal or beat the rung's
    best until the rung holds ``rf`` values. A trial that jumped over several rungs must be
    promoted at each. ``nan`` ranks below every number and is never promoted, not even alone.
    A report at or beyond ``max_resource`` is never stopped, and a report that reaches no new
    rung always goes on.

    Because a call is recorded before it is decided, the members of one array compete with
    each other as a group: three members reaching a rung together with ``rf=3`` promote the
    best one only (a first-come-first-served scheduler would have promoted the first caller
    too), and the result does not depend on the order of the reports.

    **Brackets.** With ``brackets > 1``, each trial is assigned to a bracket when it first
    reports, round-robin in order of first report (trials first seen in the same call: in the
    order of their ids), so the assignment is deterministic and survives a resume.

    Args:
        mode: ``"max"`` or ``"min"``.
        max_resource: a trial's full budget (epochs by default).
        grace_period: the first rung of bracket 0; ``0 < grace_period < max_resource``.
        reduction_factor: ``rf > 1``; the top ``1/rf`` of a rung go on.
        brackets: how many brackets, at most the number of ``s >= 0`` with
            ``grace_period * rf**s <= max_resource`` (a bracket whose first rung would be
            ``max_resource`` itself stops nothing).
    """

    _weights: list[int]
    _rungs: list[tuple[float, ...]]
    _records: list[list[dict[str, float]]]
    _round_robin: list[int]
    _bracket_of: dict[str, int]

    def __init__(
        self,
        *,
        mode: str = "max",
        max_resource: float,
        grace_period: float = 1,
        reduction_factor: float = 3,
        brackets: int = 1,
    ) -> None:
        super().__init__(mode=mode, max_resource=max_resource)
        self._grace = check_positive("grace_period", grace_period)
        self._rf = check_positive("reduction_factor", reduction_factor)
        if self._rf <= 1:
            raise ValueError(f"reduction_factor must be > 1, got {reduction_factor!r}")
        if reached(self._grace, self._max_resource):
            raise ValueError(
                f"grace_period ({grace_period!r}) must be smaller than max_resource "
                f"({max_resource!r}): no rung would lie below the budget, so no trial could stop"
            )
        self._max_brackets = self._count_brackets()
        n = check_int("brackets", brackets, 1)
        if n > self._max_brackets:
            raise ValueError(
                f"brackets must be between 1 and {self._max_brackets} for grace_period="
                f"{grace_period!r}, reduction_factor={reduction_factor!r}, max_resource="
                f"{max_resource!r}, got {brackets!r}"
            )
        self._setup_brackets([1] * n)

    # -- public introspection ---------------------------------------------------------------

    @property
    def grace_period(self) -> float:
        """The first rung of bracket 0."""
        return self._grace

    @property
    def reduction_factor(self) -> float:
        """The top ``1/reduction_factor`` of a rung are promoted."""
        return self._rf

    @property
    def n_brackets(self) -> int:
        """How many brackets trials are dealt to."""
        return len(self._rungs)

    def rung_resources(self, bracket: int = 0) -> tuple[float, ...]:
        """The resources of the rungs of ``bracket`` (possibly none for the last Hyperband one)."""
        return self._rungs[bracket]

    def bracket_of(self, trial: str) -> int | None:
        """The bracket ``trial`` was assigned to, or ``None`` before its first report."""
        return self._bracket_of.get(trial)

    def rung_records(self, bracket: int = 0) -> list[dict[str, float]]:
        """For each rung of ``bracket``, the values recorded there by trial id (copies)."""
        return [dict(r) for r in self._records[bracket]]

    # -- the decision -----------------------------------------------------------------------

    def decide(self, reports: Sequence[Report]) -> dict[str, Decision]:
        """Record every report at the rungs it newly reaches, then promote or stop each trial."""
        reports = self._check_reports(reports)
        for trial in sorted({r.trial for r in reports} - self._bracket_of.keys()):
            self._bracket_of[trial] = self._next_bracket()

        crossed: dict[str, list[int]] = {}
        for r in reports:
            bracket = self._bracket_of[r.trial]
            records = self._records[bracket]
            new = [
                k
                for k, rung in enumerate(self._rungs[bracket])
                if reached(r.resource, rung) and r.trial not in records[k]
            ]
            for k in new:
                records[k][r.trial] = r.value
            crossed[r.trial] = new

        cutoffs: dict[tuple[int, int], float] = {}
        decisions: dict[str, Decision] = {}
        for r in reports:
            bracket = self._bracket_of[r.trial]
            go = True
            if not self._at_budget(r.resource):
                for k in crossed[r.trial]:
                    if (bracket, k) not in cutoffs:
                        cutoffs[bracket, k] = self._cutoff(self._records[bracket][k])
                    if math.isnan(r.value) or self._score(r.value) < cutoffs[bracket, k]:
                        go = False
            decisions[r.trial] = Decision.CONTINUE if go else Decision.STOP
        return decisions

    def _cutoff(self, record: Mapping[str, float]) -> float:
        """The score a trial needs at a rung holding ``record`` to be promoted."""
        scores = sorted((self._score(v) for v in record.values()), reverse=True)
        k = max(1, math.floor(len(scores) / self._rf + RESOURCE_RTOL))
        return scores[k - 1]

    # -- state ------------------------------------------------------------------------------

    def _config(self) -> dict[str, Any]:
        return {
            **super()._config(),
            "grace_period": self._grace,
            "reduction_factor": self._rf,
            "brackets": self.n_brackets,
        }

    def state_dict(self) -> dict[str, Any]:
        """Config, ended trials, bracket assignment and every rung's recorded values."""
        state = super().state_dict()
        state["bracket_of"] = dict(self._bracket_of)
        state["round_robin"] = list(self._round_robin)
        state["records"] = [
            [{t: encode_float(v) for t, v in rung.items()} for rung in bracket]
            for bracket in self._records
        ]
        return state

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore a :meth:`state_dict` of a scheduler built with the same arguments."""
        super().load_state_dict(state)
        records = [
            [{str(t): decode_float(v) for t, v in rung.items()} for rung in bracket]
            for bracket in state["records"]
        ]
        if [len(b) for b in records] != [len(r) for r in self._rungs]:
            raise ValueError("state's rungs do not match this scheduler's rungs")
        round_robin = [int(x) for x in state["round_robin"]]
        if len(round_robin) != self.n_brackets:
            raise ValueError("state's bracket counters do not match this scheduler's brackets")
        self._records = records
        self._round_robin = round_robin
        self._bracket_of = {str(t): int(b) for t, b in state["bracket_of"].items()}

    # -- brackets ---------------------------------------------------------------------------

    def _count_brackets(self) -> int:
        """The number of ``s >= 0`` with ``grace_period * rf**s <= max_resource``."""
        s = 0
        while self._grace * self._rf ** (s + 1) <= self._max_resource * (1 + RESOURCE_RTOL):
            s += 1
        return s + 1

    def _setup_brackets(self, weights: list[int]) -> None:
        """Brackets ``0..len(weights)-1``; trials are dealt to them in proportion to weights."""
        self._weights = weights
        self._rungs = []
        for s in range(len(weights)):
            rungs: list[float] = []
            k = s
            while not reached(self._grace * self._rf**k, self._max_resource):
                rungs.append(self._grace * self._rf**k)
                k += 1
            self._rungs.append(tuple(rungs))
        self._records = [[{} for _ in r] for r in self._rungs]
        self._round_robin = [0] * len(weights)
        self._bracket_of = {}

    def _next_bracket(self) -> int:
        """Smooth weighted round-robin: deterministic, interleaved, exact proportions."""
        total = sum(self._weights)
        for i, w in enumerate(self._weights):
            self._round_robin[i] += w
        best = max(range(len(self._weights)), key=lambda i: (self._round_robin[i], -i))
        self._round_robin[best] -= total
        return best


class HyperbandScheduler(ASHAScheduler):
    """Asynchronous Hyperband: ASHA in every bracket, trials dealt in Hyperband's proportions.

    Brackets ``s = 0 .. s_max`` with ``s_max = floor(log_rf(max_resource / grace_period))``:
    bracket ``s`` is an :class:`ASHAScheduler` bracket whose first rung is
    ``grace_period * rf**s`` (bracket 0 stops most aggressively; the last one has at most one
    rung, and none when ``grace_period * rf**s_max == max_resource``: its trials train to the
    full budget, Hyperband's plain random-search bracket). As in Hyperband, aggressive brackets
    get more trials: bracket ``s`` gets a share proportional to
    ``ceil((s_max + 1) * rf**(s_max - s) / (s_max - s + 1))``, the number of configurations
    synchronous Hyperband starts in it. Trials are assigned when they first report, by smooth
    weighted round-robin over those shares (deterministic and interleaved: with ``rf=3``,
    ``max_resource=9`` the shares are 9:5:3 and the first trials go to brackets
    0, 1, 0, 2, 0, 1, 0, ...). Promotion inside a bracket is ASHA's, decided jointly per call.

    Args:
        mode: ``"max"`` or ``"min"``.
        max_resource: a trial's full budget (epochs by default).
        grace_period: the smallest first rung (bracket 0's); ``0 < grace_period < max_resource``.
        reduction_factor: ``rf > 1``.
    """

    def __init__(
        self,
        *,
        mode: str = "max",
        max_resource: float,
        grace_period: float = 1,
        reduction_factor: float = 3,
    ) -> None:
        super().__init__(
            mode=mode,
            max_resource=max_resource,
            grace_period=grace_period,
            reduction_factor=reduction_factor,
        )
        n = self._max_brackets
        shares = [
            math.ceil(n * self._rf ** (n - 1 - s) / (n - s) - RESOURCE_RTOL) for s in range(n)
        ]
        self._setup_brackets(shares)

    @property
    def bracket_shares(self) -> tuple[int, ...]:
        """Each bracket's share of the trials."""
        return tuple(self._weights)

    def _config(self) -> dict[str, Any]:
        config = super()._config()
        del config["brackets"]
        return config
