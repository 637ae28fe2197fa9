"""The two narrow ports through which :class:`~hfsweep.core.sweep.Sweep` talks out: the
searcher it asks for member configs and tells of evaluations and ends, and the decider (a trial
scheduler made joint) that answers an array's fresh evaluations.

A door (``hfsweep run``, the Ray Tune plugin, a test) plugs its own searcher and scheduler in by
implementing these two protocols; everything else (pools, array sizes, the rule a report is
judged by, every end recorded once in the ledger, refill, requeue, saving) is the sweep's.

Results handed through the ports are member history rows as plain dicts: ``training_iteration``,
``step``, ``epoch``, the task's metrics and ``time_total_s`` (the member's own training time),
plus ``time_this_iter_s`` and ``done`` for a fresh evaluation. A port adds its own API's names
(Tune's ``trial_id``...) itself.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from typing import Any, Final, Protocol

from .members import MemberRecord
from .status import Status

__all__ = ["EXHAUSTED", "DeciderPort", "Exhausted", "SearcherPort"]


class Exhausted(enum.Enum):
    """A searcher's answer meaning "no config, ever again" (its one value is
    :data:`EXHAUSTED`; an enum so that it survives a pickle as itself)."""

    EXHAUSTED = "exhausted"


#: what :meth:`SearcherPort.ask` returns when the searcher will never give another config
EXHAUSTED: Final = Exhausted.EXHAUSTED


class SearcherPort(Protocol):
    """Where member configs come from, and who hears of evaluations and ends."""

    def ask(self, member_id: str) -> Mapping[str, Any] | Exhausted | None:
        """One member config asked under ``member_id``; ``None`` when the searcher has none
        now (it waits for results), :data:`EXHAUSTED` when it has none ever again."""
        ...

    def report(self, member: MemberRecord, result: Mapping[str, Any]) -> None:
        """``member``'s evaluation ``result`` (its metric a finite number), after every
        decision and end it led to is recorded in the ledger."""
        ...

    def tell(self, member: MemberRecord, status: Status, result: Mapping[str, Any] | None) -> None:
        """``member`` ended with ``status`` (final; recorded in the ledger and in ``member``
        already); ``result`` its last evaluation (``None`` for a failed member without one)."""
        ...


class DeciderPort(Protocol):
    """The trial scheduler, applied jointly to the members one report evaluated."""

    def decide(self, fresh: list[tuple[MemberRecord, dict[str, Any]]]) -> dict[str, bool]:
        """Member id -> go on, for the members of one report and their fresh evaluations
        (judged together, never first come, first served); a member not named goes on."""
        ...

    def at_budget(self, member: MemberRecord, result: Mapping[str, Any]) -> bool:
        """Whether ``member``, stopped after ``result``, reached the decider's own budget
        (ASHA's ``max_t``, a stop criterion it met): it ends ``COMPLETED``, not ``STOPPED``."""
        ...

    def end(self, member: MemberRecord, status: Status, result: Mapping[str, Any] | None) -> None:
        """``member`` ended with ``status`` (told to the scheduler before the searcher)."""
        ...
