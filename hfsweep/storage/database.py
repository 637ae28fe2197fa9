"""A sweep's database storage: the connection check made before anything is written, and the
retries that carry a sweep through a database restart.

:func:`check_connection` connects once with a short timeout, so that a wrong password, port or
database name is refused as a config error naming the server's own message, before the run
directory exists. :func:`open_storage` opens the storage the engine uses: SQLAlchemy checks a
pooled connection before using it (``pool_pre_ping``), and :class:`RetryingStorage` tries a
call that lost its connection (the server restarting, a connection closed) again with backoff
for up to ``storage_retry`` seconds; then :class:`StorageUnavailable` stops the sweep, and
every call after it fails at once. URLs are shown with their password masked (:mod:`.db_url`).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Container, Iterator, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

from optuna.storages import BaseStorage

from .._compat_optuna import BaseHeartbeat, FrozenStudy
from .._errors import SweepError
from .._signals import interruptible
from .db_url import for_driver, mask, scrub
from .study_lock import LockLost
from .transient import causes, is_transient

if TYPE_CHECKING:
    import optuna
    from optuna.distributions import BaseDistribution
    from optuna.study import StudyDirection
    from optuna.trial import FrozenTrial, TrialState

__all__ = [
    "RetryingStorage",
    "StorageUnavailable",
    "check_connection",
    "engine_kwargs",
    "open_storage",
    "server_message",
    "study_exists",
]

_log = logging.getLogger("hfsweep.storage")
_T = TypeVar("_T")

#: seconds a connection attempt may take before it counts as failed
CONNECT_TIMEOUT_S = 5
#: SQLAlchemy driver -> its connect() argument for a timeout in seconds
_TIMEOUT_ARG = {
    "psycopg2": "connect_timeout",
    "psycopg": "connect_timeout",
    "pg8000": "timeout",
    "pymysql": "connect_timeout",
    "mysqldb": "connect_timeout",
    "mysqlconnector": "connection_timeout",
}
#: first and longest wait between two tries of a call that lost the connection
_FIRST_WAIT_S = 0.5
_LONGEST_WAIT_S = 5.0


class StorageUnavailable(SweepError):
    """The sweep's database did not answer for the whole ``storage_retry`` time.

    The message names the storage (its password masked), the server's last message and how to
    continue; the sweep stopped with every finished trial recorded, so it can be resumed. The
    CLI exits 1 on it (a failure at run time, not a mistake in the sweep file).
    """


# ---------------------------------------------------------------------------- connecting
def _driver(url: str) -> str:
    from sqlalchemy.engine import make_url

    return str(make_url(url).get_dialect().driver)


def engine_kwargs(url: str, timeout_s: float = CONNECT_TIMEOUT_S) -> dict[str, Any]:
    """SQLAlchemy ``create_engine`` arguments for the sweep's storage (Optuna's RDBStorage
    ``engine_kwargs``): a pooled connection is checked before use (``pool_pre_ping``), so one
    that a database restart closed is replaced instead of failing the call; and a connection
    attempt gives up after ``timeout_s`` where the driver takes a timeout."""
    kwargs: dict[str, Any] = {"pool_pre_ping": True}
    arg = _TIMEOUT_ARG.get(_driver(url))
    if arg is not None:
        kwargs["connect_args"] = {arg: max(2, round(timeout_s))}  # libpq's minimum is 2 s
    return kwargs


def server_message(exc: BaseException, url: str) -> str:
    """The database driver's own message behind ``exc`` (``FATAL: password authentication
    failed for user "me"``), on one line, without the password."""
    found = exc
    for cause in causes(exc):
        orig = getattr(cause, "orig", None)  # SQLAlchemy's DBAPIError: the driver's error
        if isinstance(orig, BaseException):
            found = orig
            break
        found = cause
    text = " ".join(str(found).split()) or type(found).__name__
    return scrub(text, url)


def check_connection(url: str, timeout_s: float = CONNECT_TIMEOUT_S) -> str | None:
    """Connect to the database of ``url`` (as :func:`~hfsweep.storage.db_url.for_driver` gives
    it) once; return None if that works, else the server's message. A file database (SQLite) is
    not opened: opening creates the file, and a check writes nothing. Gives up after about
    ``timeout_s`` seconds even where the driver takes no timeout."""
    from sqlalchemy import create_engine
    from sqlalchemy.engine import make_url
    from sqlalchemy.pool import NullPool

    if make_url(url).get_backend_name() == "sqlite":
        return None
    outcome: list[str | None] = []

    def connect() -> None:
        engine = create_engine(url, poolclass=NullPool, **engine_kwargs(url, timeout_s))
        try:
            with engine.connect():
                pass
            outcome.append(None)
        except Exception as exc:
            outcome.append(server_message(exc, url))
        finally:
            engine.dispose()

    thread = threading.Thread(target=connect, name="hfsweep-storage-check", daemon=True)
    thread.start()
    thread.join(timeout_s + 2)
    if not outcome:
        return f"no answer within {timeout_s + 2:g} s (is the host reachable?)"
    return outcome[0]


# ---------------------------------------------------------------------------- retrying
class _Retrier:
    """Runs a storage call, and again while it fails with a lost or refused connection
    (:func:`is_transient`): after 0.5, 1, 2, 4, 5, 5... seconds, until ``retry_s`` seconds have
    passed since it first failed; then raises :class:`StorageUnavailable`, and every later
    call raises it at once (the sweep is stopping, and its last writes, publishing results in a
    ``finally``, must not wait the whole time again). ``where`` names the storage in messages
    (the masked URL), ``url`` is the URL whose password is scrubbed from them, ``resume`` the
    advice for continuing; ``say`` shows the retries as they happen (the sweep's progress
    line: a stall of minutes is explained), besides the log; ``sleep`` and ``clock`` are for
    tests."""

    def __init__(
        self,
        *,
        where: str,
        url: str,
        retry_s: float | None,
        resume: str,
        say: Callable[[str], None] | None = None,
        sleep: Callable[[float], None] = time.sleep,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.where = where
        self.url = url
        self.retry_s = retry_s or 0.0
        self.resume = resume
        self.say = say
        self.sleep = sleep
        self.clock = clock
        self.gave_up: StorageUnavailable | None = None
        self._local = threading.local()

    @contextlib.contextmanager
    def fenced(self) -> Iterator[None]:
        """A block of this thread in which a lost connection raises
        :class:`~hfsweep.storage.study_lock.LockLost` at once instead of being tried again (see
        :meth:`~hfsweep.storage.study_lock.StudyLock.fenced`)."""
        self._local.fenced = getattr(self._local, "fenced", 0) + 1
        try:
            yield
        finally:
            self._local.fenced -= 1

    def run(
        self,
        call: Callable[[], _T],
        *,
        settled: Callable[[], _T | None] | None = None,
        reset: Callable[[], None] | None = None,
    ) -> _T:
        """``call()``, tried again while it fails with a transient error. ``settled``, asked
        when a retry fails otherwise, returns the call's result if an earlier try did the work
        although its answer was lost (else None); ``reset`` runs before each retry."""
        if self.gave_up is not None:  # the error that stopped the sweep is its __cause__
            raise StorageUnavailable(
                f"the sweep's storage {self.where} is not answering: the sweep gave up on it "
                "(the error before this one says why)"
            ) from self.gave_up
        first: float | None = None
        wait = _FIRST_WAIT_S
        while True:
            try:
                result = call()
            except Exception as exc:
                if not is_transient(exc):
                    done = settled() if first is not None and settled is not None else None
                    if done is not None:
                        return done
                    raise
                if getattr(self._local, "fenced", 0):
                    if reset is not None:
                        reset()
                    _log.warning(
                        "storage %s: %s, while holding the study lock; taking the lock again",
                        self.where,
                        server_message(exc, self.url),
                    )
                    raise LockLost(server_message(exc, self.url)) from exc
                now = self.clock()
                if first is None:
                    first = now
                    self._tell(
                        f"storage {self.where}: {server_message(exc, self.url)}; trying again "
                        f"for up to {self.retry_s:g} s"
                    )
                if now - first >= self.retry_s:
                    raise self._give_up(exc, now - first) from exc
                with interruptible():  # a stop need not wait out the database
                    self.sleep(min(wait, first + self.retry_s - now))
                wait = min(wait * 2, _LONGEST_WAIT_S)
                if reset is not None:
                    reset()
                continue
            if first is not None:
                self._tell(
                    f"storage {self.where}: reachable again after {self.clock() - first:.1f} s"
                )
            return result

    def _tell(self, text: str) -> None:
        _log.warning("%s", text)
        if self.say is not None:
            self.say(text)

    def _give_up(self, exc: BaseException, waited: float) -> StorageUnavailable:
        retried = (
            f"for {waited:.0f} s (storage_retry: {self.retry_s:g} s)"
            if self.retry_s
            else "(storage_retry: null, so no second try)"
        )
        error = StorageUnavailable(
            f"the sweep's storage {self.where} could not be reached {retried}: "
            f"{server_message(exc, self.url)}. The sweep stopped; every trial that finished is "
            f"recorded there. Once the database answers again, continue with {self.resume}; a "
            "longer storage_retry rides out longer outages"
        )
        error.__cause__ = exc
        self.gave_up = error
        _log.error("%s", error)
        return error


def open_storage(
    url: str,
    *,
    retry_s: float | None,
    resume: str,
    say: Callable[[str], None] | None = None,
) -> RetryingStorage:
    """The Optuna storage for the sweep's ``storage`` URL (as written: its ``${NAME}``
    references are expanded here): Optuna's cached RDB storage with :func:`engine_kwargs`,
    opened (which creates its tables) and used through :class:`RetryingStorage`, whose
    retries ``say`` shows."""
    from optuna.storages import RDBStorage, _CachedStorage

    expanded = for_driver(url)  # the password percent-encoded: SQLAlchemy reads it whole
    retrier = _Retrier(
        where=str(mask(expanded)), url=expanded, retry_s=retry_s, resume=resume, say=say
    )

    def build() -> BaseStorage:
        for attempt in range(_CREATE_TRIES):
            try:
                return _CachedStorage(RDBStorage(expanded, engine_kwargs=engine_kwargs(expanded)))
            except Exception as exc:
                if attempt == _CREATE_TRIES - 1 or not _created_meanwhile(exc):
                    raise
                # another driver created the schema between Optuna's check and its CREATE:
                # it exists now, and the next try finds it
                _log.info(
                    "storage %s: another process was creating its tables; opening it again",
                    mask(expanded),
                )
                time.sleep(_CREATE_WAIT_S * (attempt + 1))
        raise AssertionError("unreachable")

    return RetryingStorage(retrier.run(build), retrier)


#: tries to open an RDB storage whose tables another process is creating at the same moment
_CREATE_TRIES = 5
_CREATE_WAIT_S = 0.2


def _created_meanwhile(exc: BaseException) -> bool:
    """Whether opening an RDB storage failed because another process created the same table,
    type or row at the same moment (two drivers started together on an empty database:
    Optuna checks what exists, then creates it, and the slower one's CREATE or its version
    row collides): SQLAlchemy's ``IntegrityError``, or a ``ProgrammingError`` saying that
    the object already exists."""
    from sqlalchemy import exc as sa

    return any(
        isinstance(cause, sa.IntegrityError)
        or (isinstance(cause, sa.ProgrammingError) and "already exists" in str(cause))
        for cause in causes(exc)
    )


def study_exists(storage: BaseStorage, name: str) -> bool:
    """Whether ``storage`` holds a study named ``name``. A resumed sweep checks it: where the
    URL comes from an environment variable, sweep.json cannot tell that it now names another
    database, in which resuming would start over in a new, empty study."""
    return any(study.study_name == name for study in storage.get_all_studies())


class RetryingStorage(BaseStorage, BaseHeartbeat):
    """An Optuna storage whose every call ``retrier`` runs (see :class:`_Retrier`): a sweep
    rides out a database restart instead of dying at its first lost connection.

    A trial's end whose first try was committed although its answer was lost is not told
    twice: the retry finds the trial finished, and counts as done if it ended as asked.
    """

    def __init__(self, inner: BaseStorage, retrier: _Retrier) -> None:
        self._inner = inner
        self._retrier = retrier

    @property
    def inner(self) -> BaseStorage:
        """The wrapped storage."""
        return self._inner

    def _retry(self, call: Callable[[], _T], settled: Callable[[], _T | None] | None = None) -> _T:
        return self._retrier.run(call, settled=settled, reset=self._forget_session)

    def _forget_session(self) -> None:
        """Drop this thread's database session, which may hold a dead connection."""
        with contextlib.suppress(Exception):  # the session is being thrown away
            self._inner.remove_session()

    # ------------------------------------------------------------------ studies
    def create_new_study(
        self, directions: Sequence[StudyDirection], study_name: str | None = None
    ) -> int:
        return self._retry(lambda: self._inner.create_new_study(directions, study_name))

    def delete_study(self, study_id: int) -> None:
        self._retry(lambda: self._inner.delete_study(study_id))

    def set_study_user_attr(self, study_id: int, key: str, value: Any) -> None:
        self._retry(lambda: self._inner.set_study_user_attr(study_id, key, value))

    def set_study_system_attr(self, study_id: int, key: str, value: Any) -> None:
        self._retry(lambda: self._inner.set_study_system_attr(study_id, key, value))

    def get_study_id_from_name(self, study_name: str) -> int:
        return self._retry(lambda: self._inner.get_study_id_from_name(study_name))

    def get_study_name_from_id(self, study_id: int) -> str:
        return self._retry(lambda: self._inner.get_study_name_from_id(study_id))

    def get_study_directions(self, study_id: int) -> list[StudyDirection]:
        return self._retry(lambda: self._inner.get_study_directions(study_id))

    def get_study_user_attrs(self, study_id: int) -> dict[str, Any]:
        return self._retry(lambda: self._inner.get_study_user_attrs(study_id))

    def get_study_system_attrs(self, study_id: int) -> dict[str, Any]:
        return self._retry(lambda: self._inner.get_study_system_attrs(study_id))

    def get_all_studies(self) -> list[FrozenStudy]:
        return self._retry(self._inner.get_all_studies)

    # ------------------------------------------------------------------ trials
    def create_new_trial(self, study_id: int, template_trial: FrozenTrial | None = None) -> int:
        return self._retry(lambda: self._inner.create_new_trial(study_id, template_trial))

    def set_trial_param(
        self,
        trial_id: int,
        param_name: str,
        param_value_internal: float,
        distribution: BaseDistribution,
    ) -> None:
        self._retry(
            lambda: self._inner.set_trial_param(
                trial_id, param_name, param_value_internal, distribution
            )
        )

    def get_trial_id_from_study_id_trial_number(self, study_id: int, trial_number: int) -> int:
        return self._retry(
            lambda: self._inner.get_trial_id_from_study_id_trial_number(study_id, trial_number)
        )

    def get_trial_number_from_id(self, trial_id: int) -> int:
        return self._retry(lambda: self._inner.get_trial_number_from_id(trial_id))

    def get_trial_param(self, trial_id: int, param_name: str) -> float:
        return self._retry(lambda: self._inner.get_trial_param(trial_id, param_name))

    def set_trial_state_values(
        self, trial_id: int, state: TrialState, values: Sequence[float] | None = None
    ) -> bool:
        def settled() -> bool | None:  # a lost answer to a committed end: the trial has it
            trial = self._inner.get_trial(trial_id)
            same = trial.state == state and (values is None or trial.values == list(values))
            return True if same else None

        return self._retry(
            lambda: self._inner.set_trial_state_values(trial_id, state, values), settled
        )

    def set_trial_intermediate_value(
        self, trial_id: int, step: int, intermediate_value: float
    ) -> None:
        self._retry(
            lambda: self._inner.set_trial_intermediate_value(trial_id, step, intermediate_value)
        )

    def set_trial_user_attr(self, trial_id: int, key: str, value: Any) -> None:
        self._retry(lambda: self._inner.set_trial_user_attr(trial_id, key, value))

    def set_trial_system_attr(self, trial_id: int, key: str, value: Any) -> None:
        self._retry(lambda: self._inner.set_trial_system_attr(trial_id, key, value))

    def get_trial(self, trial_id: int) -> FrozenTrial:
        return self._retry(lambda: self._inner.get_trial(trial_id))

    def get_all_trials(
        self,
        study_id: int,
        deepcopy: bool = True,
        states: Container[TrialState] | None = None,
    ) -> list[FrozenTrial]:
        return self._retry(lambda: self._inner.get_all_trials(study_id, deepcopy, states))

    def get_n_trials(
        self, study_id: int, state: tuple[TrialState, ...] | TrialState | None = None
    ) -> int:
        return self._retry(lambda: self._inner.get_n_trials(study_id, state))

    def get_best_trial(self, study_id: int) -> FrozenTrial:
        return self._retry(lambda: self._inner.get_best_trial(study_id))

    def remove_session(self) -> None:
        self._inner.remove_session()

    # ------------------------------------------------------------------ heartbeats
    def record_heartbeat(self, trial_id: int) -> None:
        self._retry(lambda: self._heartbeat.record_heartbeat(trial_id))

    def _get_stale_trial_ids(self, study_id: int) -> list[int]:
        return self._retry(lambda: self._heartbeat._get_stale_trial_ids(study_id))

    def get_heartbeat_interval(self) -> int | None:
        inner = self._inner
        return inner.get_heartbeat_interval() if isinstance(inner, BaseHeartbeat) else None

    def get_heartbeat_stale_trial_callback(
        self,
    ) -> Callable[[optuna.Study, FrozenTrial], None] | None:
        inner = self._inner
        if isinstance(inner, BaseHeartbeat):
            return inner.get_heartbeat_stale_trial_callback()
        return None

    @property
    def _heartbeat(self) -> BaseHeartbeat:
        assert isinstance(self._inner, BaseHeartbeat), "heartbeats of a storage without them"
        return self._inner
