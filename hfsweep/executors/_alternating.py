"""The local executor with ``fusion.alternate``: several offloaded arrays trained at once on one
device, their shards alternating (issue 22, Hydra's shard alternation in ``hfsweep run``).

The engine calls :meth:`~AlternatingExecutor.run_array` from up to ``alternate`` threads of its
own pool and blocks each call until its array has ended. The arrays train together through
the trainer level's driver (:class:`hfsweep.training._together.StepDriver`, what
:func:`hfsweep.train_together` runs): one driver thread takes each array's run in as its call
arrives, advances every run to its next step and steps them as one
:class:`~hfsweep.offload.AlternatingArrays` step, so one array's shard fetches overlap
another's compute. An array that starts while others train joins at the next round, and one
that ends leaves the others going on.

The contract of :meth:`Executor.run_array <hfsweep.executors.Executor.run_array>` holds: each
hook (``report``, ``refill``, ``on_finish``) is called in the thread that called ``run_array``
(the driver thread hands the call over and waits for its answer, as a Ray worker hands its
hooks to the driver); a run's error ends that array only and is raised from its own call (the
engine then stops the sweep, :meth:`close` stopping the others at their current step); after
:meth:`close`, every array still training raises :class:`~hfsweep.executors.Stopped`, its
checkpoint (written at its last evaluation) resuming it.

A profile (:meth:`~AlternatingExecutor.array_size`, ``fusion.size: auto`` for a key that appears
mid-sweep) measures the device alone: the arrays in training are held between two of their
steps while it runs (see :class:`_Gate`), so its timings are not the arrays' load.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

from .._malloc import retaining_freed_memory_on
from ..settings import ArraySettings
from ..training import ArrayJob, StepDriver
from ..training.results import Member, MemberResult
from ..training.task import Task
from ._errors import Stopped
from .base import ArrayHooks, Folder
from .local import LocalExecutor

__all__ = ["AlternatingExecutor"]

_log = logging.getLogger("hfsweep.executors")

#: what an array's thread is sent: ("call", hook, args, answer queue), ("done", results),
#: ("error", exception) or ("stopped", None)
_Message = tuple[Any, ...]


class _Gate:
    """Keeps the device to a profile while one runs: the driver thread computes only while no
    profile holds the gate, and a profile starts only once the driver is not computing,
    between rounds or waiting on a hook call (one driver thread steps every array, so while it
    waits for a hook's answer nothing trains). A profile asked from inside a hook call (the
    engine sizing a new key as it answers) therefore starts at once, and one asked while the
    driver waits on a hook that needs the engine's lock the profile holds does not deadlock."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._holds = 0  # profiles running or waiting to
        self._computing = False  # the driver thread is in a round, outside hook calls

    @contextlib.contextmanager
    def held(self) -> Iterator[None]:
        """Hold the arrays between two steps for the ``with`` block (a profile)."""
        with self._cond:
            self._holds += 1
            self._cond.wait_for(lambda: not self._computing)
        try:
            yield
        finally:
            with self._cond:
                self._holds -= 1
                self._cond.notify_all()

    def _compute(self, computing: bool) -> None:
        with self._cond:
            if computing:
                self._cond.wait_for(lambda: self._holds == 0)
            self._computing = computing
            self._cond.notify_all()

    @contextlib.contextmanager
    def computing(self) -> Iterator[None]:
        """The driver thread's round: starts once no profile holds the gate."""
        self._compute(True)
        try:
            yield
        finally:
            self._compute(False)

    @contextlib.contextmanager
    def calling(self) -> Iterator[None]:
        """A hook call of the driver thread, during which a profile may run; the round goes
        on only once none holds the gate."""
        self._compute(False)
        try:
            yield
        finally:
            self._compute(True)


class _Mailbox:
    """One array's line between the driver thread and the thread of its ``run_array`` call:
    the driver sends hook calls and the array's end, the array's thread runs the calls and
    answers them (:meth:`serve`)."""

    def __init__(self, gate: _Gate) -> None:
        self._inbox: queue.Queue[_Message] = queue.Queue()
        self._gate = gate
        #: the most arrays in training at once while this one trained (itself included)
        self.widest = 0

    def proxy(self, hook: Callable[..., Any]) -> Callable[..., Any]:
        """``hook`` as the driver thread calls it: run in the array's thread, its answer (or
        its exception) returned here."""

        def call(*args: Any) -> Any:
            answer: queue.Queue[tuple[bool, Any]] = queue.Queue(maxsize=1)
            with self._gate.calling():
                self._inbox.put(("call", hook, args, answer))
                ok, value = answer.get()
            if not ok:
                raise value
            return value

        return call

    def end(self, outcome: list[MemberResult] | BaseException | None) -> None:
        """The array ended: with its results, an error, or ``None`` (stopped by close)."""
        if outcome is None:
            self._inbox.put(("stopped", None))
        elif isinstance(outcome, BaseException):
            self._inbox.put(("error", outcome))
        else:
            self._inbox.put(("done", outcome))

    def serve(self) -> None:
        """Run the hook calls the driver sends, in this thread, until the array ends; raise
        its error, or :class:`Stopped` where the executor was closed."""
        while True:
            message = self._inbox.get()
            kind = message[0]
            if kind == "call":
                _kind, hook, args, answer = message
                try:
                    value = hook(*args)
                except BaseException as exc:  # the run raises it, as its hook raised alone
                    answer.put((False, exc))
                else:
                    answer.put((True, value))
            elif kind == "done":
                return
            elif kind == "error":
                raise message[1]
            else:
                raise Stopped("the executor was closed while the array trained")


class AlternatingExecutor(LocalExecutor):
    """A :class:`~hfsweep.executors.LocalExecutor` that trains up to ``alternate`` offloaded
    arrays at once on its device, their shards alternating (see the module docstring).

    Its arrays offload (``arrays.offload="host"``: each array's state in host memory,
    streamed through the device shard by shard), up to ``arrays.alternate`` at once, and
    share one budget on the device, ``device_memory`` (each array's shards at most a quarter of
    it over ``alternate``, as :func:`hfsweep.train_together` cuts them), stepped with the
    lockstep schedule and one shard of prefetch (``train_together``'s defaults). The other
    arguments are the local executor's; ``compile`` is off (offloaded arrays run uncompiled).
    """

    def __init__(
        self,
        task: Task,
        *,
        arrays: ArraySettings,
        **options: Any,
    ) -> None:
        super().__init__(task, arrays=arrays, **options)
        alternate = arrays.alternate
        if self.offload != "host":
            raise ValueError(
                f"alternate={alternate} trains offloaded arrays' shards in turn; it needs "
                f"offload='host', got offload={self.offload!r}"
            )
        self.alternate = alternate
        # arrays of different keys train at once: each keeps its data (their evaluations
        # would otherwise rebuild each other's)
        self._data_cache.entries = max(self._data_cache.entries, alternate)
        self._cond = threading.Condition()
        self._pending: list[tuple[ArrayJob, _Mailbox]] = []
        self._thread: threading.Thread | None = None
        self._closed = False
        #: each ended array's widest round (see :meth:`together`), by its folder
        self._together: dict[str, int] = {}
        self._gate = _Gate()

    @property
    def slots(self) -> int:
        """``alternate`` arrays at once, each ``run_array`` call in a thread of the engine's."""
        return self.alternate

    def run_array(
        self,
        checkpoint_dir: Folder,
        members: Sequence[Member],
        hooks: ArrayHooks,
        *,
        resume: bool,
        compile: bool | str | None = None,
    ) -> None:
        """Train ``members`` (and the trials ``refill`` adds) with the other arrays in
        training until every one has ended, the hooks called in this thread (``compile``: as
        the local executor's; offloaded arrays refuse anything but ``False``)."""
        box = _Mailbox(self._gate)
        job = ArrayJob(
            self._trainer(checkpoint_dir, members, compile=compile),
            members,
            report=box.proxy(hooks.report),
            refill=box.proxy(hooks.refill),
            on_finish=box.proxy(hooks.on_finish),
            resume=resume,
        )
        with self._cond:
            if self._closed:
                raise Stopped("the executor was closed before the array started")
            self._pending.append((job, box))
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._drive, name="hfsweep-alternate", daemon=True
                )
                self._thread.start()
        box.serve()
        _log.info(
            "%s: trained with up to %d array(s) at once, their shards alternating",
            checkpoint_dir,
            box.widest,
        )
        with self._cond:
            self._together[str(checkpoint_dir)] = box.widest

    def array_size(self, config: Mapping[str, Any]) -> tuple[int, str]:
        """The profiler's array size for ``config`` (the local executor's), measured with the
        arrays in training held between two of their steps (see :class:`_Gate`): a profile
        times the device alone, and holds the sweep's training while it runs, once per model
        and device (profiles are cached)."""
        with self._gate.held():
            return super().array_size(config)

    def together(self, checkpoint_dir: Folder) -> int:
        """The most arrays that trained at once (itself included) while the array in
        ``checkpoint_dir`` trained, once it has ended (0 when unknown); asked once."""
        with self._cond:
            return self._together.pop(str(checkpoint_dir), 0)

    def close(self) -> None:
        """Stop every array still training at its current step (each raises
        :class:`Stopped` from its ``run_array``) and wait for the driver thread to end. Safe
        to call more than once."""
        with self._cond:
            self._closed = True
            thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=120)
            if thread.is_alive():
                _log.warning("the alternating arrays' driver did not stop within 120 s")

    def _drive(self) -> None:
        """The driver thread: takes arrays in as they arrive, steps every array in training
        as one, hands each array's end to its thread; ends when no array is left (the next
        ``run_array`` starts another) or the executor is closed."""
        driver = StepDriver(self.device, self.device_memory, self.alternate)
        boxes: dict[int, _Mailbox] = {}
        failure: BaseException | None = None
        try:
            with retaining_freed_memory_on(self.device):
                while self._round(driver, boxes):
                    pass
        except BaseException as exc:  # the driver's own failure: every array's error
            failure = exc
            raise
        finally:
            driver.stop()
            with self._cond:
                left: list[tuple[ArrayJob, _Mailbox]] = []
                if self._closed or failure is not None:  # else they are the next thread's
                    left, self._pending = self._pending, []
                if self._thread is threading.current_thread():
                    self._thread = None
            for box in [*boxes.values(), *(b for _j, b in left)]:
                box.end(failure)

    def _round(self, driver: StepDriver, boxes: dict[int, _Mailbox]) -> bool:
        """Take the arrays that arrived in, step every array once, hand over the ends;
        ``False`` when the driver thread should end (closed, or no array left)."""
        with self._cond:
            if self._closed:
                return False
            arriving, self._pending = self._pending, []
            if not arriving and not boxes:
                self._thread = None  # the next run_array starts another thread
                return False
        with self._gate.computing():
            for job, box in arriving:
                try:
                    boxes[driver.add(job)] = box
                except Exception as exc:  # that array's start failed: its error alone
                    box.end(exc)
            for box in boxes.values():
                box.widest = max(box.widest, len(boxes))
            for key, outcome in driver.round().items():
                boxes.pop(key).end(outcome)
        return True
