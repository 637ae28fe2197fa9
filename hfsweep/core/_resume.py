"""The sweep engine's part that opens the run directory and the study and, on resume, rebuilds
the engine's state from the ledger and the study (see :mod:`hfsweep.core._parts`).
"""

from __future__ import annotations

import csv
import json
import logging
import warnings
from collections import Counter
from collections.abc import Mapping
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from .._compat import trial_for, trial_id
from ..config import make_sampler
from ..schedulers import FIFOScheduler, OptunaPruner
from ..storage.db_url import mask, shown
from ..storage.drivers import DRIVER_ATTR, Drivers
from ..storage.journal_url import is_journal, journal_file
from ..training.checkpoint import CheckpointVersionError, DamagedCheckpointError, set_aside
from ..training.trainer import ArrayTrainer, MemberResult
from ._rundir import StateVersionError, member_id, refuse_a_second_start, trial_number
from ._stale import describe_missing, lost_with_them, rank_best, unended, unrecorded_arrays
from .packer import Pending
from .status import Status

if TYPE_CHECKING:
    import optuna


from ._outcome import _KEEP_BEST
from ._parts import _Array, _Parts
from .result import SweepError

__all__: list[str] = []

_log = logging.getLogger("hfsweep.sweep")

#: settings a resumed sweep may change: they do not touch anything already trained
_MAY_CHANGE_ON_RESUME = (
    "budget.trials",
    "budget.time_limit",
    "output",
    "backend",
    "ray.",
    "storage_retry",
    "tracking",
)

#: what to do about a state.json that is missing or cannot be read
_STATE_LOST = (
    "It holds the scheduler's state and the log of its decisions, which the study cannot "
    "rebuild: resuming without it would take other pruning decisions. Restore the file (from "
    "a backup), or start the sweep again with another `output` directory; the trials finished "
    "so far stay readable with `hfsweep report`"
)


def _flatten(d: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        path = f"{prefix}.{k}" if prefix else str(k)
        if isinstance(v, Mapping) and v:
            out.update(_flatten(v, path))
        else:
            out[path] = v
    return out


class _Resume(_Parts):
    """Opening the run directory and the study; rebuilding the state on resume."""

    def _prepare_dir(self) -> dict[str, Any] | None:
        # again, now that the directory is locked: another sweep may have started since
        refuse_a_second_start(self.dir.path, self.sc.storage, self.sc.source, resume=self.resume)
        try:
            state = self.dir.read_state()
        except StateVersionError as exc:
            raise SweepError(f"cannot resume {self.dir.path}: {exc}") from None
        except ValueError as exc:
            raise SweepError(f"cannot resume {self.dir.path}: {exc}. {_STATE_LOST}") from None
        if self.dir.holds_sweep(self.sc.storage) and self.dir.config.exists():
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
            from ..storage.database import open_storage, study_exists

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
            from ..storage.journal import GroupedJournalFileBackend

            # the run directory's journal, or one drivers share (see hfsweep.storage.journal_url)
            path = self.dir.journal if storage is None else journal_file(storage)
            if storage is None and self.dir.state.exists() and not path.is_file():
                # state.json is written after the journal: the study was there, and is lost
                raise SweepError(self._study_lost(f"{path} is missing"))
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

    def _study_lost(self, what: str, counted: str | None = None) -> str:
        """The refusal to go on without the run directory's study (its journal, ``what``
        happened to it): what was lost, as ``trials.csv`` lists it (or as ``counted`` says,
        from what this run holds in memory), and the ways on."""
        try:
            with open(self.dir.trials_csv, newline="", encoding="utf-8") as f:
                rows: list[dict[str, str]] | None = list(csv.DictReader(f))
        except (OSError, csv.Error, UnicodeDecodeError):
            rows = None
        if rows:
            by_status = Counter(r.get("status") or r.get("state") or "?" for r in rows)
            listed = (
                f"{len(rows)} trial(s) as {self.dir.trials_csv} lists them ("
                + ", ".join(f"{n} {status}" for status, n in sorted(by_status.items()))
                + ")"
            )
        else:
            listed = f"{self.dir.trials_csv} lists no trial" if rows == [] else ""
        listed = "; ".join(x for x in (counted, listed) if x) or "no record of its trials is left"
        kept = [
            n for n in ("trials.csv", "histories", "checkpoints") if (self.dir.path / n).exists()
        ]
        again = f"hfsweep run {self.sc.source} --resume" if self.sc.source else "resume=True"
        return (
            f"{what}: it held this sweep's Optuna study, which is lost with it: {listed}. "
            "Resuming without it would start a new, empty study and train every trial again, "
            f"so hfsweep stops here. Restore {self.dir.journal.name} from a backup (or the "
            f"copy of the whole run directory), then continue with `{again}`; or start the "
            "sweep over in another `output` directory (`hfsweep run ... --output NEW_DIR`)"
            + (f". What finished stays readable in {', '.join(kept)}" if kept else "")
        )

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
                self.ledger.restore(saved, _Array)
                self.packer.sizes = (
                    self.ledger.sizes
                )  # one dict: the packer sizes, the ledger saves
            except (KeyError, TypeError, ValueError, AttributeError) as exc:
                raise SweepError(
                    f"cannot resume {self.dir.path}: {self.dir.state} (with the changes in "
                    f"{self.dir.state_log.name}) is not the state this sweep wrote "
                    f"({type(exc).__name__}: {exc}). {_STATE_LOST}"
                ) from None
            self._catch_up(trials)
        self.asked = len(trials)
        with self.drivers.lock:  # no other driver adopts or asks meanwhile
            # read again under the lock: a trial another driver adopted since the read above
            # still names this driver there, and would be trained (and told) by both
            trials = self.study.get_trials(deepcopy=False)
            own, adopted = self.drivers.claim(trials)
        taken = {member_id(t.number) for t in [*own, *adopted]}
        for a in self.arrays:
            if a.done:
                self.dir.remove_array(a.index)  # a crash may have come before its removal
        # ends the trainer delivered (it will not deliver them again) whose record in the
        # study was lost with a torn journal: told again below (read before an array whose
        # checkpoint is gone or damaged is dropped, with its folder)
        delivered = {
            member: result
            for a in self.arrays
            if not a.done
            for member, result in ArrayTrainer.delivered_results(self.dir.array(a.index)).items()
            if member in taken
        }
        # members each unfinished array's checkpoint holds; the others go back to a pool
        known: dict[int, set[str]] = {}
        damaged: set[int] = set()  # arrays whose checkpoint was damaged, set aside
        for a in self.arrays:
            if not a.done:
                members = self._checkpointed(a, trials)
                known[a.index] = members if members is not None else set()
                if members is None:
                    damaged.add(a.index)
        for a in self.arrays:
            if a.index in known:
                self._resume_or_drop(a, known, taken, damaged=a.index in damaged)
        held = set().union(*known.values())
        retell: list[MemberResult] = []
        for t in sorted(trials, key=lambda t: t.number):
            if t.state == TrialState.RUNNING and member_id(t.number) not in taken:
                continue  # another live driver trains it
            if t.state != TrialState.RUNNING:
                status = Status.of_trial_state(t.state)
                if status.final:
                    self.progress.states[status] += 1
                    try:
                        told = self._params(t)
                    except ValueError:  # failed before all its params were recorded
                        told = dict(t.params)
                    self.source.tell(t.number, told, status.told, t.value)
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
        self._recall_mix(trials)
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

    def _recall_mix(self, trials: list[optuna.trial.FrozenTrial]) -> None:
        """The packer's mix of keys asked so far (what :meth:`Packer.queued_arrays` estimates
        the trials still to ask from, for the elastic allocator), rebuilt from the trials the
        study holds: a resumed packer has asked nothing yet, and would otherwise count every
        trial left as an array of its own until it asks one. Every driver's trials count (they
        are draws from the same searcher's space); one not asked yet (WAITING), or whose config
        the task refuses, is left out."""
        from optuna.trial import TrialState

        for t in trials:
            if t.state == TrialState.WAITING:
                continue
            try:
                config = self.sc.trial_config(self._params(t))
                key = self.task.compatibility_key(config)
            except (ValueError, TypeError):  # failed before all its params were recorded
                continue
            self.packer.asked[key] += 1

    def _catch_up(self, trials: list[optuna.trial.FrozenTrial]) -> None:
        """Bring a restored ledger that is older than the study up to it: the ends of this
        driver's finished trials and the finished arrays it lacks, rebuilt from the study, or a
        refusal where more is lost than those (see :mod:`hfsweep.core._stale`)."""
        drivers = self.drivers
        assert drivers is not None

        def owns(t: optuna.trial.FrozenTrial) -> bool:
            # a run directory's own study, written before trials named their driver: all
            return drivers.owns(t) or (not drivers.shared and DRIVER_ATTR not in t.user_attrs)

        missing = unended(self.ledger, trials, owns)
        arrays, unrecoverable = unrecorded_arrays(
            self.ledger, trials, owns, lambda k: (self.dir.array(k) / "array.pt").exists()
        )
        if not missing and not arrays and unrecoverable is None:
            return
        files = f"{self.dir.state} (with {self.dir.state_log.name})"
        lost = [
            f"for trial {n}, {what}"
            for n, what in lost_with_them(
                self.ledger,
                missing,
                ranks_reports=not isinstance(self.scheduler, FIFOScheduler | OptunaPruner),
                by_steps=self.sc.budget.resource == "steps",
            ).items()
        ]
        if unrecoverable is not None:
            lost.append(unrecoverable)
        finished = (
            f" (its study holds {describe_missing(t.number for t in missing)} of this sweep as "
            "finished, which it does not list as ended)"
            if missing
            else ""
        )
        if lost:
            raise SweepError(
                f"cannot resume {self.dir.path}: {files} is older than its study{finished}, "
                "and what it lacks cannot be rebuilt from the study: "
                + "; ".join(lost)
                + ". It was probably restored from an older backup. Restore the newest copy of "
                f"both {self.dir.state.name} and {self.dir.state_log.name} of this run "
                "directory, or start the sweep again with another `output` directory; the "
                "trials finished so far stay readable with `hfsweep report`"
            )
        for index, held in sorted(arrays.items()):
            key = self._key_of(held[0])
            size = self.ledger.sizes.get(key, len(held))
            self.arrays.append(_Array(index=index, key=key, size=size, done=True))
            self.dir.remove_array(index)
        for t in missing:
            self.ledger.end(member_id(t.number), Status.of_trial_state(t.state))
        self.best, dropped = rank_best(
            self.best,
            missing,
            has_checkpoint=lambda n: self.dir.checkpoint(n).exists(),
            rank=self._rank,
            keep=_KEEP_BEST,
        )
        for n in dropped:
            self.dir.checkpoint(n).unlink(missing_ok=True)
        rebuilt = [describe_missing(t.number for t in missing) + " as ended"] if missing else []
        if arrays:
            rebuilt.append(f"array{'s' * (len(arrays) > 1)} {', '.join(map(str, arrays))}")
        message = (
            f"{files} did not list {' nor '.join(rebuilt)}, which the study holds as finished "
            "(the sweep was killed as it stopped, or the file is an older copy restored from a "
            "backup): rebuilt from the study"
        )
        _log.warning("%s", message)
        warnings.warn(message, stacklevel=6)  # hs.sweep's caller

    def _key_of(self, t: optuna.trial.FrozenTrial) -> str:
        """The compatibility key of finished trial ``t``'s config (``"{}"`` if the task no
        longer takes it): the record of the array it trained in."""
        try:
            return self.task.compatibility_key(self.sc.trial_config(self._params(t)))
        except (ValueError, TypeError):
            return "{}"

    def _checkpointed(self, a: _Array, trials: list[optuna.trial.FrozenTrial]) -> set[str] | None:
        """The members unfinished array ``a``'s checkpoint holds (none without one), or
        ``None`` when it was damaged: then it is set aside (see :meth:`_set_aside`), and the
        array's running trials start again."""
        from optuna.trial import TrialState

        try:
            return ArrayTrainer.checkpointed_members(self.dir.array(a.index), a.key)
        except CheckpointVersionError as exc:
            raise SweepError(f"cannot resume {self.dir.path}: {exc}") from None
        except DamagedCheckpointError as exc:
            running = [
                t.number
                for t in trials
                if t.state == TrialState.RUNNING and t.user_attrs.get("array") == a.index
            ]
            self._set_aside(a, exc, running)
            return None

    def _set_aside(self, a: _Array, exc: DamagedCheckpointError, running: list[int]) -> None:
        """Move array ``a``'s damaged checkpoint out of the array's folder (which goes when
        the array is dropped), as ``arrays/array-K.pt.damaged-<UTC time>``, and warn once,
        naming both files and what happens to the array's trials."""
        copy = set_aside(exc.path, self.dir.path / "arrays" / f"array-{a.index}.pt")
        trials = (
            f"its running trial{'s' * (len(running) != 1)} "
            + ", ".join(map(str, running))
            + " start again from step 0, with the same configs and seeds"
            if running
            else "it held no running trial"
        )
        message = (
            f"{exc}. The file is kept as {copy} and not read again; array {a.index} is not "
            f"resumed: {trials}; the trials it had finished keep their results"
        )
        _log.warning("%s", message)
        warnings.warn(message, stacklevel=7)  # hs.sweep's caller

    def _resume_or_drop(
        self, a: _Array, known: dict[int, set[str]], taken: set[str], *, damaged: bool = False
    ) -> None:
        """Resume unfinished array ``a`` if its checkpoint holds a running trial of this driver;
        else (it wrote no checkpoint yet, every trial it held has ended, or other drivers adopted
        them while this one was away) drop it: its running trials go back to their pools."""
        mine = sorted(known[a.index] & taken, key=trial_number)
        if mine:
            _log.info("array %d: resuming %s from its checkpoint", a.index, ", ".join(mine))
            return
        if damaged:  # set aside: the warning said so
            pass
        elif not known[a.index]:  # stopped before its first evaluation boundary
            _log.info(
                "array %d: stopped before its first checkpoint; its running trials start again",
                a.index,
            )
        else:
            _log.info("array %d: none of its trials is left to this driver; dropped", a.index)
        del known[a.index]
        a.done = True
        self.dir.remove_array(a.index)

    def _take_up(self, t: optuna.trial.FrozenTrial) -> tuple[str, dict[str, Any]] | None:
        """Track running trial ``t`` (one of this driver's, after a resume or an adoption):
        ``(compatibility key, config)``, or ``None`` after failing it (see :meth:`_admit`)."""
        import optuna

        trial = trial_for(self.study, t)
        try:
            # the recorded params; a custom searcher's trial must have all of them, an
            # Optuna trial interrupted while it was being sampled draws the rest
            sampled = self.sc.space.sample(
                optuna.trial.FixedTrial(t.params) if self.custom is not None else trial
            )
        except (ValueError, TypeError) as exc:
            missing = [name for name in self.sc.space.names if name not in t.params]
            if missing and "array" not in t.user_attrs:
                # its driver stopped between creating it and recording the searcher's
                # config: nothing can train it, and the budget asks another in its place
                assert self.drivers is not None
                self.drivers.void(
                    trial_id(t),
                    t.number,
                    f"its driver stopped before the searcher's params {missing} were recorded",
                )
                self.source.tell(t.number, dict(t.params), Status.FAILED.told, None)
                return None
            self._fail_unstarted(trial, exc)
            return None
        keyed = self._admit(trial, sampled)
        if keyed is not None and t.intermediate_values:
            self.reported[t.number] = max(t.intermediate_values)
        return keyed
