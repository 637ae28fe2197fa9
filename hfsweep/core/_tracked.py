"""The sweep engine's part that serves its experiment trackers and callbacks
(:mod:`hfsweep.tracking`): the sweep's start and end, and what they are told of a trial. The
hooks call ``self.tracking`` where the engine learns of a trial's start (an array's members, a
refill), an evaluation (a decision saved) and an end (told to the study); see
:mod:`hfsweep.core._parts`.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from ..tracking import SweepInfo, TrialInfo
from ._parts import _Parts

__all__: list[str] = []


class _Tracked(_Parts):
    """The trackers' side of the engine."""

    @contextmanager
    def _tracked(self, *, resumed: bool) -> Iterator[None]:
        """The trackers told that the sweep starts, and at its end (an error's too) that it
        ends."""
        sc = self.sc
        self.tracking.sweep_started(
            SweepInfo(sc.study_name, self.dir.path, sc.metric, sc.mode, resumed)
        )
        try:
            yield
        finally:
            self.tracking.sweep_ended()

    def _trial_info(self, number: int, array: int | None = None) -> TrialInfo:
        """What the trackers are told of trial ``number`` (in ``array``, else the one its
        study records, if it is running)."""
        sampled = self.sampled.get(number) or {}
        if array is None and number in self.live:
            array = self.live[number].user_attrs.get("array")
        return TrialInfo(number, array, dict(sampled), self.sc.trial_config(sampled))
