"""The sweep engine: searcher -> pools of compatible trials -> arrays -> scheduler -> study.

:func:`sweep` runs a whole sweep from a sweep file, a mapping in its schema or a
:class:`~hfsweep.config.SweepConfig`. It asks the searcher (an Optuna sampler, or a
:class:`~hfsweep.searchers.Searcher`) for trials, puts each in the pool of its compatibility key,
trains a pool's trials as one fused array once it holds the array's size (``fusion.size``, or
the profiler's choice), hands every evaluation of an array to the trial scheduler at once (a
joint decision per rung), refills a slot the moment its trial ends with a new trial of the same
key, and tells the study how each trial ended. The pools, array sizes and refill are the
packer's (:mod:`hfsweep.core.packer`), the persisted state the ledger's
(:mod:`hfsweep.core.ledger`); opening and resuming the study, the executor's hooks and the
sweep's outcome are parts of the engine in modules of their own (:mod:`hfsweep.core._parts`).

Crash safety: the Optuna study (a journal file in the run directory by default) records every
trial, its params, intermediate values and end; each array's trainer checkpoints at every
evaluation; and the ledger (``state.json`` and the changes since in ``state.jsonl``, see
:mod:`hfsweep.core.ledger`) holds the scheduler's state with a log of its decisions. A sweep
killed at any moment (SIGKILL included) and run again with ``resume=True`` finishes with no
completed trial lost or trained again: running arrays continue from their checkpoints, replayed
evaluations get the decisions already taken, and a trial whose end was saved but not yet told
is told once.
"""

from __future__ import annotations

import json
import logging
import math
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .._io import grouped_sync
from .._signals import shielded, stopping_on_signals
from .._usercode import HOOK, label, unwrap
from ..config import SweepConfig, load_sweep, make_searcher, parse_sweep
from ..config.tracking import check_trackers
from ..executors import ArrayHooks, Executor, ExecutorError, Stopped
from ..schedulers import OptunaPruner, make_scheduler
from ..search_spaces import FixedParam
from ..searchers import CustomSource, OptunaSource, Searcher, TrialSource
from ..storage.drivers import DRIVER_ATTR, Drivers
from ..storage.journal import JournalLost
from ..tracking import Callback, Tracking, make_tracker
from ..training import ArrayTrainer, Member
from ..training import DataCache as _DataCache
from ..training.checkpoint import DamagedCheckpointError
from ..training.packed import UnsafeFileError
from ._backend import _Backend
from ._hooks import _Hooks
from ._logs import logged_to, quiet_optuna
from ._outcome import _Outcome
from ._parts import _Array
from ._preflight import preflight
from ._progress import Progress
from ._resume import _Resume
from ._rundir import RunDir, RunDirBusy, member_id, refuse_a_second_start, trial_number
from ._tracked import _Tracked
from .ledger import Ledger
from .packer import NON_LEARNING, Packer, Pending, limit_for_learning
from .result import (
    _DISK_ERRORS,
    RunDirUnwritable,
    SweepError,
    SweepResult,
    TrainingError,
    _blame_hfsweep,
    _Failed,
    _raised_by_the_task,
    _torch_write_failed,
)
from .status import Status

if TYPE_CHECKING:
    import optuna

    from ..storage.journal import GroupedJournalFileBackend

__all__ = ["SweepError", "SweepResult", "TrainingError", "sweep"]

_log = logging.getLogger("hfsweep.sweep")

#: the clock of a sweep's elapsed time and ``budget.time_limit`` (tests replace it with a fake)
_clock: Callable[[], float] = time.perf_counter


def sweep(
    config: str | os.PathLike[str] | Mapping[str, Any] | SweepConfig,
    *,
    resume: bool = False,
    progress: bool = True,
    searcher: Searcher | None = None,
    callbacks: Sequence[Callback] = (),
) -> SweepResult:
    """Run the sweep ``config`` describes and return its result.

    ``config`` is a sweep file's path, a mapping in the sweep file schema (relative paths are
    taken from the working directory) or a validated :class:`~hfsweep.config.SweepConfig`.
    ``resume=True`` continues the sweep in the config's ``output`` directory where it stopped
    (or starts it, if there is none); without it, an ``output`` that already holds a sweep is
    refused. ``progress`` prints a live status line to stderr. ``searcher`` replaces the
    config's Optuna sampler with a search algorithm of your own. ``callbacks`` are
    :class:`hfsweep.Callback` instances told of every trial's start, evaluations and end, after
    the trackers the config's ``tracking:`` names (see :mod:`hfsweep.tracking`).

    Before anything is written, an ``output`` that holds a sweep already is refused unless
    resuming (the first check, as in ``hfsweep validate``), the sweep is checked against this
    machine (an output that
    cannot be written, CUDA where there is none, a storage URL whose database driver is
    missing or whose database does not answer), then the task's code runs once (a dry run: its
    model for the space's corner configs, one training step of an array of two on one batch,
    one validation batch; on a Ray cluster given by ``ray.address`` the workers' first array
    does it).

    Raises :class:`~hfsweep.config.ConfigError` for an invalid config, one this machine cannot
    run or a task that fails the dry run, :class:`SweepError` when the sweep cannot start (an
    existing run directory, a changed config on resume, a run directory another sweep is
    running in), and :class:`TrainingError` (a :class:`SweepError`) when the task's code
    raised while an array trained: that array's trials and every other unfinished one are then
    ``FAIL`` in the study, none is left ``RUNNING``. A trial whose ``model(config)`` raises
    fails alone, and the sweep goes on. A storage database that stops answering is retried
    for ``storage_retry`` seconds, then ``hfsweep.storage.database.StorageUnavailable`` (a
    :class:`SweepError`) stops the sweep, resumable.

    Ctrl-C (``KeyboardInterrupt``) and SIGTERM (:class:`~hfsweep._signals.Terminated`, a
    ``KeyboardInterrupt``) stop the sweep where it is, resumable with ``resume=True``: the
    trials still training stay ``RUNNING``, every trial told is kept. Called from the main
    thread, it handles SIGTERM and SIGINT while it runs where they have Python's default
    handlers, and restores the handlers it found as it returns.
    """
    # SIGTERM stops the sweep as Ctrl-C does; the process's handlers are restored after (in
    # this frame: the warnings' stacklevels count the frames up to hs.sweep's caller)
    with stopping_on_signals():
        if isinstance(config, SweepConfig):
            sc = config
        elif isinstance(config, Mapping):
            sc = parse_sweep(config)
        else:
            sc = load_sweep(config)
        refuse_a_second_start(sc.output, sc.storage, sc.source, resume=resume)  # cheapest first
        preflight(sc)  # before the run directory is created: a sweep that cannot run writes nothing
        check_trackers(sc)  # their libraries import
        data = _DataCache()  # the dry run's data, which the local backend's arrays train on
        from ._dryrun import dry_run, runs_on_the_driver

        if runs_on_the_driver(sc):  # before anything is written and the time limit's clock starts
            dry_run(sc, data=data)
        if searcher is None and sc.searcher.custom:
            searcher = make_searcher(sc.searcher)
        engine = _Engine(sc, resume=resume, progress=progress, searcher=searcher, data=data)
        engine.tracking = Tracking(
            [*(make_tracker(t.name, t.options) for t in sc.tracking), *callbacks]
        )
        return engine.run()


class _InLedger:
    """An engine attribute that is the ledger's (``engine.sizes`` is ``engine.ledger.sizes``)."""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, engine: Any, owner: type | None = None) -> Any:
        return getattr(engine.ledger, self.name)

    def __set__(self, engine: Any, value: Any) -> None:
        setattr(engine.ledger, self.name, value)


class _Engine(_Resume, _Hooks, _Outcome, _Tracked, _Backend):
    """One run of one sweep (see the module docstring); its parts are the mixins it is made
    of (see :mod:`hfsweep.core._parts`)."""

    #: the persisted state, kept by the ledger (see :class:`~hfsweep.core.ledger.Ledger`)
    decisions: dict[str, bool] = _InLedger()  # type: ignore[assignment]
    ended: dict[str, Status] = _InLedger()  # type: ignore[assignment]
    arrays: list[_Array] = _InLedger()  # type: ignore[assignment]
    sizes: dict[str, int] = _InLedger()  # type: ignore[assignment]
    best: list[tuple[float, int]] = _InLedger()  # type: ignore[assignment]  # of kept checkpoints
    elapsed_before: float = _InLedger()  # type: ignore[assignment]

    def __init__(
        self,
        sc: SweepConfig,
        *,
        resume: bool,
        progress: bool,
        searcher: Searcher | None,
        data: _DataCache | None = None,
    ) -> None:
        self.sc = sc
        self.task = sc.task
        self.resume = resume
        self.custom = searcher
        self.dir = RunDir(sc.output)
        budget = sc.budget
        self.total = budget.trials
        if sc.searcher.grid_size is not None:
            self.total = min(self.total, sc.searcher.grid_size)
        self.scheduler = make_scheduler(
            sc.scheduler.name,
            mode=sc.mode,
            max_resource=budget.max_resource,
            **sc.scheduler.options,
        )
        self.executor: Executor | None = None
        #: guards the engine's state: arrays training at once call the hooks from their threads
        self._lock = threading.RLock()
        self.progress = Progress(self.total, sc.metric, enabled=progress)
        self.ledger = Ledger(self.dir.ledger_file(), self.scheduler, lambda: _clock() - self.start)
        #: the pools of waiting trials, the array size per key (the ledger's), and refill
        self.packer: Packer[Pending] = Packer(
            ask=self._ask,
            size=self._size,
            may_ask=self._can_ask,
            budget=self.total,
            on_sized=lambda key, size: self._save_state(),
        )
        self.packer.sizes = self.ledger.sizes
        self.live: dict[int, optuna.Trial] = {}  # running trials
        self.sampled: dict[int, dict[str, Any]] = {}
        self.reported: dict[int, int] = {}  # last Optuna step reported per running trial
        self._last_step: dict[str, int] = {}  # per member, for the throughput shown
        self.asked = 0
        self.start = _clock()
        self._published = -math.inf  # perf_counter() of the last trials.csv/best.json write
        self._publish_s = 0.0  # and how long it took
        #: the default journal's backend (None with a storage URL), and whether the run
        #: directory is locked to this sweep
        self._journal: GroupedJournalFileBackend | None = None
        self._dir_locked = False
        #: loaded data the local executor's arrays start with (the dry run's)
        self._data = data if data is not None else _DataCache()
        #: this driver among those sharing the study (set when the study is open)
        self.drivers: Drivers | None = None
        #: the trackers and callbacks told of every trial (see hfsweep.tracking)
        self.tracking = Tracking([])

    # ------------------------------------------------------------------ the run
    def run(self) -> SweepResult:
        try:
            with self.dir.exclusive() as locked:
                self._dir_locked = locked
                try:
                    return self._run()
                finally:
                    if self.drivers is not None:
                        self.drivers.close()
        except (RunDirBusy, UnsafeFileError) as exc:  # a file of the run dir was refused
            raise SweepError(str(exc)) from None
        except JournalLost as exc:
            if self.sc.storage is not None:  # a journal the drivers share: not the run dir's
                raise
            ended = len(self.ledger.ended)
            counted = f"this run had {self.asked} trial(s) in it, {ended} of them ended"
            raise SweepError(self._study_lost(str(exc), counted)) from None
        except (OSError, RuntimeError) as exc:
            # torch.save meeting a full disk raises RuntimeError (see _torch_write_failed)
            disk = exc if isinstance(exc, OSError) else _torch_write_failed(exc, self.dir.path)
            if disk is None or (
                disk.errno not in _DISK_ERRORS and not self._in_run_dir(disk.filename)
            ):
                raise
            where = disk.filename or self.dir.path
            resume = f"hfsweep run {self.sc.source} --resume" if self.sc.source else "resume=True"
            raise RunDirUnwritable(
                f"cannot write {where}: {disk.strerror or disk}. The sweep stopped; every trial "
                f"that finished is recorded. Free some space (or fix the permissions), then "
                f"continue with {resume}"
            ) from exc

    def _in_run_dir(self, filename: object) -> bool:
        """Whether ``filename`` (an OSError's) lies in the run directory."""
        if not isinstance(filename, str | os.PathLike):
            return False
        return Path(filename).resolve().is_relative_to(self.dir.path.resolve())

    def _run(self) -> SweepResult:
        saved = self._prepare_dir()
        with (
            grouped_sync(),
            logged_to(self.dir.log),
            quiet_optuna(),
            self._executor(),
            self._tracked(resumed=saved is not None),
        ):
            self.study = self._open_study()
            assert self.drivers is not None
            # every trial names its driver from its first write (see hfsweep.storage.drivers)
            born = {DRIVER_ATTR: self.drivers.id}
            self.source: TrialSource = (
                OptunaSource(self.study, self.sc.space, born)
                if self.custom is None
                else CustomSource(self.study, self.sc.space, self.custom, born)
            )
            if self.custom is not None:
                self.custom.setup(
                    self.sc.space, metric=self.sc.metric, mode=self.sc.mode, seed=self.sc.seed
                )
            self._restore(saved)
            self._save_state()
            _log.info(
                "sweep %s: %d trials, run directory %s",
                self.sc.study_name,
                self.total,
                self.dir.path,
            )
            try:
                self._train_arrays()
            except ExecutorError as exc:
                raise SweepError(f"the {self.sc.backend} backend cannot go on: {exc}") from exc
            except _Failed as failed:
                raise self._stop(failed) from failed.exc
            finally:
                stopping = sys.exc_info()[1] is not None
                if isinstance(sys.exc_info()[1], KeyboardInterrupt):
                    _log.warning(
                        "the sweep was %s; the trials still training resume from their "
                        "checkpoints with --resume",
                        sys.exc_info()[1] or "interrupted (Ctrl-C)",
                    )
                try:
                    self.ledger.compact()  # the whole state in state.json as the sweep stops
                except OSError:
                    if not stopping:
                        raise
                    # the error that stops the sweep is the one to show (a full disk fails
                    # this too); the ledger's files are whole without the compaction
                    _log.warning("the ledger was not compacted", exc_info=True)
                self._publish_last()
                self.progress.close()
            result = self._result()
            _log.info("%s", result.summary())
        return result

    # ------------------------------------------------------------------ set-up and resume
    def _save_state(self) -> None:
        """Save what changed since the last save (one line appended to the ledger's log)."""
        self.ledger.save()

    def _wall_s(self) -> float:
        return _clock() - self.start

    def _elapsed(self) -> float:
        return self.elapsed_before + _clock() - self.start

    # ------------------------------------------------------------------ asking trials
    def _can_ask(self) -> bool:
        limit = self.sc.budget.time_limit_s
        if limit is not None and self._elapsed() >= limit:
            return False
        assert self.drivers is not None
        eager = self.drivers.count >= self.total  # last looks before this driver ends
        for t in self.drivers.adopt_stale(eager=eager):  # trials of drivers that have gone
            keyed = self._take_up(t)
            if keyed is not None:
                self._pool(keyed[0], Pending(t.number, keyed[1]), size_now=False)
        # budget.trials counts every driver's trials (checked again as one asks)
        return self.drivers.count < self.total and not self.source.exhausted

    def _ask(self, array: str) -> list[tuple[str, Pending]] | None:
        """Ask one trial (the packer pools it): ``[(key, pending)]``, empty if the task
        rejected its config, ``None`` if the searcher gave none."""
        admitted = []
        with self._journal_held():  # sizing a new key (profiling) comes after, outside it
            assert self.drivers is not None
            for trial, sampled in self.drivers.ask(self.source.ask, self.total):
                self.asked += 1
                admitted.append((trial, self._admit(trial, sampled)))
        if not admitted:
            return None
        return [
            (keyed[0], Pending(trial.number, keyed[1]))
            for trial, keyed in admitted
            if keyed is not None
        ]

    def _admit(
        self, trial: optuna.Trial, sampled: dict[str, Any]
    ) -> tuple[str, dict[str, Any]] | None:
        """``(compatibility key, config)`` of a running trial, which is tracked from now on;
        ``None`` after failing it, if the task rejects its config (the others go on)."""
        try:
            config = self.sc.trial_config(sampled)
            key = self.task.compatibility_key(config)
        except (ValueError, TypeError) as exc:
            self._fail_unstarted(trial, exc)
            return None
        self._track(trial, sampled)
        return key, config

    def _track(self, trial: optuna.Trial, sampled: dict[str, Any]) -> None:
        self.live[trial.number] = trial
        self.sampled[trial.number] = sampled
        if isinstance(self.scheduler, OptunaPruner) and member_id(trial.number) not in self.ended:
            self.scheduler.attach(member_id(trial.number), trial)

    def _pool(self, key: str, pending: Pending, *, size_now: bool) -> None:
        """Pool a trial (see :meth:`Packer.add`)."""
        self.packer.add(key, pending, size_now=size_now)

    def _size(self, key: str, pending: Pending) -> int:
        """The array size to ask for ``key``: ``fusion.size``, or the profiler's choice."""
        size = self.sc.fusion.size
        if size != "auto":
            return int(size)
        assert self.executor is not None
        config = pending.config
        self._note(f"profiling array sizes for {self._describe(config)} on {self.where}")
        try:
            size, reason = self.executor.array_size(config)
        except (ExecutorError, Stopped):
            raise
        except Exception as exc:
            if not _raised_by_the_task(exc):
                raise
            where = f"profiling the array size for {self._describe(config)}"
            raise _Failed(where, unwrap(exc)) from exc
        name = self.sc.searcher.name
        size, reason = limit_for_learning(
            size,
            reason,
            budget=self.total,
            learns=name not in NON_LEARNING,
            searcher=f"the {name} searcher",
            unit="trials",
        )
        # shown, not only logged: a cached profile says where from, how old, measured under what
        self._note(f"array size {size} for {self._describe(config)}: {reason}")
        return size

    def _fail_unstarted(self, trial: optuna.Trial, exc: Exception) -> None:
        _log.warning("trial %d failed before training: %s", trial.number, exc)
        trial.set_user_attr("status", Status.FAILED.value)
        trial.set_user_attr("error", f"{type(exc).__name__}: {exc}"[:500])
        # ended in the ledger (saved) before the study: every finished trial is in both
        self.ledger.end(member_id(trial.number), Status.FAILED)
        self._save_state()
        self.study.tell(trial, state=Status.FAILED.trial_state())
        error = f"{type(exc).__name__}: {exc}"
        self.tracking.trial_ended(
            trial.number, Status.FAILED, None, error, info=lambda: self._trial_info(trial.number)
        )
        self.source.tell(trial.number, trial.params, Status.FAILED.told, None)
        self.progress.finished(Status.FAILED)

    # ------------------------------------------------------------------ arrays
    def _train_arrays(self) -> None:
        """Finish the arrays a crash interrupted, then train new arrays until no trial is left:
        one after another, or up to the executor's ``slots`` at once, each in a thread."""
        assert self.executor is not None
        waiting = [a for a in self.arrays if not a.done]
        most = self.executor.max_slots  # slots may grow as nodes join
        if most == 1:
            for array in waiting:
                self._run_array(array, [], resume=True)
            while (started := self._next_array()) is not None:
                self._run_array(*started, resume=False)
            return
        running: set[Future[None]] = set()
        with ThreadPoolExecutor(most, thread_name_prefix="hfsweep-array") as pool:
            try:
                while True:
                    while len(running) < self.executor.slots:
                        if waiting:
                            running.add(pool.submit(self._run_array, waiting.pop(0), [], True))
                        elif (started := self._next_array()) is not None:
                            running.add(pool.submit(self._run_array, *started, False))
                        else:
                            break
                    if not running:
                        return
                    done, running = wait(running, timeout=0.5, return_when=FIRST_COMPLETED)
                    for future in done:
                        future.result()
            except BaseException:
                # stop the other arrays where they are: their checkpoints are kept for resume
                self.executor.close()
                wait(running)
                raise

    def _next_array(self) -> tuple[_Array, list[Member]] | None:
        """Take a pool's trials as a new array (asking for trials as needed); ``None`` when
        no trial is waiting and none may be asked."""
        with self._lock:
            started = self.packer.next_array(str(len(self.arrays)))
            if started is None:
                return None
            key, taken = started
            array = _Array(index=len(self.arrays), key=key, size=self.sizes[key])
            with self._journal_held():
                for p in taken:
                    self.live[p.number].set_user_attr("array", array.index)
            self.arrays.append(array)
            self._save_state()
            return array, [Member(member_id(p.number), p.config) for p in taken]

    def _run_array(self, array: _Array, members: list[Member], resume: bool) -> None:
        assert self.executor is not None
        folder = self.dir.array(array.index)
        if members or (folder / "array.pt").exists():
            with self._lock:
                shared = self._describe(json.loads(array.key))
                # resumed, its checkpoint holds the members: those whose trials still run
                held = ArrayTrainer.checkpointed_members(folder) if not members else set()
                ids = [m.id for m in members] or sorted(
                    (m for m in held if trial_number(m) in self.live), key=trial_number
                )
                self.progress.array_started(f"array {array.index}: {len(ids)} x {shared}")
                for member in ids:
                    self.tracking.trial_started(self._trial_info(trial_number(member), array.index))
                _log.info(
                    "array %d (%s): %s %d trials: %s",
                    array.index,
                    shared,
                    "resuming with" if resume else "training",
                    len(ids),
                    ", ".join(ids),
                )
            try:
                hooks = ArrayHooks(
                    report=self._locked(self._report),
                    refill=self._locked(lambda: self._refill(array)),
                    on_finish=self._locked(self._on_finish),
                    requeue=self._locked(lambda member: self._requeue(array, member)),
                )
                self.executor.run_array(folder, members, hooks, resume=resume)
            except Stopped:
                return
            except (ExecutorError, _Failed):
                raise
            except Exception as exc:
                if resume and isinstance(unwrap(exc), DamagedCheckpointError):
                    self._restart_damaged(array, unwrap(exc))
                elif not _raised_by_the_task(exc):  # the engine's hooks, files, hfsweep's code
                    if _blame_hfsweep(exc, self.dir.log):
                        _log.error("array %d: hfsweep's own code raised", array.index, exc_info=exc)
                    raise
                else:
                    raise _Failed(f"array {array.index}", unwrap(exc), array.index) from exc
        with self._lock:
            if self._journal is not None:
                # the ends of the array's members must be on disk before its checkpoint (and
                # the record of what it delivered) is removed: a power loss that then tore
                # one off would have its trial trained again
                self._journal.sync()
            array.done = True
            self._save_state()
            self.dir.remove_array(array.index)

    def _restart_damaged(self, array: _Array, exc: BaseException) -> None:
        """Resumed ``array`` found its checkpoint damaged as it loaded it (a state that does
        not fit its model; one that does not load at all is found before, see
        :meth:`_checkpointed`): the file is set aside, and the array's trials still running
        go back to their key's pool, to train again from step 0. The array is then done."""
        assert isinstance(exc, DamagedCheckpointError)
        with self._lock:
            running = sorted(
                n for n, t in self.live.items() if t.user_attrs.get("array") == array.index
            )
            if exc.path.exists():
                self._set_aside(array, exc, running)
            for n in running:
                config = self.sc.trial_config(self.sampled[n])
                self.packer.requeue(array.key, Pending(n, config))

    def _locked(self, hook: Callable[..., Any]) -> Callable[..., Any]:
        """``hook`` run under the engine's lock (arrays in threads call hooks concurrently)."""

        def call(*args: Any) -> Any:
            try:
                with self._journal_held():  # the engine's lock, and one journal lock for the hook
                    return hook(*args)
            except Exception as exc:
                label(exc, HOOK)  # raised by the engine's side, not by the array's training
                raise

        return call

    @contextmanager
    def _journal_held(self) -> Iterator[None]:
        """The engine's lock, then the journal's lock for every append until the block ends
        (see :class:`~hfsweep.storage.journal.GroupedJournalFileBackend`). Every write to the study
        takes the engine's lock, so a hold never waits for a thread that waits for it. Not
        around work that can take long (profiling a new key's array sizes): other processes
        wait for the hold to end. A Ctrl-C or SIGTERM that comes meanwhile stops the sweep
        as the block ends (:func:`~hfsweep._signals.shielded`), not inside a tell or the
        journal's lock."""
        with shielded(), self._lock:
            if self._journal is None:
                # a shared study: no other driver adopts a trial while a hook tells it
                drivers = self.drivers
                with drivers.lock if drivers is not None and drivers.shared else nullcontext():
                    yield
            else:
                with self._journal.held():
                    yield

    # ------------------------------------------------------------------ display
    def _describe(self, config: Mapping[str, Any]) -> str:
        """The values of ``config`` that set its array apart (sampled shared params)."""
        shared = [
            n
            for n in self.sc.space.names
            if n not in self.task.per_member_keys
            and n in config
            and not isinstance(self.sc.space[n], FixedParam)
        ]
        return ", ".join(f"{n}={config[n]!r}" for n in shared) or self.task.name

    def _note(self, text: str) -> None:
        _log.info("%s", text)
        if self.progress.enabled:
            self.progress.note(text)
