"""The Tune plugin's records: one per member and one per array (Tune trial), the names its
files and results use, and the saved format of its state. :mod:`schedulers._tune_state` keeps
them for the whole sweep (see there).

A member's ``status`` is the sweep core's :class:`~hfsweep.core.status.Status`, the vocabulary of
``hfsweep run``'s ``state.json`` and of trials.csv's ``user_attrs_status`` (``waiting``,
``running``, ``completed``, ``stopped``, ``failed``); its Optuna name (``COMPLETE``, ``PRUNED``,
``FAIL``...: trials.csv's ``state`` column) is :attr:`MemberRecord.state`, translated by
``Status`` and nowhere else.

The state is saved as plain data (Tune pickles it with the searcher; the result readers load it
without running code, so no enum or class of hfsweep's is in it): format
:data:`STATE_FORMAT`, whose ``"ledger"`` is the sweep core's
:meth:`hfsweep.core.ledger.Ledger.state_dict` (the decision log, how each member ended, the
array size of each key). Earlier formats are read by :func:`upgraded`: ``hfsweep.tune/2`` kept
the decision log and the sizes beside the members (``"decisions"``, ``"sizes"``), the ends only in
the members' records; ``hfsweep.tune/1`` (before the one status vocabulary) besides kept each
member's Optuna state name under ``"state"``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any
from urllib.parse import quote

from hfsweep.core.status import Status

__all__ = [
    "FINISHED",
    "FORMAT_PREFIX",
    "META",
    "STATE_FORMAT",
    "WEIGHTS_DIR",
    "ArrayRecord",
    "MemberRecord",
    "upgraded",
    "weights_file",
]

#: the key of a Tune trial's config and results that holds hfsweep's part
META = "hfsweep"
#: Tune's ``Searcher.FINISHED``
FINISHED = "FINISHED"
#: marks a saved state (and its format) in Tune's searcher checkpoint
STATE_FORMAT = "hfsweep.tune/3"
#: every saved format starts so (one this version does not read is refused by name)
FORMAT_PREFIX = "hfsweep.tune/"
#: the format before the core's ledger: the decision log and sizes beside the members
_FORMAT_2 = "hfsweep.tune/2"
#: the format before the one status vocabulary: members' Optuna state names under ``"state"``
_FORMAT_1 = "hfsweep.tune/1"
#: the folder of an array trial's Tune checkpoint that holds its completed members' weights:
#: one ``state_dict`` per member, saved with ``torch.save``, named by :func:`weights_file`
WEIGHTS_DIR = "weights"


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
    #: :meth:`SweepState.on_result`)
    clock_shift: float = 0.0

    @property
    def told(self) -> bool:
        """Whether the inner searcher was told how the member ended (its status is final)."""
        return self.status.final

    @property
    def state(self) -> str:
        """The Optuna name of :attr:`status` (``COMPLETE``, ``PRUNED``, ``FAIL``, ``RUNNING``,
        ``WAITING``), as trials.csv's ``state`` column and OptunaSearch's study say it."""
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
    """One array (one Tune trial): its members, those it got through refill, and its end."""

    id: str
    key: str
    size: int
    members: list[str]
    given: list[str] = field(default_factory=list)
    returned: list[str] = field(default_factory=list)
    done: bool = False
    last_token: str | None = None
    #: how many times the array's trainable resumed from a Tune checkpoint (retry, restore)
    resumes: int = 0
    #: evaluations it reported again after a retry or restore (answered from the decision log)
    replayed: int = 0

    def all_members(self) -> list[str]:
        """Every member that trains (or trained) in this array, in the order they joined."""
        back = set(self.returned)
        return [m for m in (*self.members, *self.given) if m not in back]


def upgraded(saved: Mapping[str, Any]) -> dict[str, Any]:
    """A saved state in :data:`STATE_FORMAT` (a copy). One of format ``hfsweep.tune/2`` gets its
    ledger (the decision log and sizes it kept beside the members, and each ended member's
    status from its record); one of ``hfsweep.tune/1`` first has its members' Optuna state names
    turned into statuses. Raises ``ValueError`` naming the format for one this hfsweep does not
    read."""
    form = saved.get("format")
    if form == STATE_FORMAT:
        return dict(saved)
    if form == _FORMAT_1:
        return upgraded(_upgraded_1(saved))
    if form != _FORMAT_2:
        raise ValueError(
            f"the saved fused-sweep state has format {form!r}; this hfsweep reads "
            f"{STATE_FORMAT!r}, {_FORMAT_2!r} and {_FORMAT_1!r}: restore the experiment with "
            "the hfsweep version that wrote it"
        )
    state = {k: v for k, v in saved.items() if k not in ("decisions", "sizes")}
    ended = {
        str(m): r["status"] for m, r in saved["members"].items() if Status.parse(r["status"]).final
    }
    ledger: dict[str, Any] = {
        "scheduler": None,  # the Tune plugin's scheduler is pickled apart (``"decider"``)
        "decisions": dict(saved["decisions"]),
        "ended": ended,
        "arrays": [],  # the arrays are Tune trials: the state's own ``"arrays"``
        "sizes": dict(saved["sizes"]),
        "best": [],
        "elapsed_s": 0.0,
    }
    return {**state, "format": STATE_FORMAT, "ledger": ledger}


def _upgraded_1(saved: Mapping[str, Any]) -> dict[str, Any]:
    """A state of format ``hfsweep.tune/1`` in format ``hfsweep.tune/2``."""
    members = {}
    for mid, record in saved["members"].items():
        data = {k: v for k, v in record.items() if k != "state"}
        data["status"] = Status.parse(record["state"]).value
        members[mid] = data
    return {**saved, "format": _FORMAT_2, "members": members}


def weights_file(member_id: str) -> str:
    """The file name of ``member_id``'s weights in :data:`WEIGHTS_DIR` (percent-encoded, one
    to one; Tune's member ids ``<trial id>-<n>`` stay as they are)."""
    return (quote(member_id, safe="-_.") or "%") + ".pt"
