"""The executor seam: what the sweep core asks of wherever its arrays train.

The sweep core (the engine behind ``hfsweep run``, ``hs.sweep``) keeps the searcher, the trial
scheduler, the packer and the study in one process, the driver. An :class:`Executor` takes the
arrays the packer forms and trains them somewhere: in this process
(:class:`~hfsweep.executors.LocalExecutor`), in Ray actors across a cluster
(:class:`~hfsweep.executors.RayExecutor`), or anywhere a new executor puts them (one array over
several accelerators as data parallelism, say). The executor never decides anything about a
trial: every decision comes back from the driver through the hooks of :meth:`Executor.run_array`.
The Ray Tune plugin goes through the same seam from the other side: Tune places each array's
trial on Ray, and the trial trains its array through a ``LocalExecutor`` whose hooks talk to
the plugin's driver.

Writing an executor
-------------------
Subclass :class:`Executor` and implement its four members:

``slots``
    How many arrays it trains at once. The engine calls :meth:`~Executor.run_array` from up to
    ``slots`` threads at a time (with ``slots == 1``, from the engine's own thread) and starts
    a new array as soon as one returns. An executor may lower ``slots`` while it runs (the Ray
    executor does when the cluster cannot place another array); the engine reads it before
    starting each array.

``array_size(config)``
    The array size for ``config``'s compatibility key and a sentence saying why, measured where
    the arrays of that key will train (the local executor runs the profiler on its device).
    Called once per key, only with ``fusion.size: auto``, before the first array of that key.

``run_array(checkpoint_dir, members, hooks, *, resume)``
    Train ``members`` as one array until every member has ended, the ones ``refill`` adds
    included, and return. The array's whole life goes through the :class:`ArrayHooks`, each
    called in the thread that called ``run_array`` (the engine's hooks take its lock, so hook
    calls from arrays that train at once never interleave):

    - ``report(evaluations)`` after each evaluation, with every member evaluated at that step.
      Its answer, ``{member id: go on?}``, is how members are **stopped**: a member answered
      ``False`` stops there (a pruned trial); members left out go on. Answers must be applied
      before the array trains another step.
    - ``refill()`` when a member ended and its slot is free: a new
      :class:`~hfsweep.Member` of the same compatibility key, or ``None`` (the slot
      stays empty).
    - ``on_finish(result)`` for each member as it ends (completed, stopped or failed), at least
      once: an :class:`~hfsweep.ArrayTrainer` with a ``checkpoint_dir`` records each
      delivery after the hook returns, so a resumed array delivers again only an end whose
      record a crash cut off (the engine tells each trial once, whatever it hears twice).
    - ``requeue(member)`` (optional) hands a member back unstarted: an executor that restarts
      an array from its checkpoint after losing a worker, without the members that joined
      after that checkpoint, gives them back to the engine's pool this way (the Ray executor
      does). An executor that never loses members ignores it.

    ``checkpoint_dir`` is the array's folder in the run directory; the array's checkpoints go
    there, so that ``resume=True`` (after the driver crashed, was killed or was interrupted)
    continues the array from its last checkpoint: ``members`` is then empty, or lists only
    members the checkpoint does not hold yet. The simplest correct executor trains with an
    :class:`~hfsweep.ArrayTrainer` on that folder (see ``local.py``); a remote one must
    put the checkpoints where the driver's machine reads them (a shared file system).
    Errors: raise :class:`~hfsweep.executors.ExecutorError` when the executor cannot go on (no
    resources for an array, workers that keep dying), :class:`~hfsweep.executors.Stopped` when
    :meth:`~Executor.close` ended the array while it trained (the sweep is stopping; the array
    resumes from its checkpoint next time), and let the task's own exceptions through (the
    engine marks the array's trials failed and stops the sweep).

``close()``
    **Give back** every resource (workers, accelerators, a cluster the executor started); arrays
    still training in other threads end with :class:`~hfsweep.executors.Stopped`. The engine
    calls it when the sweep ends, fails or is interrupted; when one array fails while others
    train, it calls it at once to stop them, and again at the end: a second call does nothing.

The lifecycle test (``tests/test_lifecycle.py``) runs one sweep (ask, pack, train, ASHA stop,
refill, SIGKILL, resume) over every executor and front door: add a new executor there.
"""

from __future__ import annotations

import abc
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ..training.results import Member, MemberResult, RefillHook, ReportHook

__all__ = ["ArrayHooks", "Executor"]

#: an array's folder in the run directory (its checkpoints go there)
Folder = str | os.PathLike[str]


@dataclass(frozen=True)
class ArrayHooks:
    """How an array talks to the driver while it trains (see :meth:`Executor.run_array`):
    ``report(evaluations)`` answers which members go on, ``refill()`` gives a new member for a
    free slot (or ``None``), ``on_finish(result)`` takes each member's end, and ``requeue(member)``
    (optional) takes back a member unstarted."""

    report: ReportHook
    refill: RefillHook
    on_finish: Callable[[MemberResult], None]
    requeue: Callable[[Member], None] | None = None


class Executor(abc.ABC):
    """Where a sweep's arrays train (see the module docstring for the contract in full).

    A subclass gives :attr:`slots` (a property, or an attribute set in ``__init__``) and
    implements :meth:`array_size`, :meth:`run_array` and :meth:`close`; one whose width
    changes while it runs (the Ray executor, as nodes come and go) also gives
    :attr:`max_slots`. Executors are context managers that :meth:`close` on exit.
    """

    @property
    @abc.abstractmethod
    def slots(self) -> int:
        """Arrays this executor trains at once now (the engine runs up to this many
        ``run_array`` calls in threads of its own)."""

    @property
    def max_slots(self) -> int:
        """The most arrays it may ever train at once (the size of the engine's thread pool);
        :attr:`slots` by default."""
        return self.slots

    @abc.abstractmethod
    def array_size(self, config: Mapping[str, Any]) -> tuple[int, str]:
        """The array size for ``config``'s compatibility key on this executor's devices, and
        why (a sentence for the sweep's log)."""

    @abc.abstractmethod
    def run_array(
        self, checkpoint_dir: Folder, members: Sequence[Member], hooks: ArrayHooks, *, resume: bool
    ) -> None:
        """Train ``members`` (and the trials ``refill`` adds) as one array until every one of
        them has ended, calling the hooks in this thread; with ``resume``, continue from the
        checkpoint in ``checkpoint_dir``."""

    @abc.abstractmethod
    def close(self) -> None:
        """Give back every resource this executor holds; arrays still training raise
        :class:`~hfsweep.executors.Stopped`. Safe to call more than once."""

    def __enter__(self) -> Executor:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
