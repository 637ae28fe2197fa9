"""The Ray executor: the engine's arrays train in Ray actors across a cluster.

The driver (the process running ``hfsweep run``) keeps the searcher, the scheduler, the packer
and the study; each array trains in an actor that reserves ``ray.cpus_per_array`` CPUs and
``ray.gpus_per_array`` GPUs, and the arrays' hook calls come back to the driver (see
:mod:`hfsweep.executors._worker`). Actors are pooled and reused, so a worker's traced forwards
serve the next array it trains. When an actor's process dies (a lost node, an out-of-memory
kill), its array restarts from its last checkpoint on a new actor: the trainer's checkpoints
are written to the run directory, which every node must see (one machine, or a shared file
system on a cluster).
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch

from ..training.task import Task
from ..training.trainer import ArrayTrainer, Member, MemberResult, RefillHook, ReportHook
from ._errors import ExecutorError, Stopped
from ._worker import ArrayWorker

if TYPE_CHECKING:
    from ..config import RayConfig

__all__ = ["RayExecutor"]

_log = logging.getLogger("hfsweep.ray")
#: seconds to wait for a cluster given by address to hold one array (its workers may be joining)
_JOIN_WAIT_S = 60.0
#: seconds to wait for Ray to place a new array's actor before counting on one array fewer
_PLACE_WAIT_S = 120.0


class RayExecutor:
    """Trains arrays of ``task`` in Ray actors; ``slots`` arrays train at once.

    Connects to the Ray cluster at ``settings.address``, or uses the Ray this process already
    initialised, or starts a local one for the run (shut down by :meth:`close`).
    """

    def __init__(
        self,
        task: Task,
        *,
        device: str,
        dtype: torch.dtype,
        eval_every: int | None,
        settings: RayConfig,
    ) -> None:
        import ray

        self.task = task
        self.device = device
        self.dtype = dtype
        self.eval_every = eval_every
        self.settings = settings
        self._owns_ray = not ray.is_initialized()
        if self._owns_ray:
            # a Ray started for this run serves this machine only
            local: dict[str, Any] = (
                {"_node_ip_address": "127.0.0.1"} if settings.address is None else {}
            )
            ray.init(
                address=settings.address,
                include_dashboard=False,
                logging_level=logging.WARNING,
                log_to_driver=False,
                **local,
            )
        #: (pid, start time) of the processes of a Ray this executor started
        self._started: set[tuple[int, float]] = self._ray_processes() if self._owns_ray else set()
        try:
            self._setup(task, device, settings)
        except BaseException:
            self._shutdown()
            raise

    def _setup(self, task: Task, device: str, settings: RayConfig) -> None:
        """Check the cluster can hold an array and size the pool of actors."""
        import ray

        _pickle_task_by_value(task)
        want_gpu = settings.gpus_per_array
        if want_gpu is None:
            gpus = float(ray.cluster_resources().get("GPU", 0.0))
            want_gpu = 1.0 if device.startswith("cuda") or (device == "auto" and gpus) else 0.0
        if device.startswith("cuda") and not want_gpu:
            raise ExecutorError(
                f"fusion.device is {device!r} but ray.gpus_per_array is 0: give each array a GPU"
            )
        self.cpus_per_array = settings.cpus_per_array
        self.gpus_per_array = want_gpu
        # a cluster's workers may still be joining: wait a while for room for one array
        deadline = time.monotonic() + (_JOIN_WAIT_S if settings.address is not None else 0.0)
        while True:
            fit, cpus, gpus = self._fit()
            if fit >= 1 or time.monotonic() >= deadline:
                break
            time.sleep(1.0)
        if fit < 1:
            raise ExecutorError(
                f"the Ray cluster ({cpus:g} CPUs, {gpus:g} GPUs) cannot hold one array's actor "
                f"({self.cpus_per_array:g} CPUs, {want_gpu:g} GPUs); lower ray.cpus_per_array "
                "or ray.gpus_per_array, or add nodes"
            )
        #: arrays training at once
        self.slots = min(fit, settings.max_concurrent or fit)
        self._idle: list[Any] = []
        self._remote: Any = None  # ArrayWorker as a Ray actor class, made once
        self._groups: dict[Any, Any] = {}  # actor -> the placement group reserved for it
        self._made = 0
        self._busy: set[Any] = set()
        self._closed = False
        self._cond = threading.Condition()
        _log.info(
            "Ray backend: up to %d array(s) at once, each %g CPUs and %g GPUs (cluster: %g CPUs, "
            "%g GPUs)",
            self.slots,
            self.cpus_per_array,
            want_gpu,
            cpus,
            gpus,
        )

    def _fit(self) -> tuple[int, float, float]:
        """How many arrays the cluster's resources hold at once, and its CPUs and GPUs."""
        import ray

        resources = ray.cluster_resources()
        cpus = float(resources.get("CPU", 0.0))
        gpus = float(resources.get("GPU", 0.0))
        fits = [cpus / self.cpus_per_array]
        if self.gpus_per_array:
            fits.append(gpus / self.gpus_per_array)
        return math.floor(min(fits) + 1e-9), cpus, gpus

    # ------------------------------------------------------------------ actors
    def _acquire(self) -> Any:
        """An idle actor, or a new one in resources reserved for it. When Ray cannot reserve
        an array's resources within ``_PLACE_WAIT_S`` (other work holds them, or no node is big
        enough though the cluster's total suggested so), one array fewer trains at once."""
        from ray.exceptions import RayActorError

        while True:
            with self._cond:
                while not self._idle and self._made >= self.slots and not self._closed:
                    self._cond.wait()
                if self._closed:
                    raise Stopped
                if self._idle:
                    actor = self._idle.pop()
                    self._busy.add(actor)
                    return actor
                self._made += 1
            group = self._reserve()
            if group is None:
                self._unplaced()
                continue
            actor = self._new_actor(group)
            try:
                where = self._ray_get(actor.where.remote())
            except RayActorError as exc:
                self._forget(actor)
                raise ExecutorError(
                    "a Ray worker could not start (is hfsweep, and the module defining the "
                    f"task, importable on every node?): {exc}"
                ) from exc
            with self._cond:
                if self._closed:
                    self._forget(actor)
                    raise Stopped
                self._busy.add(actor)
            _log.info("Ray worker ready: %s", where)
            return actor

    def _reserve(self) -> Any:
        """A placement group holding one array's resources, or ``None`` if Ray could not
        reserve them within ``_PLACE_WAIT_S`` (reserving does not wait for a process to
        start, so a slow start is not mistaken for a full cluster)."""
        from ray.util.placement_group import placement_group, remove_placement_group

        bundle = {"CPU": self.cpus_per_array}
        if self.gpus_per_array:
            bundle["GPU"] = self.gpus_per_array
        group = placement_group([bundle])
        if group.wait(timeout_seconds=_PLACE_WAIT_S):
            return group
        remove_placement_group(group)
        return None

    def _new_actor(self, group: Any) -> Any:
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        if self._remote is None:
            self._remote = ray.remote(
                num_cpus=self.cpus_per_array, num_gpus=self.gpus_per_array, max_restarts=0
            )(ArrayWorker)
        strategy = PlacementGroupSchedulingStrategy(placement_group=group)
        actor = self._remote.options(scheduling_strategy=strategy).remote(
            self.task,
            device=self.device,
            dtype=self.dtype,
            eval_every=self.eval_every,
            threads=max(1, int(self.cpus_per_array)),
        )
        self._groups[actor] = group
        return actor

    @staticmethod
    def _ray_get(ref: Any, timeout: float | None = None) -> Any:
        import ray

        return ray.get(ref, timeout=timeout)

    def _kill(self, actor: Any) -> None:
        """Kill ``actor`` and free the resources reserved for it."""
        import ray
        from ray.util.placement_group import remove_placement_group

        with contextlib.suppress(Exception):  # the cluster may be gone (Ctrl-C reaches it)
            ray.kill(actor, no_restart=True)
        group = self._groups.pop(actor, None)
        if group is not None:
            with contextlib.suppress(Exception):
                remove_placement_group(group)

    def _forget(self, actor: Any) -> None:
        """Kill an actor that never joined the pool."""
        self._kill(actor)
        with self._cond:
            self._made -= 1
            self._cond.notify_all()

    def _unplaced(self) -> None:
        """Ray could not reserve a new actor's resources: go on with one array fewer at
        once, or give up when not even one array can train."""
        with self._cond:
            self._made -= 1
            if self._made == 0:
                self._cond.notify_all()
                raise ExecutorError(
                    f"Ray could not place an array's actor ({self.cpus_per_array:g} CPUs, "
                    f"{self.gpus_per_array:g} GPUs) within {_PLACE_WAIT_S:g} s: other work holds "
                    "the cluster's resources, or no single node has that much; lower "
                    "ray.cpus_per_array or ray.gpus_per_array, or free or add nodes"
                )
            self.slots = max(1, min(self.slots - 1, self._made))
            _log.warning(
                "Ray could not place another array's actor within %g s; going on with up to "
                "%d array(s) at once",
                _PLACE_WAIT_S,
                self.slots,
            )
            self._cond.notify_all()

    def _release(self, actor: Any, *, dead: bool = False) -> None:
        with self._cond:
            self._busy.discard(actor)
            if dead:
                self._made -= 1
                self._kill(actor)
            elif not self._closed:
                self._idle.append(actor)
            self._cond.notify_all()

    def close(self) -> None:
        """Stop every actor (arrays still training raise :class:`Stopped` in their threads)
        and shut down the Ray this executor started."""
        with self._cond:
            self._closed = True
            actors = [*self._idle, *self._busy]
            self._idle.clear()
            self._cond.notify_all()
        for actor in actors:
            self._kill(actor)
        self._shutdown()

    def _shutdown(self) -> None:
        """Shut down the Ray this executor started, and what is left of its processes."""
        import ray

        if self._owns_ray and ray.is_initialized():
            self._started |= self._ray_processes()
            ray.shutdown()
            _reap(self._started)

    @staticmethod
    def _ray_processes() -> set[tuple[int, float]]:
        """The processes of the Ray this process started: its descendants whose command line
        names Ray's session (GCS, raylet...), and theirs (agents and workers, which retitle
        themselves)."""
        import psutil  # ships with Ray
        import ray

        node = getattr(getattr(ray._private.worker, "global_worker", None), "node", None)
        session = getattr(node, "session_name", None)
        if not session:
            return set()
        found: set[tuple[int, float]] = set()
        for child in psutil.Process().children(recursive=True):
            with contextlib.suppress(psutil.Error):
                if session in " ".join(child.cmdline()):
                    for p in [child, *child.children(recursive=True)]:
                        with contextlib.suppress(psutil.Error):
                            found.add((p.pid, p.create_time()))
        return found

    # ------------------------------------------------------------------ work
    def array_size(self, config: Mapping[str, Any]) -> tuple[int, str]:
        """The profiler's array size for ``config``, measured on a worker's device."""
        from ray.exceptions import RayActorError

        failures = 0
        while True:
            actor = self._acquire()
            try:
                size, reason = self._ray_get(actor.array_size.remote(dict(config)))
            except RayActorError as exc:
                self._release(actor, dead=True)
                failures = self._died(exc, failures, "profiling array sizes")
                continue
            except BaseException:
                self._release(actor, dead=True)
                raise
            self._release(actor)
            return int(size), str(reason)

    def run_array(
        self,
        checkpoint_dir: str | os.PathLike[str],
        members: Sequence[Member],
        *,
        report: ReportHook,
        refill: RefillHook,
        on_finish: Callable[[MemberResult], None],
        resume: bool,
        requeue: Callable[[Member], None] | None = None,
    ) -> None:
        """Train ``members`` (and the trials ``refill`` adds) in an actor until every one has
        ended; the hooks run in this thread. A dead actor's array restarts from its checkpoint
        on a new actor, at most ``ray.max_failures`` times; trials that joined after that
        checkpoint go back to the engine through ``requeue`` (the array keeps its size)."""
        from ray.exceptions import RayActorError

        folder = str(checkpoint_dir)
        #: members this array trains that have not ended: given, or added by refill
        active = {m.id: m for m in members}
        failures = 0
        start: list[Member] = list(members)
        while True:
            actor = self._acquire()
            try:
                self._drive(actor, folder, start, resume, active, report, refill, on_finish)
            except RayActorError as exc:
                self._release(actor, dead=True)
                failures = self._died(exc, failures, f"training {folder}")
                start = self._restart_members(folder, start, active, requeue)
                resume = True
                continue
            except BaseException:
                self._release(actor, dead=True)
                raise
            self._release(actor)
            return

    def _died(self, exc: BaseException, failures: int, doing: str) -> int:
        """A worker died while ``doing``: the new failure count, or an error when the sweep is
        stopping, the worker could not start, or ``ray.max_failures`` is spent."""
        if self._closed:
            raise Stopped from None
        if getattr(exc, "actor_init_failed", False):
            raise ExecutorError(
                "a Ray worker could not start (is hfsweep, and the module defining the task, "
                f"importable on every node?): {exc}"
            ) from exc
        failures += 1
        if failures > self.settings.max_failures:
            raise ExecutorError(
                f"the worker {doing} died {failures} times (ray.max_failures is "
                f"{self.settings.max_failures}); last error: {exc}"
            ) from exc
        text = str(exc).strip()
        _log.warning(
            "the worker %s died (%s); restarting it (%d of %d restarts)",
            doing,
            text.splitlines()[-1][:300] if text else type(exc).__name__,
            failures,
            self.settings.max_failures,
        )
        return failures

    @staticmethod
    def _restart_members(
        folder: str,
        start: list[Member],
        active: dict[str, Member],
        requeue: Callable[[Member], None] | None,
    ) -> list[Member]:
        """The members to restart an array with after its worker died: none beyond its
        checkpoint (or, before the first checkpoint, the ones it started with). Trials that
        joined later started from scratch anyway; they go back to the engine's pool, so the
        restarted array keeps its size."""
        known = ArrayTrainer.checkpointed_members(folder)
        keep = [] if known else [m for m in start if m.id in active]
        kept = {m.id for m in keep} | known
        for m in [m for m in active.values() if m.id not in kept]:
            if requeue is None:
                keep.append(m)
                continue
            del active[m.id]
            requeue(m)
        return keep

    def _drive(
        self,
        actor: Any,
        folder: str,
        members: list[Member],
        resume: bool,
        active: dict[str, Member],
        report: ReportHook,
        refill: RefillHook,
        on_finish: Callable[[MemberResult], None],
    ) -> None:
        """Answer ``actor``'s hook events until its array is done."""
        import ray

        kind, payload = ray.get(actor.start.remote(folder, members, resume))
        while kind != "done":
            answer: Any = None
            if kind == "report":
                answer = report(payload)
            elif kind == "refill":
                answer = refill()
                if answer is not None:
                    active[answer.id] = answer
            elif kind == "finish":
                on_finish(payload)
                active.pop(payload.id, None)
            elif kind == "error":
                exc, text = payload
                _log.error("the Ray worker training %s failed:\n%s", folder, text)
                if isinstance(exc, BaseException):
                    raise exc
                raise ExecutorError(f"the Ray worker training {folder} failed:\n{text}")
            else:
                raise ExecutorError(f"unknown event {kind!r} from the Ray worker")
            kind, payload = ray.get(actor.reply.remote(answer))


def _pickle_task_by_value(task: Task) -> None:
    """Send a task defined in a file loaded by path (``path/to/task.py:TASK``) to the workers
    by value: they cannot import the driver's module of that generated name."""
    import dataclasses

    from ray import cloudpickle

    values = [getattr(task, f.name) for f in dataclasses.fields(task)]
    for field_value in list(values):
        if isinstance(field_value, Mapping):  # metrics given as {name: function}
            values.extend(field_value.values())
    for value in values:
        module = sys.modules.get(getattr(value, "__module__", None) or "")
        if module is not None and module.__name__.startswith("_hfsweep_entry_"):
            cloudpickle.register_pickle_by_value(module)


def _reap(processes: set[tuple[int, float]]) -> None:
    """Kill what is left of a Ray this executor started, after ``ray.shutdown()``. A Ctrl-C at a
    terminal reaches Ray's processes too, and the raylet's agents outlive it (a known Ray
    behaviour); a process is only killed if its id and start time are the ones recorded."""
    import psutil

    for pid, started in processes:
        try:
            process = psutil.Process(pid)
            if process.create_time() == started:
                process.kill()
        except psutil.Error:
            pass
