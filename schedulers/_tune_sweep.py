"""The fused Tune sweep's state: the sweep core's :class:`~hfsweep.core.member_sweep.MemberSweep`
seen through Tune's interfaces.

One :class:`SweepState` sits behind both Tune wrappers (the searcher and the scheduler). Asking,
packing by compatibility key, turning an array's report into per-member decisions and ends,
telling each end once, refill and the end of an array are the core's (see
:mod:`hfsweep.core.member_sweep` and :mod:`hfsweep.core.array_reports`, with the members'
records in :mod:`hfsweep.core.members`). This adapter adds only what is Tune's:

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
from hfsweep.core.member_sweep import MemberSweep
from hfsweep.core.members import ArrayRecord, MemberRecord
from hfsweep.core.status import Status
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


class SweepState(MemberSweep):
    """Everything the driver knows about one fused Tune sweep (see the module docstring).

    ``uid`` names the sweep among the Ray actors; ``sizing`` is
    :class:`~hfsweep.core.member_sweep.MemberSweep`'s ``members``, ``array_size`` and
    ``refill``.
    """

    log = logging.getLogger("hfsweep.tune")
    metric_hint = "set tune.TuneConfig(metric=..., mode=...) (or on the inner searcher)"

    def __init__(self, task: Task, *, uid: str, **sizing: Any) -> None:
        super().__init__(task, **sizing)
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

    def __getstate__(self) -> dict[str, Any]:
        # the live link to the hub never travels with a pickled sweep
        state = self.__dict__.copy()
        state.update(post=None, _trials={})
        return state

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
        array = self.start_array(trial_id)
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

    def _draw(self, member_id: str) -> Mapping[str, Any] | None:
        suggestion = self.searcher.suggest(member_id)
        if isinstance(suggestion, str) and suggestion == FINISHED:
            self.inner_finished = True
            return None
        if suggestion is None:
            return None
        return {**self.constants, **dict(suggestion)}

    def on_result(self, trial_id: str, result: Mapping[str, Any]) -> bool:
        """Process one Tune result of array ``trial_id`` (see
        :meth:`~hfsweep.core.array_reports.ArrayReports.on_report`); returns whether the array
        has a member left to train."""
        return self.on_report(trial_id, _payload(result))

    def ends_by_itself(self, trial_id: str, result: Mapping[str, Any] | None) -> bool:
        """Whether array ``trial_id``'s trainable ends on its own after Tune result ``result``,
        so Tune must not stop it (see
        :meth:`~hfsweep.core.array_reports.ArrayReports.ends_by_itself`)."""
        return super().ends_by_itself(trial_id, _payload(result))

    def on_complete(
        self, trial_id: str, result: Mapping[str, Any] | None, error: bool = False
    ) -> None:
        """Tune ended array trial ``trial_id`` for good (``error``: it failed past its
        retries); see :meth:`~hfsweep.core.array_reports.ArrayReports.on_array_end`."""
        self.on_array_end(trial_id, None if error else _payload(result), error)

    # ------------------------------------------------------------------ the core's hooks
    def _result(self, rec: MemberRecord, result: dict[str, Any]) -> dict[str, Any]:
        """A member's evaluation as a Tune result dict: under the member's id, naming its
        array trial."""
        return {**result, "trial_id": rec.id, "hfsweep_array": rec.array}

    def _decide(self, fresh: list[tuple[MemberRecord, dict[str, Any]]]) -> dict[str, bool]:
        """A member that meets ``RunConfig(stop=...)`` stops (complete, see
        :meth:`_at_budget`) and its result does not reach the scheduler, as Tune consults no
        scheduler for a result that met the criterion; the scheduler decides on the others."""
        met = (
            self.stop.judge([(rec.id, result) for rec, result in fresh])
            if self.stop.active
            else set()
        )
        if self.stop.all_stopped:
            self.inner_finished = True  # stop_all(): no new member is asked
        judged = [(self._trial(rec), result) for rec, result in fresh if rec.id not in met]
        go = self.decider.decide(self._controller(), judged, self.metric or "") if judged else {}
        return {**go, **{m: False for m in met}}

    def _at_budget(self, result: Mapping[str, Any]) -> bool:
        """A member stopped by ``RunConfig(stop=...)`` or at the scheduler's budget completed."""
        return self.stop.met(result.get("trial_id")) or self.decider.at_budget(result)

    def _heard(self, rec: MemberRecord, result: Mapping[str, Any]) -> None:
        self.searcher.on_trial_result(rec.id, dict(result))

    def _told(self, rec: MemberRecord, status: Status, result: Mapping[str, Any] | None) -> None:
        """``COMPLETED``: ``on_trial_complete(id, result)``. ``STOPPED``:
        ``on_trial_complete(id, result without the metric)``, which OptunaSearch records as
        pruned (its intermediate values stay). ``FAILED``: ``on_trial_complete(id, None,
        error=True)``."""
        self.decider.end(
            self._controller(), self._trial(rec), status, dict(result) if result else None
        )
        if status is Status.COMPLETED:
            assert result is not None
            self.searcher.on_trial_complete(rec.id, dict(result))
        elif status is Status.STOPPED:
            told = {k: v for k, v in (result or {}).items() if k != self.metric}
            told.update(hfsweep_status=status.value, hfsweep_last_value=rec.value)
            self.searcher.on_trial_complete(rec.id, told)
        else:
            self.searcher.on_trial_complete(rec.id, None, error=True)

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
        self.decider = state["decider"]
        self.stop.set_criteria(state.get("stop") or {})
        self._trials = {}
        _RESTORED[self.uid] = self


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
