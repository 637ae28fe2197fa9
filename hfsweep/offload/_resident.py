"""What the offload engine holds on the compute side, counted in its ledger until released: a
shard's fetched tensors (:class:`_Resident`) and a boundary activation (:class:`_Held`); and
a shard's parameter gradients on their way to the host (:func:`grads_to_host`)."""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import torch
from torch import Tensor

from ._ledger import ResidentLedger
from ._shards import stacked_bytes
from ._transfer import Fetch, Transfer

#: numbers the fetches in the order they start (one transfer copies them in that order)
_started = itertools.count()


class _Resident:
    """A shard's tensors on the compute side, counted in the ledger until released;
    :attr:`order` numbers its fetch among all started (the earlier, the sooner it is in,
    among those of :attr:`urgent`'s class: an urgent fetch goes before the others not started)."""

    def __init__(
        self, fetch: Fetch, nbytes: int, ledger: ResidentLedger, kind: str, urgent: bool = False
    ) -> None:
        self._fetch = fetch
        self.urgent = urgent
        self._tensors: list[Tensor] | None = None
        self.nbytes = nbytes
        self._ledger = ledger
        self._kind = kind
        self.order = next(_started)
        ledger.add(kind, nbytes)  # counted from the moment the copy is started

    def ready(self) -> bool:
        """Whether the copy is in (:meth:`tensors` would not wait on it)."""
        return self._tensors is not None or self._fetch.ready()

    def started(self) -> bool:
        """Whether the copy is under way or in (one not started may be passed by an urgent
        one on the link)."""
        return self._tensors is not None or self._fetch.started()

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


def grads_to_host(
    used: Sequence[tuple[int, Tensor]],
    host: Sequence[Tensor],
    transfer: Transfer,
    ledger: ResidentLedger,
) -> None:
    """Add the compute side's gradients ``used`` (pairs of a position in ``host`` and the
    gradient of that parameter) to the host parameters' ``.grad`` as autograd accumulates
    them, counted in ``ledger`` as gradients until they are copied to the host."""
    values = [g for _, g in used]
    nbytes = stacked_bytes(values)
    ledger.add("gradients", nbytes)
    try:
        back = transfer.to_host(values)
    finally:
        ledger.remove("gradients", nbytes)
    del values
    with torch.no_grad():
        for (i, _), g in zip(used, back, strict=True):
            p = host[i]
            if p.grad is None:
                p.grad = g
            else:
                p.grad.add_(g)
