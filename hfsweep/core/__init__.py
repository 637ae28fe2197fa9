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

__all__: list[str] = []
