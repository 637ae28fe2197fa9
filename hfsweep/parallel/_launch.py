"""Training one array on k worker processes of this machine, resized and shrunk as it goes.

:func:`train_data_parallel` starts k processes (``torch.multiprocessing``), joins them in a
``torch.distributed`` process group on loopback (gloo, or NCCL with one GPU per worker), trains
the array with :class:`~hfsweep.parallel.DataParallelTrainer` and returns rank 0's results. It
goes on across two kinds of interruption, both from the checkpoint the trainer writes at every
evaluation (whose layout does not depend on k):

- a resize: :func:`~hfsweep.parallel.request_resize` asks for k' workers; at its next
  evaluation boundary the array writes its checkpoint and stops, and k' workers resume it;
- a lost worker: a worker killed by a signal (SIGKILL, the out-of-memory killer, a node gone)
  takes the others down with it (their collectives fail, or they are ended here); the array
  resumes from its last checkpoint on the k - 1 workers left. Steps after that checkpoint are
  trained again, from the same state and data, so they give the same values; the members the
  leader already delivered (``delivered.log``) are not delivered again.

A worker that raises (a bug, a bad config) is not a lost worker: the worker's own exception is
raised here, as the single-worker trainer (or a Ray actor, through :func:`~hfsweep._usercode.unwrap`)
raises it: its type, its message and its phase label (so the engine fails the trials as with one
worker), with the worker's traceback text kept on it (:func:`~hfsweep._usercode.remote_traceback`)
and a :class:`WorkerError` naming every worker that failed as its ``__cause__``. Only an exception
that cannot be brought back is raised as the :class:`WorkerError` itself. Outcomes and
exceptions come back as plain data, never as a pickle that could run code
(:mod:`~hfsweep.parallel._sent`).
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any, NoReturn

import torch

from .._compat import compile_in_this_process
from .._io import atomic_save, atomic_write_text
from .._usercode import COLLECTIVE, NOT_TRAINING, keep_traceback, phase_of
from ..training import Member, MemberResult
from ..training.results import RefillHook, ReportHook
from ..training.task import Task
from ._run import RESIZE_FILE, DataParallelTrainer, ResizeRequested
from ._sent import load_error, load_outcome, sent_error, sent_outcome

__all__ = [
    "COLLECTIVE_TIMEOUT_S",
    "WorkerError",
    "elastic_loop",
    "free_port",
    "prepare_launch",
    "raise_worker_error",
    "train_data_parallel",
    "train_worker",
]

_log = logging.getLogger("hfsweep.parallel")

#: seconds the other workers get to end on their own after one failed, before they are killed
_GRACE_S = 2.0

#: the process group's timeout (seconds): the longest a worker waits in a collective for a peer
#: that neither answers nor is reported gone (torch's own default is 30 minutes). A peer whose
#: process died is noticed much sooner: the launcher sees it exit (a process's exit code, Ray's
#: actor death) and ends the others within ``_GRACE_S``, and gloo's collectives fail as soon as
#: the dead peer's connection closes (docs/elastic.md, "A worker lost")
COLLECTIVE_TIMEOUT_S = 120.0


class WorkerError(RuntimeError):
    """A worker of a data-parallel array failed; the message holds every failed worker's
    traceback. A worker's own exception, where it could be brought back, is raised instead,
    with this error as its cause (:func:`raise_worker_error`)."""


def raise_worker_error(message: str, raised: dict[int, BaseException]) -> NoReturn:
    """Raise the exception of the workers that raised (``raised``: rank -> exception), as the
    single-worker path raises the task's: the lowest rank's among those a phase of the task's
    training labelled (the task's code raised it), else the lowest rank's among those not
    raised by a failing collective, with ``WorkerError(message)`` as its cause. When only
    collectives failed (:data:`~hfsweep._usercode.COLLECTIVE`: the other workers' view of a
    worker that left, or whose own exception did not pickle back), or nothing was raised,
    ``WorkerError(message)`` itself."""
    error = WorkerError(message)
    if not raised:
        raise error

    def rank_order(rank: int) -> tuple[int, int]:
        phase = phase_of(raised[rank])
        if phase is not None and phase not in NOT_TRAINING:
            return (0, rank)
        return (2 if phase == COLLECTIVE else 1, rank)

    rank = min(raised, key=rank_order)
    if phase_of(raised[rank]) == COLLECTIVE:
        raise error
    exc = raised[rank]
    _log.info("worker %d of a data-parallel array raised %s: %s", rank, type(exc).__name__, exc)
    raise exc from error


def train_data_parallel(
    task: Task,
    members: Sequence[Member],
    *,
    workers: int,
    checkpoint_dir: str | os.PathLike[str],
    resume: bool = False,
    report: ReportHook | None = None,
    on_finish: Callable[[MemberResult], None] | None = None,
    backend: str | None = None,
    threads: int = 1,
    timeout_s: float = COLLECTIVE_TIMEOUT_S,
    start_method: str | None = None,
    **trainer_options: Any,
) -> list[MemberResult]:
    """Train ``members`` of ``task`` as one array on ``workers`` processes and return one result
    per member (rank 0's), as :meth:`ArrayTrainer.run <hfsweep.ArrayTrainer.run>` would on one.

    ``checkpoint_dir`` is required: it is what a resize or a lost worker resumes from.
    ``report`` and ``on_finish`` run in rank 0's process (they must pickle). ``backend`` is
    ``"gloo"`` (the default on CPUs) or ``"nccl"`` (the default when ``device`` is CUDA: worker
    r takes GPU r). ``threads`` is each worker's torch threads; ``timeout_s`` (the process
    group's timeout, :data:`COLLECTIVE_TIMEOUT_S` by default) bounds a collective that waits for
    a worker that hangs; a worker that dies ends the others within 2 s. ``start_method`` is
    ``torch.multiprocessing``'s: by default ``"fork"`` on CPUs where the platform has it (a
    worker starts in milliseconds, with this process's imports; ``task`` need not pickle) and
    ``"spawn"`` otherwise and on CUDA (which a forked process cannot use; every worker then
    imports torch and hfsweep itself, and ``task`` and the hooks must pickle).
    ``trainer_options`` are
    :class:`~hfsweep.ArrayTrainer`'s (``dtype``, ``eval_every``, ``device``...).
    """
    directory, device, backend = prepare_launch(workers, checkpoint_dir, backend, trainer_options)
    if start_method is None:
        forks = "fork" in torch.multiprocessing.get_all_start_methods()
        start_method = "fork" if forks and device.type == "cpu" else "spawn"
    method: str = start_method

    def launch(job: _Job) -> tuple[str, Any]:
        with tempfile.TemporaryDirectory(prefix="hfsweep-dp-") as scratch:
            return _run_workers(job, Path(scratch), threads, timeout_s, method, trainer_options)

    job = _Job(task, list(members), workers, directory, resume, report, on_finish, backend)
    return elastic_loop(job, launch)


def prepare_launch(
    workers: int,
    checkpoint_dir: str | os.PathLike[str],
    backend: str | None,
    trainer_options: dict[str, Any],
) -> tuple[Path, torch.device, str]:
    """What every launcher of a data-parallel array does first: refuse a ``workers`` count that
    is not an integer >= 1, create ``checkpoint_dir``, and choose the collective ``backend``
    (``nccl`` for a CUDA ``device`` in ``trainer_options``, else ``gloo``) unless one is given.
    Returns the directory, the device and the backend."""
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
        raise ValueError(f"workers must be an integer >= 1, got {workers!r}")
    directory = Path(checkpoint_dir)
    directory.mkdir(parents=True, exist_ok=True)
    device = torch.device(trainer_options.get("device", "cpu"))
    return directory, device, backend or ("nccl" if device.type == "cuda" else "gloo")


def elastic_loop(
    job: _Job,
    launch: Callable[[_Job], tuple[str, Any]],
    target: Callable[[int, int], int] | None = None,
) -> list[MemberResult]:
    """Launch ``job`` until it is done: again with the workers asked for after a resize, and
    with the workers left after some were lost, each time resuming from the checkpoint.
    ``launch(job)`` runs one launch and says how it ended: ``("done", results)``,
    ``("resize", workers)`` or ``("lost", how many workers died)``. ``target(workers, lost)``,
    where given, has the last word on each relaunch's workers (an allocator whose decision
    changed since it asked for the resize; ``lost`` is 0 for a resize); a target above the
    workers left after a loss is capped at them. A resize to 0 workers is a pause: the workers
    are ended at the checkpoint, and ``target(0, 0)`` returns when the array may go on (it
    waits meanwhile), with the workers it goes on with."""
    directory = job.directory
    while True:
        outcome, value = launch(job)
        if outcome == "done":
            return value
        k = job.workers
        if outcome == "resize":
            (directory / RESIZE_FILE).unlink(missing_ok=True)
            if value == 0 and target is None:
                raise WorkerError(f"array in {directory}: paused, but nothing can resume it")
            _log.info(
                "array in %s: %d -> %s workers (asked for)", directory, k, value or "0 (paused)"
            )
            job = job.again(_targeted(target, value, 0))
            continue
        if k - value < 1:
            raise WorkerError(f"array in {directory}: every one of its {k} workers was lost")
        _log.warning(
            "array in %s: %d of %d workers lost; going on with %d from the last checkpoint",
            directory,
            value,
            k,
            k - value,
        )
        job = job.again(min(k - value, _targeted(target, k - value, value)))


def _targeted(target: Callable[[int, int], int] | None, workers: int, lost: int) -> int:
    """``target(workers, lost)`` checked (an integer >= 1), or ``workers`` without one."""
    if target is None:
        return workers
    k = target(workers, lost)
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ValueError(f"the relaunch target must be an integer >= 1, got {k!r}")
    return k


class _Job:
    """What every worker of one launch needs (pickled to each)."""

    def __init__(
        self,
        task: Task,
        members: list[Member],
        workers: int,
        directory: Path,
        resume: bool,
        report: ReportHook | None,
        on_finish: Callable[[MemberResult], None] | None,
        backend: str,
        refill: RefillHook | None = None,
    ) -> None:
        self.task, self.members, self.workers, self.directory = task, members, workers, directory
        self.resume, self.report, self.on_finish, self.backend = resume, report, on_finish, backend
        self.refill = refill

    def again(self, workers: int) -> _Job:
        """This job on ``workers`` workers, resuming from the checkpoint."""
        return _Job(
            self.task,
            self.members,
            workers,
            self.directory,
            True,
            self.report,
            self.on_finish,
            self.backend,
            self.refill,
        )


def _run_workers(
    job: _Job,
    scratch: Path,
    threads: int,
    timeout_s: float,
    start_method: str,
    options: dict[str, Any],
) -> tuple[str, Any]:
    """Start ``job.workers`` workers and wait for them: ``("done", results)``, ``("resize",
    workers)`` or ``("lost", how many were killed by a signal)``; a worker that raised raises
    :class:`WorkerError`."""
    ctx = torch.multiprocessing.get_context(start_method)
    port = free_port()
    procs = [
        ctx.Process(  # type: ignore[attr-defined]
            target=_worker,
            args=(rank, port, job, scratch, threads, timeout_s, options),
            daemon=True,
        )
        for rank in range(job.workers)
    ]
    for p in procs:
        p.start()
    try:
        failed_at: float | None = None
        while True:
            codes = [p.exitcode for p in procs]
            if all(c == 0 for c in codes):
                break
            if failed_at is None and any(c not in (None, 0) for c in codes):
                failed_at = time.monotonic()
            if failed_at is not None and (
                all(c is not None for c in codes) or time.monotonic() - failed_at > _GRACE_S
            ):
                break
            time.sleep(0.02)
    finally:
        ended_here = [p for p in procs if p.exitcode is None]
        for p in ended_here:
            p.kill()
        for p in procs:
            p.join()
    codes = [p.exitcode for p in procs]
    if all(c == 0 for c in codes):
        try:
            return load_outcome(scratch / "outcome.pt")
        except Exception as exc:  # not plain data: nothing of it was run
            raise WorkerError(
                f"the outcome of the data-parallel array in {job.directory} could not be read "
                f"as plain data (tensors, numbers, strings, lists, dicts): {exc}"
            ) from exc
    signalled = [
        rank
        for rank, (p, c) in enumerate(zip(procs, codes, strict=True))
        if c is not None and c < 0 and p not in ended_here
    ]
    if signalled:
        return "lost", len(signalled)
    errors = [
        f"worker {rank}:\n{(scratch / f'error-{rank}.txt').read_text()}"
        for rank in range(job.workers)
        if (scratch / f"error-{rank}.txt").exists()
    ]
    raise_worker_error(
        f"a worker of the data-parallel array in {job.directory} failed (exit codes {codes}):\n"
        + ("\n".join(errors) or "no traceback was written"),
        _raised(scratch, job.workers),
    )


def _raised(scratch: Path, workers: int) -> dict[int, BaseException]:
    """The exceptions the workers saved (rank -> exception, rebuilt from plain data by
    :func:`~hfsweep.parallel._sent.load_error`); a file that does not load as plain data is
    left out, none of it run (the worker's traceback text is in the :class:`WorkerError`)."""
    out: dict[int, BaseException] = {}
    for rank in range(workers):
        path = scratch / f"error-{rank}.pt"
        if path.exists():
            try:
                out[rank] = load_error(path, rank)
            except Exception as exc:
                why = " ".join(str(exc).split())[:300]
                _log.warning("worker %d's exception in %s is not plain data: %s", rank, path, why)
    return out


def _worker(
    rank: int,
    port: int,
    job: _Job,
    scratch: Path,
    threads: int,
    timeout_s: float,
    options: dict[str, Any],
) -> None:
    """One worker process: train, and (rank 0) write the outcome; a worker that raises
    writes its traceback, and its exception (the traceback text kept on it) where it pickles.
    A forked worker of a parent that compiled would hang at its own first compile in the
    parent's compile pool: it compiles in its own thread (its ``threads`` are few anyway)."""
    compile_in_this_process()
    try:
        outcome = train_worker(rank, f"127.0.0.1:{port}", job, threads, timeout_s, options)
        if rank == 0:
            atomic_save(sent_outcome(outcome), scratch / "outcome.pt")
    except BaseException as exc:
        text = traceback.format_exc()
        atomic_write_text(scratch / f"error-{rank}.txt", text)
        if isinstance(exc, Exception):
            keep_traceback(exc, text)
            with contextlib.suppress(Exception):  # the traceback text is written already
                atomic_save(sent_error(exc, text), scratch / f"error-{rank}.pt")
        raise


def train_worker(
    rank: int,
    address: str,
    job: _Job,
    threads: int,
    timeout_s: float,
    options: dict[str, Any],
    on_leave_error: Callable[[Exception], None] | None = None,
) -> tuple[str, Any]:
    """Worker ``rank`` of ``job``: join the process group at ``address`` (``host:port`` of
    rank 0's rendezvous), train, leave the group; ``("done", results)`` or ``("resize",
    workers)``. An error leaving the group goes to ``on_leave_error`` (a process that trains
    again, a kept Ray actor, must not: its group may still be there), and is dropped without
    one (a worker process ends after its launch)."""
    import torch.distributed as dist

    torch.set_num_threads(threads)
    device = torch.device(options.get("device", "cpu"))
    if device.type == "cuda":
        device = torch.device("cuda", rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
        options = {**options, "device": device}
    dist.init_process_group(
        job.backend,
        init_method=f"tcp://{address}",
        rank=rank,
        world_size=job.workers,
        timeout=timedelta(seconds=timeout_s),
    )
    try:
        trainer = DataParallelTrainer(job.task, checkpoint_dir=job.directory, **options)
        try:
            results = trainer.run(
                job.members,
                report=job.report,
                refill=job.refill,
                on_finish=job.on_finish,
                resume=job.resume,
            )
            return "done", results
        except ResizeRequested as asked:
            return "resize", asked.workers
    finally:
        try:
            dist.destroy_process_group()
        except Exception as exc:
            if on_leave_error is not None:
                on_leave_error(exc)


def free_port() -> int:
    """A TCP port free on loopback now (the workers' rendezvous)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
