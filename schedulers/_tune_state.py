"""The driver-side state of a fused Tune sweep: members, arrays, pools, decisions, and who was told.

One :class:`SweepState` sits behind both Tune wrappers (the searcher and the scheduler). It asks
the inner searcher for member configs, packs members that share the task's compatibility key into
arrays (one Tune trial each), turns every array report into per-member decisions (through a
:class:`~._tune_joint.Decider`), tells the inner searcher each member's results and its end
exactly once, and hands freed slots new members of the same key. Asking, packing and saving are
here; the handling of reports (decisions, ends, refill) is its part in :mod:`._tune_reports`.

**What is the sweep core's.** The pools, array sizes, the asking loop of a new array and of a
refill (at most :data:`~hfsweep.core.packer.REFILL_ASKS` asks per refill) and the requeue of
members an array never started are :class:`hfsweep.core.packer.Packer`'s, as for ``hfsweep run``;
the status vocabulary is :class:`hfsweep.core.status.Status`, a completed member with a
non-finite metric fails by :meth:`~hfsweep.core.status.Status.settle`, and decisions are logged
under :func:`hfsweep.core.ledger.decision_key`. **What is not, and why.** The core's
:class:`~hfsweep.core.ledger.Ledger` object itself is not used: (1) it persists into a run
directory (``state.json`` and an append-only ``state.jsonl``), where a Tune sweep's state must
live in the searcher checkpoint that Tune pickles whole whenever it chooses, the only state Tune
restores; (2) it drives an hfsweep :class:`~hfsweep.schedulers.TrialScheduler` (joint
``decide`` on :class:`~hfsweep.schedulers.Report` s, ``state_dict`` and ``replay``), where Tune's
schedulers decide one trial at a time on result dicts and are saved by pickling (the
:class:`~._tune_joint.Decider` makes them joint); (3) the engine keeps each trial's config,
intermediate values and end in the Optuna study it owns, where here the inner searcher is any
Tune searcher, opaque to hfsweep, so each member's config, history and value are kept in this
state's own :class:`~._tune_records.MemberRecord`. And the packer is driven Tune's way: Tune
asks the searcher for one trial at a time and again later, so an array smaller than its size
starts only when nothing more can be asked or nothing runs (``partial`` of
:meth:`~hfsweep.core.packer.Packer.next_array`), where the engine starts one as soon as the
searcher has no trial to give.

Tune checkpoints only the searcher, so this state is saved through the searcher wrapper
(:meth:`state_dict`) and is the source of truth after ``Tuner.restore``. A trainable that resumes
from a checkpoint replays the evaluations since that checkpoint; they get the decisions logged the
first time (``decisions``) and are never told again. A report reaches this state through whichever
wrapper Tune calls first, and processing it twice changes nothing.

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
        #: the pools of waiting members (by id), the array size per key, and refill
        self.packer: Packer[str] = Packer(
            ask=self._ask, size=self._size, may_ask=self._can_ask, budget=self.budget
        )
        self.decisions: dict[str, bool] = {}
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
            "sizes": dict(self.packer.sizes),
            "decisions": dict(self.decisions),
            "counters": dict(self.counters),
            "decider": self.decider,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict`'s output (after ``Tuner.restore``); a state saved in
        the previous format (``hfsweep.tune/1``) is read too, any other is refused naming it."""
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
        self.packer.sizes = {str(k): int(v) for k, v in state["sizes"].items()}
        self.decisions = {k: bool(v) for k, v in state["decisions"].items()}
        self.counters = {k: int(v) for k, v in state["counters"].items()}
        self.decider = state["decider"]
        self._trials = {}
        _RESTORED[self.uid] = self

    # ------------------------------------------------------------------ summaries
    def counts(self) -> dict[Status, int]:
        """Members by status, every status listed (a :class:`Status` is equal to its value:
        ``counts()["stopped"]`` works too)."""
        out = dict.fromkeys(Status, 0)
        for rec in self.members.values():
            out[rec.status] += 1
        return out
