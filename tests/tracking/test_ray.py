"""Trackers with ``backend: ray``: the arrays train in Ray actors, the trackers stay on the
driver and hear every trial's start, evaluations and end once, as with the local backend."""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from optuna.trial import TrialState

import hfsweep as hs

from .conftest import small_sweep, trials
from .test_callbacks import Recorder

ray = pytest.importorskip("ray")

pytestmark = pytest.mark.slow  # runs with the other Ray tests: tests/conftest.py's RAY_TESTS


def test_trackers_hear_every_trial_of_a_ray_sweep(tmp_path: Path, shared_ray: Any) -> None:
    pytest.importorskip("mlflow", reason="the mlflow extra is not installed")
    from mlflow.tracking import MlflowClient

    shared_ray.start()
    run_dir = tmp_path / "run"
    recorder = Recorder()
    config = small_sweep(run_dir, backend="ray", ray={"max_concurrent": 2}, tracking=["mlflow"])
    result = hs.sweep(config, progress=False, callbacks=[recorder])
    study = trials(result)
    assert {t.state for t in study} == {TrialState.COMPLETE} and len(study) == 6
    for t in study:
        kinds = [e[0] for e in recorder.of(t.number)]
        assert kinds == ["start", "eval", "eval", "end"], (t.number, kinds)
    client = MlflowClient(tracking_uri=f"sqlite:///{run_dir / 'mlflow.db'}")
    experiment = client.get_experiment_by_name("sweep")
    assert experiment is not None
    runs = client.search_runs([experiment.experiment_id], max_results=100)
    assert Counter(r.data.tags["hfsweep.trial"] for r in runs) == {str(t.number): 1 for t in study}
    for r in runs:
        t = study[int(r.data.tags["hfsweep.trial"])]
        assert r.data.tags["hfsweep.array"] == str(t.user_attrs["array"])
        assert r.data.metrics["final_val_accuracy"] == t.value
        assert r.info.status == "FINISHED"
