"""The Ray executor: the engine's arrays train in Ray actors across a cluster.

The driver (the process running ``hfsweep run``) keeps the searcher, the scheduler, the packer
and the study; each array trains in an actor that reserves ``ray.cpus_per_array`` CPUs and
``ray.gpus_per_array`` GPUs, and the arrays' hook calls come back to the driver (see
:mod:`hfsweep.executors._worker`). Actors are pooled and reused, so a worker's traced forwards
serve the next array it trains, and as many arrays train at once as the cluster's alive nodes
hold (see :mod:`hfsweep.executors._raypool`). When an actor's process dies (a lost node, an
out-of-memory kill), its array restarts from its last checkpoint on another actor: the
trainer's checkpoints are written to the run directory, which every node must see (one
machine, or a shared file system on a cluster). The cluster of ``ray.address`` is checked to
answer within ``ray.connect_timeout_s`` before the driver connects (see
:mod:`hfsweep.executors._connect`). With ``alternate`` above one (``fusion.alternate``), an actor
trains up to that many offloaded arrays at once, their shards alternating on its device; an
array shares an actor only when the cluster has no room for one of its own.

``compile`` (``fusion.compile``) reaches every actor's trainers (an elastic array's workers
too). With ``"auto"`` the profiler decides per compatibility key on the actor that answers
:meth:`RayExecutor.array_size`; the driver keeps that choice and starts each array of the key
with it, on whichever actor trains it and again when the array restarts after its actor died
(or relaunches on other workers), so every array trains as profiled.
"""

from __future__ import annotations

import contextlib
import logging
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from .._signals import handlers_kept, shielded
from ..settings import ArraySettings
from ..training.task import Task
from ..training.trainer import ArrayTrainer, Member
from ._connect import ClusterUnreachable, connect, on_loopback, reach
from ._elastic import WorkerPolicy, run_elastic_array
from ._errors import ExecutorError, Stopped
from ._raypool import ActorPool
from ._worker import ArrayWorker
from .base import ArrayHooks, Executor, Folder

if TYPE_CHECKING:
    from ..config import RayConfig

__all__ = ["RayExecutor"]

_log = logging.getLogger("hfsweep.ray")
#: seconds to wait for a cluster given by address to hold one array (its workers may be joining)
_JOIN_WAIT_S = 60.0
#: seconds to wait for Ray to place a new array's actor before counting on one array fewer
_PLACE_WAIT_S = 120.0
#: seconds close() waits for the arrays' threads to leave Ray's calls before Ray shuts down
_CLOSE_WAIT_S = 5.0
#: the engine's array threads when ray.max_concurrent is unset (nodes may join)
_MAX_SLOTS = 64
#: ray.init's arguments for the driver
_INIT: dict[str, Any] = {
    "include_dashboard": False,
    "logging_level": logging.WARNING,
    "log_to_driver": False,
}


class RayExecutor(Executor):
    """Trains arrays of ``task`` in Ray actors; ``slots`` arrays train at once, up to
    ``alternate`` of them (offloaded, ``offload="host"``) in each actor.

    Connects to the Ray cluster at ``settings.address``, or uses the Ray this process already
    initialised, or starts a local one for the run (shut down by :meth:`close`). ``arrays``:
    how every array trains (:class:`~hfsweep.settings.ArraySettings`, each actor
    builds its local executor from them); ``compile``: as the local executor's, the choice of ``"auto"`` carried from the profiling actor to
    the training ones (see the module docstring); not with offload yet.
    """

    def __init__(
        self,
        task: Task,
        *,
        arrays: ArraySettings,
        settings: RayConfig,
    ) -> None:
        import ray

        alternate = arrays.alternate
        if alternate > 1 and settings.elastic.enabled:
            raise ValueError(
                f"alternate={alternate} trains offloaded arrays' shards in turn; it needs "
                "arrays that are not elastic"
            )
        self.task = task
        #: how every array trains (see :class:`~hfsweep.settings.ArraySettings`)
        self.arrays = arrays
        self.device = arrays.device
        self.dtype = arrays.torch_dtype()
        self.eval_every = arrays.eval_every
        self.share_frozen = arrays.share_frozen
        #: each actor's arrays offload on its own device, within ``device_memory`` bytes there
        #: (``None``: that device's free memory)
        self.offload = arrays.offload
        self.device_memory = arrays.device_memory
        #: the most arrays one actor trains at once, their shards alternating
        self.alternate = alternate
        self.offload_step = arrays.offload_step
        #: every array's ``compile=``; ``"auto"``: the profiler's choice by compatibility key
        self.compile: bool | str = arrays.compile
        #: ``compile: auto``: the profiling actors' choices by compatibility key, handed to the
        #: actors that train the key (under ``_choice_lock``: the engine's threads ask at once)
        self._compile_choice: dict[str, bool] = {}
        self._choice_lock = threading.Lock()
        self.settings = settings
        self._owns_ray = not ray.is_initialized()
        #: threads inside run_array or array_size (close waits for them before ray.shutdown)
        self._inside = 0
        self._calls = threading.Condition()
        self._closed = False
        #: how many workers each elastic array gets (set by the engine with ray.elastic)
        self.policy: WorkerPolicy | None = None
        if self._owns_ray:
            if settings.address is None:
                self._start_local()
            else:
                self._connect(settings)
        #: (pid, start time) of the processes of a Ray this executor started
        self._started: set[tuple[int, float]] = (
            self._ray_processes() if self._owns_ray and settings.address is None else set()
        )
        try:
            self._setup(task, arrays.device, settings)
        except BaseException:
            self._shutdown()
            raise

    @staticmethod
    def _start_local() -> None:
        """Start a Ray for this run that serves this machine only: on loopback."""
        import ray

        try:
            with on_loopback(), handlers_kept():  # ray.init installs a SIGTERM handler
                # "local": a Ray of its own even where a `ray start` cluster (or RAY_ADDRESS)
                # runs, which address=None would join
                ray.init(address="local", _node_ip_address="127.0.0.1", **_INIT)
        except ClusterUnreachable as exc:
            raise ExecutorError(str(exc)) from None
        _log.info("Ray backend: started a local Ray on %s", ray.get_runtime_context().gcs_address)

    @staticmethod
    def _connect(settings: RayConfig) -> None:
        """Connect to the cluster at ``settings.address``, after checking that it answers
        within ``ray.connect_timeout_s`` (``ray.init`` alone waits for ever)."""
        assert settings.address is not None
        try:
            reached = reach(settings.address, settings.connect_timeout_s)
            connect(reached, **_INIT)
        except ClusterUnreachable as exc:
            raise ExecutorError(
                f"ray.address {settings.address!r}: {exc} (ray.connect_timeout_s is "
                f"{settings.connect_timeout_s:g})"
            ) from None
        import ray

        _log.info(
            "Ray backend: connected to the cluster at %s (%s nodes; this driver on %s%s)",
            ray.get_runtime_context().gcs_address or reached.address,
            "?" if reached.nodes is None else reached.nodes,
            ray.util.get_node_ip_address(),
            ", loopback" if reached.loopback else "",
        )

    def _setup(self, task: Task, device: str, settings: RayConfig) -> None:
        """Check the cluster can hold an array and make the pool of actors."""
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
        bundle = {"CPU": self.cpus_per_array}
        if want_gpu:
            bundle["GPU"] = want_gpu
        self._remote: Any = None  # ArrayWorker as a Ray actor class, made once
        most = settings.max_concurrent
        self._pool = ActorPool(
            bundle,
            self._new_actor,
            most=None if most is None else -(-most // self.alternate),
            place_wait_s=lambda: _PLACE_WAIT_S,
            capacity=self.alternate,
        )
        # a cluster's workers may still be joining: wait a while for room for one array
        deadline = time.monotonic() + (_JOIN_WAIT_S if settings.address is not None else 0.0)
        while True:
            fit = self._pool.fit()
            if fit >= 1 or time.monotonic() >= deadline:
                break
            time.sleep(1.0)
        if fit < 1:
            resources = ray.cluster_resources()
            raise ExecutorError(
                f"the Ray cluster ({resources.get('CPU', 0.0):g} CPUs, "
                f"{resources.get('GPU', 0.0):g} GPUs) cannot hold one array's actor "
                f"({self.cpus_per_array:g} CPUs, {want_gpu:g} GPUs); lower ray.cpus_per_array "
                "or ray.gpus_per_array, or add nodes"
            )
        resources = ray.cluster_resources()
        _log.info(
            "Ray backend: up to %d array(s) at once, each %g CPUs and %g GPUs%s (cluster: %g "
            "CPUs, %g GPUs); more or fewer as nodes join or leave",
            self.slots,
            self.cpus_per_array,
            want_gpu,
            f", up to {self.alternate} alternating in each" if self.alternate > 1 else "",
            resources.get("CPU", 0.0),
            resources.get("GPU", 0.0),
        )

    @property
    def slots(self) -> int:
        """Arrays to train at once now: what the cluster's alive nodes hold, at most
        ``ray.max_concurrent`` (see :meth:`ActorPool.width`), times ``alternate`` (within
        ``ray.max_concurrent``); with ``ray.elastic``, as many
        arrays as the workers give each its ``min_workers_per_array``, and no more than the
        policy admits (while an array waits for workers, the engine forms no other)."""
        if self.elastic:
            return _elastic_slots(
                self.workers(),
                self.settings.elastic.min_workers_per_array,
                self.settings.max_concurrent,
                self.policy.admits() if self.policy is not None else None,
            )
        slots = self._pool.width() * self.alternate
        return min(slots, self.settings.max_concurrent or slots)

    @property
    def elastic(self) -> bool:
        """Whether arrays train data-parallel on the workers ``policy`` gives (``ray.elastic``)."""
        return self.settings.elastic.enabled

    def workers(self) -> int:
        """Data-parallel workers (each one array's actor's resources) the cluster holds now."""
        return self._pool.fit()

    @property
    def max_slots(self) -> int:
        """The most arrays that may ever train at once (``ray.max_concurrent``, or as many as
        nodes may join): the width of the engine's pool of array threads."""
        return self.settings.max_concurrent or _MAX_SLOTS

    # ------------------------------------------------------------------ actors
    def _new_actor(self, group: Any) -> Any:
        """An actor of :class:`ArrayWorker` in the placement group ``group``."""
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        if self._remote is None:
            self._remote = ray.remote(
                num_cpus=self.cpus_per_array,
                num_gpus=self.gpus_per_array,
                max_restarts=0,
            )(ArrayWorker)
        strategy = PlacementGroupSchedulingStrategy(placement_group=group)
        # alternating: each array's start and reply calls wait in a thread of their own, and
        # where and array_size still answer
        concurrency = self.alternate + 2 if self.alternate > 1 else 1
        return self._remote.options(
            scheduling_strategy=strategy, max_concurrency=concurrency
        ).remote(
            self.task,
            arrays=self.arrays,
            threads=max(1, int(self.cpus_per_array)),
        )

    def _acquire(self) -> Any:
        return self._pool.acquire(lambda actor: actor.where.remote())

    def _release(self, actor: Any, *, dead: bool = False) -> None:
        self._pool.release(actor, dead=dead)

    @contextlib.contextmanager
    def _call(self) -> Iterator[None]:
        """Count a thread inside the executor, for :meth:`close`."""
        with self._calls:
            if self._closed:
                raise Stopped
            self._inside += 1
        try:
            yield
        finally:
            with self._calls:
                self._inside -= 1
                self._calls.notify_all()

    def close(self) -> None:
        """Stop every actor (arrays still training raise :class:`Stopped` in their threads,
        within a second or so), then shut down the Ray this executor started."""
        with self._calls:
            self._closed = True
        pool = getattr(self, "_pool", None)
        if pool is not None:
            pool.close()
        with self._calls:  # the threads leave Ray's calls before Ray shuts down
            self._calls.wait_for(lambda: self._inside == 0, timeout=_CLOSE_WAIT_S)
        self._shutdown()

    def _shutdown(self) -> None:
        """Shut down the Ray this executor started or connected, and what is left of the
        processes of one it started."""
        import ray

        if self._owns_ray and ray.is_initialized():
            with shielded():  # a second Ctrl-C must not leave Ray's processes behind
                self._started |= self._ray_processes() if self.settings.address is None else set()
                ray.shutdown()
                _reap(self._started)

    @staticmethod
    def _ray_processes() -> set[tuple[int, float]]:
        """The processes of the Ray this process started: its descendants whose command line
        names Ray's session (GCS, raylet...), and theirs (agents and workers, which retitle
        themselves)."""
        import psutil  # ships with Ray
        import ray

        session = ray.get_runtime_context().get_session_name() if ray.is_initialized() else None
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
        import ray
        from ray.exceptions import RayActorError

        failures = 0
        with self._call():
            while True:
                actor = self._acquire()
                try:
                    size, reason, compiled = ray.get(actor.array_size.remote(dict(config)))
                except RayActorError as exc:
                    self._release(actor, dead=True)
                    failures = self._died(exc, failures, "profiling array sizes")
                    continue
                except BaseException:
                    self._release(actor, dead=True)
                    raise
                # an elastic array's workers are actors of their own: free the resources
                self._release(actor, dead=self.elastic)
                if compiled is not None:  # kept for the actors that train the key
                    with self._choice_lock:
                        self._compile_choice[self.task.compatibility_key(config)] = compiled
                return int(size), str(reason)

    def run_array(
        self, checkpoint_dir: Folder, members: Sequence[Member], hooks: ArrayHooks, *, resume: bool
    ) -> None:
        """Train ``members`` (and the trials ``refill`` adds) in an actor until every one has
        ended; the hooks run in this thread. A dead actor's array restarts from its checkpoint
        on a new actor, at most ``ray.max_failures`` times; trials that joined after that
        checkpoint go back to the engine through ``requeue`` (the array keeps its size)."""
        from ray.exceptions import RayActorError

        folder = str(checkpoint_dir)
        # decided once: a restart (which may start with no member) trains as the first start
        compile, how = self._array_compile(members)
        if self.elastic:
            if how:
                _log.info("%s trains data-parallel%s", folder, how)
            self._run_elastic(folder, members, hooks, resume=resume, compile=compile)
            return
        #: members this array trains that have not ended: given, or added by refill
        active = {m.id: m for m in members}
        failures = 0
        start: list[Member] = list(members)
        with self._call():
            while True:
                actor = self._acquire()
                _log.info("%s trains on %s%s", folder, self._pool.where(actor), how)
                try:
                    self._drive(actor, folder, start, resume, active, hooks, compile)
                except RayActorError as exc:
                    self._release(actor, dead=True)
                    failures = self._died(exc, failures, f"training {folder}")
                    start = self._restart_members(folder, start, active, hooks.requeue)
                    resume = True
                    continue
                except BaseException:
                    self._release(actor, dead=True)
                    raise
                self._release(actor)
                return

    def _array_compile(self, members: Sequence[Member]) -> tuple[bool | str, str]:
        """The ``compile=`` an array of ``members`` trains with on any actor, and a note for
        the log: ``compile`` itself, or with ``"auto"`` the profiler's choice for their key as
        the driver kept it from :meth:`array_size` (uncompiled where no profile was taken: a
        fixed ``fusion.size``, as on the local backend)."""
        if self.compile is False:
            return False, ""
        if self.compile != "auto":
            name = "true" if self.compile is True else self.compile
            return self.compile, f", compiled (compile: {name})"
        key = self.task.compatibility_key(members[0].config) if members else None
        with self._choice_lock:
            chosen = self._compile_choice.get(key) if key is not None else None
        if chosen is None:
            return False, ", uncompiled (compile: auto, no profile taken for its key)"
        return chosen, f", {'compiled' if chosen else 'uncompiled'} (compile: auto, as profiled)"

    def _run_elastic(
        self,
        folder: str,
        members: Sequence[Member],
        hooks: ArrayHooks,
        *,
        resume: bool,
        compile: bool | str = False,
    ) -> None:
        """Train the array data-parallel on the workers the policy gives it (see
        :mod:`hfsweep.executors._elastic`), each compiling it as ``compile`` says, on every
        launch of it."""
        if self.policy is None:
            raise ExecutorError("ray.elastic is on but no allocator was given to the executor")
        bundle = {"CPU": self.cpus_per_array, "GPU": self.gpus_per_array}
        device = "cuda" if self.gpus_per_array else "cpu"
        options: dict[str, Any] = {
            "dtype": self.dtype,
            "eval_every": self.eval_every,
            "keep_states": False,
            "final_states": "completed",
            "compile": compile,
        }
        if device == "cpu":
            options["device"] = "cpu"
        with self._call():
            run_elastic_array(
                self.task,
                folder,
                members,
                hooks,
                resume=resume,
                policy=self.policy,
                total=self.workers,
                closed=lambda: self._closed,
                bundle=bundle,
                threads=max(1, int(self.cpus_per_array)),
                options=options,
            )

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
        hooks: ArrayHooks,
        compile: bool | str = False,
    ) -> None:
        """Start ``actor`` on the array (compiled as ``compile`` says) and answer its hook
        events until the array is done."""
        import ray

        kind, payload = ray.get(actor.start.remote(folder, members, resume, compile))
        while kind != "done":
            answer: Any = None
            if kind == "report":
                answer = hooks.report(payload)
            elif kind == "refill":
                answer = hooks.refill()
                if answer is not None:
                    active[answer.id] = answer
            elif kind == "finish":
                hooks.on_finish(payload)
                active.pop(payload.id, None)
            elif kind == "error":
                exc, text = payload
                _log.error("the Ray worker training %s failed:\n%s", folder, text)
                if isinstance(exc, BaseException):
                    raise exc
                raise ExecutorError(f"the Ray worker training {folder} failed:\n{text}")
            else:
                raise ExecutorError(f"unknown event {kind!r} from the Ray worker")
            kind, payload = ray.get(actor.reply.remote(answer, folder))
        if self.alternate > 1:
            _log.info(
                "%s: trained with up to %s array(s) at once on %s",
                folder,
                payload,
                self._pool.where(actor),
            )


def _elastic_slots(workers: int, least: int, most: int | None, admitted: int | None) -> int:
    """Arrays the engine may train at once with elastic arrays: as many as ``workers`` give
    each its ``least`` workers, at most ``most`` (``ray.max_concurrent``) and ``admitted`` (the
    policy's :meth:`~hfsweep.executors._elastic.WorkerPolicy.admits`), and at least 1 (an
    engine holding no array always forms one: nothing waits for nothing)."""
    fit = workers // least
    slots = min(fit, most or fit)
    if admitted is not None:
        slots = min(slots, admitted)
    return max(1, slots)


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
