"""The fused Tune sweep's state: the one :class:`~hfsweep.core.sweep.Sweep` seen through
Tune's interfaces.

One :class:`SweepState` sits behind both Tune wrappers (the searcher and the scheduler). Asking,
packing by compatibility key, turning an array's report into per-member decisions and ends,
telling each end once, refill and the end of an array are the core's (see
:mod:`hfsweep.core.sweep`, with the members' records in :mod:`hfsweep.core.members`). This
adapter adds only what is Tune's, through the sweep's two ports
(:mod:`hfsweep.core.ports`):

- the inner searcher is a Tune ``Searcher``: members are asked with ``suggest(member id)``
  (``FINISHED`` ends the asking), told of evaluations with ``on_trial_result`` and of their
  end with ``on_trial_complete`` (a completed member with its last result, a stopped one with
  its result minus the metric, which OptunaSearch records as pruned, a failed one with
  ``error=True``);
- the inner scheduler is a Tune ``TrialScheduler`` (or hfsweep's), made joint by a
  :class:`~._tune_joint.Decider` that sees each member as a :class:`~._tune_joint.MemberTrial`
  and its evaluation as a Tune result dict (``trial_id``, ``done``, ``time_this_iter_s``...);
- arrays are Tune trials: a trial's config lists the sampled values and carries the members
  under :data:`~._tune_format.META`, and a report is the JSON payload under the same key of a
  Tune result;
- Tune checkpoints only the searcher, so this state is saved through the searcher wrapper
  (:meth:`SweepState.state_dict`, format :data:`~._tune_format.STATE_FORMAT`, with the decider
  pickled whole) and is the source of truth after ``Tuner.restore``
  (:func:`restored_state` finds the restored one).

This module imports neither Ray nor Optuna.
"""

from __future__ import annotations

import json
import logging
import sys
from collections.abc import Mapping
from typing import Any

from hfsweep.core import members as _members
from hfsweep.core.members import ArrayRecord, MemberRecord
from hfsweep.core.ports import EXHAUSTED, Exhausted
from hfsweep.core.status import Status
from hfsweep.core.sweep import Sweep
from hfsweep.training.task import Task

from ._tune_format import FINISHED, META, STATE_FORMAT, upgraded
from ._tune_joint import Decider, MemberController, MemberTrial, NoDecider
from ._tune_stop import MemberStop

__all__ = ["SweepState", "restored_state"]

#: the newest state of each sweep (by uid) restored in this process: ``Tuner.restore``
#: unpickles a new searcher, so the state a :class:`Fusion` made is left behind; ``Fusion.state``
#: follows the restored one through this (strong references: one state per restored sweep)
_RESTORED: dict[str, SweepState] = {}


def restored_state(uid: str) -> SweepState | None:
    """The newest state of sweep ``uid`` that ``Tuner.restore`` loaded in this process."""
    return _RESTORED.get(uid)


class SweepState(Sweep):
    """Everything the driver knows about one fused Tune sweep (see the module docstring).

    ``uid`` names the sweep among the Ray actors; ``sizing`` is
    :class:`~hfsweep.core.sweep.Sweep`'s ``members``, ``array_size`` and ``refill``. The
    sweep's ports are :class:`_TuneSearcher` over :attr:`searcher` and :class:`_TuneDecider`
    over :attr:`decider`.
    """

    log = logging.getLogger("hfsweep.tune")
    metric_hint = "set tune.TuneConfig(metric=..., mode=...) (or on the inner searcher)"

    def __init__(self, task: Task, *, uid: str, **sizing: Any) -> None:
        super().__init__(task, searcher=_TuneSearcher(self), decider=_TuneDecider(self), **sizing)
        self.uid = uid
        #: the inner Tune searcher (``suggest``, ``on_trial_result``, ``on_trial_complete``)
        self.searcher: Any = None
        self.decider: Decider = NoDecider()
        self.has_scheduler = False
        self._stop = MemberStop()
        #: param_space values that are not sampled, and the names of the sampled ones
        self.constants: dict[str, Any] = {}
        self.sampled: list[str] = []
        self._trials: dict[str, MemberTrial] = {}
        #: the sweep's own save in the experiment directory (a :class:`~._tune_journal.Journal`,
        #: attached by the searcher wrapper once Tune names the experiment's storage)
        self.journal: Any = None
        #: how many times the sweep saved itself there (the number of the newest save)
        self.saves = 0
        #: calls to the inner searcher not made yet: :meth:`_flush` saves, then makes them
        self._outbox: list[tuple[Any, ...]] = []

    def __getstate__(self) -> dict[str, Any]:
        # the live link to the hub and the journal never travel with a pickled sweep
        state = self.__dict__.copy()
        state.update(post=None, _trials={}, journal=None, _outbox=[])
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        # a sweep an earlier hfsweep pickled (an experiment's tuner.pkl) had no own save
        self.__dict__.update({"journal": None, "saves": 0, "_outbox": [], **state})

    @property
    def stop(self) -> MemberStop:
        """``RunConfig(stop=...)``, judged per member (taken over from Tune by the wrappers
        at every ``fit``; a state pickled by an hfsweep without it gets an empty one)."""
        found = self.__dict__.get("_stop")
        if not isinstance(found, MemberStop):
            found = self.__dict__["_stop"] = MemberStop()
        return found

    @property
    def hub_name(self) -> str:
        """The name of the Ray actor that carries answers to this sweep's trainables."""
        return f"hfsweep-tune-{self.uid}"

    # ------------------------------------------------------------------ Tune's searcher side
    def suggest(self, trial_id: str) -> dict[str, Any] | str | None:
        """The config of a new array trial ``trial_id``, ``None`` (nothing to start now) or
        :data:`FINISHED` (the budget is spent and every member is told)."""
        asked = self.asked
        array = self.start_array(trial_id)
        self._flush(save=array is not None or self.asked != asked)
        if array is None:
            return FINISHED if self.finished else None
        return self._array_config(array)

    def _array_config(self, array: ArrayRecord) -> dict[str, Any]:
        """A Tune trial config: each sampled key as the list of its members' values (what the
        result table shows) and the members themselves under :data:`META`."""
        configs = [self.members[m].config for m in array.members]
        config: dict[str, Any] = {k: [c.get(k) for c in configs] for k in self.sampled}
        config[META] = {
            "hub": self.hub_name,
            "metric": self.metric,
            "mode": self.mode,
            "members": [{"id": m, "config": self.members[m].config} for m in array.members],
        }
        return config

    def on_result(self, trial_id: str, result: Mapping[str, Any]) -> bool:
        """Process one Tune result of array ``trial_id`` (see
        :meth:`~hfsweep.core.sweep.Sweep.on_report`); returns whether the array
        has a member left to train."""
        array = self.arrays.get(trial_id)
        seen = None if array is None else (array.last_token, array.done)
        alive = self.on_report(trial_id, _payload(result))
        array = self.arrays.get(trial_id)
        self._flush(save=array is not None and (array.last_token, array.done) != seen)
        return alive

    def ends_by_itself(self, trial_id: str, result: Mapping[str, Any] | None) -> bool:
        """Whether array ``trial_id``'s trainable ends on its own after Tune result ``result``,
        so Tune must not stop it (see
        :meth:`~hfsweep.core.sweep.Sweep.ends_by_itself`)."""
        return super().ends_by_itself(trial_id, _payload(result))

    def on_complete(
        self, trial_id: str, result: Mapping[str, Any] | None, error: bool = False
    ) -> None:
        """Tune ended array trial ``trial_id`` for good (``error``: it failed past its
        retries); see :meth:`~hfsweep.core.sweep.Sweep.on_array_end`."""
        self.on_array_end(trial_id, None if error else _payload(result), error)
        self._flush(save=True)

    def _give(self, array: ArrayRecord) -> None:
        # the searcher hears this report's evaluations and ends before it is asked for more
        self._flush(save=False)
        super()._give(array)

    # ------------------------------------------------------------------ the sweep's own save
    def _flush(self, *, save: bool) -> None:
        """Save the sweep (to its journal, if it has one) when it changed (``save``) or has
        calls to make to the inner searcher, then make them: whatever the searcher hears was
        saved first, so a restore after a hard kill keeps it (see :mod:`._tune_journal`)."""
        pending, self._outbox = self._outbox, []
        if self.journal is not None and (save or pending):
            self.saves += 1
            self.journal.write(self.saves, self.state_dict(), self.searcher, pending)
        for call in pending:
            self._call(call)

    def _call(self, call: tuple[Any, ...]) -> None:
        """Make one call of :attr:`_outbox` to the inner searcher."""
        kind, member = call[0], call[1]
        if kind == "result":
            self.searcher.on_trial_result(member, call[2])
        elif kind == "complete":
            self.searcher.on_trial_complete(member, call[2])
        else:
            self.searcher.on_trial_complete(member, None, error=True)

    def save_now(self) -> None:
        """Save the sweep to its journal (if it has one) and make the pending calls."""
        self._flush(save=True)

    def resume_from(self, saved: Mapping[str, Any]) -> None:
        """Go on from the sweep's own save ``saved`` (:meth:`~._tune_journal.Journal.read`;
        the inner searcher already restored from it): its state, then the calls it had not
        made yet to the searcher, which the restored searcher has not heard."""
        self.load_state_dict(saved["state"])
        self.saves = int(saved["saves"])
        self._outbox = [tuple(c) for c in saved["pending"]]
        self._flush(save=False)

    def reconcile(self, trials: Mapping[str, str], saved: Mapping[str, Mapping[str, Any]]) -> None:
        """Bring the sweep, loaded from its own save (newer than Tune's), to agree with the
        trials Tune restored (``trials``: Tune trial id -> status). Those Tune resumes go on
        from their checkpoints as of Tune's save, whose record of each array is ``saved[id]``
        (``"given"``: the refill members handed to it by then, ``"done"``). Every member told
        of keeps its end.

        An array Tune did not save (it started after Tune's save) will not run again: its
        members not told of wait in their pools, to train again from the start. An array Tune
        resumes replays its reports since that checkpoint, answered from the decision log, so
        its members reach their logged ends again (an array that ended after Tune's save too:
        its completed members' weights are saved again in its checkpoint); the members handed
        to it after Tune's save are taken back (its replay would not take them at the same
        points), and those not told of wait in their pools as well. An array that had ended at
        Tune's save (it failed past its retries) stays ended, whatever Tune does with it."""
        again = 0
        for array in self.arrays.values():
            status = trials.get(array.id)
            if status is None:
                if not array.done:
                    back = [m for m in array.all_members() if self._again(array, m)]
                    array.returned += back
                    again += len(back)
                    array.done = True
            elif status not in ("TERMINATED", "ERROR") and array.id in saved:
                keep = len(saved[array.id]["given"])
                late = array.given[keep:]
                del array.given[keep:]
                array.returned = [m for m in array.returned if m not in late]
                again += sum(self._again(array, m) for m in late)
                array.done = bool(saved[array.id]["done"])
        if again or any(not a.done for a in self.arrays.values()):
            self.finished = False
        if again:
            self.log.info("restored: %d members not told of before the kill train again", again)

    def _again(self, array: ArrayRecord, member: str) -> bool:
        """Member ``member`` of ``array`` trains again from the start, unless it was told of
        (or is elsewhere): its evaluations and decisions are forgotten, it waits in its pool."""
        rec = self.members[member]
        if rec.told or rec.array != array.id:
            return False
        for key in [k for k in self.ledger.decisions if k.rpartition("@")[0] == member]:
            del self.ledger.decisions[key]
        rec.array, rec.status, rec.history = None, Status.WAITING, []
        rec.value, rec.clock_shift = None, 0.0
        self._trials.pop(member, None)
        self.packer.requeue(rec.key, member)
        return True

    # ------------------------------------------------------------------ the ports' helpers
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

    # ------------------------------------------------------------------ Tune's checkpoint
    def state_dict(self) -> dict[str, Any]:
        """Everything this state knows (plain data, plus the inner scheduler object), for
        Tune's searcher checkpoint, in format :data:`STATE_FORMAT` (statuses by value)."""
        core = super().state_dict()
        return {
            "format": STATE_FORMAT,
            "uid": self.uid,
            "task": self.task.name,
            **core,
            "saves": self.saves,
            "decider": self.decider,
            # a dict RunConfig(stop=...): Tune gives it to restored array trials no more (the
            # plugin took it off them), and to the searcher only when the experiment starts
            "stop": dict(self.stop.criteria),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict`'s output (after ``Tuner.restore``); a state saved in
        an earlier format (``hfsweep.tune/2`` or ``/1``, see :func:`~._tune_format.upgraded`)
        is read too, any other is refused naming it."""
        state = upgraded(state)
        super().load_state_dict(state)
        self.uid = str(state["uid"])
        self.saves = int(state.get("saves", 0))
        self.decider = state["decider"]
        self.stop.set_criteria(state.get("stop") or {})
        self._trials = {}
        _RESTORED[self.uid] = self


def _tune_result(rec: MemberRecord, result: Mapping[str, Any]) -> dict[str, Any]:
    """A member's evaluation as a Tune result dict: under the member's id, naming its array
    trial."""
    return {**result, "trial_id": rec.id, "hfsweep_array": rec.array}


class _TuneSearcher:
    """The sweep's searcher port over the inner Tune searcher: ``suggest(member id)`` asks
    (:data:`FINISHED` ends the asking), ``on_trial_result`` hears an evaluation and
    ``on_trial_complete`` an end."""

    def __init__(self, state: SweepState) -> None:
        self.state = state

    def ask(self, member_id: str) -> Mapping[str, Any] | Exhausted | None:
        suggestion = self.state.searcher.suggest(member_id)
        if isinstance(suggestion, str) and suggestion == FINISHED:
            return EXHAUSTED
        if suggestion is None:
            return None
        return {**self.state.constants, **dict(suggestion)}

    def report(self, member: MemberRecord, result: Mapping[str, Any]) -> None:
        self.state._outbox.append(("result", member.id, _tune_result(member, result)))

    def tell(self, member: MemberRecord, status: Status, result: Mapping[str, Any] | None) -> None:
        """``COMPLETED``: ``on_trial_complete(id, result)``. ``STOPPED``:
        ``on_trial_complete(id, result without the metric)``, which OptunaSearch records as
        pruned (its intermediate values stay). ``FAILED``: ``on_trial_complete(id, None,
        error=True)``. The calls wait in the sweep's outbox until it saved the end
        (:meth:`SweepState._flush`)."""
        outbox = self.state._outbox
        if status is Status.COMPLETED:
            assert result is not None
            outbox.append(("complete", member.id, _tune_result(member, result)))
        elif status is Status.STOPPED:
            metric = self.state.metric
            seen = _tune_result(member, result) if result else {}
            told = {k: v for k, v in seen.items() if k != metric}
            told.update(hfsweep_status=status.value, hfsweep_last_value=member.value)
            outbox.append(("complete", member.id, told))
        else:
            outbox.append(("failed", member.id))


class _TuneDecider:
    """The sweep's decider port over the inner scheduler's :class:`~._tune_joint.Decider`:
    each member a :class:`~._tune_joint.MemberTrial`, its evaluation a Tune result dict, the
    running members the controller's live trials."""

    def __init__(self, state: SweepState) -> None:
        self.state = state

    def decide(self, fresh: list[tuple[MemberRecord, dict[str, Any]]]) -> dict[str, bool]:
        """A member that meets ``RunConfig(stop=...)`` stops (complete, see
        :meth:`at_budget`) and its result does not reach the scheduler, as Tune consults no
        scheduler for a result that met the criterion; the scheduler decides on the others."""
        state = self.state
        seen = [(rec, _tune_result(rec, row)) for rec, row in fresh]
        stop = state.stop
        met = stop.judge([(rec.id, result) for rec, result in seen]) if stop.active else set()
        if stop.all_stopped:
            state.inner_finished = True  # stop_all(): no new member is asked
        judged = [(state._trial(rec), result) for rec, result in seen if rec.id not in met]
        go = state.decider.decide(state._controller(), judged, state.metric or "") if judged else {}
        return {**go, **{m: False for m in met}}

    def at_budget(self, member: MemberRecord, result: Mapping[str, Any]) -> bool:
        """A member stopped by ``RunConfig(stop=...)`` or at the scheduler's budget completed."""
        return self.state.stop.met(member.id) or self.state.decider.at_budget(result)

    def end(self, member: MemberRecord, status: Status, result: Mapping[str, Any] | None) -> None:
        state = self.state
        seen = _tune_result(member, result) if result else None
        state.decider.end(state._controller(), state._trial(member), status, seen)


def _payload(result: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """hfsweep's part of an array's Tune result (a JSON string under :data:`META`)."""
    if not result or META not in result:
        return None
    raw = result[META]
    data = json.loads(raw) if isinstance(raw, str) else raw
    return dict(data) if isinstance(data, Mapping) else None


#: where hfsweep before the one sweep core kept the classes a pickled sweep state holds, and
#: where they are now: Tune pickles the searcher, and with it this state, into the experiment's
#: ``tuner.pkl``, so ``Tuner.restore`` of an experiment an earlier hfsweep started looks them up
#: under the old names (the state itself is read from the searcher checkpoint, whose format is
#: :data:`~._tune_format.STATE_FORMAT`; the old names hold no code of their own)
_MOVED = {"_tune_state": sys.modules[__name__], "_tune_records": _members}
for _old, _now in _MOVED.items():
    sys.modules.setdefault(f"{__package__}.{_old}", _now)
