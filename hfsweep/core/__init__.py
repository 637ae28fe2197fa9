"""The one sweep core: the loop that asks, pools, packs, trains and reports, the packer and the
ledger. Every front door (``hfsweep run``, ``hs.sweep``, the Ray Tune plugin) drives it.

Named ``core`` rather than ``sweep``: a subpackage ``hfsweep.sweep`` would shadow the public
function ``hs.sweep`` once imported.
"""

__all__: list[str] = []
