"""The Ray Tune plugin: keep your ``tune.Tuner``, searcher and scheduler; get fused arrays.

Importing this module imports Ray (``import hfsweep`` does not). A :class:`Fusion` describes the
sweep once (the task, how many members in all, the array size) and hands Tune three things::

    from ray import tune
    from ray.tune.schedulers import ASHAScheduler
    from ray.tune.search.optuna import OptunaSearch
    from hfsweep.schedulers.tune import Fusion, best_member, member_results

    fusion = Fusion("digits_mlp", members=64, array_size=16)
    tuner = tune.Tuner(
        fusion.trainable,                                          # trains one array per trial
        param_space={"lr": tune.loguniform(1e-3, 0.5), "momentum": tune.uniform(0, 0.99)},
        tune_config=tune.TuneConfig(
            metric="val_accuracy", mode="max", num_samples=-1,    # the Fusion owns the budget
            search_alg=fusion.searcher(OptunaSearch()),
            scheduler=fusion.scheduler(ASHAScheduler(max_t=10, grace_period=1)),
        ),
    )
    results = tuner.fit()                   # one row per array
    print(member_results(results))          # one row per member
    best = best_member(results)
    print(best.config)
    model = best.load_model(fusion.task)    # its final weights in a fresh model of the task

**Packing.** The searcher asks the inner searcher for member configs (under member ids
``<array trial id>-<n>``) and packs members whose configs share the task's compatibility key
(``hs.Task.compatibility_key``: everything that shapes the model or the data) into one array:
one Tune trial. A member whose key differs from the array being packed is **held** in its key's
pool and starts in a later array of its key (or joins a running one); its id keeps the prefix of
the array that asked for it, its ``array`` column says where it trained. When the budget is spent,
the remaining pools start as smaller arrays.

**Per member.** After each evaluation the array trainable reports every evaluated member; the
scheduler wrapper runs the inner scheduler on each of them, decided jointly for the array (each
member is judged after all its array-mates' values at that step are recorded); the Tune trial
ends once no member is left. Each member's results reach the inner searcher under its own
id: ``on_trial_result`` per evaluation, then ``on_trial_complete`` once: with its last result if
it completed, without the metric if it was pruned (OptunaSearch records PRUNED), with
``error=True`` if it failed (non-finite loss or gradients, or a config the task rejects); the
others in its array go on unaffected. With ``refill`` (the default), a freed slot gets a new
member of the same key at once. The pools and refill are the sweep core's packer
(:mod:`hfsweep.core.packer`), as in ``hfsweep run``, and a member's status is the core's
:class:`~hfsweep.core.status.Status`: ``member_results`` says ``completed``, ``stopped`` or
``failed`` in its ``status`` column, as ``hfsweep run``'s ``state.json`` does, and Optuna's name
for it (``COMPLETE``, ``PRUNED``, ``FAIL``) in its ``state`` column, as trials.csv does.

**Weights.** Each array trial's Tune checkpoint holds the final weights of its members that
completed (trained to their budget, or stopped at the scheduler's budget, such as ASHA's
``max_t``): one ``state_dict`` per member, saved with ``torch.save`` as
``weights/<member id>.pt`` in the checkpoint directory (the sweep's dtype, on the CPU), readable
with ``torch.load(path, weights_only=True)``. ``best_member(results)`` returns the best member
with its array's ``checkpoint``; ``.state_dict()`` reads its weights and ``.load_model(task)``
builds the task's model for its config with them loaded. ``results.get_best_result().checkpoint``
is the checkpoint of the array with the best reported value; ``member_results(results)`` lists
which members trained in which array (column ``array``). Pruned and failed members' weights are
not kept.

**Restore and retries.** Tune saves the searcher with the experiment, and with it every
member's state and the sweep core's ledger (:class:`hfsweep.core.ledger.Ledger`: the log of
decisions taken and how each member ended, as ``hfsweep run`` keeps them in ``state.json``). Each array report carries a Tune checkpoint of
the array trainer, so ``FailureConfig(max_failures=...)`` retries an array from its last report
and ``Tuner.restore(path, fusion.trainable)`` continues an interrupted experiment: replayed
evaluations get the decisions already taken, and no member is told twice. Tune saves the
experiment only now and then (``TUNE_GLOBAL_CHECKPOINT_S``), so the sweep also saves itself,
with the inner searcher, in the experiment directory (``hfsweep-sweep.journal``) before the
inner searcher hears anything. A restore after a hard kill of the driver (SIGKILL, a lost
machine) goes on from that save when it is newer than Tune's: every member whose end the
searcher was told keeps that end and value, every member it was asked for is in the results,
the restored searcher is told nothing it had heard, and members still training at the kill
train again (from their array's last checkpoint Tune saved, or from the start) and end once.
This needs the fused scheduler (``fusion.scheduler(...)``), which tells the sweep where the
experiment is, and an inner searcher that saves itself (``save``/``restore``, as Tune's do).

**After a restore.** ``Tuner.restore`` unpickles a new searcher from the experiment, so the
objects of the first run (``fusion.searcher(...)``'s return value and its ``.state``) keep the
state from before the interruption. Read the member results from the restored experiment::

    results = tune.Tuner.restore(path, trainable=fusion.trainable).fit()
    member_results(results)        # or member_results(path), best_member(results), ...

``member_results``, ``member_history``, ``best_member``, ``tuned_members`` and ``sweep_state``
take the ``ResultGrid`` (of the first or the restored ``fit``), an ``ExperimentAnalysis`` or
the experiment directory, and read the newest state Tune saved there: use them after a restore,
in any process. ``fusion.state`` (and ``member_results(fusion)``) follow the restored state only
in the process that ran ``Tuner.restore(...).fit()``; a new ``Fusion`` made in another process
knows nothing of the experiment.

**Times.** Each member's result carries its own clock: ``time_total_s`` is its training time
since it joined its array (kept through retries and restores: a resumed array redoes the work
since its checkpoint, and its members' clocks go on from the evaluation it replays, so they never
go back), ``time_this_iter_s`` the time
since its previous evaluation, ``training_iteration`` its evaluations so far. So
``MedianStoppingRule``'s grace period and ASHA's rungs count from a member's start, also for a
member that joins a running array by refill. The array's members train together, so their
time is wall time of the array, not a per-member share of it (and after an out-of-memory split
on a GPU, whose halves train one after the other, a member's clock also runs while its half
waits).

**Ray processes.** Answers reach the trainables through one small Ray actor per sweep (the
hub). It ends when the search is finished and every array trial has ended; an interrupted
experiment keeps it until its restored run finishes or Ray shuts down.

**Know this.**

- Only schedulers that continue or stop trials run per member: ``FIFOScheduler``,
  ``ASHAScheduler`` (``AsyncHyperBandScheduler``), ``MedianStoppingRule`` and hfsweep's
  schedulers (:class:`~hfsweep.schedulers.TrialScheduler`). ``PAUSE`` counts as go on. A
  member that ASHA stops at ``max_t`` is told as completed. Use the task's ``epochs`` as
  ``max_t``.
- ``tune.RunConfig(stop=...)`` (a dict of thresholds, a callable or a ``Stopper``) is judged
  per member, on the member's own result: a member that meets it ends completed (weights kept)
  and its array-mates go on; a ``Stopper``'s ``stop_all()`` stops every member at its next
  evaluation. It needs ``fusion.scheduler(...)`` (:mod:`._tune_stop`).
- ``tune.with_parameters(fusion.trainable, ...)`` is refused before any array trains: a task
  builds its data from the config, in the worker; load large data in the task's ``data``.
- Members of one array are asked together: with TPE, ``OptunaSearch(sampler=TPESampler(
  constant_liar=True))`` keeps them apart.
- Every report carries a checkpoint of the whole array (and the weights of its members that
  completed so far); keep disk use bounded with
  ``tune.RunConfig(checkpoint_config=tune.CheckpointConfig(num_to_keep=2))``: Tune always keeps
  each trial's newest checkpoint, the one that holds the weights.
- A member that joins an array through refill trains on the same data as the others but sees
  the epochs' shuffles in another order (see the README's note on refill).
- ``Tuner.restore(..., restart_errored=True)`` or ``resume_errored=True`` does not retrain an
  errored array: its members were told as failed when it failed; the restarted or resumed
  array is stopped at its first report, and no new member joins it.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from hfsweep._checks import in_range, is_int
from hfsweep.config import MAX_TRIALS
from hfsweep.core.packer import limit_for_learning
from hfsweep.settings import FUSION, ArraySettings, SettingsError, array_settings
from hfsweep.training.task import Task

from . import _tune_results
from ._tune_results import *  # noqa: F403 - reading a finished sweep, as _tune_results.__all__ lists
from ._tune_sweep import SweepState, restored_state
from ._tune_trainable import TRAINABLE_NAME, TrainSpec, make_trainable
from ._tune_wrappers import SUPPORTED_SCHEDULERS, FusedScheduler, FusedSearcher

__all__ = [
    "SUPPORTED_SCHEDULERS",
    "TRAINABLE_NAME",
    "FusedScheduler",
    "FusedSearcher",
    "Fusion",
    *_tune_results.__all__,
]

_log = logging.getLogger("hfsweep.tune")


class Fusion:
    """One fused Tune sweep: the task, the member budget and the array size.

    Args:
        task: an :class:`hfsweep.Task`, or its name: a ready task (``"digits_mlp"``),
            ``"module:attribute"`` or ``"path/to/file.py:attribute"`` (loaded by each worker).
        members: how many member configs to ask the inner searcher for in all (the budget that
            ``num_samples`` is in plain Tune; set ``num_samples=-1``).
        array_size: members per array, or ``"auto"``: the profiler's choice per compatibility
            key (``hs.profile_task``), measured on this (the driver's) machine with ``device``
            and cached; give a number when the workers' device differs from the driver's. As
            in ``hfsweep run``, ``"auto"`` is at most half of ``members`` (rounded up) unless
            the inner searcher draws without learning (``OptunaSearch`` with a random, grid or
            QMC sampler), so that half of the members are drawn knowing earlier results.
        device: where arrays train: ``"auto"`` (CUDA when the worker sees a GPU; give the
            trainable a GPU with ``tune.with_resources(fusion.trainable, {"gpu": 1})``),
            ``"cpu"``, ``"cuda"``.
        dtype: ``"float32"``, ``"float64"`` or ``"bfloat16"``.
        eval_every: evaluate every this many of a member's steps (default: once per epoch).
        refill: give a freed slot a new member of the same key at once (default); without,
            an array shrinks as its members end.
        share_frozen: keep frozen tensors that every member of an array holds identically
            (a fine-tuning sweep's pretrained backbone) once per array (default), as
            ``share_frozen`` of :func:`hfsweep.fuse` and a sweep file's
            ``fusion.share_frozen``; ``False`` gives every member its own copy. The profiler's
            ``"auto"`` array size measures arrays built the same way.
        compile: ``True`` compiles each array's traced forward, backward and loss with
            ``torch.compile`` in the worker (a sweep file's ``fusion.compile``; CUDA graphs on
            CUDA); ``False`` (default) trains them eager. ``"auto"`` (the profiler's choice)
            is refused: the choice is made where arrays are sized, in the driver, and is not
            carried to Tune's trials.
        offload: ``"none"`` (default), ``"host"`` (each array's stacked state in host memory,
            streamed through the device shard by shard; same results) or ``"auto"``
            (``"host"`` only for an array that does not fit the device), as a sweep file's
            ``fusion.offload`` (docs/offload.md). Not with ``compile``.
        device_memory: bytes the offload engine may hold on the device (with ``offload``
            ``"host"`` or ``"auto"``; ``None``: a CUDA device's free memory).
        offload_step: where an offloaded array's optimizer steps: ``"host"`` (default),
            ``"device"`` or ``"auto"`` (both timed, the faster kept); needs ``offload``.
        alternate: offloaded arrays trained at once on one device, their shards alternating.
            Only ``1``: each Tune trial trains one array in a trainable of its own, so there
            is no other array in its process to alternate with.

    Every argument is checked here, before anything trains, by the rules a sweep file's
    ``fusion:`` section is checked by (:func:`~hfsweep.settings.array_settings`);
    an error names the argument (``Fusion(offload=...)``) and what would be valid.
    """

    def __init__(
        self,
        task: Task | str,
        *,
        members: int,
        array_size: int | str = "auto",
        device: str = "auto",
        dtype: str = "float32",
        eval_every: int | None = None,
        refill: bool = True,
        share_frozen: bool = True,
        compile: bool = False,
        offload: str = "none",
        device_memory: int | None = None,
        offload_step: str = "host",
        alternate: int = 1,
    ) -> None:
        if not is_int(members) or not in_range(members, 1, MAX_TRIALS):
            raise ValueError(
                f"Fusion(members={members!r}): give the budget as an integer from 1 to "
                f"{MAX_TRIALS:,} (the largest budget.trials of a sweep file)"
            )
        if array_size != "auto" and not (is_int(array_size) and array_size >= 1):
            raise ValueError(
                f"Fusion(array_size={array_size!r}): give an integer >= 1 or 'auto' (the "
                "profiler's choice)"
            )
        arrays = array_settings(
            {
                "device": device,
                "dtype": dtype,
                "eval_every": eval_every,
                "share_frozen": share_frozen,
                "compile": compile,
                "offload": offload,
                "device_memory": device_memory,
                "offload_step": offload_step,
                "alternate": alternate,
            },
            FUSION,
        )
        _check_for_tune(arrays)
        loaded, ref = _task(task)
        self.task = loaded
        self._spec = TrainSpec(task=ref, arrays=arrays, trace=True)
        size: int | Callable[[Mapping[str, Any]], int]
        size = self._profiled_size if array_size == "auto" else int(array_size)
        self._state = SweepState(
            loaded, members=members, array_size=size, refill=refill, uid=uuid.uuid4().hex[:12]
        )
        self._searcher: FusedSearcher | None = None
        self._scheduler: FusedScheduler | None = None

    @property
    def trainable(self) -> Callable[[dict[str, Any]], None]:
        """The Tune function trainable that trains one array per trial (its name is
        ``"hfsweep_array"``; pass it again to ``Tuner.restore``)."""
        return make_trainable(self._spec)

    def searcher(self, searcher: Any) -> FusedSearcher:
        """Wrap a Tune searcher (``OptunaSearch``, ``HyperOptSearch``, ...): the fused searcher
        to pass as ``TuneConfig(search_alg=...)``. One per Fusion."""
        if self._searcher is not None:
            raise RuntimeError(
                "this Fusion already has a searcher; a Fusion runs one sweep, make another "
                "for another Tuner"
            )
        self._searcher = FusedSearcher(searcher, self._state)
        return self._searcher

    def scheduler(self, scheduler: Any = None) -> FusedScheduler:
        """Wrap a Tune scheduler (``ASHAScheduler``, ``MedianStoppingRule``, ``FIFOScheduler``;
        default FIFO, no early stopping) or an hfsweep ``TrialScheduler``: the fused scheduler
        to pass as ``TuneConfig(scheduler=...)``. Call :meth:`searcher` first."""
        if self._searcher is None:
            raise RuntimeError(
                "call fusion.searcher(...) before fusion.scheduler(...): the scheduler applies "
                "to the members the searcher packs"
            )
        if self._scheduler is not None:
            raise RuntimeError("this Fusion already has a scheduler; a Fusion runs one sweep")
        if scheduler is None:
            from ray.tune.schedulers import FIFOScheduler

            scheduler = FIFOScheduler()
        self._scheduler = FusedScheduler(scheduler, self._searcher)
        return self._scheduler

    @property
    def state(self) -> SweepState:
        """The sweep's live state in this process (members, arrays, pools).

        ``Tuner.restore`` runs a new searcher unpickled from the experiment; once it has
        loaded its state in this process, this is that (restored) state, not the one this
        Fusion's first ``fit`` left behind. In another process, read the experiment instead:
        ``member_results(results)`` or ``member_results(experiment_path)``.
        """
        return restored_state(self._state.uid) or self._state

    def _profiled_size(self, config: Mapping[str, Any]) -> int:
        from hfsweep.sizing.cache import ProfileCache
        from hfsweep.sizing.task import profile_task

        device = self._spec.torch_device()
        arrays = self._spec.arrays
        profile = profile_task(
            self.task,
            config,
            device=device,
            dtype=arrays.torch_dtype(),
            cache=ProfileCache(),
            share_frozen=arrays.share_frozen,
            # as the workers' trainers build them: beyond the device, offloaded
            offload="auto" if arrays.offload == "auto" else "none",
            device_memory=arrays.device_memory,
        )
        size, reason = limit_for_learning(
            int(profile.chosen),
            profile.reason,
            budget=self._state.budget,
            learns=self._inner_learns(),
            searcher="the searcher",
            unit="members",
        )
        _log.info("array size %d on %s: %s", size, device, reason)
        return size

    def _inner_learns(self) -> bool:
        """Whether the inner searcher learns from results (``"auto"`` array sizes are then
        capped, see :func:`~hfsweep.core.packer.learning_cap`)."""
        inner: Any = self._searcher.searcher if self._searcher is not None else None
        while hasattr(inner, "searcher") and not hasattr(inner, "_sampler"):
            inner = inner.searcher  # ConcurrencyLimiter and other wrappers
        return not _draws_blind(inner)


def _check_for_tune(arrays: ArraySettings) -> None:
    """Refuse the array settings that a sweep file takes but Tune's trials cannot honour."""
    if arrays.compile == "auto":
        raise SettingsError(
            "compile",
            "'auto' (the profiler's choice) is not supported by the Tune plugin: the choice "
            "is made where arrays are sized, in the driver, and is not carried to Tune's "
            "trials; give compile=True or compile=False",
            FUSION,
        )
    if arrays.alternate != 1:
        raise SettingsError(
            "alternate",
            f"{arrays.alternate} trains that many offloaded arrays at once in one process; a "
            "Tune trial trains one array in a trainable of its own, so there is none to "
            "alternate with: give alternate=1",
            FUSION,
        )


def _draws_blind(searcher: Any) -> bool:
    """Whether ``searcher`` draws configs without learning from results: ``OptunaSearch``
    with Optuna's random, grid or QMC sampler."""
    import optuna

    sampler = getattr(searcher, "_sampler", None)
    blind = (optuna.samplers.RandomSampler, optuna.samplers.GridSampler, optuna.samplers.QMCSampler)
    return type(searcher).__name__ == "OptunaSearch" and isinstance(sampler, blind)


def _task(task: Task | str) -> tuple[Task, Task | str]:
    """``(the task, what workers load)``: a file path in a name is made absolute."""
    if isinstance(task, Task):
        return task, task
    if not isinstance(task, str):
        raise TypeError(
            f"Fusion(task=...) takes an hfsweep.Task or a task name, got {type(task).__name__}"
        )
    from hfsweep.config.entry import load_task

    where, sep, attr = task.rpartition(":")
    if sep and where.endswith(".py"):
        task = f"{Path(where).resolve()}:{attr}"
    return load_task(task), task
