"""Several drivers on one study: who asked each trial, which drivers are alive, and one budget.

Optuna users share a study between machines as a matter of course (one PostgreSQL study, a
driver per machine). Each hfsweep driver is one run directory: its identity is a random id kept
in ``<run dir>/driver.json``, so a driver killed and resumed from its run directory is the same
driver and continues its own trials from its arrays' checkpoints. Every trial it asks (or
adopts) carries the user attr ``driver`` with that id; a trial it asks is created with it, in
the same storage write (:func:`hfsweep._compat.ask_with_user_attrs`), so a driver killed just
after a create leaves a trial that is its own, never one that names nobody.

Liveness: a driver on a shared storage writes a heartbeat, the study system attr
``hfsweep:driver:<id>`` (host, pid, run directory, a counter, the wall time), every
:data:`HEARTBEAT_S` seconds from a thread, and a last one marked ``ended`` when it stops. A
driver is *gone* when its last heartbeat says ``ended``; when it runs on this host (in this
process-id namespace) and its process is no more, or its heartbeat is older than
:data:`GRACE_S` by this host's clock; or, on another host, when its counter has not moved for
:data:`GRACE_S` seconds of this driver's own watching (clocks of different machines are never
compared). A storage outage stops every heartbeat at once: when this driver's own heartbeat
is held up for a quarter of the grace period or more (its write waits for the storage to come
back), the other drivers get a whole grace period from then before a heartbeat that did not
move counts as stopped, so drivers that ride out an outage longer than the grace period do not
adopt each other's trials. Optuna's own heartbeats
(``RDBStorage(heartbeat_interval=...)`` with ``fail_stale_trials``) do not fit: they keep one
thread per trial (an array holds many), mark a stale trial ``FAIL`` (its checkpoint could have
continued it, and a retry would be a new trial past the budget) and Optuna 5's journal storage
has none.

A driver trains only the running trials it owns and those whose owner is gone, which it adopts
(under :class:`~hfsweep.storage.study_lock.StudyLock`, so two drivers never adopt one trial) by
setting ``driver`` to its own id; another live driver's trials are left alone and counted.
``budget.trials`` counts every trial of the study, whichever driver asked it: each ask counts
the study's trials and creates one under the study lock, so drivers together ask exactly the
budget. A database server restart ends a database lock with its connection while its holder is
between counting and creating: the ask then takes the lock again and counts again (a lost
connection inside it is not retried in place, see :meth:`StudyLock.fenced`), and before an ask
counts as done the lock's own connection must still hold it (:meth:`StudyLock.intact`). A trial
that was created all the same (its answer lost with the connection, or created while the lock
was lost and found past the budget) is *void*: ended ``FAIL`` with the user attr
:data:`VOID_ATTR` and the reason in ``error``, never trained, and not counted in
``budget.trials``.

``HFSWEEP_DRIVER_HEARTBEAT_S`` and ``HFSWEEP_DRIVER_GRACE_S`` set the two periods (seconds).
"""

from __future__ import annotations

import json
import logging
import math
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from .._compat import study_id, study_storage, trial_for, trial_id
from .._io import atomic_write_text
from .._status import Status
from .study_lock import LockLost, StudyLock

if TYPE_CHECKING:
    import optuna

__all__ = [
    "DRIVER_ATTR",
    "GRACE_S",
    "HEARTBEAT_S",
    "VOID_ATTR",
    "Beat",
    "Drivers",
    "countable",
    "driver_id",
]

_log = logging.getLogger("hfsweep.sweep")
_T = TypeVar("_T")

#: the clocks of heartbeats and of watching other drivers' (tests replace them)
_wall: Callable[[], float] = time.time
_monotonic: Callable[[], float] = time.monotonic
#: the trial user attr naming the driver that trains the trial
DRIVER_ATTR = "driver"
#: the trial user attr of a void trial (asked twice across a lost database lock; not counted)
VOID_ATTR = "void"
#: times an ask takes the study lock again after losing it before the sweep gives up
_ASK_TRIES = 8
#: study system attr prefix of each driver's heartbeat
_BEAT = "hfsweep:driver:"
#: the file in a run directory that keeps its driver's id
_ID_FILE = "driver.json"


def _seconds(name: str, default: float) -> float:
    raw = os.environ.get(name)
    if raw is None:
        return default
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"environment variable {name}={raw!r}: expected seconds, a number > 0")
    return value


#: seconds between a driver's heartbeats
HEARTBEAT_S = _seconds("HFSWEEP_DRIVER_HEARTBEAT_S", 10.0)
#: seconds without a heartbeat after which another host's driver counts as gone
GRACE_S = _seconds("HFSWEEP_DRIVER_GRACE_S", 60.0)


def countable(trials: Iterable[optuna.trial.FrozenTrial]) -> int:
    """How many of ``trials`` count in ``budget.trials``: all but void ones."""
    return sum(1 for t in trials if not t.user_attrs.get(VOID_ATTR))


def driver_id(run_dir: str | os.PathLike[str]) -> str:
    """The id of the driver of ``run_dir``: read from its ``driver.json``, or made and kept
    there the first time."""
    path = Path(run_dir) / _ID_FILE
    try:
        found = json.loads(path.read_text(encoding="utf-8")).get("id")
    except (OSError, ValueError, AttributeError):
        found = None
    if isinstance(found, str) and found:
        return found
    made = uuid.uuid4().hex
    atomic_write_text(path, json.dumps({"id": made}) + "\n")
    return made


@dataclass(frozen=True)
class Beat:
    """A driver's last heartbeat, as recorded in the study."""

    id: str
    host: str
    node: str
    pid: int
    run_dir: str
    seq: int
    time: float
    ended: bool

    @classmethod
    def parse(cls, driver: str, raw: Any) -> Beat | None:
        """The heartbeat ``driver`` wrote, from the study system attr's value ``raw``; None
        for a value that is not one (written by another version, or by hand)."""
        if not isinstance(raw, dict):
            return None
        try:
            return cls(
                driver,
                str(raw["host"]),
                str(raw.get("node", "")),
                int(raw["pid"]),
                str(raw["run_dir"]),
                int(raw["seq"]),
                float(raw["time"]),
                bool(raw.get("ended", False)),
            )
        except (KeyError, TypeError, ValueError):
            return None

    def describe(self) -> str:
        """``driver 3f2a9c1b (process host:1234, run directory runs/a)``."""
        return (
            f"driver {self.id[:8]} (process {self.host}:{self.pid}, run directory {self.run_dir})"
        )


def _node() -> str:
    """This machine's name, and on Linux its process-id namespace: two containers on one host
    may share a host name (host networking) but see different processes under one pid."""
    try:
        namespace = f":{os.stat('/proc/self/ns/pid').st_ino}"
    except OSError:
        namespace = ""
    return socket.gethostname() + namespace


def _alive(pid: int) -> bool:
    """Whether a process ``pid`` exists on this host."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


class Drivers:
    """This driver's identity in the study, its heartbeat, and the trials it may train (see
    the module docstring). ``shared`` is whether other drivers can reach the study (a storage
    URL): without it there is no heartbeat and nothing to adopt after the start."""

    def __init__(
        self,
        study: optuna.Study,
        run_dir: str | os.PathLike[str],
        *,
        shared: bool,
        every: float = HEARTBEAT_S,
        grace: float = GRACE_S,
    ) -> None:
        self.study = study
        self.run_dir = str(run_dir)
        self.id = driver_id(run_dir)
        self.shared = shared
        self.every = every
        self.grace = grace
        self.lock = StudyLock(study_storage(study), study.study_name)
        self.host = socket.gethostname()
        self.node = _node()
        #: trials in the study as of the last count (every driver's)
        self.count = countable(study.get_trials(deepcopy=False))
        #: running trials of live other drivers, as of the last look
        self.foreign = 0
        self._seq = 0
        self._seen: dict[str, tuple[int, float]] = {}  # driver -> (counter, when first seen)
        self._looked = -math.inf  # monotonic time of the last look for abandoned trials
        #: since when the other drivers' heartbeats count (the end of this driver's last
        #: held-up heartbeat), and when the heartbeat being written started (None: none is)
        self._watching_since = -math.inf
        self._beat_started: float | None = None
        self._watch_lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # ------------------------------------------------------------------ heartbeat
    def start(self) -> None:
        """Record a first heartbeat and keep beating from a thread (shared studies only)."""
        if not self.shared:
            return
        _log.info(
            "driver %s (process %s:%d) on study %r; asks and adoptions under a %s",
            self.id[:8],
            self.host,
            os.getpid(),
            self.study.study_name,
            self.lock.kind,
        )
        self.beat()
        self._thread = threading.Thread(target=self._beating, name="hfsweep-heartbeat", daemon=True)
        self._thread.start()

    def beat(self, *, ended: bool = False) -> None:
        """Write this driver's heartbeat into the study. A write held up for a quarter of
        the grace period or more (the storage was away) starts the watching of the other
        drivers again (see :meth:`gone`)."""
        self._seq += 1
        record: dict[str, Any] = {
            "host": self.host,
            "node": self.node,
            "pid": os.getpid(),
            "run_dir": self.run_dir,
            "seq": self._seq,
            "time": _wall(),
            "ended": ended,
        }
        self._beat_started = started = _monotonic()
        try:
            study_storage(self.study).set_study_system_attr(
                study_id(self.study), _BEAT + self.id, record
            )
        finally:
            self._beat_started = None
            if _monotonic() - started >= self.grace / 4:
                self._watch_again()

    def _watch_again(self) -> None:
        """Give every other driver a whole grace period from now: none could beat while
        this driver's heartbeat could not be written."""
        with self._watch_lock:
            now = _monotonic()
            self._watching_since = now
            self._seen = {owner: (seq, now) for owner, (seq, _) in self._seen.items()}

    def _beating(self) -> None:
        while not self._stop.wait(self.every):
            try:
                self.beat()
            except Exception as exc:  # the storage is away for a moment: beat again later
                _log.warning("heartbeat of driver %s not recorded: %s", self.id[:8], exc)

    def close(self) -> None:
        """Stop beating and record that this driver ended: its unfinished trials (an
        interrupted sweep's) may be adopted by other drivers at once."""
        if self._thread is None:
            return
        self._stop.set()
        self._thread.join()
        self._thread = None
        try:
            self.beat(ended=True)
        except Exception as exc:
            from .database import StorageUnavailable  # imports optuna

            # a storage the sweep gave up on has been reported already, once
            quiet = isinstance(exc, StorageUnavailable)
            _log.log(
                logging.INFO if quiet else logging.WARNING,
                "the end of driver %s not recorded (its trials are adopted once its "
                "heartbeat is %g s old): %s",
                self.id[:8],
                GRACE_S,
                exc,
            )

    # ------------------------------------------------------------------ owners
    def beats(self) -> dict[str, Beat]:
        """Every driver's last heartbeat recorded in the study, by driver id."""
        attrs = study_storage(self.study).get_study_system_attrs(study_id(self.study))
        out = {}
        for key, raw in attrs.items():
            if key.startswith(_BEAT):
                beat = Beat.parse(key[len(_BEAT) :], raw)
                if beat is not None:
                    out[beat.id] = beat
        return out

    def gone(self, owner: str | None, beats: dict[str, Beat]) -> bool:
        """Whether driver ``owner`` (``None``: a trial no driver claimed, from an hfsweep
        that recorded none) has stopped."""
        if owner is None:
            return True
        if owner == self.id:
            return False
        beat = beats.get(owner)
        if beat is None or beat.ended:
            return True
        started = self._beat_started
        if started is not None and _monotonic() - started >= self.grace / 4:
            self._watch_again()  # this driver's own heartbeat is held up: the storage is away
        with self._watch_lock:
            now = _monotonic()
            seen = self._seen.get(owner)
            if seen is None or seen[0] != beat.seq:
                seen = self._seen[owner] = (beat.seq, now)
            watched = now - self._watching_since
        if beat.node == self.node:  # one clock, one process table
            if not _alive(beat.pid):
                return True
            return _wall() - beat.time > self.grace and watched >= self.grace
        return now - seen[1] >= self.grace

    def owns(self, trial: optuna.trial.FrozenTrial) -> bool:
        """Whether ``trial`` is this driver's."""
        return trial.user_attrs.get(DRIVER_ATTR) == self.id

    def asked_any(self, trials: Iterable[optuna.trial.FrozenTrial]) -> bool:
        """Whether this driver asked any of ``trials``: on a shared study those that name it,
        on a run directory's own journal any."""
        if self.shared:
            return any(self.owns(t) for t in trials)
        return any(True for _ in trials)

    def claim(
        self, trials: Iterable[optuna.trial.FrozenTrial]
    ) -> tuple[list[optuna.trial.FrozenTrial], list[optuna.trial.FrozenTrial]]:
        """The running trials among ``trials`` this driver trains: ``(its own, adopted)``;
        the adopted ones (their owner gone) now name this driver. Counts the others (a live
        driver's) in :attr:`foreign`. Call it under :attr:`lock`."""
        from optuna.trial import TrialState

        own: list[optuna.trial.FrozenTrial] = []
        adopted: list[optuna.trial.FrozenTrial] = []
        beats = self.beats()
        self.foreign = 0
        for t in trials:
            if t.state != TrialState.RUNNING:
                continue
            if t.user_attrs.get(VOID_ATTR):  # a driver stopped while making it void
                self.void(trial_id(t), t.number, "its driver stopped while making it void")
                continue
            owner = t.user_attrs.get(DRIVER_ATTR)
            if owner == self.id:
                own.append(t)
            elif self._adoptable(t, beats):
                trial_for(self.study, t).set_user_attr(DRIVER_ATTR, self.id)
                adopted.append(t)
                if owner is not None:
                    was = beats.get(owner)
                    _log.warning(
                        "trial %d: adopted from %s, which is gone",
                        t.number,
                        was.describe() if was is not None else f"driver {owner[:8]}",
                    )
            else:
                self.foreign += 1
        return own, adopted

    def _adoptable(self, t: optuna.trial.FrozenTrial, beats: dict[str, Beat]) -> bool:
        """Whether running trial ``t``, not this driver's, may be adopted: its driver is gone.
        A trial that names no driver was asked by an hfsweep that recorded none (it set the
        user attr ``array``) or, in a shared study, by another tool (plain Optuna workers),
        whose trials are left alone."""
        owner = t.user_attrs.get(DRIVER_ATTR)
        if owner is None and self.shared and "array" not in t.user_attrs:
            return False
        return self.gone(owner, beats)

    def adopt_stale(self, *, eager: bool = False) -> list[optuna.trial.FrozenTrial]:
        """Running trials of drivers that have gone since the last look, now this driver's.
        Empty without other drivers. At most one look a second, unless ``eager`` (the
        driver is about to end: the budget is asked)."""
        now = _monotonic()
        if not self.shared or (not eager and now - self._looked < min(self.every, 1.0)):
            return []
        self._looked = now
        from optuna.trial import TrialState

        def others() -> list[optuna.trial.FrozenTrial]:
            running = self.study.get_trials(deepcopy=False, states=(TrialState.RUNNING,))
            return [t for t in running if not self.owns(t)]

        found = others()
        beats = self.beats() if found else {}
        if not any(self._adoptable(t, beats) for t in found):
            self.foreign = len(found)
            return []
        with self.lock:  # looked at again under it: another driver may have adopted them
            return self.claim(others())[1]

    def still_owns(self, trial_id: int) -> bool:
        """Whether the trial is still this driver's, read from the storage now (another driver
        adopts a trial whose driver's heartbeat stopped for longer than the grace period)."""
        if not self.shared:
            return True
        trial = study_storage(self.study).get_trial(trial_id)
        return trial.user_attrs.get(DRIVER_ATTR) == self.id

    # ------------------------------------------------------------------ budget
    def ask(self, ask: Callable[[int], Sequence[_T]], total: int) -> list[_T]:
        """``ask(1)``'s trials (pairs whose first item is an ``optuna.Trial``), each marked as
        this driver's, unless the study already holds ``total`` trials (every driver's, void
        ones not counted): then none. Counting and asking are one step under the study lock,
        taken again and the step looked at again where the lock was lost meanwhile (see the
        module docstring)."""
        unsure: list[_T] = []  # asked while the lock may have been lost
        lost_from: int | None = None  # a try cut off may have created trials from this number
        with self.lock:
            for attempt in range(_ASK_TRIES):
                if attempt:
                    self.lock.renew()
                try:
                    with self.lock.fenced():
                        trials = self.study.get_trials(deepcopy=False)
                        if unsure:
                            assert lost_from is not None
                            answered = {pair[0].number for pair in unsure}  # type: ignore[index]
                            trials = self._void_orphans(trials, lost_from, answered)
                            return self._settle(unsure, trials, total)
                        if lost_from is not None:
                            trials = self._void_cut_off(trials, lost_from)
                        self.count = countable(trials)
                        if self.count >= total:
                            return []
                        lost_from = len(trials)  # trial numbers are 0, 1, ... per study
                        asked = list(ask(1))
                        for pair in asked:
                            trial = pair[0]  # type: ignore[index]
                            if trial.user_attrs.get(DRIVER_ATTR) != self.id:  # not born named
                                trial.set_user_attr(DRIVER_ATTR, self.id)
                        if self.lock.intact():
                            self._void_unanswered(lost_from, asked)
                            self.count += len(asked)
                            return asked
                        unsure = asked
                        _log.warning(
                            "the study lock (%s) was lost while trial(s) %s were asked: "
                            "checking the budget again",
                            self.lock.kind,
                            [pair[0].number for pair in asked],  # type: ignore[index]
                        )
                except LockLost:
                    continue
        from .database import StorageUnavailable  # imports optuna

        raise StorageUnavailable(
            f"the study lock ({self.lock.kind}) of study {self.study.study_name!r} was lost "
            f"{_ASK_TRIES} times in a row while asking a trial (the database keeps closing "
            "connections); the sweep stopped with every finished trial recorded: resume it "
            "once the database is stable"
        )

    def _settle(self, asked: list[_T], trials: list[Any], total: int) -> list[_T]:
        """``asked`` (created while the lock was lost), unless the study now holds more than
        ``total`` counted trials: another driver asked meanwhile under the lock, counting
        without them, so they are the surplus and void. Decided once: a try cut off while
        making them void is finished by the next."""
        mine = {pair[0].number for pair in asked}  # type: ignore[index]
        already = any(t.user_attrs.get(VOID_ATTR) for t in trials if t.number in mine)
        if not already and countable(trials) <= total:
            self.count = countable(trials)
            return asked
        for t in trials:
            if t.number in mine:
                self._void(trial_id(t), t.number, "asked past budget.trials")
        self.count = countable(self.study.get_trials(deepcopy=False))
        return []

    def _void_cut_off(self, trials: list[Any], first: int) -> list[Any]:
        """``trials`` with those a cut-off ask of this driver created made void: running, from
        trial ``first`` on, named by this driver (each is created naming it) and never put in
        an array (the ask was not answered, so nothing trains them). Re-read after."""
        return self._void_orphans(trials, first, set())

    def _void_unanswered(self, first: int, asked: Sequence[Any]) -> None:
        """Make void the trials an answered ask created besides ``asked`` (see
        :meth:`_void_orphans`). Such a trial was created before the answered ones, so where
        ``asked`` are numbered from ``first`` on, one after another, there is none, and the
        study need not be read again."""
        mine = {pair[0].number for pair in asked}
        if mine != set(range(first, first + len(mine))):
            self._void_orphans(self.study.get_trials(deepcopy=False), first, mine)

    def _void_orphans(self, trials: list[Any], first: int, answered: set[int]) -> list[Any]:
        """``trials`` with this driver's orphans from trial ``first`` on made void: running,
        named by this driver, never put in an array and not among the ``answered`` trial
        numbers its ask returned. Nothing would train them: a create whose answer was lost
        (the ask was cut off, or the storage created the trial again in place, as Optuna's
        RDB storage retries a failed create by itself). Re-read after."""
        from optuna.trial import TrialState

        orphans = [
            t
            for t in trials
            if t.number >= first
            and t.number not in answered
            and t.state == TrialState.RUNNING
            and t.user_attrs.get(DRIVER_ATTR) == self.id
            and "array" not in t.user_attrs
        ]
        for t in orphans:
            why = "its ask lost the connection to the storage after creating it"
            self.void(trial_id(t), t.number, f"{why} (a database restart or a dropped connection)")
        return self.study.get_trials(deepcopy=False) if orphans else trials

    def _void(self, ident: int, number: int, why: str) -> None:
        """End trial ``number`` as void, asked across a lost study lock (see the module
        docstring)."""
        self.void(ident, number, f"{why} while the study lock was lost (a database restart)")

    def void(self, ident: int, number: int, why: str) -> None:
        """End running trial ``number`` (storage id ``ident``) as void, saying ``why``: never
        trained, not counted in ``budget.trials``."""
        from optuna.trial import TrialState

        storage = study_storage(self.study)
        if storage.get_trial(ident).state != TrialState.RUNNING:
            return  # made void by an earlier try
        reason = f"void: {why}; never trained, not counted in budget.trials"
        storage.set_trial_user_attr(ident, VOID_ATTR, True)
        storage.set_trial_user_attr(ident, "status", Status.FAILED.value)
        storage.set_trial_user_attr(ident, "error", reason)
        storage.set_trial_state_values(ident, TrialState.FAIL)
        _log.warning("trial %d: %s", number, reason)

    @property
    def seed_offset(self) -> int:
        """Added to the searcher's seed on a shared study, so that drivers that start together
        draw different trials (0 for a run directory's own journal)."""
        return int(self.id[:7], 16) if self.shared else 0
