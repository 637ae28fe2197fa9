"""The members of an array: what a trial to train is (:class:`Member`), what it reports
(:class:`Evaluation`) and yields (:class:`MemberResult`), a slot's training state, and how these
are written to the trainer's checkpoints and read back (plain data only: see ``_packed``)."""

from __future__ import annotations

import base64
import pickle
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import quote

from torch import Tensor

from ._io import atomic_save, read_lines
from ._packed import UnsafeFileError
from ._packed import load as load_packed
from ._packed import loads as loads_plain

if TYPE_CHECKING:
    from .fusion import FusedArray
    from .optim import FusedOptimizer
    from .optim.lr_scheduler import FusedLRScheduler

__all__ = ["Evaluation", "Member", "MemberResult", "RefillHook", "ReportHook"]


@dataclass(frozen=True)
class Member:
    """A trial to train: a unique ``id`` and its config (completed with the task's defaults)."""

    id: str
    config: Mapping[str, Any]


@dataclass(frozen=True)
class Evaluation:
    """One member's metrics at one evaluation, as the report hook receives them."""

    member: str
    step: int
    epoch: float
    metrics: dict[str, float]
    final: bool  #: the member has reached its budget with this evaluation


@dataclass
class MemberResult:
    """What a member's training produced.

    ``status`` is ``"completed"`` (budget reached), ``"stopped"`` (the report hook stopped it) or
    ``"failed"`` (its loss or gradients went non-finite). ``state`` holds ``model`` (a
    ``state_dict`` that loads into the task's model class), ``optimizer`` and ``scheduler``
    (``state_dict``\\ s in torch's formats). ``on_finish`` gets it (with
    ``ArrayTrainer(final_states=...)`` only for the members it names); with
    ``ArrayTrainer(keep_states=False)`` it is dropped after that, so a long run does not hold
    every finished member's weights in memory.
    """

    id: str
    config: dict[str, Any]
    status: str
    steps: int
    history: list[dict[str, float]]
    state: dict[str, Any] | None = None
    error: str | None = None
    #: where in the array's training data the member's first step was: steps since epoch 0's
    #: first batch (``epoch * steps_per_epoch + batch``; 0 for a member that started the array,
    #: later for one that joined by refill; ``None`` in results saved before it was recorded).
    #: With the seeds in its config it fixes the data the member saw (docs/reproducing.md)
    start_step: int | None = 0

    @property
    def metrics(self) -> dict[str, float]:
        """The member's last evaluation (empty if it was never evaluated)."""
        return dict(self.history[-1]) if self.history else {}


#: ``report(evaluations) -> {member id: go on?}``; members left out of the answer go on
ReportHook = Callable[[list[Evaluation]], Mapping[str, bool] | None]
#: ``refill() -> Member | None``: a new compatible trial for a freed slot, or None
RefillHook = Callable[[], Member | None]


@dataclass
class _SlotState:
    member: Member
    config: dict[str, Any]
    budget: int
    steps: int = 0
    history: list[dict[str, float]] = field(default_factory=list)
    since: int = 0  # training steps since the last evaluation
    loss_sum: float = 0.0  # their summed training loss, when restored from a checkpoint
    saved: dict[str, Any] | None = None  # model/optimizer/scheduler/rng to load
    start: int | None = 0  # MemberResult.start_step


@dataclass
class _ArrayState:
    slots: list[_SlotState | None]
    epoch: int = 0
    batch: int = 0


def _member_state(
    array: FusedArray, opt: FusedOptimizer, sched: FusedLRScheduler | None, i: int
) -> dict[str, Any]:
    model = dict(array.member_state_dict(i, device="cpu"))
    optimizer = _to_cpu(opt.member_state_dict(i))
    scheduler = sched.member_state_dict(i) if sched is not None else None
    return {
        "model": model,
        "optimizer": optimizer,
        "scheduler": scheduler,
        "rng": array.rng_state(i),
    }


def _to_cpu(obj: Any) -> Any:
    if isinstance(obj, Tensor):
        return obj.detach().cpu()
    if isinstance(obj, dict):
        return {k: _to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return type(obj)(_to_cpu(v) for v in obj)
    return obj


def _slot_dict(s: _SlotState | None) -> dict[str, Any] | None:
    if s is None:
        return None
    return {
        "id": s.member.id,
        "config": dict(s.member.config),
        "resolved": s.config,
        "budget": s.budget,
        "steps": s.steps,
        "history": s.history,
        "since": s.since,
        "loss_sum": s.loss_sum,
        "saved": s.saved,
        "start": s.start,
    }


def _slot_from_dict(d: dict[str, Any] | None) -> _SlotState | None:
    if d is None:
        return None
    return _SlotState(
        member=Member(d["id"], d["config"]),
        config=d["resolved"],
        budget=d["budget"],
        steps=d["steps"],
        history=d["history"],
        since=d["since"],
        loss_sum=d["loss_sum"],
        saved=d["saved"],
        start=d.get("start"),  # None: a checkpoint written before it was recorded
    )


#: ``ArrayTrainer(final_states=)``: whose final state a result carries
_FINAL_STATES = ("all", "completed", "none")
#: one line per member whose on_finish was called: its result without the state
_DELIVERED = "delivered.log"


def _result_record(result: MemberResult) -> dict[str, Any]:
    """``result`` without its state."""
    return {
        "id": result.id,
        "config": result.config,
        "status": result.status,
        "steps": result.steps,
        "history": result.history,
        "error": result.error,
        "start_step": result.start_step,
    }


def _result_from_record(record: Mapping[str, Any], state: dict[str, Any] | None) -> MemberResult:
    return MemberResult(
        record["id"],
        record["config"],
        record["status"],
        record["steps"],
        record["history"],
        state,
        record["error"],
        record.get("start_step"),
    )


def _encode_record(record: dict[str, Any]) -> str:
    """One line: the record pickled (configs may hold any Python value), in base64."""
    return base64.b64encode(pickle.dumps(record, protocol=pickle.HIGHEST_PROTOCOL)).decode()


def _read_delivered(path: Path) -> list[dict[str, Any]]:
    """The records of the delivered log; a line a crash cut short is skipped (its member was
    not recorded as delivered, so it is delivered again)."""
    records = []
    for line in read_lines(path):
        try:
            record = loads_plain(base64.b64decode(line, validate=True), path)
        except UnsafeFileError:
            raise
        except Exception:  # a cut line fails in one of several ways
            continue
        if isinstance(record, dict) and "id" in record:
            records.append(record)
    return records


def _write_member(directory: Path, result: MemberResult, state: dict[str, Any]) -> None:
    """The final state of a member that ended, for a resume to give back (``keep_states``)."""
    atomic_save(dict(state), directory / "members" / f"{_safe(result.id)}.pt")


def _read_member_state(directory: Path, member_id: str) -> dict[str, Any] | None:
    """The saved final state of a member, ``None`` if it ended without one (``final_states``)."""
    path = directory / "members" / f"{_safe(member_id)}.pt"
    if not path.exists():
        return None
    return dict(load_packed(path))


def _safe(member_id: str) -> str:
    """A file name for ``member_id``, one-to-one (percent-encoding)."""
    return quote(member_id, safe="-_.") or "%"
