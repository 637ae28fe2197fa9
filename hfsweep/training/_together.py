"""Several offloaded arrays trained together on one device, their shards alternating
(:func:`train_together`; issue 22, Hydra's shard alternation in the trainer).

Each array is one :class:`ArrayJob`: its own :class:`~hfsweep.ArrayTrainer` (``offload="host"``)
with the members and hooks its :meth:`~hfsweep.ArrayTrainer.run` would get. Every job's run is
the trainer's own loop (:meth:`~hfsweep.training.run.ArrayRun.steps`): its data stream, losses,
non-finite isolation, evaluations, reports, refills, checkpoints, resume and budgets are the
ones it has alone. The loop hands each training step's forward, loss and backward out as a
:class:`~hfsweep.training.run.StepRequest`; the driver here collects one request from every job
still training and runs them as one :meth:`AlternatingArrays.step
<hfsweep.offload.AlternatingArrays.step>`, so one array's shard fetches overlap another's
compute, then sends each run its ``[B]`` losses and lets it go on to its next step. A job that
ends leaves the others going on alone; a job whose array is rebuilt (an out-of-memory split, a
compaction) gets new engines and stays in the turns.

No threads (besides the transfer's own): the runs are generators advanced in turn, each on its
own copy of torch's global random generators (swapped in whenever it runs, the caller's at its
start, as :meth:`~hfsweep.ArrayTrainer.run` starts on the caller's), so every array's data
order, hooks' draws and dropout streams are exactly those it has trained alone. The joint step
itself draws from no global generator (the arrays' dropout has per-member streams); a model
whose own forward draws from torch's global generator would see the arrays' draws interleaved.
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from .._malloc import retaining_freed_memory_on
from .._usercode import Phase
from ..fusion import FusedArray
from ..offload import (
    SCHEDULES,
    AlternatingArrays,
    OffloadedArray,
    ResidentLedger,
    Schedule,
    Transfer,
    default_transfer,
)
from ..optim import clip_grad_norm_
from .checkpoint import _rng_state, _set_rng_state
from .results import Member, MemberResult, RefillHook, ReportHook
from .run import ArrayRun, StepRequest
from .trainer import ArrayTrainer

__all__ = ["ArrayJob", "StepDriver", "train_together"]


@dataclass
class ArrayJob:
    """One array of :func:`train_together`: what ``trainer.run(members, report=...,
    refill=..., on_finish=..., resume=..., start_step=...)`` would be given."""

    trainer: ArrayTrainer
    members: Sequence[Member]
    report: ReportHook | None = None
    refill: RefillHook | None = None
    on_finish: Callable[[MemberResult], None] | None = None
    resume: bool = False
    start_step: int = 0


def train_together(
    jobs: Sequence[ArrayJob],
    *,
    schedule: Schedule = "lockstep",
    prefetch_depth: int = 1,
    transfer: Transfer | None = None,
) -> list[list[MemberResult]]:
    """Train every job's array at once on one device, each training step of all of them one
    :class:`~hfsweep.offload.AlternatingArrays` step (their offloaded shards alternating, so
    that one array's transfers overlap another's compute); the results of each job, in order,
    as its ``trainer.run(...)`` returns them.

    Each job's array trains exactly as ``job.trainer.run(...)`` alone would train it (same
    members, data, seeds, evaluations, hooks' calls, checkpoints; see the module's
    docstring). The trainers must offload (``offload="host"``: ``"auto"`` decides per array
    and may keep one on the device, which has nothing to alternate), compute on one device,
    and give one ``device_memory``: the budget the arrays share, each array's shards at most
    a quarter of it over the number of jobs (see :class:`~hfsweep.offload.AlternatingArrays`).
    Each job needs its own trainer (its data, caches and checkpoint directory are its own).

    ``schedule`` and ``prefetch_depth`` (one depth for every array) are
    :class:`~hfsweep.offload.AlternatingArrays`'; ``transfer`` the one link every array's
    shards are copied through (default: :func:`~hfsweep.offload.default_transfer` of the
    device), closed at the end. Where one job's run raises, the others stop at their current
    step (their checkpoints, written at their last evaluation, resume them) and the error is
    raised."""
    _check(jobs, schedule, prefetch_depth)
    first = jobs[0].trainer
    driver = StepDriver(
        first.device, first.device_memory, len(jobs), schedule, prefetch_depth, transfer
    )
    results: dict[int, list[MemberResult]] = {}
    with retaining_freed_memory_on(first.device):
        try:
            keys = [driver.add(job) for job in jobs]
            while driver.training:
                for key, outcome in driver.round().items():
                    if isinstance(outcome, Exception):
                        raise outcome
                    results[key] = outcome
        finally:
            driver.stop()  # after an error: the others stop at their current step
    return [results[k] for k in keys]


def _check(jobs: Sequence[ArrayJob], schedule: str, prefetch_depth: int) -> None:
    """Refuse what :func:`train_together` cannot train, naming the job and what is valid."""
    if not isinstance(jobs, list | tuple) or not jobs:
        raise ValueError(f"train_together needs a list of at least one ArrayJob, got {jobs!r}")
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule must be one of {SCHEDULES}, got {schedule!r}")
    if (
        isinstance(prefetch_depth, bool)
        or not isinstance(prefetch_depth, int)
        or prefetch_depth < 1
    ):
        raise ValueError(f"prefetch_depth must be an int >= 1, got {prefetch_depth!r}")
    trainers: set[int] = set()
    dirs: dict[Path, int] = {}
    for n, job in enumerate(jobs):
        where = f"jobs[{n}]"
        if not isinstance(job, ArrayJob):
            raise ValueError(f"{where} must be an ArrayJob, got {type(job).__name__}")
        t = job.trainer
        if not isinstance(t, ArrayTrainer):
            raise ValueError(f"{where}.trainer must be an ArrayTrainer, got {type(t).__name__}")
        if t.offload != "host":
            raise ValueError(
                f"{where}.trainer has offload={t.offload!r}; train_together alternates offloaded "
                "arrays' shards: give ArrayTrainer(..., offload='host')"
            )
        if t.offload_step != "host":
            raise ValueError(
                f"{where}.trainer has offload_step={t.offload_step!r}; arrays trained together "
                "step their optimizers on the host (the device step is not alternated yet): "
                "give offload_step='host'"
            )
        if t.run_class is not ArrayRun:
            raise ValueError(
                f"{where}.trainer runs {t.run_class.__name__}, not the plain trainer's run: "
                "a data-parallel array is not trained together with others"
            )
        if id(t) in trainers:
            raise ValueError(f"{where}.trainer is another job's trainer: give each its own")
        trainers.add(id(t))
        first = jobs[0].trainer
        if t.device != first.device or t.device_memory != first.device_memory:
            raise ValueError(
                f"{where}.trainer computes on {t.device} with device_memory={t.device_memory}, "
                f"jobs[0]'s on {first.device} with device_memory={first.device_memory}: the "
                "arrays trained together share one device and its budget"
            )
        if t.checkpoint_dir is not None:
            d = t.checkpoint_dir.resolve()
            if d in dirs:
                raise ValueError(
                    f"{where}.trainer's checkpoint_dir {str(t.checkpoint_dir)!r} is also "
                    f"jobs[{dirs[d]}]'s: each array needs its own"
                )
            dirs[d] = n
        s = job.start_step
        if isinstance(s, bool) or not isinstance(s, int) or s < 0:
            raise ValueError(f"{where}.start_step must be an int >= 0, got {s!r}")


#: a run's loop under the driver: yields its steps, is sent their losses, returns its results
_Loop = Generator[StepRequest, Tensor, list[MemberResult]]
#: what a run is sent next: nothing (its start), its step's losses, or its step's error
_Reply = Tensor | BaseException | None


class StepDriver:
    """Runs advanced in turn (see the module's docstring): :meth:`add` a job's run, then each
    :meth:`round` takes every run to its next step request or its end and runs the requests
    as one alternating step. Runs may be added between rounds (an executor's arrays start
    while others train); ``arrays`` is how many may train at once, which divides the budget."""

    def __init__(
        self,
        device: torch.device,
        device_memory: int | None,
        arrays: int,
        schedule: Schedule = "lockstep",
        prefetch_depth: int = 1,
        transfer: Transfer | None = None,
    ) -> None:
        self.schedule: Schedule = schedule
        self.depth = prefetch_depth
        self.device = device
        self.transfer = transfer if transfer is not None else default_transfer(device)
        self.ledger = ResidentLedger(device_memory)
        # as AlternatingArrays: waiting arrays hold their depth's shards, the one computing
        # one more and its gradients, within half the budget
        parts = max(4 * arrays, 2 * (arrays * prefetch_depth + 2))
        self.shard_bytes = None if device_memory is None else max(device_memory // parts, 1)
        self._loops: dict[int, _Loop] = {}
        self._rng: dict[int, dict[str, Any]] = {}
        self._replies: dict[int, _Reply] = {}
        self._added = 0

    def _engine(self, array: FusedArray) -> OffloadedArray:
        """An array's engine: cut along the graph, on the shared ledger and transfer."""
        return OffloadedArray(
            array,
            device=self.device,
            transfer=self.transfer,
            shard_bytes=self.shard_bytes,
            cut="graph",
            ledger=self.ledger,
            prefetch_depth=self.depth,
        )

    def add(self, job: ArrayJob) -> int:
        """Start ``job``'s run (on torch's global generators as they are now, as ``run()``
        starts on the caller's); its key in :meth:`round`'s outcomes."""
        run = ArrayRun(job.trainer, job.report, job.refill, job.on_finish)
        run.engine_for = self._engine
        key = self._added
        self._added += 1
        self._loops[key] = run.steps(job.members, job.resume, job.start_step)
        self._rng[key] = _rng_state()
        self._replies[key] = None
        return key

    @property
    def training(self) -> bool:
        """Whether a run added has not ended."""
        return bool(self._loops)

    def round(self) -> dict[int, list[MemberResult] | Exception]:
        """Every run to its next step or its end, then their steps as one; the runs that
        ended in it (their results, or the exception their run raised), by key. Torch's
        global generators are as they were before (each run's are its own)."""
        outer = _rng_state()
        ended: dict[int, list[MemberResult] | Exception] = {}
        requests: dict[int, StepRequest] = {}
        try:
            for key, reply in self._replies.items():
                loop = self._loops[key]
                _set_rng_state(self._rng[key])
                try:
                    if isinstance(reply, BaseException):
                        requests[key] = loop.throw(reply)
                    else:
                        requests[key] = loop.send(reply)  # type: ignore[arg-type]
                except StopIteration as done:
                    ended[key] = done.value
                except Exception as exc:  # that run's end; the others go on
                    ended[key] = exc
                finally:
                    self._rng[key] = _rng_state()
        finally:
            _set_rng_state(outer)
        for key in ended:
            del self._loops[key], self._rng[key]
        self._replies = self._step(requests) if requests else {}
        return ended

    def stop(self) -> None:
        """Stop every run not ended at its current step (its checkpoint, written at its last
        evaluation, resumes it) and close the transfer."""
        outer = _rng_state()
        try:
            for loop in self._loops.values():
                loop.close()
        finally:
            self._loops.clear()
            self._rng.clear()
            self._replies.clear()
            _set_rng_state(outer)
            self.transfer.close()

    def _step(self, requests: Mapping[int, StepRequest]) -> dict[int, _Reply]:
        """Every request's forward, loss and backward as one alternating step; each run's
        ``[B]`` losses, or the step's error for each (out of memory: each run handles it as
        alone, restoring its buffers and going on as smaller arrays; any other: it ends each
        run it reaches, as it would end the run alone)."""
        order = sorted(requests)
        reqs = [requests[i] for i in order]
        losses: list[Tensor | None] = [None] * len(reqs)
        engines = []
        for r in reqs:
            assert r.live.engine is not None  # every array of a driven run is offloaded
            engines.append(r.live.engine)
        arrays = AlternatingArrays.of_engines(engines, schedule=self.schedule)
        try:
            with Phase("the forward and backward passes (arrays alternating)"):
                arrays.step([r.x for r in reqs], [_loss(r, losses, k) for k, r in enumerate(reqs)])
        except Exception as exc:
            return dict.fromkeys(order, exc)
        replies: dict[int, _Reply] = {}
        for i, r, value in zip(order, reqs, losses, strict=True):
            if r.live.clip is not None:
                clip_grad_norm_(r.live.array, r.live.clip)
            assert value is not None
            replies[i] = value
        return replies


def _loss(request: StepRequest, out: list[Tensor | None], k: int) -> Callable[[Tensor], Tensor]:
    """The scalar loss of ``request``'s array from its output, as its run computes it alone
    (the task's per-member losses, summed); the ``[B]`` losses are kept in ``out[k]``."""
    live, run = request.live, request.run
    smoothing = live.smoothing if live.smoothes else None
    member_loss: Any = run.t._loss or run.task.member_loss

    def loss(output: Tensor) -> Tensor:
        with Phase("the loss"):
            values: Tensor = member_loss(output, request.y, smoothing)
        out[k] = values.detach()  # the run adds it to its sums; the graph can go
        return values.sum()

    return loss
