"""The Tune plugin's records: one per member and one per array (Tune trial), the names its
files and results use, and the states a member is told in. :mod:`schedulers._tune_state` keeps
them for the whole sweep (see there)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any
from urllib.parse import quote

from hfsweep.core.status import FINAL, Status

__all__ = [
    "FINAL_STATES",
    "FINISHED",
    "META",
    "STATE_FORMAT",
    "WEIGHTS_DIR",
    "ArrayRecord",
    "MemberRecord",
    "weights_file",
]

#: the key of a Tune trial's config and results that holds hfsweep's part
META = "hfsweep"
#: Tune's ``Searcher.FINISHED``
FINISHED = "FINISHED"
#: marks a saved state (and its format) in Tune's searcher checkpoint
STATE_FORMAT = "hfsweep.tune/1"
#: the folder of an array trial's Tune checkpoint that holds its completed members' weights:
#: one ``state_dict`` per member, saved with ``torch.save``, named by :func:`weights_file`
WEIGHTS_DIR = "weights"
#: states a member is told in; told members never change again
FINAL_STATES = tuple(s.optuna_name for s in Status if s in FINAL)


@dataclass
class MemberRecord:
    """One member: its config, compatibility key, array, state and evaluations."""

    id: str
    config: dict[str, Any]
    key: str
    array: str | None = None
    state: str = "WAITING"
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
        """Whether the inner searcher was told how the member ended."""
        return self.state in FINAL_STATES


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


def weights_file(member_id: str) -> str:
    """The file name of ``member_id``'s weights in :data:`WEIGHTS_DIR` (percent-encoded, one
    to one; Tune's member ids ``<trial id>-<n>`` stay as they are)."""
    return (quote(member_id, safe="-_.") or "%") + ".pt"
