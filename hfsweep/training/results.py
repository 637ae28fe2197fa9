"""What the trainer trains and gives back: a member to train (:class:`Member`), one of its
evaluations (:class:`Evaluation`), its result (:class:`MemberResult`), and the hooks through which
a caller stops members (:data:`ReportHook`) and fills freed slots (:data:`RefillHook`)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

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
