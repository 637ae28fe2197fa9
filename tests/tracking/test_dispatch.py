"""The dispatcher alone: order, once-only starts, and a failing callback dropped after one
warning while the others keep receiving."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest

from hfsweep.tracking import Callback, SweepInfo, TrackingWarning, TrialInfo
from hfsweep.tracking._dispatch import Tracking


class Log(Callback):
    def __init__(self, fail_in: str = "") -> None:
        self.calls: list[str] = []
        self.fail_in = fail_in

    def _got(self, hook: str) -> None:
        self.calls.append(hook)
        if hook == self.fail_in:
            raise OSError("disk full")

    def on_sweep_start(self, sweep: SweepInfo) -> None:
        self._got("sweep_start")

    def on_trial_start(self, trial: TrialInfo) -> None:
        self._got(f"start {trial.number}")

    def on_evaluation(self, trial: TrialInfo, *args: Any) -> None:
        self._got(f"eval {trial.number}")

    def on_trial_end(self, trial: TrialInfo, *args: Any) -> None:
        self._got(f"end {trial.number}")

    def on_sweep_end(self) -> None:
        self._got("sweep_end")


def _run(tracking: Tracking) -> None:
    tracking.sweep_started(SweepInfo("s", Path("run"), "acc", "max"))
    tracking.trial_started(TrialInfo(0, 0))
    tracking.trial_started(TrialInfo(0, 0))  # a second announcement is not passed on
    tracking.evaluated(0, 5, 1.0, {"acc": 0.5, "note": "text is left out"})
    tracking.evaluated(7, 5, 1.0, {"acc": 0.5})  # never started here: nothing to send
    tracking.trial_ended(0, "completed", 0.5, None, info=lambda: TrialInfo(0, 0))
    # ended before it reached an array: started first, from info
    tracking.trial_ended(1, "failed", None, "bad config", info=lambda: TrialInfo(1, None))
    tracking.sweep_ended()


def test_events_arrive_in_order_once() -> None:
    log = Log()
    _run(Tracking([log]))
    assert log.calls == [
        "sweep_start",
        "start 0",
        "eval 0",
        "end 0",
        "start 1",
        "end 1",
        "sweep_end",
    ]


@pytest.mark.parametrize("hook", ["sweep_start", "start 0", "eval 0", "end 0", "end 1"])
def test_a_failing_callback_is_dropped_after_one_warning(hook: str) -> None:
    broken, after = Log(fail_in=hook), Log()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _run(Tracking([broken, after]))
    (warning,) = caught
    assert warning.category is TrackingWarning
    assert "tracker Log failed in on_" in str(warning.message)
    assert "OSError: disk full" in str(warning.message)
    # nothing after its failure, but its on_sweep_end, to let go of what it holds
    every = after.calls
    assert broken.calls == [*every[: every.index(hook) + 1], "sweep_end"]
    assert len(every) == 7  # the other callback got everything


def test_no_callbacks_keep_no_trials() -> None:
    tracking = Tracking([])
    assert not tracking
    tracking.trial_started(TrialInfo(0, 0))
    assert tracking.trials == {}
