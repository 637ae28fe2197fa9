"""An array's evaluations at one step turned into decisions and ends: the one rule every front
door applies (``hfsweep run``'s executor hooks, :mod:`hfsweep.core._hooks`, and the Tune
plugin's :class:`~hfsweep.core.sweep.Sweep`).

:func:`judge` takes the evaluations an array reported together (:class:`Evaluated`) and:

1. refuses the whole report, before anything is recorded, if an evaluation lacks the sweep's
   metric (:class:`MissingMetricError`);
2. answers an evaluation whose decision the ledger logged (a replay: an array that resumed from
   a checkpoint reports it again) with that decision, and one of a member that ended elsewhere
   (in the ledger, or as the front door says: told already, adopted by another driver) with
   "stop"; neither reaches the scheduler or the searcher again;
3. lets the front door record each fresh evaluation (:meth:`FrontDoor.record`: the study's
   intermediate value, the member's history row) before any decision;
4. fails a member whose training or validation loss is not finite, unjudged (no scheduler ranks
   a diverged value, as the trainer ends it ``failed``), and has the front door's scheduler
   decide on the others jointly (:meth:`FrontDoor.decide`); a member at its budget
   (``final``) goes on by the rule whatever the scheduler says;
5. logs every decision in the ledger (:meth:`~hfsweep.core.ledger.Ledger.log`, unless the
   scheduler logged it as it decided: :meth:`~hfsweep.core.ledger.Ledger.decide`), ends every
   member that ends now by :meth:`~hfsweep.core.ledger.Ledger.settle` (``FAILED`` for a
   non-finite loss; ``COMPLETED`` at its budget, or when the scheduler stopped it at the
   scheduler's own budget; else ``STOPPED``) and saves the ledger if it has a file;
6. only then tells the searcher (:meth:`FrontDoor.hear`: the judged evaluations whose metric
   is a finite number) and the front door of each end (:meth:`FrontDoor.ended`), so that an
   error or a kill in a searcher cannot leave it ahead of the decision log.

What differs per front door is behind :class:`FrontDoor`: where member facts live (the Optuna
study ``hfsweep run`` owns, or the core's :class:`~hfsweep.core.members.MemberRecord`), which
scheduler decides (:meth:`Ledger.decide <hfsweep.core.ledger.Ledger.decide>`, or a Tune
scheduler through the plugin's ``Decider``) and how a searcher is told (``Study.tell`` and a
custom searcher's ``report``, or a Tune searcher's ``on_trial_result``/``on_trial_complete``).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from .._checks import is_finite
from .ledger import Ledger
from .result import SweepError
from .status import Status

__all__ = [
    "Evaluated",
    "FrontDoor",
    "Judgement",
    "MissingMetricError",
    "check_metric",
    "judge",
    "trainer_status",
]

#: the losses whose non-finite value fails a member (the trainer reports both at an evaluation)
_LOSSES = ("train_loss", "val_loss")


class MissingMetricError(SweepError, ValueError):
    """An array's evaluation lacks the sweep's metric: no scheduler or searcher can use it.

    A :class:`~hfsweep.core.result.SweepError` (``hfsweep run`` stops with it) and a
    ``ValueError`` (what the Tune plugin raised for it before the one rule)."""


@dataclass
class Evaluated:
    """One member's evaluation as :func:`judge` takes it, whatever the front door: the member,
    its trainer step, epoch (fractional with ``eval_every``), metrics, and whether the member
    reached its budget with it (``final``). ``seen`` is what the front door made of it
    (:meth:`FrontDoor.record`'s return)."""

    member: str
    step: int
    epoch: float
    metrics: Mapping[str, Any]
    final: bool = False
    seen: Any = field(default=None, compare=False)

    def value(self, metric: str) -> Any:
        """The evaluation's ``metric`` (checked present by :func:`check_metric`)."""
        return self.metrics[metric]

    @property
    def diverged(self) -> bool:
        """Whether a loss it reports is not a finite number (the member failed)."""
        return not all(is_finite(self.metrics.get(k)) for k in _LOSSES)


@dataclass
class Judgement:
    """What :func:`judge` made of one report: the answer per evaluated member (go on?), the
    fresh evaluations (recorded, in order), the replayed ones, and the ends with their settled
    status and why."""

    go: dict[str, bool] = field(default_factory=dict)
    fresh: list[Evaluated] = field(default_factory=list)
    replayed: list[Evaluated] = field(default_factory=list)
    ends: list[tuple[Evaluated, Status, str | None]] = field(default_factory=list)


class FrontDoor(Protocol):
    """What :func:`judge` asks of a front door (see the module docstring)."""

    def gone(self, member: str) -> bool:
        """Whether ``member`` ended outside this report's reach (told already, adopted by
        another driver): its evaluation is answered "stop" and nothing else."""
        ...

    def replayed(self, evaluation: Evaluated, go: bool) -> None:
        """``evaluation`` was seen before and is answered ``go`` (the logged decision)."""
        ...

    def record(self, evaluation: Evaluated) -> Any:
        """Record a fresh ``evaluation`` where the front door keeps member facts; returns what
        its scheduler and searcher see of it (kept in :attr:`Evaluated.seen`)."""
        ...

    def decide(self, judged: list[Evaluated]) -> dict[str, bool]:
        """The front door's scheduler on ``judged`` jointly: member -> go on (a member it does
        not name goes on). It may log the decisions in the ledger as it takes them."""
        ...

    def at_budget(self, evaluation: Evaluated) -> bool:
        """Whether a member the scheduler stopped at ``evaluation`` reached the scheduler's
        budget (it is then ``COMPLETED``, not ``STOPPED``)."""
        ...

    def hear(self, evaluation: Evaluated, searcher: bool) -> None:
        """A fresh ``evaluation``, after the decisions are saved; ``searcher``: whether the
        searcher hears it (a judged one with a finite metric)."""
        ...

    def ended(self, evaluation: Evaluated, status: Status, error: str | None) -> None:
        """The member of ``evaluation`` ended with ``status`` (settled and recorded in the
        ledger already) and why (``error``)."""
        ...


def check_metric(evaluations: Iterable[Evaluated], metric: str, hint: str) -> None:
    """Refuse evaluations lacking ``metric``: :class:`MissingMetricError` naming the member and
    the metrics it reports; ``hint`` says how the user sets the metric."""
    for e in evaluations:
        if metric not in e.metrics:
            raise MissingMetricError(
                f"the sweep's metric {metric!r} is not among the metrics member {e.member} "
                f"reports: {sorted(e.metrics)}; {hint} to one of them"
            )


def judge(
    evaluations: Sequence[Evaluated], door: FrontDoor, ledger: Ledger, metric: str, hint: str
) -> Judgement:
    """Apply the one rule to an array's ``evaluations`` (see the module docstring); ``hint``
    says how a user sets ``metric`` (for :class:`MissingMetricError`)."""
    check_metric(evaluations, metric, hint)
    out = Judgement()
    for e in evaluations:
        logged = ledger.logged(e.member, e.step)
        if logged is not None:
            out.go[e.member] = logged
            out.replayed.append(e)
            door.replayed(e, logged)
        elif ledger.status(e.member) is not None or door.gone(e.member):
            out.go[e.member] = False
        else:
            e.seen = door.record(e)
            out.fresh.append(e)
    judged = [e for e in out.fresh if not e.diverged]
    decided = door.decide(judged) if judged else {}
    for e in out.fresh:
        stop = e.diverged or not (e.final or decided.get(e.member, True))
        out.go[e.member] = not stop
        if ledger.logged(e.member, e.step) != (not stop):
            ledger.log(e.member, e.step, not stop)
        if stop or e.final:
            status = _ending(e, door)
            settled = ledger.settle(e.member, status, e.value(metric), metric)
            if settled is not None:
                why = "non-finite loss" if e.diverged else settled[1]
                out.ends.append((e, settled[0], why))
    if out.fresh and ledger.file is not None:
        ledger.save()
    for e in out.fresh:
        door.hear(e, not e.diverged and is_finite(e.value(metric)))
    for e, status, why in out.ends:
        door.ended(e, status, why)
    return out


def trainer_status(word: object, value: object) -> Status:
    """How a member ends by the word its trainer sent outside a report (an end between
    evaluations: non-finite gradients; an end delivered again after a resume), ``value`` its
    last metric: the trainer's status, ``FAILED`` for a word hfsweep does not know, and
    ``FAILED`` for a member that is not ``COMPLETED`` and has no finite value to be ranked by.
    Both front doors record it with :meth:`~hfsweep.core.ledger.Ledger.settle` (which fails a
    ``COMPLETED`` one without a finite value, saying why)."""
    try:
        status = Status.parse(str(word))
    except ValueError:
        return Status.FAILED
    if status is not Status.COMPLETED and not is_finite(value):
        return Status.FAILED
    return status


def _ending(e: Evaluated, door: FrontDoor) -> Status:
    """How a member whose evaluation ``e`` ends it ends, before the ledger settles it."""
    if e.diverged:
        return Status.FAILED
    if e.final or door.at_budget(e):
        return Status.COMPLETED
    return Status.STOPPED
