"""What is training where: one member's trial as the trainer trains it (:class:`TrialSpec`), a
slot holding one with its progress (:class:`_SlotState`), and an array of slots at one position in
the shared data stream (:class:`ArrayState`)."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from .results import Member

__all__ = ["ArrayState", "TrialSpec", "key_difference"]


@dataclass(frozen=True)
class TrialSpec:
    """One member's trial as the trainer trains it, fixed when the member joins an array.

    ``member`` is the trial as given (id and config); ``config`` is that config completed with
    the task's defaults; ``budget`` is the optimizer steps it trains at most (``max_steps``, else
    ``epochs`` epochs); ``start`` is where in the array's training data its first step was, in
    steps since epoch 0's first batch (0 for a member that started the array, later for one
    that joined by refill; ``None`` when restored from a checkpoint that predates it). With the
    config's ``seed`` (initialisation and dropout stream) and ``data_seed`` (each epoch's data
    order) it fixes everything the member saw, so a trial can be retrained alone.
    """

    member: Member
    config: dict[str, Any]
    budget: int
    start: int | None = 0

    @classmethod
    def of(
        cls, member: Member, config: Mapping[str, Any], steps_per_epoch: int, start: int | None
    ) -> TrialSpec:
        """The spec of ``member`` with its completed ``config``, joining at ``start``."""
        budget = config["max_steps"] or config["epochs"] * steps_per_epoch
        return cls(member=member, config=dict(config), budget=int(budget), start=start)

    @property
    def id(self) -> str:
        """The member's id."""
        return self.member.id

    @property
    def seed(self) -> int:
        """The seed of the member's initialisation and dropout stream (config ``seed``)."""
        return int(self.config["seed"])

    @property
    def data_seed(self) -> int:
        """The seed of the data order, with the epoch (config ``data_seed``)."""
        return int(self.config["data_seed"])


@dataclass
class _SlotState:
    """A member in a slot of an array: its spec and how far it got."""

    spec: TrialSpec
    steps: int = 0
    history: list[dict[str, float]] = field(default_factory=list)
    since: int = 0  # training steps since the last evaluation
    loss_sum: float = 0.0  # their summed training loss, when restored from a checkpoint
    saved: dict[str, Any] | None = None  # model/optimizer/scheduler/rng to load

    @property
    def member(self) -> Member:
        return self.spec.member

    @property
    def config(self) -> dict[str, Any]:
        return self.spec.config

    @property
    def budget(self) -> int:
        return self.spec.budget


@dataclass
class ArrayState:
    """One array of a run: its slots (``None``: a free one) and the position of its shared data
    stream (``epoch``, ``batch``), as a run queues it and its checkpoint stores it."""

    slots: list[_SlotState | None]
    epoch: int = 0
    batch: int = 0


def key_difference(a: str, b: str) -> str:
    """The first keys in which two compatibility keys (JSON objects) differ, for messages."""
    da, db = json.loads(a), json.loads(b)
    keys = sorted(k for k in set(da) | set(db) if da.get(k) != db.get(k))
    return ", ".join(f"{k}={db.get(k)!r} (array: {da.get(k)!r})" for k in keys[:3])
