"""The one status vocabulary of a sweep's trials and members: :class:`Status` and :data:`FINAL`.

Defined in the leaf module ``hfsweep._status`` (it imports nothing of hfsweep but its number
checks), so that the trial schedulers, which the core imports, can use it too without an import
cycle; this is its public home, ``hfsweep.core.status.Status``.
"""

from __future__ import annotations

from .._status import FINAL, Status

__all__ = ["FINAL", "Status"]
