"""Fixtures the sweep tests share."""

from __future__ import annotations

from collections import Counter
from typing import Any

import optuna
import pytest


@pytest.fixture
def told(monkeypatch: pytest.MonkeyPatch) -> Counter[int]:
    """How many times each trial of the sweep's study was told (in this process)."""
    counts: Counter[int] = Counter()
    real_tell = optuna.Study.tell

    def counting_tell(self: optuna.Study, trial: Any, *args: Any, **kwargs: Any) -> Any:
        if self.study_name == "sweep":
            counts[trial if isinstance(trial, int) else trial.number] += 1
        return real_tell(self, trial, *args, **kwargs)

    monkeypatch.setattr(optuna.Study, "tell", counting_tell)
    return counts
