"""The scheduler that stops nothing."""

from __future__ import annotations

from collections.abc import Sequence

from ._base import Decision, Report, TrialScheduler

__all__ = ["FIFOScheduler"]


class FIFOScheduler(TrialScheduler):
    """Every trial trains to its budget: :meth:`decide` always answers ``CONTINUE``.

    It still checks the reports (one per trial per call, none after a trial ended), so an
    engine is held to the same contract whichever scheduler it runs.
    """

    def decide(self, reports: Sequence[Report]) -> dict[str, Decision]:
        """``CONTINUE`` for every reported trial."""
        return {r.trial: Decision.CONTINUE for r in self._check_reports(reports)}
