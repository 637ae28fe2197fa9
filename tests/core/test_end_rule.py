"""``hfsweep run`` ends its trials by the ledger's one rule, as the Tune plugin ends its members
(:meth:`hfsweep.core.ledger.Ledger.settle`): a trial that trained to its budget with a metric
that is not a finite number is failed in the ledger (``state.json``) as in the study."""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
from optuna.trial import TrialState
from sweep._toy import TASK, sweep_config
from torch import Tensor

import hfsweep as hs


def _nan_score(outputs: Tensor, target: Tensor) -> Tensor:
    """A metric of every member that is NaN: finite losses, a metric no scheduler can rank."""
    return torch.full((outputs.shape[0],), math.nan)


def test_a_completed_trial_with_a_nan_metric_fails_in_the_ledger_and_the_study(
    tmp_path: Path,
) -> None:
    task = hs.Task(
        name="nan_score",
        model=TASK.model,
        data=TASK.data,
        defaults=TASK.defaults,
        metrics={"score": _nan_score},
    )
    config = sweep_config(
        tmp_path / "run",
        task=task,
        metric="val_score",
        budget={"trials": 2, "epochs": 1},
        fusion={"size": 2, "device": "cpu"},
    )
    result = hs.sweep(config, progress=False)
    assert [t.state for t in result.study.get_trials()] == [TrialState.FAIL] * 2
    assert {t.user_attrs["error"] for t in result.study.get_trials()} == {"val_score is nan"}
    saved = json.loads((tmp_path / "run" / "state.json").read_text())
    assert saved["ended"] == {"trial-0": "failed", "trial-1": "failed"}
