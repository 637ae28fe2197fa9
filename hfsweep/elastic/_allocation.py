"""What the elastic allocator decides over and what it returns: the records of
:mod:`hfsweep.elastic.allocator` (re-exported there, where they are documented as its API).

:class:`ArrayState` is a runnable array and :class:`WaitingPool` the trials waiting for a new
one, as the allocator sees them; :class:`Decision` is what happens to one of them and
:class:`Plan` one call's decisions, with the accounting and the status line they show. Kept
apart from the dynamic program and its rules (``allocator.py``) so that each module has one job.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Literal

from ..sizing.scaling import ScalingProfile

__all__ = ["Action", "ArrayState", "Decision", "Plan", "WaitingPool"]


Action = Literal["keep", "grow", "shrink", "start", "pause", "wait"]


@dataclass(frozen=True)
class ArrayState:
    """A runnable array as the allocator sees it.

    ``workers`` is what it trains on now (0: paused, or never started); ``remaining_s`` the
    seconds it still needs on one worker at its current size (its longest-lived member's
    remaining steps times one worker's step time); ``profile`` its scaling at its current size.
    ``since`` is when ``workers`` last changed (start, resize or pause) on the allocator's clock.
    ``horizon_s`` is the seconds on one worker until its members may next stop (the trial
    scheduler's next rung, such as ASHA's, or the budget), ``None`` where not known
    (``remaining_s`` then): a resize must pay for itself before it, since the array may end or
    shrink to a few members there.

    ``expected_s`` and ``expected_member_s`` are the end estimate that knows the pruner
    (:mod:`hfsweep.elastic.survival`, given where the trial scheduler's rungs and reduction factor
    are known; ``None``: not known): the one-worker seconds until the array's last member is
    expected to stop, and the one-worker member-seconds its members are expected to train in
    all. Given them, the allocator weighs the array by ``expected_member_s`` (instead of
    ``members * remaining_s``), a resize must pay for itself within ``expected_s`` (instead of
    before the horizon), and in the tail of a sweep the array expected to end last gets
    priority for freed workers (see the module docstring).

    ``pending`` says that ``workers`` is a resize an earlier plan asked for and the array has
    not made yet (it resizes at its next evaluation boundary, and a later request replaces a
    pending one: one pause, to the latest count). In the tail of a sweep (no trial waits or
    queues) such an array may be resized again within its cooldown, and no second pause is
    charged for it, so that workers freed one after another before it makes its resize go to
    it in one step instead of one each to several arrays that then cool.
    """

    name: str
    key: str
    members: int
    remaining_s: float
    profile: ScalingProfile
    workers: int = 0
    since: float = 0.0
    horizon_s: float | None = None
    expected_s: float | None = None
    expected_member_s: float | None = None
    pending: bool = False

    def __post_init__(self) -> None:
        if self.members < 1:
            raise ValueError(f"array {self.name!r}: members must be >= 1, got {self.members}")
        if not (self.remaining_s >= 0 and math.isfinite(self.remaining_s)):
            raise ValueError(
                f"array {self.name!r}: remaining_s must be >= 0, got {self.remaining_s}"
            )
        if self.workers < 0:
            raise ValueError(f"array {self.name!r}: workers must be >= 0, got {self.workers}")
        for name in ("horizon_s", "expected_s", "expected_member_s"):
            value = getattr(self, name)
            if value is not None and not (value >= 0 and math.isfinite(value)):
                raise ValueError(f"array {self.name!r}: {name} must be >= 0 or None, got {value}")

    @property
    def payback_s(self) -> float:
        """The one-worker seconds a resize has to pay for itself in: the array's expected
        remaining time where the pruner is known (``expected_s``), else up to its horizon, or
        its end if that comes first."""
        if self.expected_s is not None:
            return min(self.expected_s, self.remaining_s)
        if self.horizon_s is None:
            return self.remaining_s
        return min(self.horizon_s, self.remaining_s)

    @property
    def weight_s(self) -> float:
        """The member-seconds the objective weighs the array by: its members' expected
        one-worker seconds left where the pruner is known, else ``members * remaining_s``."""
        if self.expected_member_s is not None:
            return max(self.expected_member_s, 1e-9)
        return self.members * max(self.remaining_s, 1e-9)


@dataclass(frozen=True)
class WaitingPool:
    """Trials of one compatibility key waiting for an array: ``arrays`` new arrays of
    ``members`` trials each could start, each needing ``remaining_s`` seconds on one worker,
    scaling as ``profile``.

    ``name`` names the decisions about it (``hfsweep run`` passes an array that the engine has
    formed and that waits for its first workers, ``"array 3"``; without one they are named
    ``new:<key>#i`` and ``pool:<key>``); ``since`` is when its trials began to wait on the
    allocator's clock (``None``: not known), so that a pool that waited ``max_wait_s`` starts
    before any array grows. ``expected_member_s`` is one new array's members' expected
    one-worker seconds where the pruner is known (as :class:`ArrayState`'s; ``None``:
    ``members * remaining_s``), so that waiting trials and running arrays are weighed alike.
    """

    key: str
    arrays: int
    members: int
    remaining_s: float
    profile: ScalingProfile
    name: str | None = None
    since: float | None = None
    expected_member_s: float | None = None

    @property
    def weight_s(self) -> float:
        """The member-seconds one new array is weighed by (see :attr:`ArrayState.weight_s`)."""
        if self.expected_member_s is not None:
            return max(self.expected_member_s, 1e-9)
        return self.members * max(self.remaining_s, 1e-9)

    def overdue(self, now: float, max_wait_s: float) -> bool:
        """Whether its trials have waited ``max_wait_s`` or longer at ``now``."""
        return self.since is not None and now - self.since >= max_wait_s

    def label(self, i: int) -> str:
        """The name of the decision to start its ``i``-th new array."""
        if self.name is None:
            return f"new:{self.key}#{i}"
        return self.name if self.arrays == 1 else f"{self.name}#{i}"


@dataclass(frozen=True)
class Decision:
    """What happens to one array (or one pool of waiting trials): ``before`` -> ``after``
    workers, the ``action`` and why (``reason``, one sentence for the log)."""

    array: str
    key: str
    action: Action
    before: int
    after: int
    reason: str

    def __str__(self) -> str:
        return f"{self.array}: {self.action} {self.before}->{self.after} ({self.reason})"


@dataclass(frozen=True)
class Plan:
    """One decision of the allocator: every :class:`Decision`, the workers left idle, the event
    that triggered it and the clock time."""

    decisions: tuple[Decision, ...]
    total: int
    idle: int
    event: str
    now: float
    notes: tuple[str, ...] = field(default=())
    #: arrays this plan leaves without workers (paused, and new arrays of waiting trials)
    waiting: int = 0
    #: the allocator's accounting up to this plan, since its first: seconds summed over the
    #: arrays its plans left waiting, and over the workers they left idle (each plan's counts
    #: held until the next plan)
    waited_s: float = 0.0
    idle_s: float = 0.0

    def workers(self) -> dict[str, int]:
        """Array name -> workers after this plan (started arrays included, paused ones 0)."""
        return {d.array: d.after for d in self.decisions if d.action != "wait"}

    def apply(self, arrays: Sequence[ArrayState]) -> list[ArrayState]:
        """``arrays`` with this plan's workers, ``since`` set to the plan's time where the
        workers changed (new arrays are the caller's to create, from the ``start`` decisions
        named ``new:<key>#i``)."""
        after = self.workers()
        out = []
        for a in arrays:
            k = after.get(a.name, a.workers)
            out.append(a if k == a.workers else replace(a, workers=k, since=self.now))
        return out

    def waits(self) -> str:
        """``arrays waited 12 s, workers idle 30 s`` (the accounting up to this plan, summed
        over arrays and over workers), or ``""`` before anything waited or idled."""
        if not (self.waited_s or self.idle_s):
            return ""
        return f"arrays waited {self.waited_s:.0f} s, workers idle {self.idle_s:.0f} s"

    def changed(self) -> list[Decision]:
        """The decisions that change something (not ``keep``)."""
        return [d for d in self.decisions if d.action != "keep"]

    def status(self) -> str:
        """A short line for the progress display: ``elastic: 5 arrays on 60/64 workers (+2
        grown, 1 new, 1 paused, 1 waiting) [node left]`` (``waiting``: the pools, or the
        formed arrays, whose trials the plan leaves waiting)."""
        count = {a: sum(d.action == a for d in self.decisions) for a in ("grow", "shrink")}
        started = sum(d.action == "start" for d in self.decisions)
        paused = sum(d.action == "pause" for d in self.decisions)
        waiting = sum(d.action == "wait" for d in self.decisions)
        running = sum(1 for d in self.decisions if d.action != "wait" and d.after > 0)
        parts = [
            f"+{count['grow']} grown" if count["grow"] else "",
            f"-{count['shrink']} shrunk" if count["shrink"] else "",
            f"{started} new" if started else "",
            f"{paused} paused" if paused else "",
            f"{waiting} waiting" if waiting else "",
        ]
        detail = ", ".join(p for p in parts if p)
        return (
            f"elastic: {running} arrays on {self.total - self.idle}/{self.total} workers"
            + (f" ({detail})" if detail else "")
            + f" [{self.event}]"
        )


def earlier_totals(earlier: Mapping[str, Any]) -> tuple[float, float, int]:
    """``(arrays_waited_s, workers_idle_s, plans)`` of an earlier run's totals (its
    ``elastic.json``), checked: ``ValueError`` names a value that is not a count or a number
    of seconds >= 0."""
    values: dict[str, float] = {}
    for name in ("arrays_waited_s", "workers_idle_s", "plans"):
        value = earlier.get(name)
        if (
            isinstance(value, bool)
            or not isinstance(value, (int, float))
            or not (value >= 0 and math.isfinite(value))
            or (name == "plans" and not float(value).is_integer())
        ):
            valid = "an integer >= 0" if name == "plans" else "a finite number >= 0"
            raise ValueError(f"{name} is {value!r}, not {valid}")
        values[name] = float(value)
    return values["arrays_waited_s"], values["workers_idle_s"], int(values["plans"])
