"""The array trainer: trains the members of one fused array, each on its own budget.

One shared batch feeds every member at each step; each member has its own loss, optimizer
hyperparameters, schedule, dropout stream, budget and metric history. After each evaluation a
report hook decides per member whether it goes on; a member that is done (budget reached,
stopped, or non-finite) frees its slot, which a refill hook may fill at once with a new
compatible trial. Checkpoints are taken at every evaluation, atomically, and a run resumes from
them exactly; an out-of-memory error splits the array in two and goes on without losing any
member's progress.
"""

from __future__ import annotations

import logging
import os
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from .._malloc import retaining_freed_memory
from .._usercode import Phase
from ..fusion._compile import check_compile, mode_for
from ..offload import OffloadChoice, check_offload, check_offload_step
from ..optim._compiled import CompiledUpdate
from ._compiled import CompiledLoss
from ._threads import training_threads
from .checkpoint import (
    _DELIVERED,
    _FINAL_STATES,
    _read_delivered,
    _result_from_record,
    read_payload,
)
from .results import Evaluation, Member, MemberResult, RefillHook, ReportHook
from .run import _Run
from .settings import ArraySettings
from .task import Task, TaskError

__all__ = ["ArrayTrainer", "Evaluation", "Member", "MemberResult", "RefillHook", "ReportHook"]

_log = logging.getLogger("hfsweep.trainer")


class _DataCache:
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


class ArrayTrainer:
    """Trains arrays of members of one task and compatibility key.

    ``eval_every`` is the evaluation period in a member's own optimizer steps (default: one
    epoch); a member is also evaluated when it reaches its budget (``max_steps``, else
    ``epochs`` epochs). With ``checkpoint_dir`` the trainer writes ``array.pt`` (every slot's
    model, optimizer, schedule, dropout stream, history and the data position, and the members
    that ended but whose ``on_finish`` has not been called yet) at each evaluation and whenever
    a member ends or joins, and appends to ``delivered.log`` each member ``on_finish`` was
    called for (its result without the state); with ``keep_states`` also ``members/<id>.pt``
    (a member's final state) when a member ends. ``run(..., resume=True)`` continues from
    ``array.pt``. ``final_states`` says which ended members' results carry their state:
    ``"all"``, ``"completed"`` (a sweep keeps the weights of its best completed trials only;
    saving every pruned member's cost a sweep of small models a noticeable share of its time)
    or ``"none"``.
    ``share_frozen`` (``fusion.share_frozen``) keeps frozen tensors that every member holds
    identically (a fine-tuning sweep's pretrained backbone) once in each array, and its
    checkpoints store them once (see :func:`hfsweep.fuse`).
    ``float64`` is for exactness tests; models are built on the CPU from their seed, then moved
    to ``device``. ``compile`` compiles each array's traced forward and backward and the task's
    loss with ``torch.compile`` (see ``compile`` of :func:`hfsweep.fuse`; ``True``: CUDA graphs
    on CUDA), and its optimizer's update (:meth:`hfsweep.optim.FusedOptimizer.compile`,
    inductor's default mode); the time compiling takes is left out of the measured step times.

    ``offload`` (``"none"``, ``"host"``, ``"auto"``) keeps an array's stacked parameters and
    optimizer state in host memory and runs it on ``device`` shard by shard (see
    :mod:`hfsweep.offload` and docs/offload.md; same results as without). ``device_memory``
    (bytes) is the budget on the compute side: what the engine may hold there with ``"host"``,
    and what ``"auto"`` compares the array's estimated state with (``None``: a CUDA device's free
    memory; on the CPU ``"auto"`` then keeps arrays as they are): an array that fits stays, one
    of which not even one member fits is offloaded, and otherwise the profiler measures it
    offloaded against arrays of the members that fit and the faster is trained (see
    docs/offload.md). An offloaded array keeps the frozen tensors every member holds
    identically once with ``share_frozen``, as on the device (in host storage, copied in once
    for all members), and runs uncompiled: ``compile`` with ``offload`` other than ``"none"``
    is refused. ``offload_step`` says where an offloaded array's optimizer steps: ``"host"``
    (the default: the fused step on the host tensors), ``"device"`` (each shard on ``device``
    right after its backward, its optimizer state fetched for it; on the host, with a
    warning, while a member clips its gradients) or ``"auto"`` (both timed on the array's
    first steps, the faster kept and logged); every value trains the same results, except
    that an out-of-memory error once a shard's device update has begun fails the array's
    members rather than replaying the step (see docs/offload.md).
    """

    #: what :meth:`run` executes (a data-parallel worker's trainer sets its own, on shards)
    _run_class: type[_Run] = _Run

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
        self._data_cache = _DataCache()
        #: traced forwards by compatibility key, shared by the arrays this trainer builds
        self._trace_cache: dict[str, dict[Any, Any]] = {}

    @classmethod
    def from_settings(
        cls,
        task: Task,
        settings: ArraySettings,
        *,
        checkpoint_dir: str | os.PathLike[str] | None = None,
        trace: bool = True,
        keep_states: bool = True,
        final_states: str = "all",
    ) -> ArrayTrainer:
        """A trainer of ``task``'s arrays as a sweep's ``settings`` say (its device, dtype,
        evaluation period, shared frozen tensors, compile and offload: what executors and Ray
        workers build their trainers from; ``alternate`` is theirs: a trainer trains one
        array). The other arguments are the constructor's."""
        return cls(
            task,
            device=settings.resolved_device(),
            dtype=settings.torch_dtype(),
            eval_every=settings.eval_every,
            checkpoint_dir=checkpoint_dir,
            trace=trace,
            keep_states=keep_states,
            final_states=final_states,
            share_frozen=settings.share_frozen,
            compile=settings.compile,
            offload=settings.offload,
            device_memory=settings.device_memory,
            offload_step=settings.offload_step,
        )

    # ------------------------------------------------------------------ public
    def run(
        self,
        members: Sequence[Member],
        *,
        report: ReportHook | None = None,
        refill: RefillHook | None = None,
        on_finish: Callable[[MemberResult], None] | None = None,
        resume: bool = False,
        start_step: int = 0,
    ) -> list[MemberResult]:
        """Train ``members`` as one array (their configs must share the compatibility key) and
        return one result per member, including members that joined through ``refill``.

        ``report`` is called after every evaluation with the members evaluated at that step
        and may stop any of them; ``on_finish`` is called as each member finishes. On the CPU
        it keeps this process's freed memory for reuse while it runs (see ``hfsweep._malloc``;
        ``HFSWEEP_MALLOC=system`` leaves the allocator alone). With
        ``resume=True`` and a checkpoint in ``checkpoint_dir``, ``members`` is only used for
        members the checkpoint does not know yet; finished members are not trained again.
        ``start_step`` starts the array's data stream that many steps in (epoch
        ``start_step // steps_per_epoch``, its batch ``start_step % steps_per_epoch``): how a
        trial that joined an array by refill is retrained alone on the same data
        (``MemberResult.start_step``).
        """
        if isinstance(start_step, bool) or not isinstance(start_step, int) or start_step < 0:
            raise ValueError(f"start_step must be an int >= 0, got {start_step!r}")
        run = self._run_class(self, report, refill, on_finish)
        if self.device.type != "cpu":
            return run.execute(members, resume, start_step)
        with retaining_freed_memory(), training_threads() as threads:
            run.threads = threads
            return run.execute(members, resume, start_step)

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

    # ------------------------------------------------------------------ helpers for _Run
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
