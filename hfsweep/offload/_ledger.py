"""The compute side's ledger: how many bytes the offload engine holds on the device at each moment.

Every tensor the engine puts on the compute side (a shard's parameters and buffers, fetched or
prefetched; a shard's gradients before they go back to the host or until the device step is
done; the activations kept at shard boundaries for the backward pass; a shard's optimizer state
while the device step has it) is added when it is allocated and removed when the engine lets
go of it. An addition that would take the total over the budget raises
:class:`~hfsweep.offload.OffloadBudgetError` before anything is allocated, so the total never
exceeds the budget. The activations inside the shard being computed are transient and not counted:
on a GPU, give a budget below the free memory to leave them room.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from ._errors import OffloadBudgetError

__all__ = ["ResidentLedger"]

#: what the engine holds on the compute side, by kind (``optimizer state``: a shard's state
#: fetched for the optimizer step on the device, ``offload_step="device"``)
KINDS = ("shard state", "gradients", "boundary activations", "optimizer state")


def _mib(n: float) -> str:
    return f"{n / 2**20:.3f} MiB"


class ResidentLedger:
    """Bytes resident on the compute side, by kind, with the peak overall and per phase.

    ``budget`` (bytes) is the limit an addition may not cross; ``None`` records without a limit.
    :meth:`phase` names a stretch (``"forward"``, ``"backward"``, ``"step"``) whose own peak is kept
    in :attr:`peaks`.
    """

    def __init__(self, budget: int | None) -> None:
        if budget is not None and (isinstance(budget, bool) or not isinstance(budget, int)):
            raise OffloadBudgetError(f"budget must be an int (bytes) or None, got {budget!r}")
        if budget is not None and budget < 1:
            raise OffloadBudgetError(f"budget must be >= 1 byte, got {budget}")
        self.budget = budget
        self.resident = 0
        self.peak = 0
        self.by_kind = dict.fromkeys(KINDS, 0)
        #: the peak within each phase entered so far, by phase name (the largest of its stretches)
        self.peaks: dict[str, int] = {}
        self._phase: str | None = None

    def add(self, kind: str, nbytes: int) -> None:
        """Count ``nbytes`` more of ``kind``; raises if that would cross the budget."""
        if kind not in self.by_kind:
            raise ValueError(f"unknown kind {kind!r}; one of {KINDS}")
        total = self.resident + nbytes
        if self.budget is not None and total > self.budget:
            held = ", ".join(f"{k} {_mib(v)}" for k, v in self.by_kind.items())
            raise OffloadBudgetError(
                f"offload: holding {_mib(nbytes)} more {kind} on the compute side would make "
                f"{_mib(total)}, over the budget of {_mib(self.budget)} (held now: {held}); give a "
                "larger budget (device_memory) or a smaller batch"
            )
        self.by_kind[kind] += nbytes
        self.resident = total
        self.peak = max(self.peak, total)
        if self._phase is not None:
            self.peaks[self._phase] = max(self.peaks.get(self._phase, 0), total)

    def remove(self, kind: str, nbytes: int) -> None:
        """Count ``nbytes`` of ``kind`` as released."""
        if nbytes > self.by_kind[kind]:
            raise AssertionError(f"ledger: releasing {nbytes} bytes of {kind}, holding fewer")
        self.by_kind[kind] -= nbytes
        self.resident -= nbytes

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Record the peak of the additions made inside the block under ``name`` (what was
        resident on entry counts too)."""
        outer = self._phase
        self._phase = name
        self.peaks[name] = max(self.peaks.get(name, 0), self.resident)
        try:
            yield
        finally:
            self._phase = outer
