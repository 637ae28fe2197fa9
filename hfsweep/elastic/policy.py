"""The allocator in ``hfsweep run``: how many workers each elastic array of a Ray sweep gets.

:class:`ElasticPolicy` is the Ray executor's :class:`~hfsweep.executors._elastic.WorkerPolicy`
when ``ray.elastic.enabled``: it keeps every running array's state (members, progress through
the budget, workers), asks the :class:`~hfsweep.elastic.allocator.Allocator` at every event (an
array starts or resumes, an array ends, members stop, workers are lost, the cluster's workers
change, i.e. a node joined or left) and carries out its plan: the starting array gets its
workers, a running array whose workers change is asked to resize at its next evaluation
boundary (:func:`~hfsweep.parallel.request_resize`, the checkpoint the trainer writes there is
what it resumes from). Every decision goes to ``sweep.log`` with its reason, and the plan's
one-line summary to the progress line.

A ``pause`` (fewer workers than the arrays' minimums, after a node left) is carried out: a
running array the plan pauses is asked to stop at its next evaluation boundary (a resize to 0
workers); its workers are ended there and given back, and :meth:`ElasticPolicy.relaunch`
answers 0. The executor then asks :meth:`ElasticPolicy.waiting` until a later plan gives the
array workers again (another array ended, the cluster grew, or it waited ``max_wait_s`` and
takes the place of the array that last (re)started); the array resumes from the checkpoint
written at that boundary, so nothing is lost or trained twice. While it waits,
:meth:`~ElasticPolicy.waiting` re-plans when the cluster's workers change, once when its
wait reaches ``max_wait_s``, and on the allocator's timer (``resize_every_s``, at least 1 s;
a timer plan that changes nothing is not logged).

The allocator's ``start``/``wait`` decisions for waiting trials are carried out too. An array
the engine has formed (its trials taken from their pool) is, until its first launch, one of the
plan's :class:`~hfsweep.elastic.allocator.WaitingPool` s, named after it: the plan may start it or
leave it waiting when its workers save more member-seconds growing the running arrays.
:meth:`ElasticPolicy.started` then answers 0 and the executor waits, asking
:meth:`~ElasticPolicy.waiting`, as a paused array does (it has no workers, no actors and no
placement group), until a later plan starts it: an array ends, members stop, the cluster's
workers change, or its wait reaches ``max_wait_s`` (then it starts before any array grows).
With no array running it always starts (no deadlock). While an array waits for its first
workers or is paused, :meth:`~ElasticPolicy.admits` holds the engine to the arrays it has: no
other array is formed, so the waiting one is served first. An array resumed from its checkpoint
(``--resume``) is an array, not a pool: it gets its minimum whenever the workers suffice for
every array's, and otherwise waits in line like a paused array, instead of starting on
``min_workers_per_array`` workers the cluster does not have.

What the allocator is given:

- ``remaining_s``: the budget still ahead of the array's furthest member, in the budget's units
  (epochs or steps), times the seconds one unit took the array on one worker, measured between
  its reports (time per unit on k workers times the profile's speed-up at k). Before its second
  report (and for an array waiting for its first workers) an array's unit is the one last
  measured on an array of its compatibility key, or one second where none was.
- ``horizon_s``: with the trial scheduler's rungs in budget units (ASHA's or Hyperband's, where
  members may stop: the ``pruner``'s, every bracket's, :attr:`RungSurvival.rungs
  <hfsweep.elastic.survival.RungSurvival.rungs>`, where one is given; else ``rungs``, for a caller
  that knows where members may stop but has no rung model), the budget from the array's
  furthest member to the next rung above it, times the same one-unit seconds; the allocator makes no resize that
  would not pay for itself before it. Without rungs (FIFO, median stopping, Optuna pruners),
  or past the last rung, none is given (the array's remaining time counts). A member refilled
  behind the furthest one may reach an earlier rung; that one is not seen.
- ``expected_s`` and ``expected_member_s``: with ``pruner`` (the trial scheduler's rung model,
  :class:`~hfsweep.elastic.survival.RungSurvival`: ASHA's or Hyperband's rungs, bracket shares
  and reduction factor), the one-worker seconds until the array's last member is expected to
  stop, and its members' expected one-worker seconds in all, from each member's progress at
  its last report (a member survives each rung ahead with probability 1/reduction factor),
  in the same one-unit seconds. The allocator then weighs arrays by what their members are
  expected to train, makes a resize only where it pays back within the array's expected time,
  and in the tail weighs the array expected to end last at least as the heaviest one, so that
  freed workers go to it first. Without it
  (FIFO, median stopping, Optuna pruners) none is given, as before.
- the scaling profile of the array's compatibility key: when the first array of a key is
  placed, the policy asks its ``scaling`` source (the engine's
  :class:`~hfsweep.elastic.scaling.SweepScaling` with ``ray.elastic.scaling: model``: the cached
  profile, else one modelled from a measured one-worker step and the measured all-reduce cost,
  then cached) once, outside its lock, and logs which it got. Without a source (``scaling:
  perfect``), or when the source has none or fails (logged with the reason), the profile is
  *assumed*: perfect scaling (k workers are k times one) up to ``max_workers_per_array`` or the
  cluster.
- measured feedback: with a scaling source, every interval between two reports of one launch of
  an array (never one across a relaunch, which holds the restart) gives that array's key a
  measured rate at the worker count it trained on, in member-units/s (its live members over the
  seconds per budget unit). Once a key has rates at two or more worker counts, their medians
  replace the profile's points (:func:`~hfsweep.elastic.scaling.measured_profile`), so the
  allocator's speed-ups become measured ones. The change is logged against what the profile
  said, and the key's profile is handed to the source's ``remember`` (the scaling cache) when
  an array of it ends, so the next sweep starts from the measured points.
"""

from __future__ import annotations

import logging
import statistics
import threading
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from ..config.schema import ElasticConfig
from ..parallel import read_resize, request_resize
from ..sizing.scaling import ScalingProfile
from ..training.results import Evaluation
from ._allocation import earlier_totals
from .allocator import Allocator, ArrayState, Plan, WaitingPool
from .scaling import measured_profile, short_key
from .survival import RungSurvival, check_rung_sources

__all__ = ["ElasticPolicy", "ScalingSource"]

_log = logging.getLogger("hfsweep.elastic")

#: measured rates kept per key and worker count (the latest ones: an array's speed changes as
#: its members stop)
_KEEP_RATES = 20

#: ``(compatibility key, a trial's config of it or None, members) -> (profile or None, how)``:
#: where the policy gets a key's scaling profile (:class:`~hfsweep.elastic.scaling.SweepScaling`)
ScalingSource = Callable[[str, Mapping[str, Any] | None, int], tuple[ScalingProfile | None, str]]


@dataclass
class _Running:
    """What the policy knows of one running array."""

    folder: str
    key: str
    members: int
    #: the workers it trains on, or will after the resize asked for
    workers: int = 0
    #: when ``workers`` last changed, on the policy's clock
    since: float = 0.0
    #: budget units its furthest member has trained, and when that was seen
    done: float = 0.0
    seen: float | None = None
    #: seconds one budget unit took on one worker (measured), or None
    unit_s: float | None = None
    #: the workers its current launch trains on (``workers`` may be a resize not yet made);
    #: 0 while no launch runs (paused at a checkpoint, its workers given back)
    launched: int = 0
    #: whether the plan after its wait reached ``max_wait_s`` was made (once per pause)
    overdue: bool = False
    #: whether a plan has given it workers since the engine formed it (resumed: from the
    #: start); until then it is a pool of waiting trials to the allocator, not an array
    begun: bool = False
    #: whether it has trained (launched, or resumed from a checkpoint)
    trained: bool = False
    #: when the engine formed it (``started``), on the policy's clock
    formed: float = 0.0
    #: each live member's budget units trained at its last report (None before one)
    dones: list[float] | None = None


class ElasticPolicy:
    """Workers per elastic array, from the allocator (see the module docstring).

    ``budget`` is a trial's budget in ``by`` units (``"epochs"`` or ``"steps"``); ``show``
    gets each plan's status line (the progress display); ``clock`` is seconds (tests pass a
    fake one); ``scaling`` gives each compatibility key's scaling profile (None: perfect
    scaling assumed); ``pruner`` is the trial scheduler's rung model (None: not known), from
    which each array's expected end and ``horizon_s`` are given; ``rungs`` the scheduler's rungs
    in ``by`` units (where members may stop; empty: not known) for a caller without a rung
    model. The pruner is the one source of rungs where it is given (:attr:`rungs` reads it):
    ``rungs`` given beside it must be the same rungs (every bracket's below the budget) and its
    budget the policy's, else a :class:`ValueError` says which differ. They are refused rather
    than one silently preferred because two rung sources that disagree mean a caller built them
    from different schedulers or budgets, and the horizon and the expected end would then judge
    one array by two rung structures; ``rungs`` is kept (not removed) for callers and tests that
    know the rungs but not the reduction factor or the brackets' shares. ``queued``
    says, given the folders of the arrays the policy holds, about how many more arrays the
    engine will start (formed ones it has not told the policy of yet, and those its queued
    trials would form; None: none known), which the allocator starts before it grows an
    array; ``max_arrays`` is the most
    arrays the engine holds at once (``ray.max_concurrent``; None: no bound), so that no more
    queued arrays count than it can form beside the ones it has.
    """

    def __init__(
        self,
        settings: ElasticConfig,
        *,
        budget: float,
        by: str,
        show: Callable[[str], None] = lambda line: None,
        clock: Callable[[], float] = time.monotonic,
        scaling: ScalingSource | None = None,
        remember: Callable[[ScalingProfile], None] | None = None,
        rungs: Sequence[float] = (),
        record: Callable[[Mapping[str, Any]], None] | None = None,
        queued: Callable[[Collection[str]], int] | None = None,
        max_arrays: int | None = None,
        pruner: RungSurvival | None = None,
    ) -> None:
        self.settings = settings
        self.budget = float(budget)
        #: the rungs given without a rung model (read through :attr:`rungs`)
        self._rungs = tuple(sorted({float(r) for r in rungs}))
        self._pruner: RungSurvival | None = None
        self.pruner = pruner  # checked against ``rungs`` and ``budget`` (the setter)
        if pruner is not None:
            _log.info(
                "elastic: arrays' ends estimated from the trial scheduler's %s", pruner.describe()
            )
        self.queued = queued
        self.max_arrays = max_arrays
        self.record = record
        self.scaling = scaling
        self.remember = remember
        #: each key's profile as the source gave it, before measured points replaced any
        self._given: dict[str, ScalingProfile] = {}
        #: measured rates by key and worker count (member-units/s, the latest _KEEP_RATES)
        self._rates: dict[str, dict[int, list[float]]] = {}
        #: the speed-ups last logged per key, so that only a change is logged again
        self._logged: dict[str, dict[int, float]] = {}
        #: the profile of each compatibility key the source gave (keys it was asked about and
        #: had none for are in ``_asked`` only: they are assumed perfect)
        self.profiles: dict[str, ScalingProfile] = {}
        self._asked: set[str] = set()
        self._scaling_lock = threading.Lock()
        self.allocator = Allocator(
            min_workers=settings.min_workers_per_array,
            max_workers=settings.max_workers_per_array,
            resize_every_s=settings.resize_every_s,
            resize_cost_s=settings.resize_cost_s,
            max_wait_s=settings.max_wait_s,
        )
        self.by = by
        self.show = show
        self.clock = clock
        self._lock = threading.Lock()
        self._arrays: dict[str, _Running] = {}
        self._total: int | None = None
        #: every plan, in order (for tests and the log)
        self.plans: list[Plan] = []
        #: plans the sweep's earlier runs made (:meth:`carry_on`)
        self._earlier_plans = 0
        #: the seconds per budget unit on one worker last measured per compatibility key
        self._unit_s: dict[str, float] = {}

    # ------------------------------------------------------------------ the rung model
    @property
    def pruner(self) -> RungSurvival | None:
        """The trial scheduler's rung model (None: not known): each array's expected end and,
        where given, the one source of its horizon's rungs."""
        return self._pruner

    @pruner.setter
    def pruner(self, pruner: RungSurvival | None) -> None:
        if pruner is not None:
            check_rung_sources(pruner, self._rungs, self.budget)
        self._pruner = pruner

    @property
    def rungs(self) -> tuple[float, ...]:
        """The rungs each array's ``horizon_s`` is measured to, in budget units: the pruner's
        (every bracket's below the budget) where one is given, else the ``rungs`` given."""
        return self._pruner.rungs if self._pruner is not None else self._rungs

    # ------------------------------------------------------------------ the executor's events
    def started(
        self,
        folder: str,
        key: str,
        members: int,
        total: int,
        config: Mapping[str, Any] | None = None,
        *,
        resume: bool = False,
    ) -> int:
        """The workers the array in ``folder`` starts on, or 0: it waits for its first workers
        (ask :meth:`waiting`). A new array (``resume`` false) is a pool of waiting trials to
        the allocator, which may leave it waiting; a resumed one is an array that had been
        paused."""
        self._learn(folder, key, config, max(1, members))
        with self._lock:
            now = self.clock()
            entry = _Running(
                folder, key, max(1, members), since=now, begun=resume, trained=resume, formed=now
            )
            self._arrays[folder] = entry
            self._decide("array started", total, fresh=folder)
            if entry.workers < 1:
                _log.info(
                    "elastic: %s waits for workers before it trains (the engine forms no other "
                    "array meanwhile)",
                    self._name(folder),
                )
                return 0
            entry.launched, entry.trained = entry.workers, True
            return entry.workers

    def admits(self) -> int | None:
        """The most arrays the engine may hold now: while an array waits for its first workers
        or is paused, the arrays it holds (it forms no other, so the waiting one is served
        first); ``None`` otherwise (as many as the workers give each its minimum)."""
        with self._lock:
            if any(e.workers == 0 for e in self._arrays.values()):
                return len(self._arrays)
            return None

    def relaunch(self, folder: str, workers: int, lost: int, total: int) -> int:
        """The workers the array in ``folder`` relaunches on; 0: it is paused (its workers are
        given back; ask :meth:`waiting` until it may go on)."""
        with self._lock:
            entry = self._arrays[folder]
            if lost:
                entry.workers, entry.since = workers, self.clock()
                self._decide(f"{lost} worker(s) lost", total)
            if entry.workers == 0:
                entry.launched, entry.seen, entry.overdue = 0, None, False
                _log.info(
                    "elastic: %s paused at its checkpoint; its workers are given back until "
                    "a plan gives it workers again (at most %g s unless others waited longer)",
                    self._name(folder),
                    self.settings.max_wait_s,
                )
                return 0
            if entry.workers != workers:
                _log.info(
                    "elastic: %s relaunches on %d worker(s) (the latest plan), not %d",
                    self._name(folder),
                    max(1, entry.workers),
                    workers,
                )
            entry.launched, entry.seen = max(1, entry.workers), None
            return entry.launched

    def waiting(self, folder: str, total: int) -> int:
        """The paused array in ``folder`` (or one waiting for its first workers) asks whether
        it may go on: the workers it (re)launches on, or 0 (still waiting). Re-plans when the
        cluster's workers changed since the last plan (``node joined``/``node left``), and once
        when the array's wait reached ``max_wait_s``."""
        with self._lock:
            entry = self._arrays[folder]
            if entry.workers == 0:
                overdue = self.clock() - entry.since >= self.settings.max_wait_s
                if total != self._total:
                    self._decide("paused array waiting" if entry.begun else "array waiting", total)
                elif overdue and not entry.overdue:
                    entry.overdue = True
                    self._decide(
                        f"{self._name(folder)} waited {self.settings.max_wait_s:g} s", total
                    )
                elif self._timer_due():
                    self._decide("timer", total, quiet=True)
            if entry.workers == 0:
                return 0
            entry.launched, entry.seen = entry.workers, None
            if not entry.trained:
                entry.trained = True
                _log.info(
                    "elastic: %s starts on %d worker(s) after waiting %.0f s",
                    self._name(folder),
                    entry.workers,
                    self.clock() - entry.formed,
                )
            else:
                _log.info(
                    "elastic: %s resumes on %d worker(s) from its checkpoint",
                    self._name(folder),
                    entry.workers,
                )
            return entry.launched

    def _timer_due(self) -> bool:
        """Whether the last plan is the allocator's ``timer_s`` old (``resize_every_s``, at
        least 1 s): a waiting array is then re-decided as the running arrays progress (their
        remaining time shrinks with every report), not only at events, as the simulator
        assumes."""
        last = self.allocator.last
        return last is not None and self.clock() - last.now >= self.allocator.timer_s

    def reported(self, folder: str, evaluations: Sequence[Evaluation], live: int) -> None:
        """Learn the array's speed from its ``evaluations``; re-decide if members stopped."""
        with self._lock:
            entry = self._arrays.get(folder)
            if entry is None or not evaluations:
                return
            now = self.clock()
            units = sorted(
                (e.epoch if self.by == "epochs" else float(e.step) for e in evaluations),
                reverse=True,
            )
            done = units[0]
            # the live members are taken to be the furthest (a refilled one lags behind)
            entry.dones = units[:live] if 0 < live < len(units) else units
            if entry.seen is not None and done > entry.done:
                per_unit = (now - entry.seen) / (done - entry.done)
                if per_unit > 0:
                    self._measured(entry, entry.members / per_unit)
                k = max(1, entry.launched or entry.workers)
                entry.unit_s = per_unit * self._profile(entry.key).speedup(k)
                self._unit_s[entry.key] = entry.unit_s
            entry.done, entry.seen = done, now
            if 0 < live < entry.members:
                entry.members = live
                self._decide("members stopped", self._total or 1)

    def ended(self, folder: str, total: int) -> None:
        """The array's workers are free: re-decide the others; cache a measured scaling."""
        with self._lock:
            entry = self._arrays.pop(folder, None)
            if entry is not None and self._arrays:
                self._decide("array ended", total)
            elif entry is not None:  # none left: every worker idle until an array starts
                self._total = total
                self._show(self.allocator.rest(total, self.clock()))
            learnt = self.profiles.get(entry.key) if entry is not None else None
        if learnt is not None and learnt.measured and self.remember is not None:
            try:
                self.remember(learnt)
            except Exception as exc:  # a cache that cannot be written must not stop the sweep
                _log.warning("elastic: the measured scaling was not cached: %s", exc)

    # ------------------------------------------------------------------ scaling profiles
    def _learn(self, folder: str, key: str, config: Mapping[str, Any] | None, members: int) -> None:
        """Ask the scaling source for ``key``'s profile, once per key (the first array of the
        key placed), outside the policy's lock (modelling measures a few training steps), and
        log what it gave."""
        if self.scaling is None or key in self._asked:
            return
        with self._scaling_lock:
            if key in self._asked:
                return
            try:
                profile, how = self.scaling(key, config, members)
            except Exception as exc:  # a failed measurement must not stop the sweep
                profile, how = None, f"modelling it failed ({type(exc).__name__}: {exc})"
            with self._lock:
                self._asked.add(key)
                if profile is not None:
                    self.profiles[key] = self._given[key] = profile
                    self._apply_measured(key)
        name = self._name(folder)
        if profile is None:
            _log.warning("elastic: scaling of %s's kind of array assumed perfect: %s", name, how)
            return
        k2 = f"; 2 workers {profile.speedup(2):.2f}x one" if profile.max_workers >= 2 else ""
        _log.info(
            "elastic: scaling profile of %s's kind of array (key %s): %s: %s%s",
            name,
            short_key(key),
            how,
            profile.describe(),
            k2,
        )

    def _measured(self, entry: _Running, rate: float) -> None:
        """Record ``rate`` (member-units/s) of ``entry``'s key at the workers its launch trains
        on, and update the key's profile (called under the lock)."""
        if self.scaling is None or entry.launched < 1:
            return
        rates = self._rates.setdefault(entry.key, {}).setdefault(entry.launched, [])
        rates.append(rate)
        del rates[:-_KEEP_RATES]
        self._apply_measured(entry.key)

    def _apply_measured(self, key: str) -> None:
        """Replace ``key``'s profile points by the measured ones (see the module docstring)
        and log the speed-ups that changed; nothing before two worker counts are measured or
        before the source gave a profile (called under the lock)."""
        given, rates = self._given.get(key), self._rates.get(key, {})
        if given is None or len(rates) < 2:
            return
        median = {k: statistics.median(r) for k, r in rates.items()}
        learnt = measured_profile(given, median)
        points = learnt.points
        self.profiles[key] = learnt
        logged = self._logged.setdefault(key, {})
        changed = [
            k
            for k in sorted(points)
            if k > 1 and abs(learnt.speedup(k) - logged.get(k, 0.0)) > 0.1 * learnt.speedup(k)
        ]
        if not changed:
            return
        for k in changed:
            logged[k] = learnt.speedup(k)
        said = ", ".join(
            f"{k} workers {learnt.speedup(k):.2f}x one (the profile said {given.speedup(k):.2f}x)"
            for k in changed
        )
        _log.info(
            "elastic: measured scaling of key %s (median of the arrays' intervals at %s "
            "worker(s)): %s",
            short_key(key),
            "/".join(str(k) for k in sorted(median)),
            said,
        )

    # ------------------------------------------------------------------ deciding
    def _decide(
        self, event: str, total: int, fresh: str | None = None, *, quiet: bool = False
    ) -> None:
        """Ask the allocator, log every decision with its reason, and carry the plan out.
        ``quiet`` (a timer's plan): a plan that changes no array's workers is neither logged,
        shown nor kept in :attr:`plans` (the allocator still counts from it)."""
        if self._total is not None and total != self._total:
            event = f"{'node joined' if total > self._total else 'node left'}, {event}"
        self._total = total
        now = self.clock()
        states = [
            ArrayState(
                name=self._name(e.folder),
                key=e.key,
                members=e.members,
                remaining_s=self._remaining_s(e),
                profile=self._profile(e.key, total),
                workers=e.workers,
                since=e.since,
                horizon_s=self._horizon_s(e),
                **self._expected(e),
                # asked for and not made yet: the launcher removes the request at its restart
                pending=e.launched > 0 and e.workers > 0 and read_resize(e.folder) is not None,
            )
            for e in self._arrays.values()
            if e.begun
        ]
        pools = [  # formed arrays waiting for their first workers, the oldest first
            WaitingPool(
                key=e.key,
                arrays=1,
                members=e.members,
                remaining_s=self._remaining_s(e),
                profile=self._profile(e.key, total),
                name=self._name(e.folder),
                since=e.formed,
                expected_member_s=self._expected(e).get("expected_member_s"),
            )
            for e in sorted(self._arrays.values(), key=lambda e: e.formed)
            if not e.begun
        ]
        queued = 0 if self.queued is None else max(0, int(self.queued(set(self._arrays))))
        if self.max_arrays is not None:  # the engine forms no more arrays than this at once
            queued = min(queued, max(0, self.max_arrays - len(self._arrays)))
        plan = self.allocator.decide(states, pools, total, now=now, event=event, queued=queued)
        if quiet and all(d.after == d.before for d in plan.decisions):
            return
        self.plans.append(plan)
        after = plan.workers()
        new = self._name(fresh) if fresh is not None else None
        for decision in plan.decisions:
            if decision.array == new and decision.action == "start":  # not a paused one's
                k, members = decision.after, self._arrays[str(fresh)].members
                decision = replace(
                    decision,
                    reason=f"a new array of {members} trials; {k} worker(s) is its best share "
                    f"of the {total} now",
                )
            _log.info("elastic [%s]: %s", event, decision)
        for note in plan.notes:
            _log.info("elastic [%s]: %s", event, note)
        for e in self._arrays.values():
            k = after.get(self._name(e.folder), e.workers if e.begun else 0)
            if k > 0 and not e.begun:  # started: an array to the next plans
                e.begun = True
            if k == e.workers:
                continue
            if e.launched > 0:  # training: resized (0: paused) at its next evaluation boundary
                request_resize(e.folder, k)
            e.workers, e.since = k, now
        self._show(plan)

    def _show(self, plan: Plan) -> None:
        """``plan``'s status line, with the time arrays waited and workers idled so far, to the
        log and the progress line."""
        status = plan.status()
        waits = plan.waits()
        if waits:
            status = f"{status}; {waits}"
        _log.info("%s", status)
        self.show(status)
        self._record()

    def totals(self) -> dict[str, Any]:
        """The allocator's account so far (:meth:`~hfsweep.elastic.allocator.Allocator.waits`):
        ``arrays_waited_s`` summed over arrays its plans left without workers,
        ``workers_idle_s`` over the workers they left idle, up to now; the ``plans`` made and
        the cluster's ``workers`` at the last. The plans' view, not the workers': a resize
        counts from its plan, a relaunch's start-up is not idle."""
        with self._lock:
            return self._totals()

    def carry_on(self, earlier: Mapping[str, Any]) -> None:
        """Go on from the totals of a sweep's earlier runs (its ``elastic.json``, read when it
        is resumed with ``--resume``): the waits, idle time and plans shown and written from
        now on include theirs, up to their last plan (a driver killed after it loses the time
        since). Before any plan; ``ValueError`` names a value that is not a count or a number
        of seconds >= 0."""
        waited, idle, plans = earlier_totals(earlier)
        with self._lock:
            if self.plans:
                raise RuntimeError("carry_on() after the policy's first plan")
            self.allocator.carried = (waited, idle)
            self._earlier_plans = plans

    def _totals(self) -> dict[str, Any]:
        """:meth:`totals` (called under the lock)."""
        waited, idle = self.allocator.waits(self.clock())
        return {
            "arrays_waited_s": waited,
            "workers_idle_s": idle,
            "plans": self._earlier_plans + len(self.plans),
            "workers": self._total,
        }

    def _record(self) -> None:
        """Hand :meth:`totals` to ``record`` (the run directory's ``elastic.json``); a file
        that cannot be written is logged, not raised (the sweep goes on)."""
        if self.record is None:
            return
        try:
            self.record(self._totals())
        except OSError as exc:
            _log.warning("elastic: the wait totals were not written: %s", exc)

    def _remaining_s(self, e: _Running) -> float:
        """Seconds ``e`` still needs on one worker (see the module docstring)."""
        left = max(0.0, self.budget - e.done)
        unit = e.unit_s if e.unit_s is not None else self._unit_s.get(e.key, 1.0)
        return left * unit

    def _expected(self, e: _Running) -> dict[str, float]:
        """``expected_s`` and ``expected_member_s`` of ``e`` from the pruner's rung model (see
        the module docstring); none without one. Before its first report every member counts
        at the array's progress (0 for a new array)."""
        if self.pruner is None:
            return {}
        dones = e.dones if e.dones else [e.done] * e.members
        unit = e.unit_s if e.unit_s is not None else self._unit_s.get(e.key, 1.0)
        return {
            "expected_s": self.pruner.array_units(dones) * unit,
            "expected_member_s": sum(self.pruner.member_units(d) for d in dones) * unit,
        }

    def _horizon_s(self, e: _Running) -> float | None:
        """Seconds on one worker from ``e``'s furthest member to the next rung above it, or
        None (no rungs known, or none left before the budget)."""
        above = [r for r in self.rungs if e.done < r < self.budget]
        if not above:
            return None
        unit = e.unit_s if e.unit_s is not None else self._unit_s.get(e.key, 1.0)
        return (above[0] - e.done) * unit

    def _profile(self, key: str, total: int | None = None) -> ScalingProfile:
        """``key``'s profile from the scaling source, else the assumed one: perfect scaling up
        to the most workers an array may have."""
        known = self.profiles.get(key)
        if known is not None:
            return known
        most = self.settings.max_workers_per_array or total or self._total or 1
        return ScalingProfile(key, {k: float(k) for k in range(1, max(1, most) + 1)})

    @staticmethod
    def _name(folder: str) -> str:
        return f"array {Path(folder).name}"
