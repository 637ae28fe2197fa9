"""One evaluation of the members due in an array, as pure steps apart from the run that calls
them (:mod:`.run`): the validation metrics summed over the validation data, each due member's
history record and :class:`~hfsweep.training.results.Evaluation`, and which members the results
and the report hook's decisions end.

Kept out of ``run`` so that a run holds the order of things (train, evaluate, report, finish,
refill, checkpoint) and this module what an evaluation computes; a data-parallel run
(:mod:`hfsweep.parallel._run`) sums its shards with the same :func:`add_metrics`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
from torch import Tensor

from .._usercode import Phase
from .results import Evaluation
from .spec import ArrayState
from .task import Task


def add_metrics(sums: dict[str, Tensor], values: Mapping[str, Tensor], rows: int) -> None:
    """Add one batch's ``[B]`` metric means, weighted by its ``rows``, to ``sums`` (float64, by
    metric name), so that the sums over all batches divided by all rows are the sample means."""
    for name, value in values.items():
        add = value.detach().to(torch.float64) * rows
        sums[name] = sums[name] + add if name in sums else add


def validation_sums(
    task: Task,
    val: Iterable[Any],
    to_device: Callable[[Any], tuple[Any, Any]],
    forward: Callable[[Any], Any],
) -> tuple[dict[str, Tensor], int]:
    """Each of ``task``'s validation metrics summed over the samples of ``val`` (``[B]`` float64
    per name; a batch's mean weighted by its rows), and the number of samples. ``to_device``
    moves a batch to the array's device as ``(x, y)``; ``forward`` is the array's forward."""
    sums: dict[str, Tensor] = {}
    count = 0
    for batch in val:
        x, y = to_device(batch)
        with Phase("the forward pass (evaluation)"):
            out = forward(x)
        with Phase("the validation loss and metrics"):
            n = int(y.shape[0]) if isinstance(y, Tensor) and y.dim() else 1
            add_metrics(sums, task.member_metrics(out, y), n)
        count += n
    return sums, count


def record_evaluations(
    state: ArrayState,
    due: list[int],
    steps_per_epoch: int,
    sums: Mapping[str, Tensor],
    count: int,
    loss_sum: Tensor,
) -> list[Evaluation]:
    """The evaluations of the members in slots ``due`` of ``state``: each one's record (step,
    epoch, mean training loss since its last evaluation, the validation means ``sums / count``)
    appended to its history, and its training-loss sum ``loss_sum[i]`` started again."""
    host = {name: (v / count).tolist() for name, v in sums.items()}
    train_loss = loss_sum.tolist()
    evaluations: list[Evaluation] = []
    for i in due:
        s = state.slots[i]
        assert s is not None
        epoch = s.steps / steps_per_epoch
        record = {
            "step": float(s.steps),
            "epoch": epoch,
            "train_loss": train_loss[i] / max(s.since, 1),
        }
        record.update({name: values[i] for name, values in host.items()})
        s.history.append(record)
        s.since = 0
        loss_sum[i] = 0.0
        metrics = {k: v for k, v in record.items() if k not in ("step", "epoch")}
        evaluations.append(Evaluation(s.member.id, s.steps, epoch, metrics, s.steps >= s.budget))
    return evaluations


def endings(
    due: list[int], evaluations: list[Evaluation], decisions: Mapping[str, bool]
) -> list[tuple[int, str, str | None]]:
    """``(slot, status, error)`` of each evaluated member that ends now: ``failed`` on a
    non-finite loss, ``completed`` at its budget, ``stopped`` where the report hook's
    ``decisions`` say ``False``. A decision for a member not evaluated now is refused."""
    unknown = sorted(set(decisions) - {e.member for e in evaluations})
    if unknown:
        raise ValueError(
            f"report hook answered for member {unknown[0]!r}, which was not evaluated "
            f"now; evaluated: {[e.member for e in evaluations]}"
        )
    ends: list[tuple[int, str, str | None]] = []
    for i, e in zip(due, evaluations, strict=True):
        if not all(math.isfinite(v) for v in (e.metrics["train_loss"], e.metrics["val_loss"])):
            ends.append((i, "failed", "non-finite loss"))
        elif e.final:
            ends.append((i, "completed", None))
        elif not decisions.get(e.member, True):
            ends.append((i, "stopped", None))
    return ends
