"""An array's report turned into per-member decisions and ends, refill of its freed slots, and
its end: the part of :class:`~hfsweep.core.member_sweep.MemberSweep` that answers a running
array (see there).

A report is the mapping an array's trainer sends at every evaluation: its ``token`` (a report
seen again is not processed again), the ``evaluations`` (member, step, epoch, metrics, time,
whether it was the member's last), the members whose end the trainer saw (``ended``: e.g.
non-finite gradients), the refill members it never started (``unused``), how many members it
took from the answers so far (``consumed``) and whether some wait in its queue (``queued``),
whether it resumed from a checkpoint (``resumed``) and whether this is its last word
(``final``).

The report's evaluations are processed by the core's one rule,
:func:`hfsweep.core.judging.judge`, exactly as ``hfsweep run``'s executor hooks process theirs:
replays answered from the decision log, the metric check, diverged members failed, the joint
decision by the front door's scheduler, every decision and end recorded in the ledger
(:meth:`hfsweep.core.ledger.Ledger.settle`) before the searcher hears. This class is that
rule's front door for member records (``_RecordsDoor``). A member ends once and is told to the
searcher in the front door's terms. Freed slots are refilled by the core's packer
(:meth:`hfsweep.core.packer.Packer.refill`, :meth:`~hfsweep.core.packer.Packer.requeue`, as
``hfsweep run`` refills and requeues).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Any

from .._checks import is_finite
from . import judging
from .judging import Evaluated
from .ledger import Ledger
from .members import ArrayRecord, MemberRecord
from .packer import Packer
from .status import Status

__all__ = ["ArrayReports"]


class ArrayReports:
    """The report-handling part of :class:`~hfsweep.core.member_sweep.MemberSweep` (which sets
    these attributes): the sweep's members and arrays, its packer and ledger, the metric, and
    ``post`` (how an answer reaches the array's trainer)."""

    log: logging.Logger
    members: dict[str, MemberRecord]
    arrays: dict[str, ArrayRecord]
    packer: Packer[str]
    ledger: Ledger
    metric: str | None
    mode: str | None
    refill: bool
    post: Callable[[str, dict[str, Any]], None] | None
    #: how a user sets the metric and mode, for the error that asks for them
    metric_hint = "set the sweep's metric and mode"

    # ------------------------------------------------------------------ the front door's part
    def _decide(self, fresh: list[tuple[MemberRecord, dict[str, Any]]]) -> dict[str, bool]:
        """The front door's scheduler on an array's fresh evaluations, jointly: member id ->
        go on (a member it does not name goes on)."""
        raise NotImplementedError

    def _at_budget(self, result: Mapping[str, Any]) -> bool:
        """Whether a member the scheduler stopped after ``result`` reached its budget (it is
        then ``COMPLETED``, not ``STOPPED``)."""
        raise NotImplementedError

    def _heard(self, rec: MemberRecord, result: Mapping[str, Any]) -> None:
        """Tell the searcher of ``rec``'s evaluation ``result`` (a finite metric)."""
        raise NotImplementedError

    def _told(self, rec: MemberRecord, status: Status, result: Mapping[str, Any] | None) -> None:
        """Tell the scheduler and the searcher that ``rec`` ended with ``status`` (settled and
        recorded in :attr:`ledger` and the record already); ``result`` its last evaluation."""
        raise NotImplementedError

    def _result(self, rec: MemberRecord, result: dict[str, Any]) -> dict[str, Any]:
        """What the scheduler and searcher see of ``rec``'s evaluation ``result`` (a history
        row, with ``time_this_iter_s`` and ``done`` when it is fresh): the front door adds how
        its API names the member and its array (``rec.array``)."""
        return result

    def _require_metric(self) -> str:
        if self.metric is None or self.mode is None:
            raise ValueError(
                f"the fused sweep has metric={self.metric!r}, mode={self.mode!r}: "
                f"{self.metric_hint}"
            )
        return self.metric

    # ------------------------------------------------------------------ array reports
    def on_report(self, array_id: str, report: Mapping[str, Any] | None) -> bool:
        """Process ``report`` of array ``array_id`` (decide, tell, refill, answer the trainer)
        unless it was processed already; returns whether the array has a member left to
        train. ``None``: a report without the sweep's part (nothing to process)."""
        array = self.arrays.get(array_id)
        if array is None:
            # e.g. Tuner.restore(restart_errored=True) restarts an errored array under a new
            # id: its members were told already, so it is stopped untrained
            self.log.warning(
                "array %s reported, but this fused sweep never packed it (a restarted "
                "trial?); it is stopped and nothing is told",
                array_id,
            )
            self._stop_all(report)
            return False
        if array.done:
            # an array resumed after it failed for good (Tuner.restore(resume_errored=True)):
            # its members were told (FAIL) when it failed, so whatever it reports (replays
            # included) is answered "stop", no member joins it and nothing is told
            if report is not None and report.get("token") != array.last_token:
                self.log.warning(
                    "array %s reported after it had ended (Tuner.restore(resume_errored=True)?); "
                    "its members were told already, it is stopped",
                    array_id,
                )
                array.last_token = str(report["token"])
                self._stop_all(report)
            return False
        if report is None or report.get("token") == array.last_token:
            return self._alive(array)
        self._process(array, report)
        array.last_token = str(report["token"])
        return self._alive(array)

    def ends_by_itself(self, array_id: str, report: Mapping[str, Any] | None) -> bool:
        """Whether array ``array_id``'s trainer ends on its own after ``report``, so it must
        not be stopped from outside: a regular report of an array this sweep trains, whose
        answer ended its last members. The trainer then sends its last report, whose
        checkpoint holds the weights of the members that completed at this one (stopping it
        would lose them)."""
        array = self.arrays.get(array_id)
        return (
            array is not None and not array.done and report is not None and not report.get("final")
        )

    def _stop_all(self, report: Mapping[str, Any] | None) -> None:
        """Answer a report of an array this sweep no longer trains: every evaluated member
        stops, nobody joins. A final report (the trainer's last word) waits for no answer."""
        if report is None or report.get("final") or self.post is None:
            return
        go = {str(e["member"]): False for e in report.get("evaluations", [])}
        self.post(str(report["token"]), {"go": go, "given": []})

    def _check(self, array: ArrayRecord, report: Mapping[str, Any]) -> None:
        """Refuse a report naming members not in ``array`` before anything is recorded (the
        metric is checked by the core's rule, :func:`~hfsweep.core.judging.judge`)."""
        ended = [e["member"] for e in report.get("ended", [])]
        for mid in [e["member"] for e in report.get("evaluations", [])] + ended:
            self._member(array, mid)
        for mid in report.get("unused", []):
            self._member(array, mid)

    def _process(self, array: ArrayRecord, report: Mapping[str, Any]) -> None:
        self._check(array, report)
        if report.get("resumed"):
            array.resumes += 1
        evaluations = [
            Evaluated(
                str(ev["member"]),
                int(ev["step"]),
                float(ev["epoch"]),
                dict(ev["metrics"]),
                bool(ev["final"]),
            )
            for ev in report.get("evaluations", [])
        ]
        metric = self._require_metric() if evaluations else ""
        door = _RecordsDoor(self, array, report)
        go = judging.judge(evaluations, door, self.ledger, metric, self.metric_hint).go
        self._trainer_ends(array, report)
        if report.get("final"):
            return
        consumed = int(report.get("consumed", 0))
        if self.refill and consumed == len(array.given) and not report.get("queued"):
            self._give(array)
        if self.post is not None:
            given = [{"id": m, "config": self.members[m].config} for m in array.given[consumed:]]
            # members stopped now but told COMPLETED (the scheduler's budget, e.g. ASHA's
            # max_t): the trainer keeps their weights as it keeps those of members it completed
            done = Status.COMPLETED
            complete = [m for m, g in go.items() if not g and self.members[m].status is done]
            self.post(str(report["token"]), {"go": go, "given": given, "complete": complete})

    def _trainer_ends(self, array: ArrayRecord, report: Mapping[str, Any]) -> None:
        """The ends the trainer saw (e.g. non-finite gradients), and the refill members it
        never started (back to their pool)."""
        for end in report.get("ended", []):
            rec = self._member(array, end["member"])
            if not rec.told:
                last = self._last_result(rec, array)
                value = None if last is None else last.get(str(self.metric))
                status = judging.trainer_status(end["status"], value)  # as hfsweep run's
                failed = status is Status.FAILED
                self._end(rec, status, None if failed else last, error=end.get("error"))
        for mid in report.get("unused", []):
            self._return(array, self._member(array, mid))

    def _member(self, array: ArrayRecord, member_id: str) -> MemberRecord:
        rec = self.members.get(member_id)
        if rec is None or rec.array != array.id:
            raise RuntimeError(
                f"array {array.id} reported member {member_id!r}, which this fused sweep did not "
                f"put in it (members: {array.all_members()})"
            )
        return rec

    def _last_result(self, rec: MemberRecord, array: ArrayRecord) -> dict[str, Any] | None:
        if not rec.history:
            return None
        return self._result(rec, dict(rec.history[-1]))

    def _alive(self, array: ArrayRecord) -> bool:
        return not array.done and any(not self.members[m].told for m in array.all_members())

    # ------------------------------------------------------------------ ends
    def _end(
        self,
        rec: MemberRecord,
        status: Status,
        result: Mapping[str, Any] | None,
        *,
        error: str | None = None,
    ) -> None:
        """Record how ``rec`` ended (in the ledger, which holds it once, by the core's rule,
        and in its record) and tell the scheduler and the searcher, once."""
        assert status.final and not rec.told, (rec.id, status)
        metric = self._require_metric()
        value = rec.history[-1].get(metric) if rec.history else None
        settled = self.ledger.settle(rec.id, status, value, metric)
        if settled is None:
            raise AssertionError(f"member {rec.id} ended twice: the ledger holds its end")
        self._record_end(rec, settled[0], result, error or settled[1])

    def _record_end(
        self,
        rec: MemberRecord,
        status: Status,
        result: Mapping[str, Any] | None,
        error: str | None,
    ) -> None:
        """``rec`` ended with ``status`` (settled in the ledger already): its record, and the
        scheduler and searcher told."""
        value = rec.history[-1].get(str(self.metric)) if rec.history else None
        rec.status, rec.error = status, error
        rec.value = float(value) if is_finite(value) else None
        self._told(rec, status, result)
        self.log.info("member %s %s (%s=%s)", rec.id, status, self.metric, rec.value)

    # ------------------------------------------------------------------ refill
    def _give(self, array: ArrayRecord) -> None:
        """New members of ``array``'s key for its free slots: from the pool, else asked.
        An array that ended gets none: nothing would train or tell them."""
        if array.done:
            return
        alive = sum(not self.members[m].told for m in array.all_members())
        for mid in self.packer.refill(array.key, array.size - alive, array.id):
            rec = self.members[mid]
            rec.array, rec.status = array.id, Status.RUNNING
            array.given.append(mid)
            self.log.info("member %s joins array %s", mid, array.id)

    def _return(self, array: ArrayRecord, rec: MemberRecord) -> None:
        """``rec`` never started in ``array``: it waits for another array of its key."""
        if rec.told or rec.history:
            return
        rec.array, rec.status = None, Status.WAITING
        array.returned.append(rec.id)
        self.packer.requeue(rec.key, rec.id)

    # ------------------------------------------------------------------ end of an array
    def on_array_end(
        self, array_id: str, report: Mapping[str, Any] | None, error: bool = False
    ) -> None:
        """Array ``array_id`` ended for good (``error``: it failed past its retries), its last
        report ``report``. That report is processed if it was not; members still untold end
        now: ``FAILED`` after an error, ``STOPPED`` if they were evaluated (the array was
        stopped from outside), and members that never trained go back to a pool."""
        array = self.arrays.get(array_id)
        if array is None or array.done:
            return
        if report is not None and not error and report.get("token") != array.last_token:
            self._process(array, {**report, "final": True})
            array.last_token = str(report["token"])
        for mid in array.all_members():
            rec = self.members[mid]
            if rec.told:
                continue
            if error:
                self._end(rec, Status.FAILED, None, error=f"array trial {array_id} failed")
            elif rec.history:
                self._end(rec, Status.STOPPED, self._last_result(rec, array))
            else:
                self._return(array, rec)
        array.done = True


class _RecordsDoor:
    """The front door of :func:`~hfsweep.core.judging.judge` for :class:`ArrayReports`: member
    facts in the :class:`~hfsweep.core.members.MemberRecord`\\ s, decisions by the front door's
    scheduler (``_decide``), the searcher told through ``_heard`` and ``_told``."""

    def __init__(self, sweep: ArrayReports, array: ArrayRecord, report: Mapping[str, Any]) -> None:
        self.sweep = sweep
        self.array = array
        self.elapsed = float(report.get("elapsed", 0.0))
        #: each evaluation's own clock (the member's training time), by member
        self.times = {
            str(ev["member"]): float(ev.get("time", self.elapsed))
            for ev in report.get("evaluations", [])
        }

    def gone(self, member: str) -> bool:
        return self.sweep.members[member].told

    def replayed(self, evaluation: Evaluated, go: bool) -> None:
        rec = self.sweep.members[evaluation.member]
        self.array.replayed += 1
        # the resumed array's clock went on from its checkpoint's time, which may be behind
        # the time this evaluation had: shift the member's later evaluations so that its clock
        # goes on from the evaluation's recorded time, never back
        first = next((h for h in rec.history if h["step"] == evaluation.step), None)
        if first is not None:
            rec.clock_shift = float(first["time_total_s"]) - self.times[rec.id]

    def record(self, evaluation: Evaluated) -> dict[str, Any]:
        """A history row appended to the member's record; returns the result its scheduler and
        searcher see (with ``time_this_iter_s`` and ``done``)."""
        rec = self.sweep.members[evaluation.member]
        # the member's own training time since it joined its array (kept through the array's
        # checkpoints), never the array's: a member that joined late gets its grace period,
        # and a resumed array does not restart its members' clocks
        before = float(rec.history[-1].get("time_total_s", 0.0)) if rec.history else 0.0
        # never back, also where no replay set the shift (a member the replayed report did not
        # evaluate, or a restore whose decision log is older than the array's checkpoint)
        own = max(self.times[rec.id] + rec.clock_shift, before)
        row = {
            "training_iteration": len(rec.history) + 1,
            "step": evaluation.step,
            "epoch": evaluation.epoch,
            **dict(evaluation.metrics),
            "time_total_s": own,
        }
        rec.history.append(row)
        since = max(own - before, 0.0)
        return self.sweep._result(rec, {**row, "time_this_iter_s": since, "done": evaluation.final})

    def decide(self, judged: list[Evaluated]) -> dict[str, bool]:
        return self.sweep._decide([(self.sweep.members[e.member], e.seen) for e in judged])

    def at_budget(self, evaluation: Evaluated) -> bool:
        return self.sweep._at_budget(evaluation.seen)

    def hear(self, evaluation: Evaluated, searcher: bool) -> None:
        if searcher:
            self.sweep._heard(self.sweep.members[evaluation.member], evaluation.seen)

    def ended(self, evaluation: Evaluated, status: Status, error: str | None) -> None:
        rec = self.sweep.members[evaluation.member]
        result = None if status is Status.FAILED and evaluation.diverged else evaluation.seen
        self.sweep._record_end(rec, status, result, error)
