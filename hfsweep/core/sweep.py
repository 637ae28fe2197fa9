"""The one sweep: members asked and packed into arrays, an array's report turned into
per-member decisions and ends, refill, requeue, the end of an array, and the whole state as
plain data.

:class:`Sweep` owns the three things every door shares:

- the :class:`~hfsweep.core.packer.Packer`: the pools of waiting members by compatibility key,
  each key's array size, the asking loop of a new array and of a refill (at most
  :data:`~hfsweep.core.packer.REFILL_ASKS` asks per refill) and the requeue of members an array
  never started;
- the :class:`~hfsweep.core.ledger.Ledger`: the decision log, how each member ended (once, by
  :meth:`~hfsweep.core.ledger.Ledger.settle`) and each key's array size;
- one table of member records (:class:`~hfsweep.core.members.MemberRecord`: status, config,
  key, array, history, value) and one record per array
  (:class:`~hfsweep.core.members.ArrayRecord`).

It writes the lifecycle once: :meth:`Sweep.start_array`, :meth:`Sweep.on_report` (the core's one
rule, :func:`hfsweep.core.judging.judge`: replays answered from the decision log, the metric
check, diverged members failed, the joint decision, every decision and end saved in the ledger
before the searcher hears), refill of freed slots, requeue of members an array never started,
the end of a member and of an array (:meth:`Sweep.on_array_end`), and
:meth:`Sweep.state_dict`/:meth:`Sweep.load_state_dict`. It talks out only through two narrow
ports (:mod:`hfsweep.core.ports`): a searcher (ask, report, tell) and a decider (decide, at
budget, end). A door translates its API to those ports and to the report format below; the Ray
Tune plugin is one (:mod:`hfsweep.schedulers._tune_sweep`).

A door asks for one array at a time, and again later (Tune asks its searcher so): an array
smaller than its size starts only when nothing more can be asked or nothing runs (``partial`` of
:meth:`~hfsweep.core.packer.Packer.next_array`).

A report is the mapping an array's trainer sends at every evaluation: its ``token`` (a report
seen again is not processed again), the ``evaluations`` (member, step, epoch, metrics, time,
whether it was the member's last), the members whose end the trainer saw (``ended``: e.g.
non-finite gradients), the refill members it never started (``unused``), how many members it
took from the answers so far (``consumed``) and whether some wait in its queue (``queued``),
whether it resumed from a checkpoint (``resumed``) and whether this is its last word
(``final``). The answer goes back through :attr:`Sweep.post`.

Member statuses are :class:`~hfsweep.core.status.Status`: ``WAITING`` (asked, in its key's
pool), ``RUNNING`` (in an array), then ``COMPLETED``, ``STOPPED`` or ``FAILED`` (told; final).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import asdict
from typing import Any

from .._checks import is_finite
from ..training.task import Task
from . import judging
from .judging import Evaluated
from .ledger import Ledger
from .members import ArrayRecord, MemberRecord, agree, counts
from .packer import Packer, Pools
from .ports import EXHAUSTED, DeciderPort, SearcherPort
from .status import Status

__all__ = ["Sweep"]


class Sweep:
    """Everything a driver knows about one sweep (see the module docstring).

    ``task`` checks configs and computes compatibility keys; ``members`` is the budget (how many
    member configs are asked in all); ``array_size`` is the array size for every key, or a
    callable ``config -> size`` asked once per key (the profiler); ``refill`` gives freed slots
    new members of the same key; ``searcher`` and ``decider`` are the two ports.
    """

    #: where the sweep's messages go (a door names its own logger)
    log = logging.getLogger("hfsweep.sweep")
    #: how a user sets the metric and mode, for the error that asks for them
    metric_hint = "set the sweep's metric and mode"

    def __init__(
        self,
        task: Task,
        *,
        members: int,
        array_size: int | Callable[[Mapping[str, Any]], int],
        searcher: SearcherPort,
        decider: DeciderPort,
        refill: bool = True,
    ) -> None:
        self.task = task
        self.budget = members
        self.array_size = array_size
        self.refill = refill
        self.searcher_port = searcher
        self.decider_port = decider
        self.metric: str | None = None
        self.mode: str | None = None
        #: ``post(token, message)``: hands the answer to a report to its array's trainer
        self.post: Callable[[str, dict[str, Any]], None] | None = None
        self._reset()

    def _reset(self) -> None:
        #: the member table: one record per member asked, by id
        self.members: dict[str, MemberRecord] = {}
        self.arrays: dict[str, ArrayRecord] = {}
        #: the decision log, the members' ends and the array sizes
        self.ledger = Ledger()
        #: the pools of waiting members (by id), the array size per key, and refill
        self.packer: Packer[str] = Packer(
            ask=self._ask, size=self._size, may_ask=self._can_ask, budget=self.budget
        )
        self.packer.sizes = self.ledger.sizes  # one dict: the packer sizes, the ledger saves
        self.counters: dict[str, int] = {}
        self.asked = 0
        #: the searcher said it has no member config to give, ever again
        self.inner_finished = False
        #: the budget is spent (or the searcher finished) and every member is told
        self.finished = False

    @property
    def decisions(self) -> dict[str, bool]:
        """The decision log (``"<member>@<step>"`` -> go on): the ledger's."""
        return self.ledger.decisions

    def configure(self, metric: str | None, mode: str | None) -> None:
        """Set the metric and mode (a ``None`` leaves the one set before)."""
        if metric:
            self.metric = metric
        if mode:
            if mode not in ("min", "max"):
                raise ValueError(f"mode must be 'min' or 'max', got {mode!r}")
            self.mode = mode

    def _require_metric(self) -> str:
        if self.metric is None or self.mode is None:
            raise ValueError(
                f"the fused sweep has metric={self.metric!r}, mode={self.mode!r}: "
                f"{self.metric_hint}"
            )
        return self.metric

    # ------------------------------------------------------------------ asking and packing
    def start_array(self, array_id: str) -> ArrayRecord | None:
        """A new array ``array_id`` of members asked and packed by key; ``None`` when none
        can start now (and :attr:`finished` set when none ever will: the budget is spent and
        every member is told)."""
        if self.finished:
            return None
        self._require_metric()
        # an array smaller than its size when nothing more can come, or when nothing runs (the
        # searcher waits for results that only a running array can give)
        started = self.packer.next_array(
            array_id, partial=lambda: not self._can_ask() or not self._live_arrays()
        )
        if started is None:
            if not self._can_ask() and not self._live_arrays():
                self.finished = True
                self.log.info("all %d members asked and told: the search is finished", self.asked)
            return None
        key, taken = started
        array = ArrayRecord(id=array_id, key=key, size=self.packer.sizes[key], members=taken)
        self.arrays[array_id] = array
        for mid in taken:
            rec = self.members[mid]
            rec.array, rec.status = array_id, Status.RUNNING
        self.log.info("array %s: %d members (%s)", array_id, len(taken), ", ".join(taken))
        return array

    def _can_ask(self) -> bool:
        return self.asked < self.budget and not self.inner_finished

    def _new_id(self, prefix: str) -> str:
        n = self.counters.get(prefix, 0)
        while f"{prefix}-{n}" in self.members:
            n += 1
        self.counters[prefix] = n + 1
        return f"{prefix}-{n}"

    def _ask(self, prefix: str) -> list[tuple[str, str]] | None:
        """Ask the searcher for one member config (named after ``prefix``, the array it is
        asked for): ``[(key, member id)]`` for the packer to pool, empty if the task rejected
        it (it is told ``FAILED``), ``None`` when the searcher has none now or none ever
        again."""
        member_id = self._new_id(prefix)
        drawn = self.searcher_port.ask(member_id)
        if drawn is EXHAUSTED:
            self.inner_finished = True
            self.log.info("the inner searcher is finished after %d members", self.asked)
            return None
        if drawn is None:
            return None
        assert isinstance(drawn, Mapping)
        self.asked += 1
        rec = MemberRecord(id=member_id, config=dict(drawn), key="")
        self.members[member_id] = rec
        try:
            rec.key = self.task.compatibility_key(rec.config)
        except (ValueError, TypeError) as exc:
            self.log.warning("member %s failed before training: %s", member_id, exc)
            self._end(rec, Status.FAILED, None, error=f"{type(exc).__name__}: {exc}")
            return []
        return [(rec.key, member_id)]

    def _size(self, key: str, member_id: str) -> int:
        """The array size to ask for ``key``, whose first member is ``member_id``."""
        config = self.members[member_id].config
        return self.array_size(config) if callable(self.array_size) else self.array_size

    def _live_arrays(self) -> list[ArrayRecord]:
        return [a for a in self.arrays.values() if not a.done]

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
                last = self._last_result(rec)
                value = None if last is None else last.get(str(self.metric))
                status = judging.trainer_status(end["status"], value)  # as hfsweep run's
                failed = status is Status.FAILED
                self._end(rec, status, None if failed else last, error=end.get("error"))
        for mid in report.get("unused", []):
            self._requeue(array, self._member(array, mid))

    def _member(self, array: ArrayRecord, member_id: str) -> MemberRecord:
        rec = self.members.get(member_id)
        if rec is None or rec.array != array.id:
            raise RuntimeError(
                f"array {array.id} reported member {member_id!r}, which this fused sweep did not "
                f"put in it (members: {array.all_members()})"
            )
        return rec

    @staticmethod
    def _last_result(rec: MemberRecord) -> dict[str, Any] | None:
        return dict(rec.history[-1]) if rec.history else None

    def _alive(self, array: ArrayRecord) -> bool:
        return not array.done and any(not self.members[m].told for m in array.all_members())

    # ------------------------------------------------------------------ member ends
    def _end(
        self,
        rec: MemberRecord,
        status: Status,
        result: Mapping[str, Any] | None,
        *,
        error: str | None = None,
    ) -> None:
        """Record how ``rec`` ended (in the ledger, which holds it once, by the core's rule,
        and in its record) and tell the decider and the searcher, once."""
        assert status.final and not rec.told, (rec.id, status)
        metric = self._require_metric()
        value = rec.history[-1].get(metric) if rec.history else None
        settled = self.ledger.settle(rec.id, status, value, metric)
        if settled is None:
            raise AssertionError(f"member {rec.id} ended twice: the ledger holds its end")
        self._finish(rec, settled[0], result, error or settled[1])

    def _finish(
        self,
        rec: MemberRecord,
        status: Status,
        result: Mapping[str, Any] | None,
        error: str | None,
    ) -> None:
        """``rec`` ended with ``status`` (settled in the ledger already): its record, then the
        decider and the searcher told."""
        value = rec.history[-1].get(str(self.metric)) if rec.history else None
        rec.status, rec.error = status, error
        rec.value = float(value) if is_finite(value) else None
        self.decider_port.end(rec, status, result)
        self.searcher_port.tell(rec, status, result)
        self.log.info("member %s %s (%s=%s)", rec.id, status, self.metric, rec.value)

    # ------------------------------------------------------------------ refill and requeue
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

    def _requeue(self, array: ArrayRecord, rec: MemberRecord) -> None:
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
                self._end(rec, Status.STOPPED, self._last_result(rec))
            else:
                self._requeue(array, rec)
        array.done = True

    # ------------------------------------------------------------------ persistence
    def state_dict(self) -> dict[str, Any]:
        """The members, arrays, pools, ledger and counts as plain data (statuses by value);
        a door adds what it needs to find and check a saved state (its format)."""
        return {
            "metric": self.metric,
            "mode": self.mode,
            "budget": self.budget,
            "asked": self.asked,
            "inner_finished": self.inner_finished,
            "finished": self.finished,
            "members": {m: r.as_dict() for m, r in self.members.items()},
            "arrays": {a: asdict(r) for a, r in self.arrays.items()},
            "pools": self.packer.pools.as_dict(),
            "ledger": self.ledger.state_dict(),
            "counters": dict(self.counters),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict`'s output; the records and the ledger are brought to
        agree (:func:`~hfsweep.core.members.agree`)."""
        self._reset()
        self.configure(state.get("metric"), state.get("mode"))
        self.budget = int(state["budget"])
        self.asked = int(state["asked"])
        self.inner_finished = bool(state["inner_finished"])
        self.finished = bool(state["finished"])
        self.members = {m: MemberRecord.from_dict(r) for m, r in state["members"].items()}
        self.arrays = {a: ArrayRecord(**r) for a, r in state["arrays"].items()}
        self.packer.budget = self.budget
        self.packer.pools = Pools({str(k): [str(m) for m in v] for k, v in state["pools"].items()})
        self.ledger.load_state_dict(state["ledger"])  # its sizes: the packer's dict, in place
        agree(self.members.values(), self.ledger)
        self.counters = {k: int(v) for k, v in state["counters"].items()}

    # ------------------------------------------------------------------ summaries
    def counts(self) -> dict[Status, int]:
        """Members by status, every status listed (a :class:`Status` is equal to its value:
        ``counts()["stopped"]`` works too)."""
        return counts(self.members.values())


class _RecordsDoor:
    """What :func:`~hfsweep.core.judging.judge` asks of a sweep, for one report: member facts
    in the member table, decisions by the decider port, the searcher told through the
    searcher port."""

    def __init__(self, sweep: Sweep, array: ArrayRecord, report: Mapping[str, Any]) -> None:
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
        """A history row appended to the member's record; returns the result its decider and
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
        return {**row, "time_this_iter_s": since, "done": evaluation.final}

    def decide(self, judged: list[Evaluated]) -> dict[str, bool]:
        fresh = [(self.sweep.members[e.member], e.seen) for e in judged]
        return self.sweep.decider_port.decide(fresh)

    def at_budget(self, evaluation: Evaluated) -> bool:
        rec = self.sweep.members[evaluation.member]
        return self.sweep.decider_port.at_budget(rec, evaluation.seen)

    def hear(self, evaluation: Evaluated, searcher: bool) -> None:
        if searcher:
            rec = self.sweep.members[evaluation.member]
            self.sweep.searcher_port.report(rec, evaluation.seen)

    def ended(self, evaluation: Evaluated, status: Status, error: str | None) -> None:
        rec = self.sweep.members[evaluation.member]
        result = None if status is Status.FAILED and evaluation.diverged else evaluation.seen
        self.sweep._finish(rec, status, result, error)
