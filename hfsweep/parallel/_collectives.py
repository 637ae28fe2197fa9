"""The collectives a data-parallel array uses, over one ``torch.distributed`` process group.

Gradients are summed with one ``all_reduce`` over a flat buffer that holds every stacked
parameter's gradient and the members' weighted shard losses, rather than by wrapping the array
in ``DistributedDataParallel``: the trainer's step stays what it is for one worker (forward, the
per-member loss, backward, per-member clipping of the *global* gradient, the fused optimizer
with its per-member non-finite checks), the loss weights per shard (which DDP's fixed averaging
by the world size does not know) are applied before the backward, the evaluation forwards need
no wrapper, and DDP's buffer broadcast from rank 0 would overwrite the row-weighted BatchNorm
statistics. A collective that fails (mostly: another worker left) labels its exception
:data:`~hfsweep._usercode.COLLECTIVE`, the machine's phase, not the task's. What this gives up is DDP's overlap of communication with the backward (its
buckets are reduced while later layers still compute): one collective after the backward.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from .._compat import flatten_dense_tensors, unflatten_dense_tensors
from .._usercode import COLLECTIVE, Phase

__all__ = ["Group"]


class Group:
    """This worker's place in a data-parallel array: ``rank`` of ``size`` workers in the
    default process group (``torch.distributed.init_process_group`` already called), or a
    group of one without ``torch.distributed`` (the collectives are then the identity)."""

    def __init__(self) -> None:
        self.distributed = dist.is_available() and dist.is_initialized()
        self.rank = dist.get_rank() if self.distributed else 0
        self.size = dist.get_world_size() if self.distributed else 1

    @property
    def leader(self) -> bool:
        """Whether this worker is rank 0: it calls the hooks and writes the files."""
        return self.rank == 0

    def sum_(self, tensors: Sequence[Tensor]) -> None:
        """Replace each of ``tensors`` (one dtype and device) by its sum over the workers, in
        one ``all_reduce`` of their flat concatenation."""
        if self.size == 1 or not tensors:
            return
        flat = flatten_dense_tensors(list(tensors))
        with Phase(COLLECTIVE):
            dist.all_reduce(flat, op=dist.ReduceOp.SUM)
        for t, reduced in zip(tensors, unflatten_dense_tensors(flat, list(tensors)), strict=True):
            t.copy_(reduced)

    def broadcast_(self, tensors: Sequence[Tensor]) -> None:
        """Give every worker rank 0's values of ``tensors`` (one dtype and device)."""
        if self.size == 1 or not tensors:
            return
        flat = flatten_dense_tensors(list(tensors))
        with Phase(COLLECTIVE):
            dist.broadcast(flat, src=0)
        for t, value in zip(tensors, unflatten_dense_tensors(flat, list(tensors)), strict=True):
            t.copy_(value)

    def share(self, value: Any) -> Any:
        """Rank 0's ``value`` (any picklable object) on every worker: the decisions only the
        leader takes (hooks, timing-based choices) must be the same everywhere, or the workers'
        collectives would stop matching."""
        if self.size == 1:
            return value
        box = [value if self.leader else None]
        with Phase(COLLECTIVE):
            dist.broadcast_object_list(box, src=0)
        return box[0]

    def rows_total(self, rows: int) -> int:
        """The sum of ``rows`` over the workers."""
        if self.size == 1:
            return rows
        t = torch.tensor([rows], dtype=torch.int64, device=self._device())
        with Phase(COLLECTIVE):
            dist.all_reduce(t)
        return int(t.item())

    def _device(self) -> torch.device:
        if self.distributed and dist.get_backend() == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")
