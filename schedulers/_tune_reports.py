"""The Tune plugin's handling of array reports: per-member decisions, telling each member once,
refill, and the end of an array (a part of :class:`~._tune_state.SweepState`, see there).

Every report of an array trainable (one JSON payload under :data:`META`) is checked, then each
evaluated member is decided on jointly with its array-mates (through a
:class:`~._tune_joint.Decider`); a replayed evaluation after a retry or restore gets the decision
logged the first time in the sweep core's ledger (:meth:`hfsweep.core.ledger.Ledger.log`,
:meth:`~hfsweep.core.ledger.Ledger.logged`). A member ends once, recorded in the ledger
(:meth:`~hfsweep.core.ledger.Ledger.end`) by the core's rule
(:meth:`hfsweep.core.status.Status.settle`), and is told to the inner searcher in Tune's terms. Freed slots are refilled by the core's packer
(:meth:`hfsweep.core.packer.Packer.refill`, :meth:`~hfsweep.core.packer.Packer.requeue`).

This module imports neither Ray nor Optuna.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Mapping
from typing import Any

from hfsweep._checks import is_finite
from hfsweep.core.ledger import Ledger
from hfsweep.core.packer import Packer
from hfsweep.core.status import Status

from ._tune_joint import Decider, MemberController, MemberTrial
from ._tune_records import META, ArrayRecord, MemberRecord

__all__ = ["Reports"]

_log = logging.getLogger("hfsweep.tune")


class Reports:
    """The report-handling part of :class:`~._tune_state.SweepState` (which sets these
    attributes): the sweep's members and arrays, its packer, ledger (decision log and ends) and
    inner searcher and scheduler, the metric, and ``post`` (the hub's answer to a trainable)."""

    members: dict[str, MemberRecord]
    arrays: dict[str, ArrayRecord]
    packer: Packer[str]
    ledger: Ledger
    decider: Decider
    searcher: Any
    metric: str | None
    mode: str | None
    refill: bool
    post: Callable[[str, dict[str, Any]], None] | None
    _trials: dict[str, MemberTrial]

    def _require_metric(self) -> str:
        if self.metric is None or self.mode is None:
            raise ValueError(
                f"the fused sweep has metric={self.metric!r}, mode={self.mode!r}: set both in "
                "tune.TuneConfig(metric=..., mode=...) (or on the inner searcher)"
            )
        return self.metric

    # ------------------------------------------------------------------ array reports
    def on_result(self, trial_id: str, result: Mapping[str, Any]) -> bool:
        """Process one report of array ``trial_id`` (decide, tell, refill, answer the
        trainable) unless it was processed already; returns whether the array has a member
        left to train."""
        array = self.arrays.get(trial_id)
        payload = _payload(result)
        if array is None:
            # e.g. Tuner.restore(restart_errored=True) restarts an errored array under a new
            # trial id: its members were told already, so it is stopped untrained
            _log.warning(
                "Tune trial %s reported, but this fused sweep never packed it (a restarted "
                "trial?); it is stopped and nothing is told",
                trial_id,
            )
            self._stop_all(payload)
            return False
        if array.done:
            # Tuner.restore(resume_errored=True) resumes an array that failed for good under
            # its own id: its members were told (FAIL) when it failed, so whatever it reports
            # (replays included) is answered "stop", no member joins it and nothing is told
            if payload is not None and payload.get("token") != array.last_token:
                _log.warning(
                    "array %s reported after it had ended (Tuner.restore(resume_errored=True)?); "
                    "its members were told already, it is stopped",
                    trial_id,
                )
                array.last_token = str(payload["token"])
                self._stop_all(payload)
            return False
        if payload is None or payload.get("token") == array.last_token:
            return self._alive(array)
        self._process(array, payload)
        array.last_token = str(payload["token"])
        return self._alive(array)

    def ends_by_itself(self, trial_id: str, result: Mapping[str, Any]) -> bool:
        """Whether array ``trial_id``'s trainable ends on its own after ``result``, so Tune
        must not stop it: a regular report of an array this sweep trains, whose answer ended
        its last members. The trainable then sends its last report, whose checkpoint holds the
        weights of the members that completed at this one (stopping the trial would lose
        them)."""
        array = self.arrays.get(trial_id)
        payload = _payload(result)
        return (
            array is not None
            and not array.done
            and payload is not None
            and not payload.get("final")
        )

    def _stop_all(self, payload: Mapping[str, Any] | None) -> None:
        """Answer a report of an array this sweep no longer trains: every evaluated member
        stops, nobody joins. A final report (the trainable's last word) waits for no answer."""
        if payload is None or payload.get("final") or self.post is None:
            return
        go = {str(e["member"]): False for e in payload.get("evaluations", [])}
        self.post(str(payload["token"]), {"go": go, "given": []})

    def _check(self, array: ArrayRecord, payload: Mapping[str, Any]) -> None:
        """Refuse a report naming members not in ``array`` or lacking the metric, before
        anything is recorded."""
        for ev in payload.get("evaluations", []):
            rec = self._member(array, ev["member"])
            metric = self._require_metric()
            if metric not in ev["metrics"]:
                raise ValueError(
                    f"the fused sweep's metric {metric!r} is not among the metrics member "
                    f"{rec.id} reports: {sorted(ev['metrics'])}; set tune.TuneConfig(metric=...) "
                    "to one of them"
                )
        for mid in [e["member"] for e in payload.get("ended", [])] + list(
            payload.get("unused", [])
        ):
            self._member(array, mid)

    def _process(self, array: ArrayRecord, payload: Mapping[str, Any]) -> None:
        self._check(array, payload)
        if payload.get("resumed"):
            array.resumes += 1
        go: dict[str, bool] = {}
        fresh: list[tuple[MemberRecord, dict[str, Any], bool]] = []
        elapsed = float(payload.get("elapsed", 0.0))
        for ev in payload.get("evaluations", []):
            rec = self.members[ev["member"]]
            logged = self.ledger.logged(rec.id, int(ev["step"]))
            reported = float(ev.get("time", elapsed))
            if logged is not None:
                go[rec.id] = logged  # a replay after a resume: the decision already taken
                array.replayed += 1
                # the resumed array's clock went on from its checkpoint's time, which may be
                # behind the time this evaluation had: shift the member's later evaluations so
                # that its clock goes on from the evaluation's recorded time, never back
                first = next((h for h in rec.history if h["step"] == int(ev["step"])), None)
                if first is not None:
                    rec.clock_shift = float(first["time_total_s"]) - reported
                continue
            if rec.told:
                go[rec.id] = False
                continue
            metrics = dict(ev["metrics"])
            # the member's own training time since it joined its array (kept through the
            # array's checkpoints), never the array's: a member that joined late gets its
            # grace period, and a resumed array does not restart its members' clocks
            before = float(rec.history[-1].get("time_total_s", 0.0)) if rec.history else 0.0
            # never back, also where no replay set the shift (a member the replayed report did
            # not evaluate, or a restore whose decision log is older than the array's checkpoint)
            own = max(reported + rec.clock_shift, before)
            row = {
                "training_iteration": len(rec.history) + 1,
                "step": int(ev["step"]),
                "epoch": float(ev["epoch"]),
                **metrics,
                "time_total_s": own,
            }
            rec.history.append(row)
            result = {
                **row,
                "time_this_iter_s": max(own - before, 0.0),
                "trial_id": rec.id,
                "done": bool(ev["final"]),
                "hfsweep_array": array.id,
            }
            fresh.append((rec, result, bool(ev["final"])))

        diverged = [f for f in fresh if not _finite(f[1].get("train_loss"), f[1].get("val_loss"))]
        judged = [f for f in fresh if f not in diverged]
        metric = self._require_metric() if fresh else ""
        decided = self.decider.decide(
            self._controller(), [(self._trial(rec), result) for rec, result, _ in judged], metric
        )
        for rec, result, final in judged:
            if _finite(result[metric]):
                self.searcher.on_trial_result(rec.id, dict(result))
            keep = final or decided.get(rec.id, True)
            self.ledger.log(rec.id, result["step"], keep)
            go[rec.id] = keep
        for rec, result, _ in diverged:
            self.ledger.log(rec.id, result["step"], False)
            go[rec.id] = False
            self._end(rec, Status.FAILED, None, error="non-finite loss")
        for rec, result, final in judged:
            if final:
                self._end(rec, Status.COMPLETED, result)
            elif not go[rec.id]:
                at_budget = self.decider.at_budget(result)
                self._end(rec, Status.COMPLETED if at_budget else Status.STOPPED, result)

        for end in payload.get("ended", []):  # ends the trainer saw (e.g. non-finite gradients)
            rec = self._member(array, end["member"])
            if not rec.told:
                status = _status(end["status"])
                last = self._last_result(rec, array)
                if last is None or not _finite(last.get(str(self.metric))):
                    status = Status.FAILED
                failed = status is Status.FAILED
                self._end(rec, status, None if failed else last, error=end.get("error"))
        for mid in payload.get("unused", []):  # refill members the array never started
            self._return(array, self._member(array, mid))

        if payload.get("final"):
            return
        consumed = int(payload.get("consumed", 0))
        if self.refill and consumed == len(array.given) and not payload.get("queued"):
            self._give(array)
        if self.post is not None:
            given = [{"id": m, "config": self.members[m].config} for m in array.given[consumed:]]
            # members stopped now but told COMPLETED (the scheduler's budget, e.g. ASHA's
            # max_t): the trainable keeps their weights as it keeps those of members it completed
            done = Status.COMPLETED
            complete = [m for m, g in go.items() if not g and self.members[m].status is done]
            self.post(str(payload["token"]), {"go": go, "given": given, "complete": complete})

    def _member(self, array: ArrayRecord, member_id: str) -> MemberRecord:
        rec = self.members.get(member_id)
        if rec is None or rec.array != array.id:
            raise RuntimeError(
                f"array {array.id} reported member {member_id!r}, which this fused sweep did not "
                f"put in it (members: {array.all_members()})"
            )
        return rec

    def _controller(self) -> MemberController:
        """The controller a Tune scheduler sees: the running members are its live trials."""
        return MemberController(
            [self._trial(r) for r in self.members.values() if r.status is Status.RUNNING]
        )

    def _trial(self, rec: MemberRecord) -> MemberTrial:
        trial = self._trials.get(rec.id)
        if trial is None:
            trial = self._trials[rec.id] = MemberTrial(rec.id, rec.config)
        return trial

    def _last_result(self, rec: MemberRecord, array: ArrayRecord) -> dict[str, Any] | None:
        if not rec.history:
            return None
        return {**rec.history[-1], "trial_id": rec.id, "hfsweep_array": array.id}

    def _alive(self, array: ArrayRecord) -> bool:
        return not array.done and any(not self.members[m].told for m in array.all_members())

    # ------------------------------------------------------------------ telling
    def _end(
        self,
        rec: MemberRecord,
        status: Status,
        result: Mapping[str, Any] | None,
        *,
        error: str | None = None,
    ) -> None:
        """Record how ``rec`` ended (in the ledger, which holds it once, and in its record) and
        tell the scheduler and the inner searcher, once.

        ``COMPLETED``: ``on_trial_complete(id, result)``; a non-finite metric makes it
        ``FAILED``. ``STOPPED``: ``on_trial_complete(id, result without the metric)``, which
        OptunaSearch records as pruned (its intermediate values stay). ``FAILED``:
        ``on_trial_complete(id, None, error=True)``.
        """
        assert status.final and not rec.told, (rec.id, status)
        metric = self._require_metric()
        value = rec.history[-1].get(metric) if rec.history else None
        status, why = status.settle(value, metric)
        if not self.ledger.end(rec.id, status):
            raise AssertionError(f"member {rec.id} ended twice: the ledger holds its end")
        rec.status, rec.error = status, error or why
        rec.value = float(value) if is_finite(value) else None
        self.decider.end(
            self._controller(), self._trial(rec), status, dict(result) if result else None
        )
        if status is Status.COMPLETED:
            assert result is not None
            self.searcher.on_trial_complete(rec.id, dict(result))
        elif status is Status.STOPPED:
            told = {k: v for k, v in (result or {}).items() if k != metric}
            told.update(hfsweep_status=status.value, hfsweep_last_value=rec.value)
            self.searcher.on_trial_complete(rec.id, told)
        else:
            self.searcher.on_trial_complete(rec.id, None, error=True)
        _log.info("member %s %s (%s=%s)", rec.id, status, self.metric, rec.value)

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
            _log.info("member %s joins array %s", mid, array.id)

    def _return(self, array: ArrayRecord, rec: MemberRecord) -> None:
        """``rec`` never started in ``array``: it waits for another array of its key."""
        if rec.told or rec.history:
            return
        rec.array, rec.status = None, Status.WAITING
        array.returned.append(rec.id)
        self.packer.requeue(rec.key, rec.id)

    # ------------------------------------------------------------------ end of an array
    def on_complete(
        self, trial_id: str, result: Mapping[str, Any] | None, error: bool = False
    ) -> None:
        """Tune ended array trial ``trial_id`` for good (``error``: it failed past its
        retries). Its last report is processed if no wrapper saw it; members still untold
        end now: ``FAILED`` after an error, ``STOPPED`` if they were evaluated (the array was
        stopped, e.g. by a Tune stopper), and members that never trained go back to a pool."""
        array = self.arrays.get(trial_id)
        if array is None or array.done:
            return
        if result and not error:
            payload = _payload(result)
            if payload is not None and payload.get("token") != array.last_token:
                self._process(array, {**payload, "final": True})
                array.last_token = str(payload["token"])
        for mid in array.all_members():
            rec = self.members[mid]
            if rec.told:
                continue
            if error:
                self._end(rec, Status.FAILED, None, error=f"array trial {trial_id} failed")
            elif rec.history:
                self._end(rec, Status.STOPPED, self._last_result(rec, array))
            else:
                self._return(array, rec)
        array.done = True


def _payload(result: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """hfsweep's part of an array's Tune result (a JSON string under :data:`META`)."""
    if not result or META not in result:
        return None
    raw = result[META]
    data = json.loads(raw) if isinstance(raw, str) else raw
    return dict(data) if isinstance(data, Mapping) else None


def _status(status: Any) -> Status:
    """The status of a trainer's end (``FAILED`` for one it does not know)."""
    try:
        return Status.parse(str(status))
    except ValueError:
        return Status.FAILED


def _finite(*values: Any) -> bool:
    return all(is_finite(v) for v in values)
