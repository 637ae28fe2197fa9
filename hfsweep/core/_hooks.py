"""The sweep engine's part that its executor calls back while arrays train: joint decisions at
evaluations, a trial's end, refilling a freed slot and taking back a member (see
:mod:`hfsweep.core._parts`).
"""

from __future__ import annotations

import logging
import math
from typing import TYPE_CHECKING

from .._compat import trial_id
from ..schedulers import OptunaPruner, Report
from ..training.trainer import Evaluation, Member, MemberResult
from ._rundir import member_id, trial_number
from .packer import Pending
from .status import Status

if TYPE_CHECKING:
    pass

from ._parts import _Array, _Parts
from .result import SweepError

__all__: list[str] = []

_log = logging.getLogger("hfsweep.sweep")


class _Hooks(_Parts):
    """The executor's hooks: decisions, trial ends, refill and requeue."""

    def _report(self, evaluations: list[Evaluation]) -> dict[str, bool]:
        """Decide for every member evaluated now, jointly; replayed evaluations (after a
        resume) get the decision already taken."""
        answer: dict[str, bool] = {}
        todo: list[tuple[Evaluation, Report]] = []
        steps = 0
        for e in evaluations:
            if trial_number(e.member) not in self.live:  # ended elsewhere: another driver's
                answer[e.member] = False
                continue
            logged = self.ledger.logged(e.member, e.step)
            if logged is not None:
                answer[e.member] = logged
                continue
            if self.sc.metric not in e.metrics:
                raise SweepError(
                    f"the task's evaluation has no metric {self.sc.metric!r}; it reports "
                    f"{sorted(e.metrics)}"
                )
            value = float(e.metrics[self.sc.metric])
            resource = e.epoch if self.sc.budget.resource == "epochs" else float(e.step)
            todo.append((e, Report(e.member, resource, value)))
        if not todo:
            return answer
        if not isinstance(self.scheduler, OptunaPruner):
            for _, r in todo:
                self._report_to_study(r)
        decided = self.ledger.decide([(r, e.step) for e, r in todo])
        for e, r in todo:
            answer[e.member] = decided[r.trial]
            steps += e.step - int(self._last_step.get(e.member, 0))
            self._last_step[e.member] = e.step
        # every decision is saved before the searcher hears of any, so an error or a kill in
        # a custom searcher's report() cannot leave the scheduler ahead of the decision log
        self._save_state()
        for e, _ in todo:  # once: a replayed evaluation (after a resume) is not in todo
            self.tracking.evaluated(trial_number(e.member), e.step, e.epoch, e.metrics)
        for _, r in todo:
            self.source.report(trial_number(r.trial), round(r.resource), r.value)
        self.progress.stepped(steps)
        return answer

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
        # completed trial whose metric is not finite failed); an end told again after a torn
        # journal is in the ledger already
        settled = self.ledger.settle(result.id, result.status, value, self.sc.metric)
        status, why = settled or Status.parse(result.status).settle(value, self.sc.metric)
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
        _log.info(
            "trial %d %s after %d steps: %s=%s",
            number,
            status.value,
            result.steps,
            self.sc.metric,
            value,
        )

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
