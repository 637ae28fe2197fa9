"""The sweep engine's part that its executor calls back while arrays train: joint decisions at
evaluations, a trial's end, refilling a freed slot and taking back a member (see
:mod:`hfsweep.core._parts`).
"""

from __future__ import annotations

import logging
import math
from typing import Any

from .._compat import trial_id
from ..schedulers import OptunaPruner, Report
from ..training.trainer import Evaluation, Member, MemberResult
from . import judging
from ._parts import _Array, _Parts
from ._rundir import member_id, trial_number
from .judging import Evaluated
from .packer import Pending
from .status import Status

__all__: list[str] = []

_log = logging.getLogger("hfsweep.sweep")

#: how a user of ``hfsweep run`` sets the sweep's metric (for the core's missing-metric error)
METRIC_HINT = "set the sweep file's `metric` (val_<name> of a task metric, or val_loss)"


class _Hooks(_Parts):
    """The executor's hooks: decisions, trial ends, refill and requeue."""

    def _report(self, evaluations: list[Evaluation]) -> dict[str, bool]:
        """Decide for every member evaluated now, jointly, by the core's one rule
        (:func:`~hfsweep.core.judging.judge`, as the Tune plugin's reports are decided):
        replayed evaluations (after a resume) get the decision already taken, every decision
        and end is saved before the searcher hears of any."""
        evaluated = [Evaluated(e.member, e.step, e.epoch, e.metrics, e.final) for e in evaluations]
        judged = judging.judge(
            evaluated, _StudyDoor(self), self.ledger, self.sc.metric, METRIC_HINT
        )
        steps = 0
        for e in judged.fresh:
            steps += e.step - int(self._last_step.get(e.member, 0))
            self._last_step[e.member] = e.step
        self.progress.stepped(steps)
        return judged.go

    def _report_to_study(self, r: Report) -> None:
        number = trial_number(r.trial)
        step = math.floor(r.resource + 0.5)
        if self.reported.get(number, -1) >= step:
            return
        self.live[number].report(r.value, step)
        self.reported[number] = step

    def _on_finish(self, result: MemberResult) -> None:
        number = trial_number(result.id)
        trial = self.live.get(number)
        if trial is None or self._lost(number):
            return  # told before a crash (the trainer delivers at least once), or adopted
        value = result.metrics.get(self.sc.metric)
        # ended once in the ledger by the core's rule, as the Tune plugin ends its members (a
        # completed trial whose metric is not finite failed): at its last report, where the
        # rule ended it (the trainer ends it the same way), else now (an end the trainer saw
        # between evaluations); an end told again after a torn journal is in the ledger already
        word = judging.trainer_status(result.status, value)  # as the Tune plugin's trainer ends
        settled = self.ledger.settle(result.id, word, value, self.sc.metric)
        status, why = settled or word.settle(value, self.sc.metric)
        held = self.ledger.status(result.id)
        if settled is None and held is not None and held is not status:
            status, why = held, None  # the ledger's end is the one told
        self.dir.write_history(number, result.history)
        error = why if why is not None else result.error
        trial.set_user_attr("status", status.value)  # settled: a nan metric's trial failed
        trial.set_user_attr("steps", result.steps)
        if result.start_step is not None:  # where in its array's data it started (a refill's)
            trial.set_user_attr("start_step", result.start_step)
        if error is not None:
            trial.set_user_attr("error", error)
        if status is Status.COMPLETED and value is not None and result.state is not None:
            self._keep_checkpoint(number, value, result.state["model"])
        self._save_state()
        if status is Status.COMPLETED:
            self.study.tell(trial, value)
        else:
            self.study.tell(trial, state=status.trial_state())
        # the log's line straight after the study's tell: a SIGKILL between them loses the line
        # (the tell is what is kept), and the less runs in between the rarer that is
        _log.info(
            "trial %d %s after %d steps: %s=%s",
            number,
            status.value,
            result.steps,
            self.sc.metric,
            value,
        )
        told = value if status is not Status.FAILED else None
        self.tracking.trial_ended(
            number, status, told, error, info=lambda: self._trial_info(number)
        )
        self.source.tell(number, self.sampled.pop(number), status.told, told)
        del self.live[number]
        self.reported.pop(number, None)
        self.progress.finished(status)
        if status is Status.COMPLETED and value is not None and self._improves(value, number):
            self.progress.set_best(value, number)
        self._publish()

    def _lost(self, number: int) -> bool:
        """Whether running trial ``number`` was adopted by another driver (this one's
        heartbeat stopped for longer than the grace period): it is forgotten here."""
        assert self.drivers is not None
        if self.drivers.still_owns(trial_id(self.live[number])):
            return False
        _log.warning("trial %d: adopted by another driver while this one trained it", number)
        del self.live[number]
        self.sampled.pop(number, None)
        self.reported.pop(number, None)
        return True

    def _requeue(self, array: _Array, member: Member) -> None:
        """A trial the executor hands back (its array restarted without it): it waits in its
        key's pool again, for a refill or a later array."""
        _log.info("trial %s goes back to the pool of array %d's key", member.id, array.index)
        self.packer.requeue(array.key, Pending(trial_number(member.id), dict(member.config)))

    def _refill(self, array: _Array) -> Member | None:
        """A trial of the array's key for a freed slot: a waiting one, else a new one."""
        taken = self.packer.refill(array.key, 1, str(array.index))
        if not taken:
            return None
        p = taken[0]
        self.live[p.number].set_user_attr("array", array.index)
        self.tracking.trial_started(self._trial_info(p.number, array.index))
        return Member(member_id(p.number), p.config)


class _StudyDoor:
    """The front door of :func:`~hfsweep.core.judging.judge` for ``hfsweep run``: member facts
    in the engine's Optuna study, decisions by :meth:`Ledger.decide
    <hfsweep.core.ledger.Ledger.decide>` (the sweep's trial scheduler, logged as it decides),
    the searcher told through the trial source; a trial's end is told to the study when its
    trainer delivers it (:meth:`_Hooks._on_finish`)."""

    def __init__(self, engine: _Hooks) -> None:
        self.engine = engine

    def gone(self, member: str) -> bool:
        return trial_number(member) not in self.engine.live  # ended elsewhere: another driver's

    def replayed(self, evaluation: Evaluated, go: bool) -> None:
        return None

    def record(self, evaluation: Evaluated) -> Report:
        """The evaluation as the scheduler's report (resource in the budget's unit), its value
        reported to the study as the trial's intermediate value (an OptunaPruner reports it
        itself as it decides)."""
        e, sc = evaluation, self.engine.sc
        resource = e.epoch if sc.budget.resource == "epochs" else float(e.step)
        report = Report(e.member, resource, float(e.value(sc.metric)))
        if not isinstance(self.engine.scheduler, OptunaPruner):
            self.engine._report_to_study(report)
        return report

    def decide(self, judged: list[Evaluated]) -> dict[str, bool]:
        return self.engine.ledger.decide([(e.seen, e.step) for e in judged])

    def at_budget(self, evaluation: Evaluated) -> bool:
        # hfsweep's trial schedulers never stop a trial at its budget: it ends completed
        return False

    def hear(self, evaluation: Evaluated, searcher: bool) -> None:
        e, number = evaluation, trial_number(evaluation.member)
        self.engine.tracking.evaluated(number, e.step, e.epoch, dict(e.metrics))
        if searcher:
            report: Any = e.seen
            self.engine.source.report(number, round(report.resource), report.value)

    def ended(self, evaluation: Evaluated, status: Status, error: str | None) -> None:
        return None  # told when the trainer delivers the end (it ends the member the same way)
