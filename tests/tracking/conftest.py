"""A small real sweep the tracker tests run: the engine tests' toy task, 6 trials of 2 epochs
in arrays of up to 3, two compatibility keys (``hidden`` 4 or 8), so trials train in more than
one array and refill freed slots."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from optuna.trial import FrozenTrial
from sweep._toy import sweep_config

import hfsweep as hs


def small_sweep(output: Path, **overrides: Any) -> dict[str, Any]:
    """The sweep config (see the module docstring) into ``output``."""
    config = sweep_config(
        output,
        search_space={
            "lr": {"type": "float", "low": 1e-3, "high": 0.5, "log": True},
            "momentum": {"type": "float", "low": 0.0, "high": 0.9},
            "hidden": {"type": "categorical", "choices": [4, 8]},
        },
        budget={"trials": 6, "epochs": 2},
        fusion={"size": 3, "device": "cpu"},
    )
    config.update(overrides)
    return config


def trials(result: hs.SweepResult) -> list[FrozenTrial]:
    """The sweep's trials, by number."""
    return sorted(result.study.get_trials(deepcopy=False), key=lambda t: t.number)


@pytest.fixture
def quiet_wandb(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """wandb's own files (settings, cache) under the test's folder, never the user's home."""
    for name in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR"):
        monkeypatch.setenv(name, str(tmp_path / "wandb-home"))
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
