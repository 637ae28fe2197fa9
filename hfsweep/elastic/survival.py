"""How long an array is expected to train on, given the trial scheduler's rungs: the end
estimate the elastic allocator decides with when the pruner is known.

Under successive halving (ASHA, asynchronous Hyperband) a member goes past a rung only if it
is in the top ``1 / reduction_factor`` of the values recorded there, so most members of an array
stop at its next rung, and an array's remaining budget (``remaining_s``) overstates how long it
will train. :class:`RungSurvival` is the simple model: a member survives each rung it has yet
to reach with probability ``1 / reduction_factor``, independently of the others and of its
metric so far (a member that has already passed a rung counts as any other). Then, ``t`` budget
units from now, member ``i`` (at ``done_i`` units) is still training with probability

    alive_i(t) = eta ** -(rungs r with done_i < r <= done_i + t),   0 once done_i + t >= budget

and

- its expected remaining units are ``integral alive_i(t) dt`` (what the allocator's
  member-seconds objective weighs: :meth:`RungSurvival.member_units`);
- the array's expected remaining units, until its last member stops, are
  ``integral 1 - prod_i (1 - alive_i(t)) dt`` (:meth:`RungSurvival.array_units`; what a
  resize must pay back within, and what the critical path is measured in).

The independence is a simplification: ASHA ranks the members of one array that reach a rung
together against each other, so that at most about ``1/eta`` of them go on, which makes the
array's end a little earlier than modelled. Refills are not in it: a member that replaces a
stopped one is new work, seen when it arrives. With several brackets (a member's bracket is
not known before its first report), the expectation is the brackets' mean, weighted by their
shares of the trials.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import pairwise

__all__ = ["RungSurvival", "check_rung_sources", "from_scheduler"]

#: rungs at most this close to a member's progress count as reached (the schedulers' rounding)
_EPS = 1e-9


@dataclass(frozen=True)
class RungSurvival:
    """The trial scheduler's rung structure: ``brackets`` (each a tuple of rungs in budget
    units, below ``budget``) with their ``shares`` of the trials, and ``reduction_factor`` (the
    top ``1/reduction_factor`` of a rung go on). See the module docstring for the model."""

    brackets: tuple[tuple[float, ...], ...]
    reduction_factor: float
    budget: float
    shares: tuple[float, ...] = ()

    def __post_init__(self) -> None:
        if not (self.reduction_factor > 1 and math.isfinite(self.reduction_factor)):
            raise ValueError(f"reduction_factor must be > 1, got {self.reduction_factor!r}")
        if not (self.budget > 0 and math.isfinite(self.budget)):
            raise ValueError(f"budget must be > 0, got {self.budget!r}")
        if not self.brackets:
            raise ValueError("at least one bracket of rungs is needed")
        if self.shares and len(self.shares) != len(self.brackets):
            raise ValueError(
                f"{len(self.shares)} shares for {len(self.brackets)} brackets; give one each"
            )
        if self.shares and not all(s > 0 for s in self.shares):
            raise ValueError(f"bracket shares must be > 0, got {self.shares}")

    @property
    def rungs(self) -> tuple[float, ...]:
        """Every rung of every bracket below the budget, in budget units, sorted: where the
        scheduler may stop a member whose bracket is not known (before its first report, any
        bracket's earliest rung counts). The elastic policy's horizons come from these, so that
        the horizon and the expected end read one rung model."""
        return tuple(sorted({float(r) for b in self.brackets for r in b if r < self.budget - _EPS}))

    def _weights(self) -> list[float]:
        shares = self.shares or (1.0,) * len(self.brackets)
        total = float(sum(shares))
        return [s / total for s in shares]

    def _pieces(self, done: float, rungs: Sequence[float]) -> list[tuple[float, float]]:
        """``[(until, alive)]``: one member at ``done`` units is alive with probability ``alive``
        from the previous piece's ``until`` to this one's (units from now), 0 after the last."""
        left = self.budget - done
        if left <= _EPS:
            return []
        out = []
        alive = 1.0
        for r in sorted(rungs):
            if done + _EPS < r < self.budget - _EPS:
                out.append((r - done, alive))
                alive /= self.reduction_factor
        out.append((left, alive))
        return out

    def member_units(self, done: float) -> float:
        """Expected budget units a member at ``done`` still trains (see the module docstring)."""
        total = 0.0
        for w, rungs in zip(self._weights(), self.brackets, strict=True):
            start = 0.0
            for until, alive in self._pieces(done, rungs):
                total += w * (until - start) * alive
                start = until
        return total

    def array_units(self, dones: Sequence[float]) -> float:
        """Expected budget units until the last of an array's members (at ``dones`` units each)
        stops: the integral of the probability that any is still training."""
        if not dones:
            return 0.0
        total = 0.0
        for w, rungs in zip(self._weights(), self.brackets, strict=True):
            pieces = [self._pieces(d, rungs) for d in dones]
            cuts = sorted({0.0, *(u for p in pieces for u, _ in p)})
            for a, b in pairwise(cuts):
                mid = (a + b) / 2
                gone = 1.0
                for p in pieces:
                    gone *= 1.0 - next((alive for until, alive in p if mid < until), 0.0)
                total += w * (b - a) * (1.0 - gone)
        return total

    def describe(self) -> str:
        """``rungs at 1, 3, 9 of 27 (reduction factor 3)`` for the log."""
        return (
            f"rungs at {', '.join(f'{r:g}' for r in self.rungs)} of {self.budget:g} "
            f"(reduction factor {self.reduction_factor:g}, {len(self.brackets)} bracket(s); "
            f"a member survives each rung ahead with probability 1/{self.reduction_factor:g})"
        )


def from_scheduler(scheduler: object, budget: float) -> RungSurvival | None:
    """The rung model of ``scheduler`` when it is successive halving (hfsweep's ASHA or
    asynchronous Hyperband: their rungs per bracket, shares and reduction factor); ``None``
    for the others (FIFO, median stopping, Optuna pruners: no rungs known in advance), which
    leaves the allocator's estimate as before (the remaining budget)."""
    from ..schedulers import ASHAScheduler

    if not isinstance(scheduler, ASHAScheduler):
        return None
    brackets = tuple(tuple(scheduler.rung_resources(b)) for b in range(scheduler.n_brackets))
    shares = tuple(float(s) for s in getattr(scheduler, "bracket_shares", ()))
    if not any(brackets):
        return None
    return RungSurvival(brackets, float(scheduler.reduction_factor), float(budget), shares)


def check_rung_sources(pruner: RungSurvival, rungs: Sequence[float], budget: float) -> None:
    """Refuse a rung model that disagrees with the ``rungs`` or ``budget`` given beside it
    (see :class:`ElasticPolicy`): the error names both values and what would be valid."""
    if pruner.budget != budget:
        raise ValueError(
            f"ElasticPolicy: the pruner's budget is {pruner.budget:g} but the policy's budget is "
            f"{budget:g}; build the pruner (RungSurvival, from_scheduler) with the policy's "
            "budget (budget.max_resource)"
        )
    given = tuple(r for r in sorted({float(r) for r in rungs}) if r < budget)
    if given and given != pruner.rungs:
        raise ValueError(
            f"ElasticPolicy: rungs={list(given)} disagree with the pruner's rungs "
            f"{list(pruner.rungs)} ({pruner.describe()}); give the pruner alone (its rungs are "
            "the horizon's), or rungs equal to its rungs"
        )
