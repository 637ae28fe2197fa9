"""What the parts of the sweep engine share.

The engine (:class:`~hfsweep.core.loop._Engine`) is one object whose jobs live in separate
modules, each a mixin of :class:`_Parts`: opening and resuming the study
(:mod:`~hfsweep.core._resume`), the executor for the backend (:mod:`~hfsweep.core._backend`),
the executor's hooks (:mod:`~hfsweep.core._hooks`: decisions, trial ends, refill) and the
sweep's outcome (:mod:`~hfsweep.core._outcome`: stopping on a failure, publishing results, the
best trials). :class:`_Parts` declares the state they share
and the methods one part calls on another, so each module reads, and type-checks, alone.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..config import SweepConfig
from ..executors import Executor
from ..schedulers import TrialScheduler
from ..searchers import Searcher, TrialSource
from ..storage.drivers import Drivers
from ..tracking import Tracking, TrialInfo
from ..training import DataCache as _DataCache
from ..training import MemberResult
from ..training.task import Task
from ._rundir import RunDir
from .ledger import Ledger
from .packer import Packer, Pending
from .status import Status

if TYPE_CHECKING:
    import optuna

    from ..storage.journal import GroupedJournalFileBackend
    from ._progress import Progress

__all__: list[str] = []

_log = logging.getLogger("hfsweep.sweep")


@dataclass
class _Array:
    index: int
    key: str
    size: int
    done: bool = False


class _Parts:
    """The engine's state and cross-part methods (set and defined by the engine and its parts;
    see the module docstring)."""

    sc: SweepConfig
    task: Task
    resume: bool
    custom: Searcher | None
    dir: RunDir
    total: int
    scheduler: TrialScheduler
    executor: Executor | None
    progress: Progress
    ledger: Ledger
    packer: Packer[Pending]
    live: dict[int, optuna.Trial]
    sampled: dict[int, dict[str, Any]]
    reported: dict[int, int]
    _last_step: dict[str, int]
    asked: int
    start: float
    _published: float
    _publish_s: float
    _journal: GroupedJournalFileBackend | None
    _dir_locked: bool
    drivers: Drivers | None
    study: optuna.Study
    source: TrialSource
    decisions: dict[str, bool]
    ended: dict[str, Status]
    arrays: list[_Array]
    best: list[tuple[float, int]]
    tracking: Tracking
    #: where arrays train, for messages (a device, or the Ray workers)
    where: str
    _data: _DataCache
    _lock: threading.RLock

    # the engine's (hfsweep/core/loop.py)
    def _journal_held(self) -> AbstractContextManager[None]:
        raise NotImplementedError

    def _save_state(self) -> None:
        raise NotImplementedError

    def _wall_s(self) -> float:
        raise NotImplementedError

    def _admit(
        self, trial: optuna.Trial, sampled: dict[str, Any]
    ) -> tuple[str, dict[str, Any]] | None:
        raise NotImplementedError

    def _fail_unstarted(self, trial: optuna.Trial, exc: Exception) -> None:
        raise NotImplementedError

    def _pool(self, key: str, pending: Pending, *, size_now: bool) -> None:
        raise NotImplementedError

    def _ask(self, array: str) -> list[tuple[str, Pending]] | None:
        raise NotImplementedError

    def _can_ask(self) -> bool:
        raise NotImplementedError

    def _elapsed(self) -> float:
        raise NotImplementedError

    def _trial_info(self, number: int, array: int | None = None) -> TrialInfo:
        raise NotImplementedError

    # the hooks' (_hooks.py)
    def _on_finish(self, result: MemberResult) -> None:
        raise NotImplementedError

    # the outcome's (_outcome.py)
    def _publish(self, force: bool = False) -> None:
        raise NotImplementedError

    def _keep_checkpoint(self, number: int, value: float, model: Mapping[str, Any]) -> None:
        raise NotImplementedError

    def _improves(self, value: float, number: int) -> bool:
        raise NotImplementedError

    def _rank(self, value: float | None, number: int) -> tuple[float, int]:
        raise NotImplementedError

    def _best_trial(self) -> optuna.trial.FrozenTrial | None:
        raise NotImplementedError

    def _params(self, t: optuna.trial.FrozenTrial) -> dict[str, Any]:
        raise NotImplementedError
