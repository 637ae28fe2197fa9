"""Training fused arrays: a task's members trained together, each exactly as it would train alone.

One job per module, each importing only those below it in this list:

- ``_together``: :func:`train_together`, several offloaded arrays' runs (:class:`ArrayJob`)
  trained at once, each step of all of them one alternating step of their shards.
- ``trainer``: :class:`ArrayTrainer`, what a caller builds and runs.
- ``run``: one run of it (:class:`ArrayRun`): the arrays it trains, evaluations, ends,
  refills, checkpoints. A trainer that trains differently subclasses it and names its subclass
  in :attr:`ArrayTrainer.run_class` (the extension point :mod:`hfsweep.parallel` uses).
- ``_evaluation``: what one evaluation computes: validation sums, history records, endings.
- ``live``: the array in training (:class:`LiveArray`: model, optimizer, schedule, per-member
  tensors): how it is built from slots, and the snapshots that go on in two halves or a
  smaller array.
- ``_offload_auto``: ``offload="auto"``'s choice, measured by the profiler that registers
  itself (:func:`use_offload_profiler`).
- ``base``: :class:`TrainerBase`, the trainer's settings, data cache (:class:`DataCache`) and
  data helpers, which ``run``, ``live`` and ``_offload_auto`` read the trainer through (so
  they do not import ``trainer``); ``_compiled``: the task's loss compiled.
- ``step``: the fused training step and the per-step helpers (dropout, data seed, timing).
- ``checkpoint``: the trainer's files and records, read back as plain data only.
- ``spec``: :class:`~hfsweep.training.spec.TrialSpec` (one member's config, budget, seeds and
  data position), a slot's progress, an array's data position.
- ``settings``: :class:`ArraySettings`, how every array of a sweep trains, and the one check of
  them for a sweep file's ``fusion:`` and the Tune plugin's ``Fusion(...)``.
- ``results``: :class:`Member`, :class:`Evaluation`, :class:`MemberResult` and the hooks.
- ``task``: :class:`~hfsweep.Task`, the user's model, data, loss and metrics, and the optimizers
  and schedules its configs name.
- ``packed``: checkpoint packing that stores many small tensors as a few and loads only plain data.

Users import :class:`ArrayTrainer`, :class:`Member`, :class:`Evaluation`,
:class:`MemberResult`, :class:`ArrayJob` and :func:`train_together` from :mod:`hfsweep`; the
other names here are what hfsweep's other packages (the executors, the profiler, the
data-parallel trainer) build on.
"""

from ..settings import ArraySettings
from ._compiled import CompiledLoss
from ._evaluation import add_metrics
from ._offload_auto import use_offload_profiler
from ._together import ArrayJob, StepDriver, train_together
from .base import DataCache, TrainerBase
from .live import LiveArray
from .results import Evaluation, Member, MemberResult, RefillHook, ReportHook
from .run import ArrayRun
from .spec import ArrayState
from .trainer import ArrayTrainer

__all__ = [
    "ArrayJob",
    "ArrayRun",
    "ArraySettings",
    "ArrayState",
    "ArrayTrainer",
    "CompiledLoss",
    "DataCache",
    "Evaluation",
    "LiveArray",
    "Member",
    "MemberResult",
    "RefillHook",
    "ReportHook",
    "StepDriver",
    "TrainerBase",
    "add_metrics",
    "train_together",
    "use_offload_profiler",
]
