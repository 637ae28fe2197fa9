"""What the trainer does with ``offload="auto"``: each array it is about to build is kept on the
device, offloaded, or split into arrays that fit (:func:`offload_plan`, :func:`split_for_offload`).

Where there is no memory budget (the CPU without ``device_memory``), or not even one member's
estimated state fits it, the rule is memory alone (:func:`~hfsweep.offload.choose_offload`).
Otherwise what fits is measured, activations included, and where B' < B members fit the choice
is by measured member-samples/s: both are the profiler's job
(:func:`hfsweep.sizing.offloading.profile_offload`). The
profiler imports the trainer (it times the trainer's step), so the trainer cannot import it: the
profiler hands its function over with :func:`use_offload_profiler` when it is imported, which
``import hfsweep`` does. Choices are kept per trainer by compatibility key and size, so an array
is measured once per run; the profile cache keeps them across runs (a resume reads them back).
"""

from __future__ import annotations

import itertools
import logging
import math
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any, Protocol

import torch

from ..offload import (
    OffloadChoice,
    choose_offload,
    fit_size,
    frozen_bytes,
    offload_budget,
    state_bytes,
)
from .spec import ArrayState, _SlotState
from .task import Task, fork_rng

if TYPE_CHECKING:
    from .base import TrainerBase

__all__ = [
    "OffloadProfiler",
    "offload_mode",
    "offload_plan",
    "split_for_offload",
    "use_offload_profiler",
]

_log = logging.getLogger("hfsweep.trainer")


class OffloadProfiler(Protocol):
    """:func:`hfsweep.sizing.offloading.profile_offload`'s signature, as the trainer calls it."""

    def __call__(
        self,
        task: Task,
        config: Mapping[str, Any] | None,
        size: int,
        *,
        device_memory: int,
        device: str | torch.device = ...,
        dtype: torch.dtype = ...,
        data: tuple[Iterable[Any], Iterable[Any]] | None = ...,
        share_frozen: bool = ...,
        offload_step: str = ...,
    ) -> OffloadChoice: ...


#: the profiler's :func:`profile_offload`, once it is imported (see the module's docstring)
_PROFILER: list[OffloadProfiler] = []


def use_offload_profiler(profiler: OffloadProfiler) -> None:
    """Have ``offload="auto"`` measure with ``profiler`` (the profiler's ``profile_offload``
    registers itself; tests may put another in its place)."""
    _PROFILER[:] = [profiler]


def offload_plan(t: TrainerBase, key: str, config: Mapping[str, Any], size: int) -> OffloadChoice:
    """How ``t`` (``offload="auto"``) trains an array of ``size`` members of ``config`` (of the
    compatibility key ``key``): ``"none"``, ``"host"`` or ``"split"`` (see
    :class:`~hfsweep.offload.OffloadChoice`); logged once per trainer, key and size."""
    plans: dict[tuple[str, int], OffloadChoice] = t._offload_plans
    known = plans.get((key, size))
    if known is not None:
        return known
    resolved = t.task.resolve(config)
    with fork_rng():  # the members' own initialisations stay as they would be
        model = t.task.build_model(resolved).to(t.dtype)
    # with share_frozen, the frozen tensors count once for the array
    member = max(state_bytes(model, share_frozen=t.share_frozen), 1)
    shared = frozen_bytes(model) if t.share_frozen else 0
    budget = offload_budget(t.device, t.device_memory)
    if budget is None or fit_size(member, budget, shared) == 0:
        mode, why = choose_offload(
            "auto", state=shared + size * member, device=t.device, device_memory=t.device_memory
        )
        choice = (
            OffloadChoice(size, size, budget, "none", why)
            if mode == "none"
            else OffloadChoice(
                size, 0, budget, "host", f"{why}; not even one member fits: nothing to measure"
            )
        )
    elif not _PROFILER:
        raise RuntimeError(
            "offload='auto' needs the profiler to compare offloading with splitting "
            "(import hfsweep, which registers it)"
        )
    else:
        choice = _PROFILER[0](
            t.task,
            resolved,
            size,
            device_memory=budget,
            device=t.device,
            dtype=t.dtype,
            data=t._dataset(resolved),
            share_frozen=t.share_frozen,
            offload_step=t.offload_step,  # measured offloaded as the array would step
        )
    _log.info("%s", choice.reason)
    plans[(key, size)] = choice
    return choice


def split_for_offload(t: TrainerBase, key: str, state: ArrayState) -> list[ArrayState] | None:
    """The arrays ``state``'s members train as instead, where ``offload="auto"`` chose to split
    it (at the same data position, each member with its slot as it is); ``None`` to train it as
    it is (offloaded or not: :func:`offload_mode` says)."""
    if t.offload != "auto":
        return None
    busy = [s for s in state.slots if s is not None]
    if not busy:
        return None
    choice = offload_plan(t, key, busy[0].config, len(state.slots))
    if choice.mode != "split":
        return None
    n = math.ceil(len(busy) / choice.fit_size)
    q, r = divmod(len(busy), n)  # n runs of consecutive members, as even as can be
    bounds = [i * q + min(i, r) for i in range(n + 1)]
    parts: list[list[_SlotState | None]] = [list(busy[a:b]) for a, b in itertools.pairwise(bounds)]
    for n in {len(part) for part in parts}:  # at most B', measured to fit: nothing to ask again
        t._offload_plans.setdefault(
            (key, n),
            OffloadChoice(
                n, n, choice.budget_bytes, "none",
                f"offload: auto keeps the array of {n} on the device: at most B'="
                f"{choice.fit_size} members fit",
            ),
        )  # fmt: skip
    _log.info(
        "offload: auto trains the %d members as arrays of %s, one after another",
        len(busy),
        ", ".join(str(len(part)) for part in parts),
    )
    return [ArrayState(part, state.epoch, state.batch) for part in parts]


def offload_mode(t: TrainerBase, key: str, config: Mapping[str, Any], size: int) -> str:
    """``"none"`` or ``"host"``: whether ``t`` offloads an array of ``size`` members of
    ``config`` (an array ``auto`` split is not built: :func:`split_for_offload`)."""
    if t.offload != "auto":
        return str(t.offload)
    return "host" if offload_plan(t, key, config, size).mode == "host" else "none"
