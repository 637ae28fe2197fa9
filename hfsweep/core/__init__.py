"""The one sweep core: the loop that asks, pools, packs, trains and reports, the packer and the
ledger. Every front door (``hfsweep run``, ``hs.sweep``, the Ray Tune plugin) drives it: the
first two through the engine (:mod:`~hfsweep.core.loop`), which keeps its trials in the Optuna
study it owns, the Tune plugin through :class:`~hfsweep.core.sweep.Sweep`, which owns the
same packer and ledger and one table of member records (:mod:`~hfsweep.core.members`) and talks
to a searcher and a scheduler through two ports (:mod:`~hfsweep.core.ports`). Both process an array's report by one rule,
:func:`~hfsweep.core.judging.judge`, with what differs per front door behind its
:class:`~hfsweep.core.judging.FrontDoor` protocol.

Named ``core`` rather than ``sweep``: a subpackage ``hfsweep.sweep`` would shadow the public
function ``hs.sweep`` once imported.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ._dryrun import dry_run, runs_on_the_driver
    from ._preflight import preflight
    from ._rundir import refuse_a_second_start

#: what the command line asks of the core before a sweep starts, by the module it lives in;
#: imported on first use (PEP 562), so that importing one of the core's modules stays as light
#: as that module
_WHERE = {
    "dry_run": "._dryrun",
    "runs_on_the_driver": "._dryrun",
    "preflight": "._preflight",
    "refuse_a_second_start": "._rundir",
}

__all__ = ["dry_run", "preflight", "refuse_a_second_start", "runs_on_the_driver"]


def __getattr__(name: str) -> Any:
    where = _WHERE.get(name)
    if where is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(where, __name__), name)
    globals()[name] = value
    return value
