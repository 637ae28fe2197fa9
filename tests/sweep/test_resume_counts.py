"""A resumed array names the trials it resumes: its members come from its checkpoint, not
from the engine's call (which passes none), so the log and the status line count them."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

import hfsweep as hs
from hfsweep.core._progress import Progress
from hfsweep.core.loop import _Engine

from ._toy import sweep_config


def test_a_resumed_array_counts_the_trials_it_resumes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = sweep_config(tmp_path / "run", budget={"trials": 4, "epochs": 3})
    report = _Engine._report
    reports = 0

    def interrupted_at_the_second_report(self: _Engine, evaluations: Any) -> Any:
        nonlocal reports
        reports += 1
        if reports == 2:  # the first epoch's checkpoint is written: Ctrl-C here
            raise KeyboardInterrupt
        return report(self, evaluations)

    monkeypatch.setattr(_Engine, "_report", interrupted_at_the_second_report)
    with pytest.raises(KeyboardInterrupt):
        hs.sweep(config, progress=False)
    monkeypatch.setattr(_Engine, "_report", report)
    shown: list[str] = []
    monkeypatch.setattr(Progress, "array_started", lambda self, text: shown.append(text))

    result = hs.sweep(config, resume=True, progress=False)

    assert result.counts["running"] == 0 and sum(result.counts.values()) == 4
    log = (tmp_path / "run" / "sweep.log").read_text()
    resumed = re.findall(r"array 0 \([^)]*\): resuming with (\d+) trials: (.*)", log)
    assert resumed == [("4", "trial-0, trial-1, trial-2, trial-3")]
    assert len(shown) == 1 and shown[0].startswith("array 0: 4 x ")
