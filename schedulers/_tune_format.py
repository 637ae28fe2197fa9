"""The names the Tune plugin's trial configs, results and checkpoint files use, and the format
its sweep state is saved in inside Tune's searcher checkpoint (the state itself is the sweep
core's :class:`~hfsweep.core.sweep.Sweep`, adapted in :mod:`._tune_sweep`).

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
from typing import Any
from urllib.parse import quote

from hfsweep.core.status import Status

__all__ = [
    "FINISHED",
    "FORMAT_PREFIX",
    "META",
    "STATE_FORMAT",
    "WEIGHTS_DIR",
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
