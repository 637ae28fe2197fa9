"""What every array trainer holds and checks: :class:`TrainerBase` validates the trainer's
settings and keeps them, with the data and trace caches its arrays share and the helpers a run
reads them through. :class:`~hfsweep.training.trainer.ArrayTrainer` adds :meth:`run`; the
modules that train an array (``run``, ``live``, ``_offload_auto``) see the trainer as this base,
so that they need not import the trainer that imports them."""

from __future__ import annotations

import os
import threading
from collections import OrderedDict
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from .._usercode import Phase
from ..fusion import check_compile, mode_for
from ..offload import OffloadChoice, check_offload, check_offload_step
from ..optim import CompiledUpdate
from ._compiled import CompiledLoss
from .checkpoint import (
    _DELIVERED,
    _FINAL_STATES,
    _read_delivered,
    _result_from_record,
    read_payload,
)
from .results import MemberResult
from .task import Task, TaskError

__all__ = ["DataCache", "TrainerBase"]


class DataCache:
    """``task.build_data(config)`` of the last ``entries`` compatibility keys asked for, kept
    for the next asks of those keys: the arrays of a sweep and its profiler share the loaded
    data. One entry by default, so a sweep over several shared configs (batch sizes, say)
    holds one dataset at a time; an executor that trains several arrays at once keeps one
    per array, so that arrays of different keys do not rebuild each other's data at every
    evaluation. Safe to share between threads (the profiler may build while arrays train)."""

    def __init__(self, entries: int = 1) -> None:
        self.entries = max(1, entries)
        self._data: OrderedDict[tuple[str, str], tuple[Iterable[Any], Iterable[Any]]] = (
            OrderedDict()
        )
        self._lock = threading.Lock()

    def get(self, task: Task, config: Mapping[str, Any]) -> tuple[Iterable[Any], Iterable[Any]]:
        """``(train, val)`` of ``config`` (complete, as ``task.resolve`` returns it)."""
        key = (task.name, task.compatibility_key(config))
        with self._lock:
            data = self._data.get(key)
            if data is not None:
                self._data.move_to_end(key)
                return data
            while len(self._data) >= self.entries:  # the old data can go before the new is built
                self._data.popitem(last=False)
            data = task.build_data(config)
            self._data[key] = data
            return data


class TrainerBase:
    """The settings, caches and data helpers of an array trainer (see
    :class:`~hfsweep.training.trainer.ArrayTrainer`, which documents the arguments)."""

    def __init__(
        self,
        task: Task,
        *,
        device: str | torch.device = "cpu",
        dtype: torch.dtype = torch.float32,
        eval_every: int | None = None,
        checkpoint_dir: str | os.PathLike[str] | None = None,
        trace: bool = True,
        keep_states: bool = True,
        final_states: str = "all",
        share_frozen: bool = True,
        compile: bool | str = False,
        offload: str = "none",
        device_memory: int | None = None,
        offload_step: str = "host",
    ) -> None:
        if eval_every is not None and (not isinstance(eval_every, int) or eval_every < 1):
            raise ValueError(f"eval_every must be an integer >= 1 (steps), got {eval_every!r}")
        if final_states not in _FINAL_STATES:
            raise ValueError(
                f"final_states must be one of {', '.join(map(repr, _FINAL_STATES))}, got "
                f"{final_states!r}"
            )
        check_offload(offload, "ArrayTrainer(offload=...)")
        check_offload_step(offload_step, "ArrayTrainer(offload_step=...)")
        if offload_step != "host" and offload == "none":
            raise ValueError(
                f"offload_step={offload_step!r} says where an offloaded array's optimizer "
                "steps; it needs offload='host' or 'auto' (got offload='none'): give "
                "offload_step='host', or offload"
            )
        if device_memory is not None and (
            isinstance(device_memory, bool)
            or not isinstance(device_memory, int)
            or device_memory < 1
        ):
            raise ValueError(
                f"device_memory must be a number of bytes >= 1 or None, got {device_memory!r}"
            )
        self.offload = offload
        self.device_memory = device_memory
        #: where an offloaded array's optimizer step runs (see _offload_step)
        self.offload_step = offload_step
        #: ``offload_step="auto"``'s choices by compatibility key and array size
        self._offload_steps: dict[tuple[str, int], str] = {}
        #: ``offload="auto"``'s choices by compatibility key and array size (see _offload_auto)
        self._offload_plans: dict[tuple[str, int], OffloadChoice] = {}
        self.task = task
        self.device = torch.device(device)
        self.dtype = dtype
        self.eval_every = eval_every
        self.checkpoint_dir = Path(checkpoint_dir) if checkpoint_dir is not None else None
        self.trace = trace
        self.share_frozen = share_frozen
        self.compile = check_compile(compile)
        if self.compile is not False and not trace:
            raise ValueError(
                f"compile={compile!r} needs trace=True: torch.compile compiles the arrays' traced "
                "forwards"
            )
        if self.compile is not False and offload != "none":
            raise ValueError(
                f"compile={compile!r} with offload={offload!r} is not supported yet: an offloaded "
                "array runs its shards uncompiled; give compile=False or offload='none'"
            )
        mode = mode_for(self.compile, self.device)
        #: the task's loss compiled (``compile``), or ``None``: ``task.member_loss`` as it is
        self._loss = CompiledLoss(task, mode) if mode is not None else None
        #: every array's optimizer update compiled (``compile``; inductor's default mode on
        #: every device: CUDA graphs of the update are not tried yet), or ``None``
        self._update = CompiledUpdate(f"{task.name!r}'s optimizer", None) if mode else None
        self.keep_states = keep_states
        self.final_states = final_states
        #: the data of the last compatibility key trained (an executor shares one between
        #: its arrays and the profiler, so that a sweep loads it once)
        self._data_cache = DataCache()
        #: traced forwards by compatibility key, shared by the arrays this trainer builds
        self._trace_cache: dict[str, dict[Any, Any]] = {}

    @staticmethod
    def checkpointed_members(
        checkpoint_dir: str | os.PathLike[str], key: str | None = None
    ) -> set[str]:
        """The ids of every member the checkpoint in ``checkpoint_dir`` holds (training or
        finished): what ``run(..., resume=True)`` continues without being given them. Empty
        when there is no checkpoint. Raises :class:`~hfsweep.training.checkpoint.
        DamagedCheckpointError` when the checkpoint is not whole, or (given ``key``) is not of
        compatibility key ``key``."""
        path = Path(checkpoint_dir) / "array.pt"
        if not path.exists():
            return set()
        return set(read_payload(path, key)["order"])

    @staticmethod
    def delivered_results(checkpoint_dir: str | os.PathLike[str]) -> dict[str, MemberResult]:
        """The results (without their states) of the members whose ``on_finish`` the trainer
        in ``checkpoint_dir`` has called, by member id: what ``run(..., resume=True)`` does
        not deliver again. Empty when there is no checkpoint."""
        results = {}
        for record in _read_delivered(Path(checkpoint_dir) / _DELIVERED):
            results[record["id"]] = _result_from_record(record, None)
        return results

    def steps_per_epoch(self, config: Mapping[str, Any]) -> int:
        """Optimizer steps in one pass over the training data of ``config``."""
        train, _ = self._dataset(config)
        if self.task.steps_per_epoch is not None:
            return self.task.steps_per_epoch
        try:
            n = len(train)  # type: ignore[arg-type]
        except TypeError:
            raise TaskError(
                f"task {self.task.name!r}: the training data has no len(); set "
                "Task(steps_per_epoch=...)"
            ) from None
        if n < 1:
            raise TaskError(f"task {self.task.name!r}: the training data is empty")
        return int(n)

    # ------------------------------------------------------------------ helpers for ArrayRun
    def _dataset(self, config: Mapping[str, Any]) -> tuple[Iterable[Any], Iterable[Any]]:
        with Phase("the task's data(config)"):
            return self._data_cache.get(self.task, config)

    def _to_device(self, batch: Any) -> Any:
        if isinstance(batch, Tensor):
            batch = batch.to(self.device, non_blocking=True)
            return batch.to(self.dtype) if batch.is_floating_point() else batch
        if isinstance(batch, tuple | list):
            return type(batch)(self._to_device(b) for b in batch)
        if isinstance(batch, Mapping):
            return {k: self._to_device(v) for k, v in batch.items()}
        return batch
