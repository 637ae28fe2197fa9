"""What is training where: a slot's member and its progress (:class:`_SlotState`), and an array of
slots at one position in the shared data stream (:class:`_ArrayState`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .results import Member


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
