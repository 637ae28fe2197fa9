"""Training fused arrays: a task's members trained together, each exactly as it would train alone.

One job per module, each importing only those below it in this list:

- ``_together``: :func:`train_together`, several offloaded arrays' runs (:class:`ArrayJob`)
  trained at once, each step of all of them one alternating step of their shards.
- ``trainer``: :class:`ArrayTrainer`, what a caller builds and runs.
- ``run``: one run of it: the arrays it trains, evaluations, ends, refills, checkpoints.
- ``_evaluation``: what one evaluation computes: validation sums, history records, endings.
- ``live``: the array in training (model, optimizer, schedule, per-member tensors): how it is
  built from slots, and the snapshots that go on in two halves or a smaller array.
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

Users import these names from :mod:`hfsweep` (and :mod:`hfsweep.trainer`).
"""

from ._together import ArrayJob, train_together
from .results import Evaluation, Member, MemberResult, RefillHook, ReportHook
from .settings import ArraySettings
from .trainer import ArrayTrainer

__all__ = [
    "ArrayJob",
    "ArraySettings",
    "ArrayTrainer",
    "Evaluation",
    "Member",
    "MemberResult",
    "RefillHook",
    "ReportHook",
    "train_together",
]
