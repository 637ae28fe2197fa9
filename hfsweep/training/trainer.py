"""The array trainer: trains the members of one fused array, each on its own budget.

One shared batch feeds every member at each step; each member has its own loss, optimizer
hyperparameters, schedule, dropout stream, budget and metric history. After each evaluation a
report hook decides per member whether it goes on; a member that is done (budget reached,
stopped, or non-finite) frees its slot, which a refill hook may fill at once with a new
compatible trial. Checkpoints are taken at every evaluation, atomically, and a run resumes from
them exactly; an out-of-memory error splits the array in two and goes on without losing any
member's progress.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence

from .._malloc import retaining_freed_memory
from ..settings import ArraySettings
from ._threads import training_threads
from .base import TrainerBase
from .results import Evaluation, Member, MemberResult, RefillHook, ReportHook
from .run import ArrayRun
from .task import Task

__all__ = ["ArrayTrainer", "Evaluation", "Member", "MemberResult", "RefillHook", "ReportHook"]


class ArrayTrainer(TrainerBase):
    """Trains arrays of members of one task and compatibility key.

    ``eval_every`` is the evaluation period in a member's own optimizer steps (default: one
    epoch); a member is also evaluated when it reaches its budget (``max_steps``, else
    ``epochs`` epochs). With ``checkpoint_dir`` the trainer writes ``array.pt`` (every slot's
    model, optimizer, schedule, dropout stream, history and the data position, and the members
    that ended but whose ``on_finish`` has not been called yet) at each evaluation and whenever
    a member ends or joins, and appends to ``delivered.log`` each member ``on_finish`` was
    called for (its result without the state); with ``keep_states`` also ``members/<id>.pt``
    (a member's final state) when a member ends. ``run(..., resume=True)`` continues from
    ``array.pt``. ``final_states`` says which ended members' results carry their state:
    ``"all"``, ``"completed"`` (a sweep keeps the weights of its best completed trials only;
    saving every pruned member's cost a sweep of small models a noticeable share of its time)
    or ``"none"``.
    ``share_frozen`` (``fusion.share_frozen``) keeps frozen tensors that every member holds
    identically (a fine-tuning sweep's pretrained backbone) once in each array, and its
    checkpoints store them once (see :func:`hfsweep.fuse`).
    ``float64`` is for exactness tests; models are built on the CPU from their seed, then moved
    to ``device``. ``compile`` compiles each array's traced forward and backward and the task's
    loss with ``torch.compile`` (see ``compile`` of :func:`hfsweep.fuse`; ``True``: CUDA graphs
    on CUDA), and its optimizer's update (:meth:`hfsweep.optim.FusedOptimizer.compile`,
    inductor's default mode); the time compiling takes is left out of the measured step times.

    ``offload`` (``"none"``, ``"host"``, ``"auto"``) keeps an array's stacked parameters and
    optimizer state in host memory and runs it on ``device`` shard by shard (see
    :mod:`hfsweep.offload` and docs/offload.md; same results as without). ``device_memory``
    (bytes) is the budget on the compute side: what the engine may hold there with ``"host"``,
    and what ``"auto"`` compares the array's estimated state with (``None``: a CUDA device's free
    memory; on the CPU ``"auto"`` then keeps arrays as they are): an array that fits stays, one
    of which not even one member fits is offloaded, and otherwise the profiler measures it
    offloaded against arrays of the members that fit and the faster is trained (see
    docs/offload.md). An offloaded array keeps the frozen tensors every member holds
    identically once with ``share_frozen``, as on the device (in host storage, copied in once
    for all members), and runs uncompiled: ``compile`` with ``offload`` other than ``"none"``
    is refused. ``offload_step`` says where an offloaded array's optimizer steps: ``"host"``
    (the default: the fused step on the host tensors), ``"device"`` (each shard on ``device``
    right after its backward, its optimizer state fetched for it; on the host, with a
    warning, while a member clips its gradients) or ``"auto"`` (both timed on the array's
    first steps, the faster kept and logged); every value trains the same results, except
    that an out-of-memory error once a shard's device update has begun fails the array's
    members rather than replaying the step (see docs/offload.md).
    """

    #: what :meth:`run` executes (a data-parallel worker's trainer sets its own, on shards)
    run_class: type[ArrayRun] = ArrayRun

    @classmethod
    def from_settings(
        cls,
        task: Task,
        settings: ArraySettings,
        *,
        checkpoint_dir: str | os.PathLike[str] | None = None,
        trace: bool = True,
        keep_states: bool = True,
        final_states: str = "all",
    ) -> ArrayTrainer:
        """A trainer of ``task``'s arrays as a sweep's ``settings`` say (its device, dtype,
        evaluation period, shared frozen tensors, compile and offload: what executors and Ray
        workers build their trainers from; ``alternate`` is theirs: a trainer trains one
        array). The other arguments are the constructor's."""
        return cls(
            task,
            device=settings.resolved_device(),
            dtype=settings.torch_dtype(),
            eval_every=settings.eval_every,
            checkpoint_dir=checkpoint_dir,
            trace=trace,
            keep_states=keep_states,
            final_states=final_states,
            share_frozen=settings.share_frozen,
            compile=settings.compile,
            offload=settings.offload,
            device_memory=settings.device_memory,
            offload_step=settings.offload_step,
        )

    # ------------------------------------------------------------------ public
    def run(
        self,
        members: Sequence[Member],
        *,
        report: ReportHook | None = None,
        refill: RefillHook | None = None,
        on_finish: Callable[[MemberResult], None] | None = None,
        resume: bool = False,
        start_step: int = 0,
    ) -> list[MemberResult]:
        """Train ``members`` as one array (their configs must share the compatibility key) and
        return one result per member, including members that joined through ``refill``.

        ``report`` is called after every evaluation with the members evaluated at that step
        and may stop any of them; ``on_finish`` is called as each member finishes. On the CPU
        it keeps this process's freed memory for reuse while it runs (see ``hfsweep._malloc``;
        ``HFSWEEP_MALLOC=system`` leaves the allocator alone). With
        ``resume=True`` and a checkpoint in ``checkpoint_dir``, ``members`` is only used for
        members the checkpoint does not know yet; finished members are not trained again.
        ``start_step`` starts the array's data stream that many steps in (epoch
        ``start_step // steps_per_epoch``, its batch ``start_step % steps_per_epoch``): how a
        trial that joined an array by refill is retrained alone on the same data
        (``MemberResult.start_step``).
        """
        if isinstance(start_step, bool) or not isinstance(start_step, int) or start_step < 0:
            raise ValueError(f"start_step must be an int >= 0, got {start_step!r}")
        run = self.run_class(self, report, refill, on_finish)
        if self.device.type != "cpu":
            return run.execute(members, resume, start_step)
        with retaining_freed_memory(), training_threads() as threads:
            run.threads = threads
            return run.execute(members, resume, start_step)
