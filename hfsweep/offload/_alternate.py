"""Several offloaded arrays stepped together, their shards alternating on the compute side
(:class:`AlternatingArrays`; Hydra's shard alternation, Nagrecha & Kumar).

One array alone with prefetch hides a shard's fetch behind the compute of the shard before it,
so its step takes about the sum over its shards of the larger of the two. Where one array's
shards wait on their transfers (large weights, little compute: a small batch) and another's on
their compute, each alone leaves one side idle: the first the compute, the second the link.
Stepped together, array ``a``'s shard ``k`` computes while array ``b``'s shard ``k`` is
copied in, then ``b``'s shard ``k`` while ``a``'s shard ``k + 1`` is, and so on: the copies
go through one transfer (one side stream or thread, in the order they are started) and the
computes through the calling thread. At best the step then takes the larger of the sum of
every array's transfers and the sum of every array's computes instead of the sum of each
array's step alone; measured (``benchmarks/offload_alternate.py``), it takes less than the
steps alone but stays above that bound.

Three schedules (``schedule``, :data:`SCHEDULES`) order the arrays' turns in :meth:`~
AlternatingArrays.step`:

- ``lockstep`` (the default; :meth:`~AlternatingArrays.forward` and
  :meth:`~AlternatingArrays.backward` are its halves): every array's forward, shard by shard
  in turn, then every array's backward. A's forward fetches then run against b's forward,
  which is the lighter half of b's compute.
- ``shifted``: array ``i + 1``'s step (forward, loss, backward) starts only once array ``i``
  has computed its loss and entered its backward; the arrays started take turns. With the
  compute-bound array first, the transfer-bound one's forward fetches run against the
  compute-bound one's backward, the heavier half. The order of ``arrays`` matters: the
  transfer-bound one first puts its backward against the other's light forward.
- ``ready``: every array's step (forward, loss, backward) starts at once, and each turn goes
  to an array whose next shard is in (its fetch done: :meth:`~hfsweep.offload.Fetch.ready`),
  the first after the one that took the last turn; where none is in, to the one whose fetch
  is first on the link (the copy under way, then urgent fetches, then the others in the
  order started: the one transfer copies in that order). Turns are weighted by readiness
  instead of one per array per round: while the compute-bound array computes a shard, the
  transfer copies several of the transfer-bound one's in, which then takes several turns in
  a row where it has several fetches in flight (``prefetch_depth``); measured, it does not pay
  (below).

``prefetch_depth`` (one int, or one per array) is how many shards ahead of the one computing
an array has fetched or on their way (:class:`~hfsweep.offload.OffloadedArray`'s, default 1,
each next fetch started as a shard starts computing).

Measured on a 2-core CPU with an injected delay per fetch
(``benchmarks/results/offload_alternate_cpu.md``: two arrays of six shards, a on a batch of
8, transfer-bound, b on 1024, compute-bound; ``docs/offload.md`` has the runs), no schedule
and no depth beats the lockstep by more than the noise, and a deeper prefetch for the
transfer-bound array is slower: ``prefetch_depth=(3, 1)`` under ``ready`` takes 0.98 to 1.22
of the lockstep's step over four delays (above it in seven rows of eight), ``ready`` at
depth 1 0.93 to 1.04, the shift with b first 0.94 to 1.14 (a first 1.09 to 1.22); the
lockstep takes 0.82 to 0.97 of the two arrays stepped alone, and on the quieter run every
arm stays at least 8% above the larger of the sum of transfers and the sum of computes. Why
(the benchmark's queue model, ``benchmarks/_queue_model.py``, which replays the turns and
fetches with the link as one first-in-first-out queue and follows the quieter run's
ratios): the link copies in the order fetches start, so more of a's fetches in flight do not
overlap each other, they take the link earlier, in b's forward, where one fetch per array
per shard already keeps it busy, and queue ahead of b's next fetch: b's compute waits. The
link's gaps are in b's backward, later.

``urgent`` (array indices) is that priority on the link: the urgent arrays' fetches are
copied before the others' not yet started (a copy under way is not interrupted;
:class:`~hfsweep.offload.CpuTransfer` honours it, :class:`~hfsweep.offload.CudaTransfer`'s
one stream copies in the order issued and does not), so a's deeper prefetch only takes the
link where b has no fetch waiting. The queue model with a two-class link, replayed on both
runs' rows (``python benchmarks/_queue_model.py RESULT.json``), predicts ``ready`` with
``prefetch_depth=(3, 1)`` and ``urgent=(1,)`` at 0.905 to 0.977 of the lockstep (over 5% in
five rows of eight); measured, see ``docs/offload.md``
(``benchmarks/results/offload_alternate_priority_cpu.md``). The lockstep stays the default;
``ready``, the depth and ``urgent`` are options.

Each array trains exactly as it would alone, under any schedule and depth: its shards compute the
same values in the same order, only other arrays' shards run in between; each keeps its own
dropout streams, buffers and gradients. The arrays share one budget and one
:class:`~hfsweep.offload.ResidentLedger`: each array's shards hold at most a quarter of the
budget divided by the number of arrays ``m``. An array waiting for its turn holds at most one
shard (the one its next turn computes), the one computing two and that shard's gradients on
their way to the host, so for ``m >= 2`` shards and gradients take at most ``(m + 2) / 4m`` of the
budget, no more than half, and the boundary activations the other half. With
``prefetch_depth`` ``d_i`` per array, an array waiting holds at most ``d_i`` shards and the
one computing ``d_i + 1`` and its gradients, ``D + 2`` shards in all for ``D`` the sum of
the depths; the shard limit is then the budget over the larger of ``4m`` and ``2 (D + 2)``
(``4m`` where every depth is 1), so the shards and gradients still take at most
half. Deeper prefetch means smaller shards within a budget, not a larger share: the budget's
division stays. The ``ready`` schedule holds no more boundary activations than the lockstep
at the end of its forwards (every array's all at once), the most any order can hold. The shift keeps that
division: an array not started or done holds nothing, and while one array's forward adds its
boundary activations the one before it, in its backward, lets go of its own, so the shift
never holds more of them than the lockstep does at the end of its forwards (every array's
all at once); the tests check its ledger's peak against the lockstep's.

The trainer uses it through :func:`hfsweep.train_together` (several ``ArrayTrainer`` runs,
each step of all of them one :meth:`~AlternatingArrays.step` over engines it builds:
:meth:`AlternatingArrays.of_engines`), and ``hfsweep run`` through it with
``fusion.alternate``. Arrays cut between their blocks (``cut="blocks"``, whose
own forward calls the units) are not alternated (they are cut along the graph here, or
refused).
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Sequence
from typing import Any, Literal, get_args

import torch
from torch import Tensor

from ..fusion import FusedArray
from ._engine import OffloadedArray
from ._errors import OffloadError
from ._ledger import ResidentLedger
from ._transfer import Transfer, default_transfer

__all__ = ["SCHEDULES", "AlternatingArrays", "Schedule"]

#: how :meth:`AlternatingArrays.step` orders the arrays' steps: ``lockstep`` (every forward,
#: then every backward) or ``shifted`` (each array's step starts when the one before it in
#: the list has entered its backward) or ``ready`` (every step at once, the turn to an array
#: whose next shard is in)
Schedule = Literal["lockstep", "shifted", "ready"]
SCHEDULES: tuple[str, ...] = get_args(Schedule)


def _alternate(steps: Sequence[Generator[None, None, Any]]) -> list[Any]:
    """Run ``steps`` (one per array) in turn, one shard each, until all are done; their
    results in order. Where one fails, the others are closed (what they held is released)."""
    results: list[Any] = [None] * len(steps)
    running = list(range(len(steps)))
    try:
        while running:
            for i in list(running):
                try:
                    next(steps[i])
                except StopIteration as done:
                    results[i] = done.value
                    running.remove(i)
    except BaseException:
        for i in running:
            steps[i].close()
        raise
    return results


class _ArrayStep:
    """One array's whole training step (its forward, its loss, its backward) as one generator
    of its shards, yielding between them as the engine's steps do; :attr:`backward` turns
    true once its forward and loss are done (what the shifted schedule waits for) and
    :attr:`loss` holds the loss (detached) by then."""

    def __init__(self, engine: OffloadedArray, x: Tensor, loss: Callable[[Tensor], Tensor]) -> None:
        self.backward = False
        self.loss: Tensor | None = None
        self.steps = self._run(engine, x, loss)

    def _run(
        self, engine: OffloadedArray, x: Tensor, loss_of: Callable[[Tensor], Tensor]
    ) -> Generator[None, None, None]:
        out = yield from engine._forward_steps(x, True)
        generation = engine._generation
        out.requires_grad_(True)
        try:
            with torch.enable_grad():
                loss = loss_of(out)
                torch.autograd.backward([loss])  # the loss's own code, down to the output
        except BaseException:
            engine._release()  # the forward kept its boundary activations for the backward
            raise
        self.loss = loss.detach()
        self.backward = True
        if out.grad is None:  # the loss does not depend on it: nothing to train
            engine._release()
            return
        yield from engine._backward_steps(out.grad, generation)


def _shifted(steps: Sequence[_ArrayStep]) -> None:
    """Run ``steps`` one shard each in turn, as :func:`_alternate` does, but start step
    ``i + 1`` only once step ``i`` has entered its backward (or is done): the arrays'
    phases are shifted by one forward. Where one fails, the others started are closed."""
    running = [0]
    started = 1
    try:
        while running:
            for i in list(running):
                try:
                    next(steps[i].steps)
                except StopIteration:
                    running.remove(i)
            # the next array joins the turns once the latest one started is in its backward
            while started < len(steps) and steps[started - 1].backward:
                running.append(started)
                started += 1
    except BaseException:
        for i in running:
            steps[i].steps.close()
        raise


def _pick(running: Sequence[int], engines: Sequence[OffloadedArray], last: int) -> int:
    """The array whose turn it is under the ``ready`` schedule: the first after ``last`` (in
    turn, so that none is starved) whose next shard is in; else the one whose next shard's
    fetch is first on the link (the copy under way, then the urgent fetches, then the others,
    each in the order started: one transfer copies in that order, so it is in first); else (each
    fetches its next shard when it resumes, as without prefetch) the first after ``last``."""
    after = [i for i in running if i > last] + [i for i in running if i <= last]
    waiting = [(i, engines[i]._waiting) for i in after]
    for i, resident in waiting:
        if resident is not None and resident.ready():
            return i
    # the link's order: the copy under way, then the urgent fetches, then the others
    started = [
        ((not resident.started(), not resident.urgent, resident.order), i)
        for i, resident in waiting
        if resident is not None
    ]
    return min(started)[1] if started else after[0]


def _ready(steps: Sequence[_ArrayStep], engines: Sequence[OffloadedArray]) -> None:
    """Run ``steps`` together, every one started at once (a start only begins its first
    fetches), each turn one shard of the array :func:`_pick` chooses: an array whose shards
    wait on the link takes several turns in a row while another's fetches are still on their
    way, and none waits on a copy while another could compute. Where one fails, the others
    are closed."""
    running = list(range(len(steps)))

    def advance(i: int) -> None:
        try:
            next(steps[i].steps)
        except StopIteration:
            running.remove(i)

    try:
        for i in list(running):
            advance(i)
        last = -1
        while running:
            last = _pick(running, engines, last)
            advance(last)
    except BaseException:
        for i in running:
            steps[i].steps.close()
        raise


def _depths(prefetch_depth: int | Sequence[int], m: int) -> list[int]:
    """``prefetch_depth`` as one depth per array (an int: the same for all); refused with the
    value and what is valid where it is neither an int >= 1 nor ``m`` of them."""
    if isinstance(prefetch_depth, int):
        depths: list[Any] = [prefetch_depth] * m
    elif isinstance(prefetch_depth, list | tuple):
        depths = list(prefetch_depth)
    else:
        depths = []  # refused below
    if len(depths) != m or any(
        isinstance(d, bool) or not isinstance(d, int) or d < 1 for d in depths
    ):
        raise OffloadError(
            f"prefetch_depth must be an int >= 1 or one such int per array ({m}), "
            f"got {prefetch_depth!r}"
        )
    return depths


def _urgent(urgent: Sequence[int], m: int) -> set[int]:
    """``urgent`` as a set of array indices; refused with the value and what is valid where
    it is not a list or tuple of distinct ints in ``range(m)``."""
    valid = isinstance(urgent, list | tuple) and all(
        not isinstance(i, bool) and isinstance(i, int) and 0 <= i < m for i in urgent
    )
    if not valid or len(set(urgent)) != len(urgent):
        raise OffloadError(
            f"urgent must be a list or tuple of distinct array indices in 0..{m - 1}, "
            f"got {urgent!r}"
        )
    return set(urgent)


class AlternatingArrays:
    """``arrays`` (:class:`~hfsweep.fusion.FusedArray`\\ s) offloaded to ``device`` within
    one budget of ``budget_bytes`` (``None``: recorded only), stepped together with their
    shards alternating (see the module's docstring).

    ``engines`` are their :class:`~hfsweep.offload.OffloadedArray`\\ s, cut along the traced
    graph, sharing :attr:`ledger` and one ``transfer`` (default:
    :func:`~hfsweep.offload.default_transfer` for ``device``); ``shard_bytes`` sets every
    array's shard limit itself (default: a quarter of the budget over the number of arrays,
    or without a budget a quarter of each array's state). A training step::

        outs = arrays.forward([x_a, x_b])
        arrays.backward([loss_a(outs[0]), loss_b(outs[1])])
        # then each array's optimizer steps on its host parameters, as alone

    or, the losses given as functions of the outputs, ordered by ``schedule``::

        arrays.step([x_a, x_b], [loss_a, loss_b])

    ``schedule`` (one of :data:`SCHEDULES`) orders :meth:`step`: ``"lockstep"`` (the
    default) runs every forward, then every backward, as :meth:`forward` and
    :meth:`backward` do; ``"shifted"`` starts each array's step once the array before it in
    ``arrays`` is in its backward (see the module's docstring: put the compute-bound array
    first; measured, it is no faster than the lockstep); ``"ready"`` starts every step at
    once and gives each turn to an array whose next shard is in. :meth:`forward` and
    :meth:`backward` are the lockstep's halves whatever the schedule: a shifted or ready step
    cannot be cut into all the forwards, then all the backwards. ``prefetch_depth`` (an int
    for all, or one per array, each >= 1) is how many shards ahead each array fetches; with
    a budget, deeper prefetch makes the shards smaller (see the module's docstring).
    ``urgent`` (array indices) marks the arrays whose fetches go first on the one transfer:
    ahead of the others' not yet started (a copy under way is not interrupted); for the
    compute-bound array, so that a deeper prefetch of a transfer-bound one fills the link's
    gaps instead of queueing ahead of it. :class:`~hfsweep.offload.CpuTransfer` honours it;
    :class:`~hfsweep.offload.CudaTransfer` copies on one stream in the order issued and
    does not (``Transfer.reorders``), so there it marks nothing and the ready schedule
    follows the order issued. It changes when shards are in, not what any array computes.

    An engine may also be called alone (``arrays.engines[0](x)``), as any offloaded array.
    """

    def __init__(
        self,
        arrays: Sequence[FusedArray],
        *,
        device: str | torch.device = "cpu",
        budget_bytes: int | None = None,
        transfer: Transfer | None = None,
        prefetch: bool = True,
        shard_bytes: int | None = None,
        schedule: Schedule = "lockstep",
        prefetch_depth: int | Sequence[int] = 1,
        urgent: Sequence[int] = (),
    ) -> None:
        if schedule not in SCHEDULES:
            raise OffloadError(f"schedule must be one of {SCHEDULES}, got {schedule!r}")
        self.schedule: Schedule = schedule
        if not arrays:
            raise OffloadError("AlternatingArrays needs at least one array")
        depths = _depths(prefetch_depth, len(arrays))
        first = _urgent(urgent, len(arrays))
        if len({id(a) for a in arrays}) != len(arrays):
            raise OffloadError("AlternatingArrays got the same array twice")
        self.ledger = ResidentLedger(budget_bytes)
        self.transfer = transfer if transfer is not None else default_transfer(device)
        limit = shard_bytes
        if limit is None and budget_bytes is not None:
            # waiting arrays hold their depth's shards, the one computing one more and its
            # gradients: (sum of depths + 2) shards in half the budget (see the module)
            parts = max(4 * len(arrays), 2 * (sum(depths) + 2))
            limit = max(budget_bytes // parts, 1)
        self.engines = [
            OffloadedArray(
                a,
                device=device,
                transfer=self.transfer,
                prefetch=prefetch,
                shard_bytes=limit,
                cut="graph",
                ledger=self.ledger,
                prefetch_depth=depth,
            )
            for a, depth in zip(arrays, depths, strict=True)
        ]
        # only where the link reorders: on one that copies in the order issued (one CUDA
        # stream), marking them would make the ready schedule wait on the wrong array
        for i in first if self.transfer.reorders else ():
            self.engines[i]._urgent = True
        self._outputs: list[Tensor | None] = []
        self._generations: list[int] = []

    @classmethod
    def of_engines(
        cls, engines: Sequence[OffloadedArray], *, schedule: Schedule = "lockstep"
    ) -> AlternatingArrays:
        """Engines built already (each :class:`~hfsweep.offload.OffloadedArray` cut along
        the graph, all sharing one ledger and one transfer) stepped together as the arrays of
        an :class:`AlternatingArrays` built from their arrays would be. For a caller whose
        arrays come and go while others train (the trainer's driver,
        :func:`~hfsweep.training.train_together`): its engines, their shard limits and
        prefetch depths are its own, and :meth:`close` here closes them and their transfer."""
        if schedule not in SCHEDULES:
            raise OffloadError(f"schedule must be one of {SCHEDULES}, got {schedule!r}")
        if not engines:
            raise OffloadError("AlternatingArrays needs at least one array")
        if len({id(e) for e in engines}) != len(engines):
            raise OffloadError("AlternatingArrays got the same engine twice")
        first = engines[0]
        for e in engines:
            if e.ledger is not first.ledger or e.transfer is not first.transfer:
                raise OffloadError(
                    "engines stepped together must share one ledger and one transfer "
                    "(OffloadedArray(..., ledger=..., transfer=...))"
                )
            if e._blocks is not None:
                raise OffloadError(
                    "an array cut between its blocks (cut='blocks') cannot be alternated: "
                    "cut it along the graph (cut='graph') or step it alone"
                )
        arrays = cls.__new__(cls)
        arrays.schedule = schedule
        arrays.ledger = first.ledger
        arrays.transfer = first.transfer
        arrays.engines = list(engines)
        arrays._outputs = []
        arrays._generations = []
        return arrays

    def _check_inputs(self, inputs: Sequence[Tensor]) -> None:
        """One tensor per array, none requiring a gradient (the arrays' inputs get none)."""
        for x in inputs:
            if not isinstance(x, Tensor):
                raise OffloadError(f"an offloaded array takes one tensor input, got {type(x)}")
            if x.requires_grad:
                raise OffloadError(
                    "AlternatingArrays trains the arrays' parameters and gives their inputs no "
                    "gradient; an input requires one: step that array alone (its engine)"
                )

    def forward(self, inputs: Sequence[Tensor]) -> list[Tensor]:
        """Every array's output (``[B, N, ...]``) on its input, their shards alternating.
        With autograd on, each output is a leaf that requires a gradient: compute the losses
        from them and hand them to :meth:`backward`. The inputs take no gradient."""
        if len(inputs) != len(self.engines):
            raise OffloadError(f"forward takes one input per array ({len(self.engines)})")
        self._check_inputs(inputs)
        keep = torch.is_grad_enabled()
        outs: list[Tensor] = _alternate(
            [e._forward_steps(x, keep) for e, x in zip(self.engines, inputs, strict=True)]
        )
        if not keep:
            return outs
        outs = [o.requires_grad_(True) for o in outs]
        self._outputs = list(outs)
        self._generations = [e._generation for e in self.engines]
        return outs

    def backward(self, losses: Sequence[Tensor]) -> None:
        """Each array's backward from its loss (a scalar computed from its output of the
        latest :meth:`forward`), their shards alternating; the parameter gradients are added
        to each array's host parameters' ``.grad``, as ``loss.backward()`` on the array alone
        would."""
        if len(losses) != len(self.engines) or len(self._outputs) != len(self.engines):
            raise OffloadError(
                f"backward takes one loss per array ({len(self.engines)}), after a forward "
                "with autograd on"
            )
        outputs = [o for o in self._outputs if o is not None]
        if len(outputs) != len(self.engines):
            raise OffloadError("backward ran already for the latest forward")
        for out in outputs:
            out.grad = None
        torch.autograd.backward(list(losses))  # the losses' own code, down to the outputs
        steps = []
        for engine, out, generation in zip(self.engines, outputs, self._generations, strict=True):
            if out.grad is None:  # its loss does not depend on it: nothing to train
                engine._release()
                continue
            steps.append(engine._backward_steps(out.grad, generation))
        self._outputs = [None] * len(self.engines)
        _alternate(steps)

    def step(
        self, inputs: Sequence[Tensor], losses: Sequence[Callable[[Tensor], Tensor]]
    ) -> list[Tensor]:
        """One training step of every array: its forward on its input, its loss
        (``losses[i](output)``, a scalar computed from the array's output) and its backward,
        ordered by :attr:`schedule`; the gradients are added to each array's host
        parameters' ``.grad`` as :meth:`backward` adds them. Returns the losses (detached).

        ``"lockstep"`` is :meth:`forward`, the losses, then :meth:`backward`. ``"shifted"``
        starts array ``i + 1``'s step only once array ``i`` has computed its loss and entered
        its backward, so that one array's forward fetches run against the one before it's
        backward compute; each loss is then computed before the arrays after it have run
        their forward, which is why the shift needs the losses as functions here. Where a
        step fails, nothing stays held on the compute side."""
        if len(inputs) != len(self.engines) or len(losses) != len(self.engines):
            raise OffloadError(f"step takes one input and one loss per array ({len(self.engines)})")
        if not torch.is_grad_enabled():
            raise OffloadError("step trains the arrays: it needs autograd on")
        self._check_inputs(inputs)
        try:
            if self.schedule == "lockstep":
                outs = self.forward(inputs)
                values = [loss(out) for loss, out in zip(losses, outs, strict=True)]
                self.backward(values)
                return [v.detach() for v in values]
            steps = [
                _ArrayStep(e, x, loss)
                for e, x, loss in zip(self.engines, inputs, losses, strict=True)
            ]
            self._outputs = []  # a backward of an earlier forward is no longer valid
            if self.schedule == "shifted":
                _shifted(steps)
            else:
                _ready(steps, self.engines)
        except BaseException:
            self._outputs = []
            for engine in self.engines:
                engine._release()
            raise
        return [s.loss for s in steps if s.loss is not None]

    def close(self) -> None:
        """Drop what the engines hold on the compute side and stop the transfer."""
        for engine in self.engines:
            engine.close()
