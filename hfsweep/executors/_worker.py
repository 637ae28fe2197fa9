"""What runs inside a Ray actor of the Ray backend: a local executor whose hooks become events.

The engine's hooks (report, refill, on_finish) are synchronous calls into the driver, which
holds the searcher, the scheduler and the study. In an actor, the array trains in a thread of
its own; each hook call puts an event in a queue and waits for the driver's answer, which the
driver sends with the next :meth:`ArrayWorker.reply`. So the driver sees the same sequence of
hook calls as with the local backend, and the engine's crash safety holds unchanged.

With ``alternate`` above one (``fusion.alternate``), the actor trains up to that many offloaded
arrays at once through an :class:`~hfsweep.executors._alternating.AlternatingExecutor`, their
shards alternating on its device; each array has its own line of events and answers, named by
its folder, and the actor serves their calls concurrently (a threaded actor).

With ``compile`` (``fusion.compile``), the arrays compile their fused step. ``"auto"`` leaves the
choice to the profiler, which runs on whichever actor the driver asks for an array size; that
actor answers the choice with the size, and the driver hands it to every actor that then trains
the key (:meth:`ArrayWorker.start`), so no array trains uncompiled merely because another actor
took its profile.
"""

from __future__ import annotations

import dataclasses
import os
import queue
import socket
import threading
import traceback
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from .._usercode import describe, keep_traceback, label, phase_of, remote_traceback
from ..settings import ArraySettings
from ..sizing.device import resolve_device
from ..training.task import Task
from ..training.trainer import Member
from ._alternating import AlternatingExecutor
from .base import ArrayHooks
from .local import LocalExecutor

__all__ = ["ArrayWorker", "Event"]

#: ``(kind, payload)``: ``("report", [Evaluation])``, ``("refill", None)``,
#: ``("finish", MemberResult)``, ``("done", arrays)`` (the most arrays that trained at once on
#: this actor while it trained) or ``("error", (exception, traceback))``
Event = tuple[str, Any]


class ArrayWorker:
    """Trains one array at a time on this actor's device, or up to ``alternate`` offloaded
    arrays at once (see the module docstring).

    ``device`` ``"auto"`` means CUDA when the actor sees a GPU, else the CPU; ``threads`` caps
    torch's intra-op threads at the CPUs the actor reserved, so arrays sharing a machine do not
    oversubscribe it. A worker keeps its traced forwards across the arrays it trains.
    ``arrays``: the sweep's array settings, as the local executor takes them, on this
    actor's device (without ``device_memory``, within a CUDA device's free memory; on a CPU
    ``offload: auto`` then keeps arrays as they are); ``compile``: each array's own comes with
    :meth:`start` (see the module docstring).
    """

    def __init__(self, task: Task, *, arrays: ArraySettings, threads: int) -> None:
        torch.set_num_threads(max(1, threads))
        device = resolve_device(arrays.device)
        if device.startswith("cuda") and not torch.cuda.is_available():
            raise RuntimeError(
                f"fusion.device is {device!r} but the Ray worker on {socket.gethostname()} sees "
                "no CUDA device; give the arrays GPUs (ray.gpus_per_array) or use device: cpu"
            )
        arrays = dataclasses.replace(arrays, device=device)
        self.local = (
            AlternatingExecutor(task, arrays=arrays)
            if arrays.alternate > 1
            else LocalExecutor(task, arrays=arrays)
        )
        #: each array's (events, answers), by its folder
        self._lines: dict[str, tuple[queue.Queue[Event], queue.Queue[Any]]] = {}
        self._lock = threading.Lock()

    def where(self) -> str:
        """This worker's host, process, device (and offload or compile, where on) and Ray
        node, for the driver's log."""
        import ray

        node = ray.get_runtime_context().get_node_id()
        device = str(self.local.device)
        if self.local.compile is not False:
            device = f"{device} (compile: {_compile_name(self.local.compile)})"
        if self.local.offload != "none":
            device = f"{device} (offload: {self.local.offload})"
        if isinstance(self.local, AlternatingExecutor):
            device = f"{device}, up to {self.local.alternate} arrays alternating"
        return f"{socket.gethostname()} pid {os.getpid()} {device} node {node}"

    def array_size(self, config: Mapping[str, Any]) -> tuple[int, str, bool | None]:
        """The profiler's array size for ``config`` on this worker's device, why, and (with
        ``compile: auto``) whether it chose to compile the key (``None``: no choice taken),
        for the driver to hand to the actors that train the key."""
        size, reason = self.local.array_size(config)
        return size, reason, self.local.compile_choice(config)

    def start(
        self,
        folder: str,
        members: Sequence[Member],
        resume: bool,
        compile: bool | str | None = None,
    ) -> Event:
        """Start training the array in ``folder`` in a thread; returns its first event.
        ``compile``: the array's ``compile=`` as the driver decided it (with ``compile: auto``,
        the profiler's choice for its key, wherever that profile ran); ``None``: this worker's
        own setting."""
        line: tuple[queue.Queue[Event], queue.Queue[Any]] = (queue.Queue(), queue.Queue())
        with self._lock:
            self._lines[folder] = line
        thread = threading.Thread(
            target=self._train, args=(folder, list(members), resume, line, compile), daemon=True
        )
        thread.start()
        return self._next(folder)

    def reply(self, answer: Any, folder: str) -> Event:
        """Answer the last event of the array in ``folder``; returns its next one."""
        with self._lock:
            _events, answers = self._lines[folder]
        answers.put(answer)
        return self._next(folder)

    def _next(self, folder: str) -> Event:
        """The next event of the array in ``folder``; its line is closed after its last."""
        with self._lock:
            events, _answers = self._lines[folder]
        event = events.get()
        if event[0] in ("done", "error"):
            with self._lock:
                self._lines.pop(folder, None)
        return event

    def _train(
        self,
        folder: str,
        members: list[Member],
        resume: bool,
        line: tuple[queue.Queue[Event], queue.Queue[Any]],
        compile: bool | str | None = None,
    ) -> None:
        events, answers = line

        def hook(kind: str, payload: Any) -> Any:
            events.put((kind, payload))
            return answers.get()

        try:
            hooks = ArrayHooks(
                report=lambda evaluations: hook("report", evaluations),
                refill=lambda: hook("refill", None),
                on_finish=lambda result: hook("finish", result),
            )
            self.local.run_array(folder, members, hooks, resume=resume, compile=compile)
        except BaseException as exc:  # handed to the driver, which raises it
            text = traceback.format_exc()
            keep_traceback(exc, text)
            events.put(("error", (_picklable(exc), text)))
        else:
            local = self.local
            together = local.together(folder) if isinstance(local, AlternatingExecutor) else 1
            events.put(("done", together))


def _compile_name(compile: bool | str) -> str:
    """``compile=`` as sweep.yaml spells it (``true``, ``false``, ``auto``, or a mode)."""
    return str(compile).lower() if isinstance(compile, bool) else compile


def _picklable(exc: BaseException) -> BaseException:
    """``exc`` if it survives pickling (the driver re-raises it), else a ``RuntimeError`` with
    its description, phase and traceback: an exception holding a lock or an open file would
    otherwise fail the actor's reply instead of reporting the error."""
    from ray import cloudpickle

    try:
        cloudpickle.loads(cloudpickle.dumps(exc))
    except Exception:
        copy = RuntimeError(describe(exc, limit=2000))
        phase = phase_of(exc)
        if phase is not None:
            label(copy, phase)
        keep_traceback(copy, remote_traceback(exc) or "")
        return copy
    return exc
