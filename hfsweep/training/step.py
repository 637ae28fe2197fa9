"""The fused training step and what it needs per step: forward and backward of every member on
one shared batch, the optimizer and schedule step, per-member dropout, the per-epoch data seed,
the step timer, and the choice of a smaller array once most slots are idle."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

from .._usercode import Phase
from ..fusion import FusedArray
from ..optim import FusedOptimizer, clip_grad_norm_
from ..optim.lr_scheduler import FusedLRScheduler
from .spec import _SlotState
from .task import Task, TaskError, manual_seed


def any_smoothing(configs: Iterable[Mapping[str, Any]]) -> bool:
    """Whether a member with one of ``configs`` trains with label smoothing. Without any, the
    loss is computed without the smoothing term: the same values (its weight is 0 for every
    member) and fewer ops."""
    return any(c["label_smoothing"] for c in configs)


def backward(
    task: Task,
    array: FusedArray,
    x: Any,
    y: Any,
    smoothing: Tensor | None,
    clip: Tensor | None,
    loss: Callable[[Tensor, Any, Tensor | None], Tensor] | None = None,
    forward: Callable[[Any], Any] | None = None,
) -> Tensor:
    """Forward and backward of every member on the shared batch ``(x, y)``, then per-member
    clipping; returns the ``[B]`` losses (``smoothing``: the ``[B]`` label smoothing, or
    ``None`` for none; ``loss``: the task's loss compiled, else ``task.member_loss``).
    ``forward`` runs the array (default: calling it; an offloaded array's engine otherwise).
    Nothing is changed yet, so after an out-of-memory error here the step can be retried by
    smaller arrays."""
    with Phase("the forward pass"):
        out = array(x) if forward is None else forward(x)
    with Phase("the loss"):
        losses = (loss or task.member_loss)(out, y, smoothing)
    with Phase("the backward pass"):
        losses.sum().backward()
    if clip is not None:
        clip_grad_norm_(array, clip)
    return losses


def _choose_compaction(
    size: int,
    busy: int,
    remaining: int,
    step_seconds: Mapping[int, float],
    rebuild_seconds: Callable[[int], float],
) -> int | None:
    """The size an array of ``size`` slots with ``busy`` members should be rebuilt at, or
    ``None`` when no rebuild pays.

    Candidates are ``busy`` and the power of two above it (a size whose traces earlier arrays
    may have left in the shared cache, its spare slots open to refills). A candidate ``b``
    gains ``remaining * (step(size) - step(b)) - rebuild_seconds(b)``; the largest positive
    gain wins. ``step_seconds`` holds the measured seconds per step by size (``size`` must be
    in it); an unmeasured size is charged ``b / size`` of the current step, a lower bound for
    the step of a smaller array (its fixed costs do not shrink), so the saving is never
    underestimated and compaction stays the choice wherever step time scales with the size.
    """
    current = step_seconds[size]
    best, best_gain = None, 0.0
    for b in sorted({busy, _next_power_of_two(busy)}):
        if b >= size:
            continue
        step = step_seconds.get(b, current * b / size)
        gain = remaining * (current - step) - rebuild_seconds(b)
        if gain > best_gain:
            best, best_gain = b, gain
    return best


def _next_power_of_two(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


class _StepTimer:
    """Seconds per training step of one array, over the stretches of steps between
    evaluations, with the time spent tracing and compiling left out. On CUDA the clock stops
    after a synchronize, so queued kernels count in the steps that launched them."""

    def __init__(self, device: torch.device, array: FusedArray, *compiled: Any) -> None:
        self._device = device
        self._array = array
        #: the compiled loss and optimizer update (or ``None``), whose compiling is left out too
        self._compiled = compiled
        self._seconds = 0.0
        self._steps = 0
        self._stretch = 0
        self._start = 0.0
        self._traced = 0.0
        #: what was traced and compiled before this array (the trainer's earlier arrays)
        self._initial = self._left_out()
        self.resume()

    def resume(self) -> None:
        """Start a stretch of training steps."""
        self._start = time.perf_counter()
        self._traced = self._left_out()
        self._stretch = 0

    def _left_out(self) -> float:
        """Seconds spent tracing and compiling so far (the array's, the compiled loss's and the
        compiled optimizer update's)."""
        return self._array._tracing_seconds + sum(
            float(getattr(c, "seconds", 0.0)) for c in self._compiled
        )

    def left_out(self) -> float:
        """Seconds spent tracing and compiling for this array so far."""
        return self._left_out() - self._initial

    def step(self) -> None:
        """One training step of the stretch is done."""
        self._stretch += 1

    def pause(self) -> float:
        """End the stretch; the mean seconds per step over every stretch so far."""
        if self._device.type == "cuda":
            torch.cuda.synchronize(self._device)
        traced = self._left_out() - self._traced
        self._seconds += max(time.perf_counter() - self._start - traced, 0.0)
        self._steps += self._stretch
        self._stretch = 0
        return self._seconds / max(self._steps, 1)


class _StepCounts:
    """The training steps of an array not yet added to its slots' counts (``pending``), and
    after how many the next slot is due for an evaluation or reaches its budget: every step
    adds one to ``pending`` and the slots are updated (a loop over the members) only then,
    or when a member failed, or the steps end."""

    def __init__(self, slots: Sequence[_SlotState | None], eval_every: int) -> None:
        self.pending = 0
        self._next = 0
        self.plan(slots, eval_every)

    def plan(self, slots: Sequence[_SlotState | None], eval_every: int) -> None:
        """Work out when the next slot is due (after the slots changed)."""
        self._next = min(
            (
                min(eval_every - s.steps % eval_every, max(s.budget - s.steps, 1))
                for s in slots
                if s is not None
            ),
            default=1,
        )

    def due(self) -> bool:
        """Whether a slot is due for an evaluation (or its last step) after the pending steps."""
        return self.pending >= self._next

    def flush(self, slots: Sequence[_SlotState | None], eval_every: int) -> list[int]:
        """Add the pending steps to every busy slot; return the slots due now."""
        steps, self.pending = self.pending, 0
        due: list[int] = []
        if steps:
            for i, s in enumerate(slots):
                if s is None:
                    continue
                s.steps += steps
                s.since += steps
                if s.steps % eval_every == 0 or s.steps >= s.budget:
                    due.append(i)
        self.plan(slots, eval_every)
        return due


def update(opt: FusedOptimizer, sched: FusedLRScheduler | None, *, stepped: bool = False) -> None:
    """The optimizer and schedule step that ends a training step (``stepped``: the optimizer
    has stepped already, on the device during the backward: only the schedule steps)."""
    if not stepped:
        opt.step()
    opt.zero_grad(set_to_none=True)
    if sched is not None:
        sched.step()


def add_losses(loss_sum: Tensor, losses: Tensor) -> None:
    """Add a step's ``[B]`` losses to the ``[B]`` float64 running sum, in one operator: the
    in-place add converts each loss to float64 exactly, as a separate ``.to(float64)`` would,
    without making that copy first (nor a ``detach``: under ``no_grad`` nothing is recorded)."""
    with torch.no_grad():
        loss_sum.add_(losses)


def _set_member_dropout(array: FusedArray, i: int, p: float) -> None:
    current = array.dropout
    if not current:
        raise TaskError(
            f"config dropout={p} was given but the model has no nn.Dropout layer to apply it to"
        )
    values = {path: [*ps[:i], p, *ps[i + 1 :]] for path, ps in current.items()}
    array.set_dropout(values)


def _batches(
    task_name: str, train: Iterable[Any], spe: int, data_seed: int, epoch: int, skip: int
) -> Iterator[tuple[int, int, Any]]:
    """``(epoch, index, batch)`` of the training data from batch ``skip`` of ``epoch`` on,
    forever; ``spe`` batches per epoch, each epoch in the order fixed by seeding torch's
    generator (and a DataLoader's own) with :func:`_epoch_seed` before it is drawn."""
    own = getattr(train, "generator", None)  # a DataLoader's own generator, if it has one
    while True:
        seed = _epoch_seed(data_seed, epoch)
        manual_seed(seed)
        if isinstance(own, torch.Generator):
            own.manual_seed(seed)
        index = 0
        for batch in train:
            if index >= skip:
                yield epoch, index, batch
            index += 1
            if index >= spe:
                break
        if index == 0:
            raise TaskError(f"task {task_name!r}: the training data yielded no batch")
        epoch, skip = epoch + 1, 0


def _epoch_seed(data_seed: int, epoch: int) -> int:
    """The seed of epoch ``epoch``'s data order (docs/reproducing.md)."""
    return (data_seed * 1_000_003 + epoch * 7919 + 1) % (2**63)
