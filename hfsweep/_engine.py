"""The sweep engine: searcher -> pools of compatible trials -> arrays -> scheduler -> study.

:func:`sweep` runs a whole sweep from a sweep file, a mapping in its schema or a
:class:`~hfsweep.config.SweepConfig`. It asks the searcher (an Optuna sampler, or a
:class:`~hfsweep.searchers.Searcher`) for trials, puts each in the pool of its compatibility key,
trains a pool's trials as one fused array once it holds the array's size (``fusion.size``, or
the profiler's choice), hands every evaluation of an array to the trial scheduler at once (a
joint decision per rung), refills a slot the moment its trial ends with a new trial of the same
key, and tells the study how each trial ended.

Crash safety: the Optuna study (a journal file in the run directory by default) records every
trial, its params, intermediate values and end; each array's trainer checkpoints at every
evaluation; and ``state.json`` holds the scheduler's state with a log of its decisions. A sweep
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
import warnings
from collections import Counter
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from ._dburl import mask, shown
from ._io import atomic_save, grouped_sync
from ._journal_url import is_journal, journal_file
from ._packed import UnsafeFileError
from ._preflight import preflight
from ._progress import Progress
from ._rundir import RunDir, RunDirBusy, StateVersionError, member_id, trial_number
from ._usercode import HOOK, NOT_TRAINING, describe, label, phase_of, unwrap
from .config import SweepConfig, load_sweep, make_sampler, make_searcher, parse_sweep
from .core._drivers import Drivers
from .core.packer import NON_LEARNING, Packer, Pending, limit_for_learning
from .executors import Executor, ExecutorError, LocalExecutor, Stopped
from .schedulers import Decision, OptunaPruner, Report, make_scheduler
from .search_spaces import FixedParam
from .searchers import Searcher
from .searchers._source import CustomSource, OptunaSource, TrialSource
from .trainer import ArrayTrainer, Evaluation, Member, MemberResult, _DataCache

if TYPE_CHECKING:
    import optuna

    from ._journal import GroupedJournalFileBackend

__all__ = ["SweepError", "SweepResult", "TrainingError", "sweep"]

_log = logging.getLogger("hfsweep.sweep")

#: settings a resumed sweep may change: they do not touch anything already trained
_MAY_CHANGE_ON_RESUME = (
    "budget.trials",
    "budget.time_limit",
    "output",
    "backend",
    "ray.",
    "storage_retry",
)
#: the clock of a sweep's elapsed time and ``budget.time_limit`` (tests replace it with a fake)
_clock: Callable[[], float] = time.perf_counter
#: completed trials whose model state_dict is kept in checkpoints/
_KEEP_BEST = 3
#: seconds between rewrites of trials.csv and best.json while a sweep runs (each rewrite reads
#: the whole study, so rewriting after every trial would cost O(trials^2) over a sweep); the
#: journal and state.json are written at every trial end, and both files again at the end
_PUBLISH_EVERY_S = 5.0
_DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16}
_STATE = {"completed": "COMPLETE", "stopped": "PRUNED", "failed": "FAIL"}
#: what to do about a state.json that is missing or cannot be read
_STATE_LOST = (
    "It holds the scheduler's state and the log of its decisions, which the study cannot "
    "rebuild: resuming without it would take other pruning decisions. Restore the file (from "
    "a backup), or start the sweep again with another `output` directory; the trials finished "
    "so far stay readable with `hfsweep report`"
)
#: Optuna state name -> what a custom searcher's tell() gets
_TOLD = {"COMPLETE": "complete", "PRUNED": "pruned", "FAIL": "failed"}


class SweepError(Exception):
    """A sweep cannot start or go on: the message says why and what to do."""


class TrainingError(SweepError):
    """Training stopped because code raised while an array trained (or while the profiler
    measured one): almost always the task's code (its model's forward, its loss, its data),
    which would fail every trial alike.

    The trials that array held and every other unfinished trial are marked ``FAIL`` in the
    study, the reason in their user attr ``error``; no trial is left ``RUNNING``. The exception
    that stopped the sweep is the ``__cause__``; the message names the array, the part of the
    task that failed (the forward pass, the loss, ...) and, for a forward pass, the submodule.
    """


class _Failed(SweepError):
    """An array's training (or a profile) raised: ``where`` it happened, the exception, and the
    array's index (``None`` for a profile). The engine turns it into :class:`TrainingError`
    (should one escape, it still reads as a sweep error)."""

    def __init__(self, where: str, exc: Exception, array: int | None = None) -> None:
        super().__init__(f"{where} raised {describe(exc)}")
        self.where = where
        self.exc = exc
        self.array = array


@dataclass
class SweepResult:
    """What a finished (or interrupted) sweep produced.

    ``study`` is the Optuna study (every trial with its params, intermediate values, state and
    user attrs ``array``, ``status``, ``steps``); ``best_*`` describe the best completed trial
    (``None``/empty when none completed); ``counts`` the trials by Optuna state name.
    """

    run_dir: Path
    study: optuna.Study
    metric: str
    mode: str
    best_trial: optuna.trial.FrozenTrial | None
    best_value: float | None
    best_params: dict[str, Any]
    best_config: dict[str, Any]
    counts: dict[str, int]
    wall_s: float
    arrays: int
    best_checkpoint: Path | None = None
    top: list[optuna.trial.FrozenTrial] = field(default_factory=list)

    def summary(self, top: int = 5) -> str:
        """The end-of-sweep report: counts, the best trial and a table of the top trials."""
        c = self.counts
        done = c.get("COMPLETE", 0) + c.get("PRUNED", 0) + c.get("FAIL", 0)
        lines = [
            f"Sweep finished in {self.wall_s:.1f} s: {done} trials ({c.get('COMPLETE', 0)} "
            f"complete, {c.get('PRUNED', 0)} pruned, {c.get('FAIL', 0)} failed) in "
            f"{self.arrays} fused array(s)"
            + (f", {c['RUNNING']} still running" if c.get("RUNNING") else "")
        ]
        failed = [t for t in self.study.get_trials(deepcopy=False) if t.state.name == "FAIL"]
        if failed:
            reasons = Counter(str(t.user_attrs.get("error", "no error recorded")) for t in failed)
            shown = "; ".join(f"{n} x {why}" for why, n in reasons.most_common(2))
            more = f"; {len(reasons) - 2} other reasons" if len(reasons) > 2 else ""
            lines.append(f"Failed: {shown}{more} (trials.csv, column user_attrs_error)")
        if self.best_trial is None:
            lines.append("No trial completed, so there is no best trial.")
        else:
            lines.append(
                f"Best {self.metric}: {self.best_value:.6g} (trial {self.best_trial.number})"
            )
            lines.append(
                "Best params: " + ", ".join(f"{k}={_fmt(v)}" for k, v in self.best_params.items())
            )
            rows = self.top[:top]
            names = sorted({p for t in rows for p in t.params})
            header = ["trial", self.metric, *names]
            table = [header] + [
                [str(t.number), _fmt(t.value), *(_fmt(t.params.get(n, "")) for n in names)]
                for t in rows
            ]
            widths = [max(len(r[i]) for r in table) for i in range(len(header))]
            lines.append(f"Top {len(rows)} completed trials:")
            lines += [
                "  " + "  ".join(v.rjust(w) for v, w in zip(r, widths, strict=True)) for r in table
            ]
        files = "trials.csv, best.json, histories/, checkpoints/"
        lines.append(f"Run directory: {self.run_dir} ({files})")
        return "\n".join(lines)


def sweep(
    config: str | os.PathLike[str] | Mapping[str, Any] | SweepConfig,
    *,
    resume: bool = False,
    progress: bool = True,
    searcher: Searcher | None = None,
) -> SweepResult:
    """Run the sweep ``config`` describes and return its result.

    ``config`` is a sweep file's path, a mapping in the sweep file schema (relative paths are
    taken from the working directory) or a validated :class:`~hfsweep.config.SweepConfig`.
    ``resume=True`` continues the sweep in the config's ``output`` directory where it stopped
    (or starts it, if there is none); without it, an ``output`` that already holds a sweep is
    refused. ``progress`` prints a live status line to stderr. ``searcher`` replaces the
    config's Optuna sampler with a search algorithm of your own.

    Before anything is written, the sweep is checked against this machine (an output that
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
    for ``storage_retry`` seconds, then ``hfsweep._storage.StorageUnavailable`` (a
    :class:`SweepError`) stops the sweep, resumable.
    """
    if isinstance(config, SweepConfig):
        sc = config
    elif isinstance(config, Mapping):
        sc = parse_sweep(config)
    else:
        sc = load_sweep(config)
    preflight(sc)  # before the run directory is created: a sweep that cannot run writes nothing
    data = _DataCache()  # the dry run's data, which the local backend's arrays train on
    if sc.backend != "ray" or sc.ray.address is None:
        # before anything is written, and before the time limit's clock starts
        from ._dryrun import dry_run

        dry_run(sc, data=data)
    if searcher is None and sc.searcher.custom:
        searcher = make_searcher(sc.searcher)
    return _Engine(sc, resume=resume, progress=progress, searcher=searcher, data=data).run()


@dataclass
class _Array:
    index: int
    key: str
    size: int
    done: bool = False


class _Engine:
    """One run of one sweep (see the module docstring)."""

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
        #: the pools of waiting trials, the array size per key, and refill
        self.packer: Packer[Pending] = Packer(
            ask=self._ask,
            size=self._size,
            may_ask=self._can_ask,
            budget=self.total,
            on_sized=lambda key, size: self._save_state(),
        )
        self.arrays: list[_Array] = []
        self.decisions: dict[str, bool] = {}
        self.ended: set[str] = set()
        self.best: list[tuple[float, int]] = []  # (value, number) of the kept checkpoints
        self.live: dict[int, optuna.Trial] = {}  # running trials
        self.sampled: dict[int, dict[str, Any]] = {}
        self.reported: dict[int, int] = {}  # last Optuna step reported per running trial
        self._last_step: dict[str, int] = {}  # per member, for the throughput shown
        self.asked = 0
        self.elapsed_before = 0.0
        self.start = _clock()
        self._published = -math.inf  # perf_counter() of the last trials.csv/best.json write
        #: the default journal's backend (None with a storage URL), and whether the run
        #: directory is locked to this sweep
        self._journal: GroupedJournalFileBackend | None = None
        self._dir_locked = False
        #: loaded data the local executor's arrays start with (the dry run's)
        self._data = data if data is not None else _DataCache()
        #: this driver among those sharing the study (set when the study is open)
        self.drivers: Drivers | None = None

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

    def _run(self) -> SweepResult:
        saved = self._prepare_dir()
        with grouped_sync(), self._logging(), _quiet_optuna(), self._executor():
            self.study = self._open_study()
            self.source: TrialSource = (
                OptunaSource(self.study, self.sc.space)
                if self.custom is None
                else CustomSource(self.study, self.sc.space, self.custom)
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
                self._save_state()
                self._publish_last()
                self.progress.close()
            result = self._result()
            _log.info("%s", result.summary())
        return result

    # ------------------------------------------------------------------ set-up and resume
    @contextmanager
    def _executor(self) -> Iterator[None]:
        """The executor for the config's backend while the sweep runs, closed after."""
        sc = self.sc
        dtype = _DTYPES[sc.fusion.dtype]
        if sc.backend == "ray":
            from .executors._ray import RayExecutor

            try:
                self.executor = RayExecutor(
                    self.task,
                    device=sc.fusion.device,
                    dtype=dtype,
                    eval_every=sc.fusion.eval_every,
                    settings=sc.ray,
                )
            except ExecutorError as exc:
                raise SweepError(f"backend ray: {exc}") from exc
            self.where = f"a Ray worker (up to {self.executor.slots} array(s) at once)"
        else:
            device = sc.fusion.device
            if device == "auto":
                device = "cuda" if torch.cuda.is_available() else "cpu"
            if device.startswith("cuda") and not torch.cuda.is_available():
                raise SweepError(f"fusion.device is {device!r} but torch sees no CUDA device")
            self.executor = LocalExecutor(
                self.task,
                device=device,
                dtype=dtype,
                eval_every=sc.fusion.eval_every,
                data=self._data,
            )
            self.where = str(self.executor.device)
        try:
            yield
        finally:
            self.executor.close()

    def _prepare_dir(self) -> dict[str, Any] | None:
        try:
            state = self.dir.read_state()
        except StateVersionError as exc:
            raise SweepError(f"cannot resume {self.dir.path}: {exc}") from None
        except ValueError as exc:
            raise SweepError(f"cannot resume {self.dir.path}: {exc}. {_STATE_LOST}") from None
        has_study = state is not None or (self.sc.storage is None and self.dir.journal.exists())
        if has_study and not self.resume:
            raise SweepError(
                f"{self.dir.path} already holds a sweep; continue it with "
                f"`hfsweep run {self.sc.source or 'SWEEP'} --resume` (hs.sweep(..., "
                "resume=True)), or set `output` to another directory"
            )
        if has_study and self.dir.config.exists():
            before = json.loads(self.dir.config.read_text(encoding="utf-8"))
            before["storage"] = mask(before.get("storage"))  # as an older hfsweep wrote it
            now = json.loads(json.dumps(self.sc.to_dict()))
            flat_b, flat_n = _flatten(before), _flatten(now)
            changed = [
                path
                for path in sorted(flat_b.keys() | flat_n.keys())
                if flat_b.get(path) != flat_n.get(path)
                and not path.startswith(_MAY_CHANGE_ON_RESUME)
            ]
            if changed:
                raise SweepError(
                    f"cannot resume {self.dir.path}: the sweep config changed since it started: "
                    + "; ".join(f"{p}: {flat_b.get(p)!r} -> {flat_n.get(p)!r}" for p in changed[:5])
                    + f". Only {', '.join(_MAY_CHANGE_ON_RESUME)} may change on resume; restore "
                    "the config or start a new sweep in another output directory"
                )
        self.dir.path.mkdir(parents=True, exist_ok=True)
        self.dir.write_config(self.sc.to_dict())
        return state

    def _open_study(self) -> optuna.Study:
        import optuna

        storage: Any = self.sc.storage
        if storage is not None and not is_journal(storage):
            from ._storage import open_storage, study_exists

            resume = f"hfsweep run {self.sc.source} --resume" if self.sc.source else "resume=True"
            storage = open_storage(
                storage, retry_s=self.sc.storage_retry_s, resume=resume, say=self.progress.note
            )
            if self.dir.state.exists() and not study_exists(storage, self.sc.study_name):
                raise SweepError(
                    f"cannot resume {self.dir.path}: storage {shown(self.sc.storage or '')} "
                    f"holds no study {self.sc.study_name!r}, which this sweep started: the URL "
                    "(or an environment variable it names) now names another database; set it "
                    "back, or start a new sweep in another output directory"
                )
        else:
            from ._journal import GroupedJournalFileBackend

            # the run directory's journal, or one that drivers share (see _journal_url)
            path = self.dir.journal if storage is None else journal_file(storage)
            if storage is not None and self.dir.state.exists() and not path.is_file():
                raise SweepError(
                    f"cannot resume {self.dir.path}: the journal {path} (storage {storage}) "
                    "that holds its study is missing; restore it, or start a new sweep in "
                    "another output directory"
                )
            self._journal = GroupedJournalFileBackend(path)
            if self._dir_locked and storage is None:  # no other sweep can be writing it
                self._journal.clear_stale_lock()
            torn = self._journal.drop_torn_tail()
            if torn is not None:
                message = (
                    f"{torn.describe(path)}. The trial it belonged to is told "
                    "again from its array's checkpoint, or trained again"
                )
                _log.warning("%s", message)
                warnings.warn(message, stacklevel=5)  # hs.sweep's caller
            try:
                storage = optuna.storages.JournalStorage(self._journal)
            except ValueError as exc:  # a line in the middle that is no record
                raise SweepError(
                    f"{path} cannot be read as an Optuna journal ({exc}): it is "
                    "damaged before its last record, which resuming cannot repair; restore it "
                    "from a backup, or start the sweep again in another output directory"
                ) from None
        pruner = (
            self.scheduler.pruner
            if isinstance(self.scheduler, OptunaPruner)
            else optuna.pruners.NopPruner()
        )
        try:
            study = optuna.create_study(
                storage=storage,
                study_name=self.sc.study_name,
                sampler=make_sampler(self.sc.searcher, self.sc.space),
                pruner=pruner,
                direction="maximize" if self.sc.mode == "max" else "minimize",
                load_if_exists=self.resume,
            )
        except ImportError as exc:  # the storage URL's database driver
            raise SweepError(
                f"storage {shown(self.sc.storage or '')}: {exc}; install the database driver "
                'it names (for PostgreSQL, pip install "hfsweep[postgres]")'
            ) from exc
        except optuna.exceptions.DuplicatedStudyError:
            raise SweepError(
                f"storage {shown(self.sc.storage or '')} already has a study named "
                f"{self.sc.study_name!r}; resume it with --resume, or set another study_name"
            ) from None
        self.drivers = Drivers(study, self.dir.path, shared=self.sc.storage is not None)
        self.drivers.start()
        asked = len(study.get_trials(deepcopy=False))
        if asked or self.drivers.seed_offset:
            # the sampler's seed restarted with this process: offset it by the trials it
            # already drew, else it would draw those trials' params again (and by the
            # driver's, so that drivers sharing the study draw different ones)
            seed = self.sc.searcher.seed + asked + self.drivers.seed_offset
            study.sampler = make_sampler(replace(self.sc.searcher, seed=seed), self.sc.space)
        return study

    def _restore(self, saved: dict[str, Any] | None) -> None:
        """Rebuild the engine's state from ``state.json`` and the study."""
        from optuna.trial import TrialState

        trials = self.study.get_trials(deepcopy=False)
        assert self.drivers is not None
        if saved is None and self.drivers.asked_any(trials):
            raise SweepError(
                f"cannot resume {self.dir.path}: its study holds {len(trials)} trial(s) but "
                f"{self.dir.state} is missing. {_STATE_LOST}"
            )
        if saved is not None:
            try:
                self.scheduler.load_state_dict(saved["scheduler"])
                self.decisions = {str(k): bool(v) for k, v in saved["decisions"].items()}
                self.ended = set(saved["ended"])
                self.arrays = [_Array(**a) for a in saved["arrays"]]
                self.sizes = {str(k): int(v) for k, v in saved["sizes"].items()}
                self.best = [(float(v), int(n)) for v, n in saved["best"]]
                self.elapsed_before = float(saved["elapsed_s"])
            except (KeyError, TypeError, ValueError, AttributeError) as exc:
                raise SweepError(
                    f"cannot resume {self.dir.path}: {self.dir.state} is not the state this "
                    f"sweep wrote ({type(exc).__name__}: {exc}). {_STATE_LOST}"
                ) from None
        self.asked = len(trials)
        with self.drivers.lock:  # no other driver adopts or asks meanwhile
            own, adopted = self.drivers.claim(trials)
        taken = {member_id(t.number) for t in [*own, *adopted]}
        for a in self.arrays:
            if a.done:
                self.dir.remove_array(a.index)  # a crash may have come before its removal
        # members each unfinished array's checkpoint holds; the others go back to a pool
        known = {
            a.index: ArrayTrainer.checkpointed_members(self.dir.array(a.index))
            for a in self.arrays
            if not a.done
        }
        for a in self.arrays:
            if a.index in known:
                self._resume_or_drop(a, known, taken)
        held = set().union(*known.values())
        # ends the trainer delivered (it will not deliver them again) whose record in the
        # study was lost with a torn journal: told again below
        delivered = {
            member: result
            for a in self.arrays
            if not a.done
            for member, result in ArrayTrainer.delivered_results(self.dir.array(a.index)).items()
            if member in taken
        }
        retell: list[MemberResult] = []
        for t in sorted(trials, key=lambda t: t.number):
            if t.state == TrialState.RUNNING and member_id(t.number) not in taken:
                continue  # another live driver trains it
            if t.state != TrialState.RUNNING:
                if t.state in (TrialState.COMPLETE, TrialState.PRUNED, TrialState.FAIL):
                    self.progress.states[t.state.name] += 1
                    try:
                        told = self._params(t)
                    except ValueError:  # failed before all its params were recorded
                        told = dict(t.params)
                    self.source.tell(t.number, told, _TOLD[t.state.name], t.value)
                continue
            keyed = self._take_up(t)
            if keyed is None:
                continue
            key, config = keyed
            member = member_id(t.number)
            if member in delivered:
                retell.append(delivered[member])
            elif member not in held:  # no array's checkpoint holds it: it starts again
                self._pool(key, Pending(t.number, config), size_now=True)
        for result in retell:
            _log.warning(
                "trial %d: its end was lost from the study (a torn journal); told again from "
                "its array's checkpoint",
                trial_number(result.id),
            )
            with self._journal_held():
                self._on_finish(result)
        best = self._best_trial()
        if best is not None and best.value is not None:
            self.progress.set_best(best.value, best.number)
        if trials:
            _log.info(
                "resuming: %d trials in the study, %d running, %d arrays unfinished",
                len(trials),
                len(self.live),
                len(known),
            )
        if self.drivers.foreign:
            _log.info("%d running trials belong to other drivers", self.drivers.foreign)

    def _resume_or_drop(self, a: _Array, known: dict[int, set[str]], taken: set[str]) -> None:
        """Resume unfinished array ``a`` if its checkpoint holds a running trial of this driver;
        else (every trial it held has ended, or other drivers adopted them while this one was
        away) drop it."""
        mine = sorted(known[a.index] & taken, key=trial_number)
        if mine:
            _log.info("array %d: resuming %s from its checkpoint", a.index, ", ".join(mine))
            return
        _log.info("array %d: none of its trials is left to this driver; dropped", a.index)
        del known[a.index]
        a.done = True
        self.dir.remove_array(a.index)

    def _take_up(self, t: optuna.trial.FrozenTrial) -> tuple[str, dict[str, Any]] | None:
        """Track running trial ``t`` (one of this driver's, after a resume or an adoption):
        ``(compatibility key, config)``, or ``None`` after failing it (see :meth:`_admit`)."""
        import optuna

        trial = optuna.Trial(self.study, t._trial_id)
        try:
            # the recorded params; a custom searcher's trial must have all of them, an
            # Optuna trial interrupted while it was being sampled draws the rest
            sampled = self.sc.space.sample(
                optuna.trial.FixedTrial(t.params) if self.custom is not None else trial
            )
        except (ValueError, TypeError) as exc:
            self._fail_unstarted(trial, exc)
            return None
        keyed = self._admit(trial, sampled)
        if keyed is not None and t.intermediate_values:
            self.reported[t.number] = max(t.intermediate_values)
        return keyed

    def _save_state(self) -> None:
        self.dir.write_state(
            {
                "scheduler": self.scheduler.state_dict(),
                "decisions": self.decisions,
                "ended": sorted(self.ended),
                "arrays": [vars(a) for a in self.arrays],
                "sizes": self.sizes,
                "best": [list(b) for b in self.best],
                "elapsed_s": self._elapsed(),
            }
        )

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

    @property
    def sizes(self) -> dict[str, int]:
        """The array size of every key sized so far (the packer's)."""
        return self.packer.sizes

    @sizes.setter
    def sizes(self, sizes: dict[str, int]) -> None:
        self.packer.sizes = sizes

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
        _log.info("array size %d for %s: %s", size, self._describe(config), reason)
        return size

    def _fail_unstarted(self, trial: optuna.Trial, exc: Exception) -> None:
        from optuna.trial import TrialState

        _log.warning("trial %d failed before training: %s", trial.number, exc)
        trial.set_user_attr("status", "failed")
        trial.set_user_attr("error", f"{type(exc).__name__}: {exc}"[:500])
        self.study.tell(trial, state=TrialState.FAIL)
        self.source.tell(trial.number, trial.params, "failed", None)
        self.progress.finished("FAIL")

    def _stop(self, failed: _Failed) -> TrainingError:
        """End the sweep after ``failed``: every trial still running (the failed array's, the
        other arrays', those waiting in a pool) is told ``FAIL`` with the reason in its user
        attr ``error``, the unfinished arrays are dropped (their trials have ended), and the
        error to raise is returned. Code that raises in one array's training step would raise
        in every array's, so the sweep does not go on to fail the rest one by one."""
        import optuna
        from optuna.trial import TrialState

        exc = failed.exc
        phase = phase_of(exc)
        cause = describe(exc)
        raised = "raised" + (f" in {phase} of task {self.task.name!r}" if phase else "")
        _log.error("%s %s: %s", failed.where, raised, cause, exc_info=exc)
        hit: list[int] = []
        others = 0
        with self._journal_held():
            running = self.study.get_trials(deepcopy=False, states=(TrialState.RUNNING,))
            assert self.drivers is not None
            for t in sorted(filter(self.drivers.owns, running), key=lambda t: t.number):
                mine = failed.array is not None and t.user_attrs.get("array") == failed.array
                if mine:
                    hit.append(t.number)
                    error = f"{failed.where} {raised}: {cause}"
                else:
                    others += 1
                    error = f"stopped unfinished: {failed.where} {raised}: {cause}"
                trial = self.live.pop(t.number, None) or optuna.Trial(self.study, t._trial_id)
                trial.set_user_attr("status", "failed")
                trial.set_user_attr("error", error[:1000])
                trial_id = member_id(t.number)
                if trial_id not in self.ended:
                    self.scheduler.on_trial_end(trial_id, "failed")
                    self.ended.add(trial_id)
                self.study.tell(trial, state=TrialState.FAIL)
                self.reported.pop(t.number, None)
                sampled = self.sampled.pop(t.number, None)
                try:
                    self.source.tell(t.number, sampled or dict(t.params), "failed", None)
                except Exception as searcher_exc:  # the sweep is stopping for another reason
                    _log.warning(
                        "the searcher could not be told of trial %d: %s", t.number, searcher_exc
                    )
                self.progress.finished("FAIL")
            for a in self.arrays:
                if not a.done:  # every trial it held has ended
                    a.done = True
                    self.dir.remove_array(a.index)
            self._save_state()
        trials = f" (trial{'s' if len(hit) > 1 else ''} {', '.join(map(str, hit))})" if hit else ""
        told = []
        if hit:
            told.append(f"its {len(hit)} trial{'s' if len(hit) > 1 else ''}")
        if others:
            other = " other" if hit else ""
            told.append(
                f"{'the ' if not hit else ''}{others}{other} unfinished trial" + "s" * (others > 1)
            )
        marked = (
            f"{' and '.join(told)} {'are' if len(hit) + others > 1 else 'is'} marked FAIL with "
            "this error (user attr 'error'); no trial is left running"
            if told
            else "no trial was running"
        )
        resume = f"hfsweep run {self.sc.source} --resume" if self.sc.source else "resume=True"
        return TrainingError(
            f"training stopped: {failed.where}{trials} {raised}: {cause}. Code that fails in "
            f"one array fails in the next, so the sweep stopped: {marked}. Fix the task, then "
            f"start a new sweep or continue this one ({resume}; the failed trials count "
            f"towards budget.trials). The traceback is in {self.dir.log}."
        )

    # ------------------------------------------------------------------ arrays
    def _train_arrays(self) -> None:
        """Finish the arrays a crash interrupted, then train new arrays until no trial is left:
        one after another, or up to the executor's ``slots`` at once, each in a thread."""
        assert self.executor is not None
        waiting = [a for a in self.arrays if not a.done]
        if self.executor.slots == 1:
            for array in waiting:
                self._run_array(array, [], resume=True)
            while (started := self._next_array()) is not None:
                self._run_array(*started, resume=False)
            return
        running: set[Future[None]] = set()
        with ThreadPoolExecutor(self.executor.slots, thread_name_prefix="hfsweep-array") as pool:
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
                self.progress.array_started(f"array {array.index}: {len(members)} x {shared}")
                _log.info(
                    "array %d (%s): %s %d trials: %s",
                    array.index,
                    shared,
                    "resuming with" if resume else "training",
                    len(members),
                    ", ".join(m.id for m in members),
                )
            try:
                self.executor.run_array(
                    folder,
                    members,
                    report=self._locked(self._report),
                    refill=self._locked(lambda: self._refill(array)),
                    on_finish=self._locked(self._on_finish),
                    resume=resume,
                    requeue=self._locked(lambda member: self._requeue(array, member)),
                )
            except Stopped:
                return
            except (ExecutorError, _Failed):
                raise
            except Exception as exc:
                if phase_of(exc) in NOT_TRAINING:  # the engine's hooks, the checkpoint's files
                    raise
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
        (see :class:`~hfsweep._journal.GroupedJournalFileBackend`). Every write to the study
        takes the engine's lock, so a hold never waits for a thread that waits for it. Not
        around work that can take long (profiling a new key's array sizes): other processes
        wait for the hold to end."""
        with self._lock:
            if self._journal is None:
                # a shared study: no other driver adopts a trial while a hook tells it
                drivers = self.drivers
                with drivers.lock if drivers is not None and drivers.shared else nullcontext():
                    yield
            else:
                with self._journal.held():
                    yield

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
        return Member(member_id(p.number), p.config)

    # ------------------------------------------------------------------ hooks
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
            logged = self.decisions.get(f"{e.member}@{e.step}")
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
        decided = self.scheduler.decide([r for _, r in todo])
        for e, r in todo:
            go = decided[r.trial] is Decision.CONTINUE
            answer[e.member] = go
            self.decisions[f"{e.member}@{e.step}"] = go
            steps += e.step - int(self._last_step.get(e.member, 0))
            self._last_step[e.member] = e.step
        # every decision is saved before the searcher hears of any, so an error or a kill in
        # a custom searcher's report() cannot leave the scheduler ahead of the decision log
        self._save_state()
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
        from optuna.trial import TrialState

        number = trial_number(result.id)
        trial = self.live.get(number)
        if trial is None or self._lost(number):
            return  # told before a crash (the trainer delivers at least once), or adopted
        if result.id not in self.ended:
            self.scheduler.on_trial_end(result.id, result.status)
            self.ended.add(result.id)
        self.dir.write_history(number, result.history)
        value = result.metrics.get(self.sc.metric)
        state = _STATE[result.status]
        error = result.error
        if state == "COMPLETE" and (value is None or not math.isfinite(value)):
            state, error = "FAIL", f"{self.sc.metric} is {value!r}"
        trial.set_user_attr("status", result.status)
        trial.set_user_attr("steps", result.steps)
        if result.start_step is not None:  # where in its array's data it started (a refill's)
            trial.set_user_attr("start_step", result.start_step)
        if error is not None:
            trial.set_user_attr("error", error)
        if state == "COMPLETE" and value is not None and result.state is not None:
            self._keep_checkpoint(number, value, result.state["model"])
        self._save_state()
        if state == "COMPLETE":
            self.study.tell(trial, value)
        else:
            self.study.tell(trial, state=TrialState[state])
        told = value if state != "FAIL" else None
        self.source.tell(number, self.sampled.pop(number), _TOLD[state], told)
        del self.live[number]
        self.reported.pop(number, None)
        self.progress.finished(state)
        if state == "COMPLETE" and value is not None and self._improves(value, number):
            self.progress.set_best(value, number)
        self._publish()
        _log.info(
            "trial %d %s after %d steps: %s=%s",
            number,
            state.lower(),
            result.steps,
            self.sc.metric,
            value,
        )

    def _lost(self, number: int) -> bool:
        """Whether running trial ``number`` was adopted by another driver (this one's
        heartbeat stopped for longer than the grace period): it is forgotten here."""
        assert self.drivers is not None
        if self.drivers.still_owns(self.live[number]._trial_id):
            return False
        _log.warning("trial %d: adopted by another driver while this one trained it", number)
        del self.live[number]
        self.sampled.pop(number, None)
        self.reported.pop(number, None)
        return True

    def _publish(self, force: bool = False) -> None:
        """Rewrite trials.csv and best.json from the study, at most every
        ``_PUBLISH_EVERY_S`` seconds unless ``force``."""
        now = time.perf_counter()
        if not force and now - self._published < _PUBLISH_EVERY_S:
            return
        self._published = now
        self.dir.write_trials(self.study.get_trials(deepcopy=False))
        self.dir.write_best(self._best_record(self._best_trial()))

    def _publish_last(self) -> None:
        """The last :meth:`_publish` of a run. While an error stops the sweep, a storage that
        is not answering (the likely error) leaves the files as they are, and the error that
        stopped the sweep is the one raised: resuming writes them again."""
        from ._storage import StorageUnavailable

        stopping = sys.exc_info()[1] is not None
        try:
            self._publish(force=True)
        except StorageUnavailable as exc:
            if not stopping:
                raise
            _log.warning("trials.csv and best.json are not updated: %s", exc)

    def _keep_checkpoint(self, number: int, value: float, model: Mapping[str, Any]) -> None:
        """Keep trial ``number``'s weights if it is among the best completed trials."""
        others = [b for b in self.best if b[1] != number]  # on_finish may come twice
        ranked = sorted([*others, (value, number)], key=lambda b: self._rank(*b))
        keep, drop = ranked[:_KEEP_BEST], ranked[_KEEP_BEST:]
        if (value, number) in keep:
            atomic_save(dict(model), self.dir.checkpoint(number))
        for _, n in drop:
            if n != number:
                self.dir.checkpoint(n).unlink(missing_ok=True)
        self.best = keep

    # ------------------------------------------------------------------ results
    def _rank(self, value: float | None, number: int) -> tuple[float, int]:
        """Sort key of a completed trial: best value first, then lower trial number."""
        sign = 1.0 if self.sc.mode == "max" else -1.0
        return (-sign * float(value or 0.0), number)

    def _improves(self, value: float, number: int) -> bool:
        """Whether completed trial ``number`` ranks before the best shown so far."""
        shown = self.progress.best
        return shown is None or self._rank(value, number) < self._rank(*shown)

    def _ranked(self) -> list[optuna.trial.FrozenTrial]:
        """The completed trials, best first."""
        from optuna.trial import TrialState

        done = self.study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
        return sorted(done, key=lambda t: self._rank(t.value, t.number))

    def _best_trial(self) -> optuna.trial.FrozenTrial | None:
        ranked = self._ranked()
        return ranked[0] if ranked else None

    def _best_record(self, best: optuna.trial.FrozenTrial | None) -> dict[str, Any] | None:
        if best is None:
            return None
        config = self.task.resolve(self.sc.trial_config(self._params(best)))
        ckpt = self.dir.checkpoint(best.number)
        return {
            "number": best.number,
            "metric": self.sc.metric,
            "value": best.value,
            "params": best.params,
            "config": config,
            "checkpoint": str(ckpt) if ckpt.exists() else None,
        }

    def _params(self, t: optuna.trial.FrozenTrial) -> dict[str, Any]:
        """The sampled config of a finished trial (its params plus the space's fixed values)."""
        import optuna

        return self.sc.space.sample(optuna.trial.FixedTrial(t.params))

    def _result(self) -> SweepResult:
        from optuna.trial import TrialState

        trials = self.study.get_trials(deepcopy=False)
        counts = {s.name: 0 for s in (TrialState.COMPLETE, TrialState.PRUNED, TrialState.FAIL)}
        counts["RUNNING"] = 0
        for t in trials:
            if t.state.name in counts:
                counts[t.state.name] += 1
        top = self._ranked()
        best = top[0] if top else None
        record = self._best_record(best)
        ckpt = self.dir.checkpoint(best.number) if best is not None else None
        return SweepResult(
            run_dir=self.dir.path,
            study=self.study,
            metric=self.sc.metric,
            mode=self.sc.mode,
            best_trial=best,
            best_value=best.value if best is not None else None,
            best_params=dict(best.params) if best is not None else {},
            best_config=record["config"] if record is not None else {},
            counts=counts,
            wall_s=_clock() - self.start,
            arrays=len(self.arrays),
            best_checkpoint=ckpt if ckpt is not None and ckpt.exists() else None,
            top=top,
        )

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

    @contextmanager
    def _logging(self) -> Iterator[None]:
        """Log hfsweep's INFO messages to ``sweep.log`` in the run directory."""
        logger = logging.getLogger("hfsweep")
        handler = logging.FileHandler(self.dir.log, encoding="utf-8")
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
        handler.setLevel(logging.INFO)
        level = logger.level
        logger.addHandler(handler)
        if logger.getEffectiveLevel() > logging.INFO:
            logger.setLevel(logging.INFO)
        try:
            yield
        finally:
            logger.removeHandler(handler)
            logger.setLevel(level)
            handler.close()


@contextmanager
def _quiet_optuna() -> Iterator[None]:
    """Optuna's per-trial INFO lines and experimental-feature warnings would drown the progress
    line; the run directory's log and trials.csv hold the same information."""
    import optuna

    verbosity = optuna.logging.get_verbosity()
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
            yield
    finally:
        optuna.logging.set_verbosity(verbosity)


def _flatten(d: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        path = f"{prefix}.{k}" if prefix else str(k)
        if isinstance(v, Mapping) and v:
            out.update(_flatten(v, path))
        else:
            out[path] = v
    return out


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)
