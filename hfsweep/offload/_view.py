"""What a shard's device step (``_step``) and a model streamed between its blocks
(``_streamed``) use of the engine that runs them: :class:`EngineView`. The engine
(:class:`~hfsweep.offload.OffloadedArray`, in ``_engine``) imports both, so they see it through
this protocol rather than importing it back."""

from __future__ import annotations

from typing import Protocol

from torch import Tensor

from ..fusion import FusedArray
from ._ledger import ResidentLedger
from ._resident import _Resident
from ._shards import Shard
from ._transfer import Transfer

__all__ = ["EngineView"]


class EngineView(Protocol):
    """The parts of :class:`~hfsweep.offload.OffloadedArray` its step and its streamed blocks
    read: the array, the ledger of compute-side bytes, the transfer, whether it prefetches,
    the anchor its shards' outputs hang on, and how it fetches tensors and finds buffers."""

    @property
    def array(self) -> FusedArray: ...

    @property
    def ledger(self) -> ResidentLedger: ...

    @property
    def transfer(self) -> Transfer: ...

    @property
    def prefetch(self) -> bool: ...

    @property
    def _anchor(self) -> Tensor: ...

    def _buffers(self, shard: Shard) -> list[int]: ...

    def _fetch_tensors(self, tensors: list[Tensor], kind: str) -> _Resident: ...
