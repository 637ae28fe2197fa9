"""What the sweep engine calls: :class:`Tracking` hands each event to every callback, once, and
keeps a callback that fails from stopping the sweep."""

from __future__ import annotations

import logging
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from ._base import Callback, SweepInfo, TrialInfo

__all__ = ["Tracking", "TrackingWarning"]

_log = logging.getLogger("hfsweep.tracking")


class TrackingWarning(UserWarning):
    """A tracker or callback failed; the sweep goes on without it."""


class Tracking:
    """The sweep's callbacks (its ``tracking:`` trackers and the Python API's ``callbacks``),
    called by the engine on the driver.

    Every call goes to each callback in turn. One that raises gets one
    :class:`TrackingWarning` (and a line in ``sweep.log`` with the traceback) and is skipped for
    the rest of the run, so a tracking server that has gone costs its timeout once, not at
    every evaluation; the sweep and the other callbacks go on. A trial's
    :meth:`Callback.on_trial_start` comes before its other events, also for a trial that ended
    before it reached an array, and at most once per run.
    """

    def __init__(self, callbacks: Sequence[Callback]) -> None:
        self.callbacks = list(callbacks)
        self.failed: set[int] = set()  # indices of the callbacks that raised
        self.trials: dict[int, TrialInfo] = {}  # started, not ended

    def __bool__(self) -> bool:
        return bool(self.callbacks)

    def sweep_started(self, sweep: SweepInfo) -> None:
        """The sweep ``sweep`` starts: every tracker and callback hears it first."""
        self._each("on_sweep_start", lambda c: c.on_sweep_start(sweep))

    def trial_started(self, trial: TrialInfo) -> None:
        """``trial`` starts in its array; a trial already started in this run is not
        announced again."""
        if trial.number in self.trials or not self.callbacks:
            return
        self.trials[trial.number] = trial
        self._each("on_trial_start", lambda c: c.on_trial_start(trial))

    def evaluated(self, number: int, step: int, epoch: float, metrics: Mapping[str, Any]) -> None:
        """Trial ``number`` (started) was evaluated."""
        trial = self.trials.get(number)
        if trial is None or not self.callbacks:
            return
        values = {k: float(v) for k, v in metrics.items() if _is_number(v)}
        self._each("on_evaluation", lambda c: c.on_evaluation(trial, step, epoch, values))

    def trial_ended(
        self,
        number: int,
        status: str,
        value: float | None,
        error: str | None,
        *,
        info: Callable[[], TrialInfo],
    ) -> None:
        """Trial ``number`` ended; ``info`` describes it if it had not started in this run."""
        if not self.callbacks:
            return
        if number not in self.trials:
            self.trial_started(info())
        trial = self.trials.pop(number)
        self._each("on_trial_end", lambda c: c.on_trial_end(trial, status, value, error))

    def sweep_ended(self) -> None:
        """The sweep ends: every callback's :meth:`Callback.on_sweep_end`, a failed one's
        too (quietly), so that it lets go of files and processes."""
        self._each("on_sweep_end", lambda c: c.on_sweep_end(), also_failed=True)
        self.trials.clear()

    def _each(
        self, hook: str, call: Callable[[Callback], None], *, also_failed: bool = False
    ) -> None:
        for i, callback in enumerate(self.callbacks):
            failed = i in self.failed
            if failed and not also_failed:
                continue
            try:
                call(callback)
            except Exception as exc:
                if failed:
                    _log.debug("%s failed again in %s", callback.label(), hook, exc_info=True)
                    continue
                self.failed.add(i)
                message = (
                    f"tracker {callback.label()} failed in {hook}: {type(exc).__name__}: "
                    f"{exc}; it receives nothing more in this run, and the sweep goes on"
                )
                _log.warning("%s", message, exc_info=exc)
                warnings.warn(message, TrackingWarning, stacklevel=2)


def _is_number(value: object) -> bool:
    try:
        float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return False
    return not isinstance(value, str)
