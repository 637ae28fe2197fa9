"""The local executor: trains the engine's arrays one after another in this process."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from ..offload import OffloadChoice
from ..settings import ArraySettings
from ..training import ArrayTrainer, DataCache, Member
from ..training.task import Task
from .base import ArrayHooks, Executor, Folder

__all__ = ["LocalExecutor"]


class LocalExecutor(Executor):
    """Trains arrays of ``task`` on ``device`` in ``dtype``, in this process (no server).

    The engine hands it one array at a time with its hooks; the array trainer checkpoints into
    the array's folder, and ``resume=True`` continues from that checkpoint after a crash.
    ``arrays`` say how every array trains (device, dtype, evaluation period, shared frozen
    tensors, compile, offload; the sweep file's ``fusion:`` or ``Fusion(...)``, checked once
    by :func:`~hfsweep.settings.array_settings`); ``arrays.alternate`` is
    :class:`~hfsweep.executors._alternating.AlternatingExecutor`'s, this one trains one array
    at a time. ``data`` is a cache of loaded data to start from (the engine's dry run loaded it).
    ``final_states`` says which ended members' results carry their weights (``"completed"``:
    the engine keeps its best completed trials'; the Tune plugin, which trains each array
    through a local executor in its trial, asks for ``"all"``), ``trace`` whether arrays
    trace their forwards. With ``offload="auto"`` the profiler's array size may be one larger
    than the device holds, trained offloaded, where it measured that faster
    (:func:`~hfsweep.profile_task`). ``compile``: ``True`` or ``False`` for every array, or
    ``"auto"``: the profiler's choice for each compatibility key
    (:func:`~hfsweep.profiler.choose_compile`; uncompiled where no profile was taken, a fixed
    ``fusion.size``).
    """

    def __init__(
        self,
        task: Task,
        *,
        arrays: ArraySettings,
        data: DataCache | None = None,
        final_states: str = "completed",
        trace: bool = True,
    ) -> None:
        self.task = task
        #: how every array trains (see :class:`~hfsweep.settings.ArraySettings`)
        self.arrays = arrays
        self.device = torch.device(arrays.resolved_device())
        self.dtype = arrays.torch_dtype()
        self.eval_every = arrays.eval_every
        self.final_states = final_states
        self.trace = trace
        self.share_frozen = arrays.share_frozen
        self.compile: bool | str = arrays.compile
        #: ``compile: auto``: the profiler's choice by compatibility key
        self._compile_choice: dict[str, bool] = {}
        self.offload = arrays.offload
        self.device_memory = arrays.device_memory
        #: where an offloaded array's optimizer steps (``fusion.offload_step``)
        self.offload_step = arrays.offload_step
        #: ``offload: auto``: the profiler's offloaded array size and why, by compatibility key
        self._offload_choice: dict[str, OffloadChoice] = {}
        #: traced forwards shared by every array of this sweep (see ArrayTrainer)
        self._trace_cache: dict[str, dict[Any, Any]] = {}
        #: the loaded data, shared by the profiler and every array of this sweep
        self._data_cache = data if data is not None else DataCache()

    #: arrays this executor trains at once
    @property
    def slots(self) -> int:
        """One array at a time, in the calling thread."""
        return 1

    def array_size(self, config: Mapping[str, Any]) -> tuple[int, str]:
        """The profiler's array size for ``config`` on this device, and why (profiles are
        cached by architecture, optimizer, input, dtype and hardware). Its arrays share
        frozen tensors as this executor's arrays do (``share_frozen``). The profile's arrays
        trace into this sweep's trace cache, so the arrays trained next replay those traces."""
        from ..sizing.cache import ProfileCache
        from ..sizing.task import profile_task

        key = self.task.compatibility_key(config)
        traces = self._trace_cache.setdefault(key, {})
        profile = profile_task(
            self.task,
            config,
            device=self.device,
            dtype=self.dtype,
            cache=ProfileCache(),
            traces=traces,
            data=self._data_cache.get(self.task, self.task.resolve(config)),
            compare_compiled=self.compile == "auto",
            share_frozen=self.share_frozen,  # as the trainer builds them, offloaded or not
            offload="auto" if self.offload == "auto" else "none",
            device_memory=self.device_memory,
        )
        if profile.compile is not None:
            self._compile_choice[key] = profile.compile.compiled
        if profile.offload is not None:  # the trainer offloads this size, nothing to measure
            self._offload_choice[key] = profile.offload
        return profile.chosen, profile.reason

    def compile_choice(self, config: Mapping[str, Any]) -> bool | None:
        """``compile: auto``: whether the profiler chose to compile ``config``'s compatibility
        key on this device, or ``None`` where no profile of that key was taken here. The Ray
        backend carries it from the actor that profiled the key to those that train it."""
        return self._compile_choice.get(self.task.compatibility_key(config))

    def close(self) -> None:
        """Nothing to release: the arrays trained in this process."""

    def run_array(
        self,
        checkpoint_dir: Folder,
        members: Sequence[Member],
        hooks: ArrayHooks,
        *,
        resume: bool,
        compile: bool | str | None = None,
    ) -> None:
        """Train ``members`` (and the trials ``refill`` adds) until every one has ended.
        (``requeue`` is for executors that may hand trials back; this one never does.)
        ``compile``: this array's ``compile=`` as decided elsewhere (a Ray worker is told the
        choice the profiling actor made, and a restarted array may start with no member to
        look its key up by); ``None``: this executor's own (see :meth:`_trainer`)."""
        self._trainer(checkpoint_dir, members, compile=compile).run(
            members,
            report=hooks.report,
            refill=hooks.refill,
            on_finish=hooks.on_finish,
            resume=resume,
        )

    def _trainer(
        self,
        checkpoint_dir: Folder,
        members: Sequence[Member],
        *,
        compile: bool | str | None = None,
    ) -> ArrayTrainer:
        """The trainer of one array in ``checkpoint_dir``: this executor's settings, the
        profiler's choices for its key (``compile``, where given, instead of this executor's),
        and the sweep's shared traces and data."""
        if compile is None:
            compile = self.compile
        if compile == "auto":
            key = self.task.compatibility_key(members[0].config) if members else ""
            compile = self._compile_choice.get(key, False)
        # decided: on or off for this array (ArraySettings.compile's values are True, False, auto)
        arrays = dataclasses.replace(self.arrays, device=str(self.device), compile=bool(compile))
        trainer = ArrayTrainer.from_settings(
            self.task,
            arrays,
            checkpoint_dir=checkpoint_dir,
            trace=self.trace,
            keep_states=False,
            final_states=self.final_states,
        )
        for key, choice in self._offload_choice.items():
            trainer._offload_plans[(key, choice.size)] = choice
        trainer._trace_cache = self._trace_cache
        trainer._data_cache = self._data_cache
        return trainer
