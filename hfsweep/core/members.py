"""Member records: each member's config, compatibility key, array, status, history and value,
for a sweep whose searcher keeps no record hfsweep can read.

``hfsweep run`` keeps its trials in the Optuna study it owns: a trial's params, intermediate
values, state and user attributes are there. A front door whose searcher is opaque (the Ray
Tune plugin drives any Tune searcher: ``suggest(id)``, ``on_trial_result``,
``on_trial_complete``, nothing to read back) has no such store, so the core keeps one record per
member (:class:`MemberRecord`) and one per array (:class:`ArrayRecord`: its members, those that
joined it through refill and those it handed back). :class:`~hfsweep.core.sweep.Sweep`
holds them; how a member ended is the :class:`~hfsweep.core.ledger.Ledger`'s, as in ``hfsweep
run``, and a record's final status agrees with it (:func:`agree`).

Records are saved as plain data (:meth:`MemberRecord.as_dict`, ``dataclasses.asdict`` of an
:class:`ArrayRecord`): the status by value (``"completed"``...), no class of hfsweep's in it.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from .ledger import Ledger
from .status import Status

__all__ = ["ArrayRecord", "MemberRecord", "agree", "counts"]


@dataclass
class MemberRecord:
    """One member: its config, compatibility key, array, status and evaluations."""

    id: str
    config: dict[str, Any]
    key: str
    array: str | None = None
    #: ``WAITING`` in its key's pool, ``RUNNING`` in an array, then how it was told
    #: (``COMPLETED``, ``STOPPED``, ``FAILED``; final)
    status: Status = Status.WAITING
    #: one row per evaluation: training_iteration, step, epoch, the task's metrics and
    #: time_total_s (the member's own training time since it joined its array)
    history: list[dict[str, Any]] = field(default_factory=list)
    value: float | None = None
    error: str | None = None
    #: added to the clock its array reports for it: after a retry or restore, the array's
    #: clock goes on from its checkpoint's, not from the member's last evaluation (see
    #: :meth:`~hfsweep.core.sweep.Sweep.on_report`)
    clock_shift: float = 0.0

    @property
    def told(self) -> bool:
        """Whether the searcher was told how the member ended (its status is final)."""
        return self.status.final

    @property
    def state(self) -> str:
        """The Optuna name of :attr:`status` (``COMPLETE``, ``PRUNED``, ``FAIL``, ``RUNNING``,
        ``WAITING``), as trials.csv's ``state`` column and an Optuna study say it."""
        return self.status.optuna_name

    def as_dict(self) -> dict[str, Any]:
        """The record as plain data (the status as its value, ``"completed"``...)."""
        data = asdict(self)
        data["status"] = self.status.value
        return data

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> MemberRecord:
        """The record :meth:`as_dict` wrote (the status given by value or Optuna name)."""
        fields = dict(data)
        return cls(**{**fields, "status": Status.parse(fields["status"])})


@dataclass
class ArrayRecord:
    """One array: its members, those it got through refill or handed back, and its end."""

    id: str
    key: str
    size: int
    members: list[str]
    given: list[str] = field(default_factory=list)
    returned: list[str] = field(default_factory=list)
    done: bool = False
    #: the token of the last report processed (a report seen again is not processed again)
    last_token: str | None = None
    #: how many times the array's trainer resumed from a checkpoint (retry, restore)
    resumes: int = 0
    #: evaluations it reported again after a resume (answered from the decision log)
    replayed: int = 0

    def all_members(self) -> list[str]:
        """Every member that trains (or trained) in this array, in the order they joined."""
        back = set(self.returned)
        return [m for m in (*self.members, *self.given) if m not in back]


def agree(records: Iterable[MemberRecord], ledger: Ledger) -> None:
    """Bring the records and the ledger to agree after a restore, as ``hfsweep run`` catches
    its ledger up to its study: an end only a record holds is recorded in the ledger, and a
    record whose member the ledger ended takes the ledger's status."""
    for rec in records:
        ended = ledger.status(rec.id)
        if ended is not None:
            rec.status = ended
        elif rec.status.final:
            ledger.end(rec.id, rec.status)


def counts(records: Iterable[MemberRecord]) -> dict[Status, int]:
    """Members by status, every status listed (a :class:`Status` is equal to its value:
    ``counts(...)["stopped"]`` works too)."""
    out = dict.fromkeys(Status, 0)
    for rec in records:
        out[rec.status] += 1
    return out
