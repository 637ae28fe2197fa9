"""The one status vocabulary of a sweep's trials and members, and its translations.

A trial (a member of an array) is ``WAITING`` in a pool, ``RUNNING`` in an array, then ends
``COMPLETED`` (its budget trained, or a stop at the budget), ``STOPPED`` (the trial scheduler
stopped it early) or ``FAILED``. The values are the trainer's own strings (``"completed"``,
``"stopped"``, ``"failed"``), so a :class:`Status` compares equal to them and a status string
read from a file or a :class:`~hfsweep.MemberResult` converts with ``Status(text)``.

The journal (Optuna), ``state.json``, trials.csv, the progress line, the report and the Tune
plugin all use this vocabulary; the translations to Optuna's trial states (``COMPLETE``,
``PRUNED``, ``FAIL``, ``RUNNING``, ``WAITING``) and to what a searcher's ``tell()`` gets
(``complete``, ``pruned``, ``failed``) are here and nowhere else.

This is a leaf module (it imports only hfsweep's number checks), so the trial schedulers, which
the sweep core imports, use it without an import cycle; its public home is
``hfsweep.core.status``, which re-exports it.
"""

from __future__ import annotations

import enum
from typing import TYPE_CHECKING

from ._checks import is_finite

if TYPE_CHECKING:
    from optuna.trial import TrialState

__all__ = ["FINAL", "Status"]


class Status(str, enum.Enum):
    """Where a trial stands (see the module docstring); a ``str`` equal to its value, which
    ``str()``, f-strings and ``json`` write."""

    WAITING = "waiting"
    RUNNING = "running"
    COMPLETED = "completed"
    STOPPED = "stopped"
    FAILED = "failed"

    def __str__(self) -> str:
        return str.__str__(self)

    def __format__(self, spec: str) -> str:
        return str.__format__(self, spec)

    @property
    def final(self) -> bool:
        """Whether the trial has ended (``COMPLETED``, ``STOPPED`` or ``FAILED``)."""
        return self in FINAL

    @property
    def optuna_name(self) -> str:
        """The name of the Optuna trial state it is recorded as (``COMPLETE``, ``PRUNED``,
        ``FAIL``, ``RUNNING``, ``WAITING``)."""
        return _OPTUNA[self]

    def trial_state(self) -> TrialState:
        """The Optuna ``TrialState`` it is recorded as."""
        from optuna.trial import TrialState

        return TrialState[self.optuna_name]

    @property
    def told(self) -> str:
        """What a :class:`~hfsweep.searchers.Searcher`'s ``tell()`` gets for a trial that ended
        so (``complete``, ``pruned``, ``failed``); ``ValueError`` for one that has not ended."""
        if not self.final:
            raise ValueError(f"a {self.value} trial has not ended: nothing to tell")
        return _TOLD[self]

    def settle(self, value: object, metric: str) -> tuple[Status, str | None]:
        """How a trial that ended so, ``value`` its last ``metric``, is recorded: a
        ``COMPLETED`` one whose value is not a finite number is ``FAILED``, with the reason
        (``"val_loss is nan"``); any other as it is, with ``None``. Every front door records
        ends through this rule."""
        if self is Status.COMPLETED and not is_finite(value):
            return Status.FAILED, f"{metric} is {value!r}"
        return self, None

    @classmethod
    def parse(cls, text: str) -> Status:
        """The status named ``text``: one of the values (``"completed"``...) or an Optuna
        state name (``"COMPLETE"``, ``"PRUNED"``, ``"FAIL"``, ``"RUNNING"``, ``"WAITING"``).
        Raises ``ValueError`` naming the valid ones."""
        if isinstance(text, cls):
            return text
        found = _BY_NAME.get(str(text))
        if found is None:
            valid = ", ".join([*(s.value for s in cls), *_OPTUNA.values()])
            raise ValueError(f"unknown trial status {text!r}; valid: {valid}")
        return found

    @classmethod
    def of_trial_state(cls, state: TrialState | str) -> Status:
        """The status of an Optuna trial state (a ``TrialState`` or its name)."""
        return cls.parse(state if isinstance(state, str) else state.name)


#: the statuses of a trial that has ended
FINAL = frozenset({Status.COMPLETED, Status.STOPPED, Status.FAILED})

_OPTUNA = {
    Status.WAITING: "WAITING",
    Status.RUNNING: "RUNNING",
    Status.COMPLETED: "COMPLETE",
    Status.STOPPED: "PRUNED",
    Status.FAILED: "FAIL",
}
_TOLD = {Status.COMPLETED: "complete", Status.STOPPED: "pruned", Status.FAILED: "failed"}
_BY_NAME = {**{s.value: s for s in Status}, **{name: s for s, name in _OPTUNA.items()}}
