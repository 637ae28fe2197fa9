"""Offload: a fused array whose stacked state lives in host memory and streams through the
compute device shard by shard (Hydra's parameter spilling and double buffering).

- ``_errors``: :class:`OffloadError`, :class:`OffloadBudgetError`.
- ``_ledger``: :class:`ResidentLedger`, the bytes held on the compute side against a budget.
- ``_transfer``: :class:`Transfer` with :class:`CpuTransfer` (copies; an injected delay in a
  background thread stands in for a slow link) and :class:`CudaTransfer` (pinned memory, a side
  stream, events, ``non_blocking`` copies).
- ``_shards``: cutting the model into runs of consecutive layers along a ``torch.fx`` trace
  (:func:`plan_shards`).
- ``_units``: where fx cannot cut it, its repeated blocks and the modules around them,
  grouped into shards by the graph cut's sizing rule (``plan_units``); ``_streamed``: the model's own forward run with those units
  streamed (``BlockRunner``).
- ``_resident``: what the engine holds on the compute side until it releases it.
- ``_engine``: :class:`OffloadedArray`, the shard-by-shard forward and backward.
- ``_step``: the optimizer step on the compute device, each shard after its backward
  (:meth:`OffloadedArray.step_on_device`, ``offload_step="device"``).
- ``_alternate``: :class:`AlternatingArrays`, several offloaded arrays stepped together, their
  shards alternating so that one's transfers overlap another's compute (Hydra's shard
  alternation; in lockstep, phase-shifted by one forward, or by readiness: ``SCHEDULES``;
  each array ``prefetch_depth`` shards ahead; the trainer's through ``hs.train_together``,
  and ``hfsweep run``'s with ``fusion.alternate``).
- ``_policy``: the ``offload`` values and what ``auto`` decides: by memory
  (:func:`choose_offload`), and by measured throughput where both ways fit (:func:`choose_by_rate`);
  the ``offload_step`` values and where ``auto`` steps (:func:`choose_step`).

Users reach it through ``hs.ArrayTrainer(..., offload="host")`` or ``fusion: {offload: host}``
in a sweep file; see docs/offload.md.
"""

from ._alternate import SCHEDULES, AlternatingArrays, Schedule
from ._engine import OffloadedArray
from ._errors import OffloadBudgetError, OffloadError
from ._ledger import ResidentLedger
from ._policy import (
    OFFLOAD_MODES,
    OFFLOAD_STEPS,
    OffloadChoice,
    check_offload,
    check_offload_step,
    choose_by_rate,
    choose_offload,
    choose_step,
    fit_size,
    frozen_bytes,
    offload_budget,
    state_bytes,
)
from ._shards import Shard, plan_shards
from ._transfer import CpuTransfer, CudaTransfer, Fetch, Transfer, default_transfer

__all__ = [
    "OFFLOAD_MODES",
    "OFFLOAD_STEPS",
    "SCHEDULES",
    "AlternatingArrays",
    "CpuTransfer",
    "CudaTransfer",
    "Fetch",
    "OffloadBudgetError",
    "OffloadChoice",
    "OffloadError",
    "OffloadedArray",
    "ResidentLedger",
    "Schedule",
    "Shard",
    "Transfer",
    "check_offload",
    "check_offload_step",
    "choose_by_rate",
    "choose_offload",
    "choose_step",
    "default_transfer",
    "fit_size",
    "frozen_bytes",
    "offload_budget",
    "plan_shards",
    "state_bytes",
]
