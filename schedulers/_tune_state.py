"""The driver-side state of a fused Tune sweep: members, arrays, pools, decisions, and who was told.

One :class:`SweepState` sits behind both Tune wrappers (the searcher and the scheduler). It asks
the inner searcher for member configs, packs members that share the task's compatibility key into
arrays (one Tune trial each), turns every array report into per-member decisions (through a
:class:`~._tune_joint.Decider`), tells the inner searcher each member's results and its end
exactly once, and hands freed slots new members of the same key. Asking, packing and saving are
here; the handling of reports (decisions, ends, refill) is its part in :mod:`._tune_reports`.

**What is the sweep core's.** The pools, array sizes, the asking loop of a new array and of a
refill (at most :data:`~hfsweep.core.packer.REFILL_ASKS` asks per refill) and the requeue of
members an array never started are :class:`hfsweep.core.packer.Packer`'s, as for ``hfsweep run``.
The decision log, how each member ended (and so whether it was told) and each key's array size
are the core's :class:`~hfsweep.core.ledger.Ledger` (:attr:`SweepState.ledger`), the one
``hfsweep run`` saves in ``state.json``: a replayed evaluation is answered by
:meth:`~hfsweep.core.ledger.Ledger.logged`, a member is told only if
:meth:`~hfsweep.core.ledger.Ledger.end` records its end (once), and the packer's sizes are the
ledger's dict. The status vocabulary is :class:`hfsweep.core.status.Status`, and a completed
member with a non-finite metric fails by :meth:`~hfsweep.core.status.Status.settle`.

**What is still the plugin's own, and why.** (1) The ledger has no file and no scheduler here:
Tune restores only the searcher checkpoint it pickles whenever it chooses, so the ledger is saved
as its :meth:`~hfsweep.core.ledger.Ledger.state_dict` inside this state's; and Tune's schedulers
decide one trial at a time on result dicts and are pickled whole, so they run through a
:class:`~._tune_joint.Decider` (which makes them joint) and the ledger logs what it decided
(:meth:`~hfsweep.core.ledger.Ledger.log`). (2) Each member's config, key, array, history and
value are its :class:`~._tune_records.MemberRecord`: ``hfsweep run`` keeps those in the Optuna
study it owns, where here the inner searcher is any Tune searcher, opaque to hfsweep; a record's
final status is the ledger's, as a trial's end is both the study's and the ledger's in
``hfsweep run`` (:meth:`load_state_dict` brings the two to agree). (3) The arrays are Tune trials
(string ids, members given and returned by refill, the last report's token): their
:class:`~._tune_records.ArrayRecord` s, where the ledger's arrays are ``hfsweep run``'s
numbered ones. And the packer is driven Tune's way: Tune asks the searcher for one trial at a
time and again later, so an array smaller than its size starts only when nothing more can be
asked or nothing runs (``partial`` of :meth:`~hfsweep.core.packer.Packer.next_array`), where the
engine starts one as soon as the searcher has no trial to give.

Tune checkpoints only the searcher, so this state is saved through the searcher wrapper
(:meth:`state_dict`) and is the source of truth after ``Tuner.restore``. A trainable that resumes
from a checkpoint replays the evaluations since that checkpoint; they get the decisions logged the
first time (in the ledger) and are never told again. A report reaches this state through
whichever wrapper Tune calls first, and processing it twice changes nothing.

Member statuses are the sweep core's :class:`~hfsweep.core.status.Status`, as in ``hfsweep
run``'s ledger: ``WAITING`` (asked, waiting in its key's pool), ``RUNNING`` (in an array), then
``COMPLETED``, ``STOPPED`` or ``FAILED`` (told to the inner searcher; final). Records, logs and
the results table say them by value (``completed``...); the Optuna names (``COMPLETE``,
``PRUNED``, ``FAIL``) only where Optuna's are meant (the table's ``state`` column).

This module imports neither Ray nor Optuna.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import asdict
from typing import Any

from hfsweep.core.ledger import Ledger
from hfsweep.core.packer import Packer, Pools
from hfsweep.core.status import Status
from hfsweep.training.task import Task

from ._tune_joint import Decider, MemberTrial, NoDecider
from ._tune_records import (
    FINISHED,
    META,
    STATE_FORMAT,
    WEIGHTS_DIR,
    ArrayRecord,
    MemberRecord,
    upgraded,
    weights_file,
)
from ._tune_reports import Reports

__all__ = [
    "FINISHED",
    "META",
    "STATE_FORMAT",
    "WEIGHTS_DIR",
    "ArrayRecord",
    "MemberRecord",
    "SweepState",
    "restored_state",
    "weights_file",
]

_log = logging.getLogger("hfsweep.tune")

#: the newest state of each sweep (by uid) restored in this process: ``Tuner.restore``
#: unpickles a new searcher, so the state a :class:`Fusion` made is left behind; ``Fusion.state``
#: follows the restored one through this (strong references: one state per restored sweep)
_RESTORED: dict[str, SweepState] = {}


def restored_state(uid: str) -> SweepState | None:
    """The newest state of sweep ``uid`` that ``Tuner.restore`` loaded in this process."""
    return _RESTORED.get(uid)


class SweepState(Reports):
    """Everything the driver knows about one fused sweep (see the module docstring).

    ``task`` checks configs and computes compatibility keys; ``members`` is the budget (how many
    member configs are asked from the inner searcher in all); ``array_size`` is the array size
    for every key, or a callable ``config -> size`` asked once per key (the profiler);
    ``refill`` gives freed slots new members of the same key.
    """

    def __init__(
        self,
        task: Task,
        *,
        members: int,
        array_size: int | Callable[[Mapping[str, Any]], int],
        refill: bool = True,
        uid: str,
    ) -> None:
        self.task = task
        self.budget = members
        self.array_size = array_size
        self.refill = refill
        self.uid = uid
        self.metric: str | None = None
        self.mode: str | None = None
        #: the inner Tune searcher (``suggest``, ``on_trial_result``, ``on_trial_complete``)
        self.searcher: Any = None
        self.decider: Decider = NoDecider()
        self.has_scheduler = False
        #: param_space values that are not sampled, and the names of the sampled ones
        self.constants: dict[str, Any] = {}
        self.sampled: list[str] = []
        #: ``post(token, message)``: hands the answer to a report to its trainable (the hub)
        self.post: Callable[[str, dict[str, Any]], None] | None = None
        self._trials: dict[str, MemberTrial] = {}
        self._reset()

    def _reset(self) -> None:
        self.members: dict[str, MemberRecord] = {}
        self.arrays: dict[str, ArrayRecord] = {}
        #: the decision log, the members' ends and the array sizes: the sweep core's ledger
        self.ledger = Ledger()
        #: the pools of waiting members (by id), the array size per key, and refill
        self.packer: Packer[str] = Packer(
            ask=self._ask, size=self._size, may_ask=self._can_ask, budget=self.budget
        )
        self.packer.sizes = self.ledger.sizes  # one dict: the packer sizes, the ledger saves
        self.counters: dict[str, int] = {}
        self.asked = 0
        self.inner_finished = False
        self.finished = False

    def __getstate__(self) -> dict[str, Any]:
        # the live link to the hub never travels with a pickled sweep
        state = self.__dict__.copy()
        state.update(post=None, _trials={})
        return state

    @property
    def decisions(self) -> dict[str, bool]:
        """The decision log (``"<member>@<step>"`` -> go on): the ledger's."""
        return self.ledger.decisions

    @property
    def hub_name(self) -> str:
        """The name of the Ray actor that carries answers to this sweep's trainables."""
        return f"hfsweep-tune-{self.uid}"

    def configure(self, metric: str | None, mode: str | None) -> None:
        """Set the metric and mode (from Tune's config, else the inner searcher's)."""
        if metric:
            self.metric = metric
        if mode:
            if mode not in ("min", "max"):
                raise ValueError(f"mode must be 'min' or 'max', got {mode!r}")
            self.mode = mode

    # ------------------------------------------------------------------ asking and packing
    def suggest(self, trial_id: str) -> dict[str, Any] | str | None:
        """The config of a new array trial ``trial_id``, ``None`` (nothing to start now) or
        :data:`FINISHED` (the budget is spent and every member is told)."""
        if self.finished:
            return FINISHED
        self._require_metric()
        # an array smaller than its size when nothing more can come, or when nothing runs (the
        # inner searcher waits for results that only a running array can give)
        started = self.packer.next_array(
            trial_id, partial=lambda: not self._can_ask() or not self._live_arrays()
        )
        if started is None:
            if not self._can_ask() and not self._live_arrays():
                self.finished = True
                _log.info("all %d members asked and told: the search is finished", self.asked)
                return FINISHED
            return None
        key, taken = started
        array = ArrayRecord(id=trial_id, key=key, size=self.packer.sizes[key], members=taken)
        self.arrays[trial_id] = array
        for mid in taken:
            rec = self.members[mid]
            rec.array, rec.status = trial_id, Status.RUNNING
        _log.info("array %s: %d members (%s)", trial_id, len(taken), ", ".join(taken))
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

    def _can_ask(self) -> bool:
        return self.asked < self.budget and not self.inner_finished

    def _new_id(self, prefix: str) -> str:
        n = self.counters.get(prefix, 0)
        while f"{prefix}-{n}" in self.members:
            n += 1
        self.counters[prefix] = n + 1
        return f"{prefix}-{n}"

    def _ask(self, prefix: str) -> list[tuple[str, str]] | None:
        """Ask the inner searcher for one member config (named after ``prefix``, the array
        it is asked for): ``[(key, member id)]`` for the packer to pool, empty if the task
        rejected it (it is told ``FAILED``), ``None`` when the searcher has none now (``None``)
        or none ever again (``FINISHED``)."""
        member_id = self._new_id(prefix)
        suggestion = self.searcher.suggest(member_id)
        if suggestion is None:
            return None
        if isinstance(suggestion, str) and suggestion == FINISHED:
            self.inner_finished = True
            _log.info("the inner searcher is finished after %d members", self.asked)
            return None
        self.asked += 1
        config = {**self.constants, **dict(suggestion)}
        rec = MemberRecord(id=member_id, config=config, key="")
        self.members[member_id] = rec
        try:
            rec.key = self.task.compatibility_key(config)
        except (ValueError, TypeError) as exc:
            _log.warning("member %s failed before training: %s", member_id, exc)
            self._end(rec, Status.FAILED, None, error=f"{type(exc).__name__}: {exc}")
            return []
        return [(rec.key, member_id)]

    def _size(self, key: str, member_id: str) -> int:
        """The array size to ask for ``key``, whose first member is ``member_id``."""
        config = self.members[member_id].config
        return self.array_size(config) if callable(self.array_size) else self.array_size

    def _live_arrays(self) -> list[ArrayRecord]:
        return [a for a in self.arrays.values() if not a.done]

    # ------------------------------------------------------------------ persistence
    def state_dict(self) -> dict[str, Any]:
        """Everything this state knows (plain data, plus the inner scheduler object), for
        Tune's searcher checkpoint, in format :data:`STATE_FORMAT` (statuses by value)."""
        return {
            "format": STATE_FORMAT,
            "uid": self.uid,
            "task": self.task.name,
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
            "decider": self.decider,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict`'s output (after ``Tuner.restore``); a state saved in
        an earlier format (``hfsweep.tune/2`` or ``/1``, see :func:`~._tune_records.upgraded`)
        is read too, any other is refused naming it."""
        state = upgraded(state)
        self._reset()
        self.uid = str(state["uid"])
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
        self._agree()
        self.counters = {k: int(v) for k, v in state["counters"].items()}
        self.decider = state["decider"]
        self._trials = {}
        _RESTORED[self.uid] = self

    def _agree(self) -> None:
        """Bring the members' records and the ledger to agree after a restore, as ``hfsweep
        run`` catches its ledger up to the study: an end only a record holds is recorded in the
        ledger, and a record whose member the ledger ended takes the ledger's status."""
        for rec in self.members.values():
            ended = self.ledger.status(rec.id)
            if ended is not None:
                rec.status = ended
            elif rec.status.final:
                self.ledger.end(rec.id, rec.status)

    # ------------------------------------------------------------------ summaries
    def counts(self) -> dict[Status, int]:
        """Members by status, every status listed (a :class:`Status` is equal to its value:
        ``counts()["stopped"]`` works too)."""
        out = dict.fromkeys(Status, 0)
        for rec in self.members.values():
            out[rec.status] += 1
        return out
