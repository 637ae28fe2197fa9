"""One worker of a data-parallel array: the trainer's run with each batch split between the
workers, the gradients and losses summed across them, and the decisions only one worker may
take (hooks, files, timing-based choices) taken by rank 0 and shared.

Every worker holds every member and runs the same steps on its shard of the same global batch
(each worker reads the whole batch in the seeded order of the one-worker run and keeps its rows,
:mod:`._split`). Worker r's loss for member i is its shard's mean weighted by
``rows_r / rows``, so the summed gradient is the gradient of the mean over the global batch, what
one worker computes: the members' hyperparameters mean what they mean on one worker, whatever k.
Dropout masks are the global batch's (:mod:`hfsweep.nn._shard`). BatchNorm normalises with each
worker's shard statistics; its running statistics are averaged across workers weighted by rows
after every step (docs/elastic.md says what this differs in from one worker).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from .._io import atomic_write_text
from .._usercode import Phase
from ..fusion import FusedArray
from ..nn import FusedBatchNormMixin, batch_shard
from ..optim import clip_grad_norm_
from ..training import (
    ArrayRun,
    ArrayState,
    ArrayTrainer,
    Evaluation,
    LiveArray,
    Member,
    MemberResult,
    add_metrics,
)
from ..training.results import RefillHook, ReportHook
from ..training.task import Task
from ._collectives import Group
from ._split import batch_rows, shard_bounds, take_rows

__all__ = ["RESIZE_FILE", "DataParallelTrainer", "ResizeRequested", "read_resize", "request_resize"]

_log = logging.getLogger("hfsweep.parallel")

#: the file in an array's checkpoint folder that asks it to go on with another number of workers
RESIZE_FILE = "resize.json"


class ResizeRequested(Exception):
    """A data-parallel run stopped at an evaluation boundary, its checkpoint written, because
    it was asked to go on with ``workers`` workers (:func:`request_resize`)."""

    def __init__(self, workers: int) -> None:
        super().__init__(f"resize to {workers} workers requested")
        self.workers = workers


def request_resize(checkpoint_dir: str | Path, workers: int) -> None:
    """Ask the data-parallel array training in ``checkpoint_dir`` to go on with ``workers``
    workers from its next evaluation boundary (written atomically; the launcher that restarts
    the array removes it). ``workers=0`` pauses it: it stops at that boundary, its workers are
    released, and the launcher's ``target`` says when, and on how many workers, it goes on."""
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 0:
        raise ValueError(f"workers must be an integer >= 0 (0: pause), got {workers!r}")
    atomic_write_text(Path(checkpoint_dir) / RESIZE_FILE, json.dumps({"workers": workers}))


def read_resize(checkpoint_dir: str | Path) -> int | None:
    """The workers asked for in ``checkpoint_dir`` (:func:`request_resize`), or ``None``."""
    path = Path(checkpoint_dir) / RESIZE_FILE
    try:
        value = json.loads(path.read_text())["workers"]
    except FileNotFoundError:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{path}: workers must be an integer >= 0 (0: pause), got {value!r}")
    return value


class _DataParallelRun(ArrayRun):
    """:class:`~hfsweep.training.run.ArrayRun` on one worker's shards (see the module docstring)."""

    t: DataParallelTrainer

    def __init__(
        self,
        trainer: DataParallelTrainer,
        report: ReportHook | None,
        refill: RefillHook | None,
        on_finish: Callable[[MemberResult], None] | None,
    ) -> None:
        super().__init__(trainer, report, refill, on_finish)
        self.group = trainer.group
        #: (offset, rows, total) of this worker's shard of the batch in hand
        self.shard = (0, 0, 0)

    # ------------------------------------------------------------------ training
    def _stream(self, config: Mapping[str, Any], state: ArrayState) -> Iterator[Any]:
        for epoch, index, batch in super()._stream(config, state):
            total = batch_rows(batch)
            start, stop = shard_bounds(total, self.group.size, self.group.rank)
            self.shard = (start, stop - start, total)
            yield epoch, index, take_rows(batch, start, stop)

    def _backward(self, live: LiveArray, x: Any, y: Any) -> Tensor:
        offset, rows, total = self.shard
        array = live.array
        params = [p for p in array.parameters() if p.requires_grad]
        if rows:
            weight = rows / total
            with batch_shard(offset, rows, total), Phase("the forward pass"):
                out = array(x)
            with Phase("the loss"):
                smoothing = live.smoothing if live.smoothes else None
                # the trainer's compiled loss (``compile``), as on one worker
                losses = (self.t._loss or self.task.member_loss)(out, y, smoothing)
            with Phase("the backward pass"):
                (losses.sum() * weight).backward()
            weighted = losses.detach() * weight
        else:  # fewer rows than workers: this worker has none to add
            weighted = live.smoothing.new_zeros(array.size)
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        with Phase("summing gradients across workers"):
            self.group.sum_([*(p.grad for p in params if p.grad is not None), weighted])
        self._sync_buffers(array, rows / total)
        if live.clip is not None:
            clip_grad_norm_(array, live.clip)
        return weighted

    def _sync_buffers(self, array: FusedArray, weight: float) -> None:
        """BatchNorm's running statistics averaged across workers weighted by rows; when a
        worker had no rows (and so no forward), rank 0's other buffers (the dropout streams'
        counters, BatchNorm's batch counts) on every worker."""
        stats = [
            t
            for m in array.module.modules()
            if isinstance(m, FusedBatchNormMixin)
            for t in (m.running_mean, m.running_var)
            if t is not None
        ]
        if stats and self.group.size > 1:
            for t in stats:
                if weight:
                    t.mul_(weight)
                else:
                    t.zero_()
            self.group.sum_(stats)
        if self.shard[2] < self.group.size:
            by_dtype: dict[torch.dtype, list[Tensor]] = {}
            for b in array._forward_buffers():
                if not b.is_floating_point():
                    by_dtype.setdefault(b.dtype, []).append(b)
            for tensors in by_dtype.values():
                self.group.broadcast_(tensors)

    def _out_of_memory(self, live: LiveArray, error: str) -> list[ArrayState] | None:
        raise RuntimeError(
            f"worker {self.group.rank} of a data-parallel array of {self.group.size} ran out of "
            f"memory ({error}); a data-parallel array does not split itself yet: train it on "
            "more workers or with fewer members"
        )

    def _compact_size(
        self, state: ArrayState, array: FusedArray, busy: int, build_s: float
    ) -> int | None:
        # a choice from measured step times: rank 0's, or the workers would build other arrays
        choice = super()._compact_size(state, array, busy, build_s) if self.group.leader else None
        return self.group.share(choice)

    # ------------------------------------------------------------------ evaluation
    def _validation_sums(self, live: LiveArray, val: Any) -> tuple[dict[str, Tensor], int]:
        array = live.array
        sums: dict[str, Tensor] = {}
        count = 0
        for batch in val:
            total = batch_rows(batch)
            start, stop = shard_bounds(total, self.group.size, self.group.rank)
            if stop == start:
                continue
            x, y = self.t._to_device(take_rows(batch, start, stop))
            with Phase("the forward pass (evaluation)"), batch_shard(start, stop - start, total):
                out = array(x)
            with Phase("the validation loss and metrics"):
                add_metrics(sums, self.task.member_metrics(out, y), stop - start)
            count += stop - start
        names: list[str] = self.group.share(sorted(sums))
        device = self.t.device
        values = [
            sums.get(n, torch.zeros(array.size, dtype=torch.float64, device=device)) for n in names
        ]
        self.group.sum_(values)
        return dict(zip(names, values, strict=True)), self.group.rows_total(count)

    def _report(self, evaluations: list[Evaluation]) -> Mapping[str, bool]:
        decisions = super()._report(evaluations) if self.group.leader else None
        return self.group.share(dict(decisions or {}))

    def _next_member(self) -> Member | None:
        member = super()._next_member() if self.group.leader else None
        return self.group.share(member)

    # ------------------------------------------------------------------ files and boundaries
    def _writes_files(self) -> bool:
        return self.group.leader and super()._writes_files()

    def _save_checkpoint(self, running: LiveArray | None) -> None:
        if self.group.leader:
            super()._save_checkpoint(running)

    def _deliver(self) -> None:
        if self.group.leader:
            super()._deliver()
            return
        for member_id in self.pending:
            if not self.t.keep_states:
                self.results[member_id].state = None
            self.delivered.add(member_id)
        self.pending.clear()

    def _at_boundary(self) -> None:
        d = self.t.checkpoint_dir
        if d is None:
            return
        asked = read_resize(d) if self.group.leader else None
        asked = self.group.share(asked)
        if asked is None:
            return
        if asked == self.group.size:
            if self.group.leader:
                (Path(d) / RESIZE_FILE).unlink(missing_ok=True)
            return
        _log.info(
            "stopping at an evaluation boundary to go on with %s instead of %d",
            f"{asked} workers" if asked else "none (paused)",
            self.group.size,
        )
        raise ResizeRequested(asked)


class DataParallelTrainer(ArrayTrainer):
    """An :class:`~hfsweep.ArrayTrainer` for one worker of a data-parallel array.

    Build one per worker after ``torch.distributed.init_process_group`` (gloo on CPUs, NCCL on
    GPUs; :func:`~hfsweep.parallel.train_data_parallel` does all of it) with the same task,
    members and settings on every worker. Rank 0 calls the hooks (``report``, ``refill``,
    ``on_finish``: they run in its process) and writes the checkpoint, which has the layout of
    the one-worker trainer's: any number of workers resumes it. ``run`` returns the results on
    rank 0 (the others return theirs too, without calling the hooks) and raises
    :class:`ResizeRequested` at an evaluation boundary where :func:`request_resize` asked for
    another number of workers.
    """

    run_class = _DataParallelRun

    def __init__(self, task: Task, **options: Any) -> None:
        super().__init__(task, **options)
        self.group = Group()
