"""A data-parallel array's k workers as Ray actors in one placement group.

:func:`train_data_parallel_ray` is :func:`~hfsweep.parallel.train_data_parallel` on a Ray
cluster: each launch holds k actors (``cpus_per_worker`` CPUs and ``gpus_per_worker`` GPUs
each) in placement groups, has rank 0's actor pick its node's address and a free port for the
``torch.distributed`` rendezvous, and trains. Resizes and lost workers are handled as on one
machine (the same loop, from the same checkpoint). A resize keeps the actors that go on and
starts only those it adds, ahead of the boundary where it happens (:class:`_Crew`). An actor
whose process dies (SIGKILL, a node lost) counts as a lost worker: the other actors are killed,
the placement groups are given back, and k - 1 new actors resume the array. A worker that
hangs without dying counts as lost too: when the others' collectives time out waiting for it
(``timeout_s``, :data:`~hfsweep.parallel.COLLECTIVE_TIMEOUT_S`) and it has not ended a grace
period later, it is killed and the array goes on without it. The checkpoint folder must be one
every worker's node sees (one machine, or a shared file system).
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Callable, Sequence
from typing import Any

from .._usercode import COLLECTIVE, phase_of, unwrap
from ..training import Member, MemberResult
from ..training.results import RefillHook, ReportHook
from ..training.task import Task
from ._launch import (
    COLLECTIVE_TIMEOUT_S,
    WorkerError,
    _Job,
    elastic_loop,
    free_port,
    prepare_launch,
    raise_worker_error,
    train_worker,
)
from ._run import read_resize

__all__ = ["train_data_parallel_ray"]

_log = logging.getLogger("hfsweep.parallel")

#: seconds the other actors get to end on their own after one failed
_GRACE_S = 2.0
#: seconds between looks for a resize request while the placement group waits
_POLL_S = 0.5


def train_data_parallel_ray(
    task: Task,
    members: Sequence[Member],
    *,
    workers: int,
    checkpoint_dir: str | os.PathLike[str],
    resume: bool = False,
    report: ReportHook | None = None,
    on_finish: Callable[[MemberResult], None] | None = None,
    cpus_per_worker: float = 1,
    gpus_per_worker: float = 0,
    backend: str | None = None,
    threads: int = 1,
    timeout_s: float = COLLECTIVE_TIMEOUT_S,
    place_timeout_s: float = 120.0,
    target: Callable[[int, int], int] | None = None,
    refill: RefillHook | None = None,
    keep_workers: bool = True,
    **trainer_options: Any,
) -> list[MemberResult]:
    """Train ``members`` as one array on ``workers`` Ray actors (Ray initialised by the
    caller) and return rank 0's results. The arguments are
    :func:`~hfsweep.parallel.train_data_parallel`'s, and each worker's resources;
    ``place_timeout_s`` bounds the wait for the placement group (a :class:`WorkerError` says
    the cluster cannot hold the array); ``target(workers, lost)`` has the last word on the
    workers of each relaunch (see :func:`~hfsweep.parallel._launch.elastic_loop`); ``refill``
    (run in rank 0's process, like ``report``) gives members for free slots. With
    ``keep_workers`` (the default) the actors that go on across a resize are kept, and those a
    grow adds start while the array still trains (:class:`_Crew`); without, every launch starts
    new actors."""
    if gpus_per_worker:
        trainer_options = {"device": "cuda", **trainer_options}
    directory, _, backend = prepare_launch(workers, checkpoint_dir, backend, trainer_options)
    bundle = {"CPU": float(cpus_per_worker), "GPU": float(gpus_per_worker)}
    bundle = {k: v for k, v in bundle.items() if v}

    crew = _Crew(bundle, keep_workers)

    def launch(job: _Job) -> tuple[str, Any]:
        return _launch(job, crew, threads, timeout_s, place_timeout_s, trainer_options)

    job = _Job(task, list(members), workers, directory, resume, report, on_finish, backend, refill)
    try:
        return elastic_loop(job, launch, target)
    finally:
        crew.end()


def _place(group: Any, job: _Job, place_timeout_s: float) -> int | None:
    """Wait until Ray placed ``group``: ``None``, or the workers a resize asked for meanwhile
    (:func:`~hfsweep.parallel.request_resize`; an allocator that gave the workers this launch
    waits for to another array must not wait for that array to end). A :class:`WorkerError`
    after ``place_timeout_s``."""
    import ray

    deadline = time.monotonic() + place_timeout_s
    while not ray.wait([group.ready()], timeout=min(_POLL_S, place_timeout_s))[0]:
        asked = read_resize(job.directory)
        if asked is not None and asked != job.workers:
            _log.info(
                "array in %s: resized to %d workers while waiting for %d to be placed",
                job.directory,
                asked,
                job.workers,
            )
            return asked
        if time.monotonic() >= deadline:
            raise WorkerError(
                f"Ray could not place {job.workers} workers of {job.directory}'s array "
                f"within {place_timeout_s} s"
            )
    return None


class _Worker:
    """One worker of a data-parallel array, in a Ray actor (kept across the array's resizes:
    see :class:`_Crew`)."""

    def warm(self) -> None:
        """Import what the first launch in this process would import on its critical path:
        ``torch._dynamo``, which ``torch.optim``'s first optimizer built in a process imports
        (seconds on a small CPU). Called as the actor starts, so that it overlaps the
        placement of the other actors, or the array's training at its old size."""
        import torch._dynamo  # noqa: F401

    def rendezvous(self) -> str:
        """``host:port`` for the process group's rendezvous, on this actor's node."""
        import ray

        return f"{ray.util.get_node_ip_address()}:{free_port()}"

    def train(
        self,
        rank: int,
        address: str,
        job: _Job,
        threads: int,
        timeout_s: float,
        options: dict[str, Any],
    ) -> tuple[tuple[str, Any], bool]:
        """:func:`~hfsweep.parallel._launch.train_worker` in this actor: its outcome (rank
        0's results, the other ranks' kind alone) and whether this actor can train again. It
        cannot where it did not leave its process group (``destroy_process_group`` raised, or
        the default group is still there): its next ``init_process_group`` would fail, a
        launch later, as a worker error, so :class:`_Crew` ends it instead of keeping it."""
        import torch.distributed as dist

        errors: list[Exception] = []
        outcome = train_worker(
            rank, address, job, threads, timeout_s, options, on_leave_error=errors.append
        )
        reusable = not errors and not (dist.is_available() and dist.is_initialized())
        if not reusable:
            _log.warning(
                "worker %d of the data-parallel array in %s did not leave its process group "
                "(%s): its actor is not kept",
                rank,
                job.directory,
                errors[0] if errors else "the default group is still initialised",
            )
        return (outcome if rank == 0 else (outcome[0], None)), reusable


class _Crew:
    """The worker actors of one data-parallel array across its launches.

    The actors are held as segments: a placement group (``PACK``) and one actor per bundle,
    rank order being segment order. With ``keep``, a launch that ends in a resize keeps the
    actors that go on: a shrink ends the last ranks' actors (a segment cut in the middle is
    given back whole, its bundles cannot be released one by one, and its leading ranks start
    again in a segment of their own), a grow adds a segment for the added ranks. The actors
    kept skip a process start, the imports of torch and hfsweep (and, on a GPU, the CUDA
    context): a resize's pause is then the checkpoint, the process group's rendezvous and the
    state load (``benchmarks/resize_pause.py`` measures it). A grow asked for while the array
    trains (:func:`~hfsweep.parallel.request_resize`) starts its segment at once
    (:meth:`ahead`), so its actors start, and :meth:`_Worker.warm`, while the array still
    trains at its old size. Any other end of a launch (done, a worker lost or raised, an
    exception) ends every actor, as without ``keep``: a relaunch after a loss starts afresh.
    An actor that could not leave its process group at a resize is not kept either
    (:meth:`discard`): its segment is ended and the next launch starts fresh actors instead."""

    def __init__(self, bundle: dict[str, float], keep: bool) -> None:
        self.bundle, self.keep = bundle, keep
        self.segments: list[tuple[Any, list[Any]]] = []
        #: a segment started ahead of a grow, not yet part of the array
        self.spare: tuple[Any, list[Any]] | None = None
        #: the placement groups already placed (ids)
        self.placed: set[Any] = set()

    @property
    def actors(self) -> list[Any]:
        return [a for _, actors in self.segments for a in actors]

    def _segment(self, n: int) -> tuple[Any, list[Any]]:
        """A new placement group of ``n`` bundles and an actor in each (created now; Ray starts
        them once the group is placed), each warming up where actors are kept. Until it is
        returned no one else holds the group: on any error or interrupt (Ctrl-C) while its
        actors are made, those made so far are killed and the group is given back."""
        import ray
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        group = placement_group([dict(self.bundle)] * n, strategy="PACK")
        actors: list[Any] = []
        try:
            remote = ray.remote(_Worker)
            for i in range(n):
                actors.append(
                    remote.options(
                        num_cpus=self.bundle.get("CPU", 0),
                        num_gpus=self.bundle.get("GPU", 0),
                        scheduling_strategy=PlacementGroupSchedulingStrategy(
                            placement_group=group, placement_group_bundle_index=i
                        ),
                    ).remote()
                )
            if self.keep:
                for a in actors:
                    a.warm.remote()
        except BaseException:
            self._end((group, actors))
            raise
        return group, actors

    def _end(self, segment: tuple[Any, list[Any]]) -> None:
        import ray
        from ray.util.placement_group import remove_placement_group

        group, actors = segment
        for a in actors:
            with contextlib.suppress(Exception):
                ray.kill(a)
        with contextlib.suppress(Exception):
            remove_placement_group(group)
        self.placed.discard(group.id)

    def shrink(self, workers: int) -> None:
        """End the actors beyond the first ``workers`` (see the class docstring); 0 ends all."""
        while len(self.actors) > workers:
            group, actors = self.segments.pop()
            self._end((group, actors))
        if workers == 0 and self.spare is not None:
            self._end(self.spare)
            self.spare = None

    def end(self) -> None:
        """End every actor and give back every placement group."""
        self.shrink(0)

    def discard(self, actors: Sequence[Any]) -> None:
        """End the segments holding any of ``actors`` (ones that cannot train again: a segment
        is given back whole), keeping the others in rank order; the next :meth:`fit` starts
        fresh actors in their place."""
        doomed = {id(a) for a in actors}
        kept: list[tuple[Any, list[Any]]] = []
        for segment in self.segments:
            if any(id(a) in doomed for a in segment[1]):
                self._end(segment)
            else:
                kept.append(segment)
        self.segments = kept

    def ahead(self, job: _Job) -> None:
        """Where a grow is asked for while ``job`` trains, start the added actors now; where
        the request that started them was withdrawn or lowered (the allocator re-planned),
        end them, so their resources go where the plan now says."""
        if not self.keep:
            return
        with contextlib.suppress(ValueError, OSError):  # a request being rewritten: next look
            asked = read_resize(job.directory)
            if self.spare is not None:
                if asked is None or asked != len(self.actors) + len(self.spare[1]):
                    _log.info(
                        "array in %s: its resize request changed (now %s); ending the %d "
                        "worker(s) started ahead of it",
                        job.directory,
                        asked,
                        len(self.spare[1]),
                    )
                    self._end(self.spare)
                    self.spare = None
                else:
                    return
            if asked is not None and asked > len(self.actors):
                _log.info(
                    "array in %s: starting %d more worker(s) ahead of its resize to %d",
                    job.directory,
                    asked - len(self.actors),
                    asked,
                )
                try:
                    self.spare = self._segment(asked - len(self.actors))
                except Exception as exc:  # the boundary starts them instead; training goes on
                    _log.warning(
                        "array in %s: could not start workers ahead of its resize (%s); they "
                        "start at its boundary",
                        job.directory,
                        exc,
                    )

    def fit(self, job: _Job, place_timeout_s: float) -> int | None:
        """Hold exactly ``job.workers`` placed actors: ``None``, or the workers a resize asked
        for while a placement group waited (see :func:`_place`)."""
        k = job.workers
        self.shrink(k)
        spare, self.spare = self.spare, None
        if spare is not None:
            if len(self.actors) + len(spare[1]) <= k:
                self.segments.append(spare)
            else:
                self._end(spare)
        if len(self.actors) < k:
            self.segments.append(self._segment(k - len(self.actors)))
        for group, _ in self.segments:
            if group.id in self.placed:
                continue
            asked = _place(group, job, place_timeout_s)
            if asked is not None:
                return asked
            self.placed.add(group.id)
        return None


def _launch(
    job: _Job,
    crew: _Crew,
    threads: int,
    timeout_s: float,
    place_timeout_s: float,
    options: dict[str, Any],
) -> tuple[str, Any]:
    """One launch of ``job`` on Ray: ``("done", results)``, ``("resize", workers)`` or
    ``("lost", actors that died)``. After a resize, ``crew`` keeps the actors that go on
    (with ``keep``); after anything else its actors are ended."""
    outcome: tuple[str, Any] | None = None
    try:
        outcome = _train_on(job, crew, threads, timeout_s, place_timeout_s, options)
        return outcome
    finally:
        if outcome is not None and outcome[0] == "resize" and crew.keep:
            crew.shrink(outcome[1])  # the workers not going on are free before the relaunch
        else:
            crew.end()


def _train_on(
    job: _Job,
    crew: _Crew,
    threads: int,
    timeout_s: float,
    place_timeout_s: float,
    options: dict[str, Any],
) -> tuple[str, Any]:
    import ray
    from ray.exceptions import RayActorError

    asked = crew.fit(job, place_timeout_s)
    if asked is not None:  # resized while it waited: relaunch without having trained
        return "resize", asked
    actors = crew.actors
    try:
        address = ray.get(actors[0].rendezvous.remote())
    except RayActorError:  # a kept rank 0 that died between launches: a lost worker
        return "lost", 1
    refs = [
        a.train.remote(rank, address, job, threads, timeout_s, options)
        for rank, a in enumerate(actors)
    ]
    outcomes: dict[int, Any] = {}
    died: set[int] = set()
    raised: dict[int, Exception] = {}
    pending = list(refs)
    failed = False
    while pending:
        ready, pending = ray.wait(pending, num_returns=1, timeout=_GRACE_S if failed else _POLL_S)
        if not ready:
            if failed:  # the others did not end on their own after a failure
                break
            crew.ahead(job)  # a grow asked for meanwhile: its actors start now
            continue
        for ref in ready:
            rank = refs.index(ref)
            try:
                outcomes[rank] = ray.get(ref)
            except RayActorError:
                died.add(rank)
                failed = True
            except Exception as exc:  # the worker raised (RayTaskError)
                raised[rank] = exc
                failed = True
    spoiled = [actors[rank] for rank, (_, reusable) in outcomes.items() if not reusable]
    if spoiled:  # still in a process group: fresh actors take their places
        _log.warning(
            "array in %s: %d worker actor(s) could not leave their process group; they are "
            "ended, and the next launch starts fresh ones",
            job.directory,
            len(spoiled),
        )
        crew.discard(spoiled)
    if died:
        return "lost", len(died)
    hung = [refs.index(ref) for ref in pending]
    if hung and all(phase_of(unwrap(e)) == COLLECTIVE for e in raised.values()):
        # the others' collectives timed out waiting for workers that never ended: those
        # hang (alive, not training); they are killed and count as lost
        _log.warning(
            "worker(s) %s of the data-parallel array in %s did not end %.0f s after the "
            "others' collectives failed (timed out waiting for them): counted as lost",
            ", ".join(map(str, hung)),
            job.directory,
            _GRACE_S,
        )
        return "lost", len(hung)
    if raised:
        text = "\n".join(f"worker {rank}: {error}" for rank, error in sorted(raised.items()))
        raise_worker_error(
            f"a worker of the data-parallel array in {job.directory} raised:\n{text}",
            {rank: unwrap(error) for rank, error in raised.items()},
        )
    result: tuple[str, Any] = outcomes[0][0]
    return result
