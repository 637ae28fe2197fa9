"""What the offload engine holds on the compute side, counted in its ledger until released: a
shard's fetched tensors (:class:`_Resident`) and a boundary activation (:class:`_Held`)."""

from __future__ import annotations

from torch import Tensor

from ._ledger import ResidentLedger
from ._shards import stacked_bytes
from ._transfer import Fetch


class _Resident:
    """A shard's tensors on the compute side, counted in the ledger until released."""

    def __init__(self, fetch: Fetch, nbytes: int, ledger: ResidentLedger, kind: str) -> None:
        self._fetch = fetch
        self._tensors: list[Tensor] | None = None
        self.nbytes = nbytes
        self._ledger = ledger
        self._kind = kind
        ledger.add(kind, nbytes)  # counted from the moment the copy is started

    def tensors(self) -> list[Tensor]:
        if self._tensors is None:
            self._tensors = self._fetch.wait()
        return self._tensors

    def release(self) -> None:
        if self.nbytes >= 0:
            if self._tensors is None:
                self._fetch.wait()  # a copy still under way finishes before it is dropped
            self._ledger.remove(self._kind, self.nbytes)
            self.nbytes = -1
            self._tensors = None


class _Held:
    """A boundary activation kept on the compute side, counted in the ledger (``None``: one
    the backward does not need, neither kept nor counted)."""

    def __init__(self, value: Tensor | None, ledger: ResidentLedger) -> None:
        self.value: Tensor | None = value
        self.nbytes = 0 if value is None else stacked_bytes([value])
        self._ledger = ledger
        if value is not None:
            ledger.add("boundary activations", self.nbytes)

    def release(self) -> None:
        if self.value is not None:
            self._ledger.remove("boundary activations", self.nbytes)
            self.value = None
