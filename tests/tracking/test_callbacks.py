"""Callbacks on a small real sweep: every trial's events arrive once and in order, a callback or
tracker that fails is dropped with one warning while the sweep and the others go on, and a
resumed sweep neither repeats events nor opens a second run for a trial."""

from __future__ import annotations

import os
import warnings
from collections import Counter, defaultdict
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest
from optuna.trial import TrialState

import hfsweep as hs
from hfsweep.core.status import Status
from hfsweep.tracking import SweepInfo, TrackingWarning, TrialInfo

from .conftest import small_sweep, trials

pytestmark = pytest.mark.slow


class Recorder(hs.Callback):
    """Every event, in order."""

    def __init__(self) -> None:
        self.events: list[tuple[Any, ...]] = []

    def on_sweep_start(self, sweep: SweepInfo) -> None:
        self.events.append(("sweep_start", sweep.study_name, sweep.resumed))

    def on_trial_start(self, trial: TrialInfo) -> None:
        self.events.append(("start", trial.number, trial.array, dict(trial.params)))

    def on_evaluation(
        self, trial: TrialInfo, step: int, epoch: float, metrics: Mapping[str, float]
    ) -> None:
        self.events.append(("eval", trial.number, step, epoch, metrics["val_accuracy"]))

    def on_trial_end(
        self, trial: TrialInfo, status: str, value: float | None, error: str | None
    ) -> None:
        self.events.append(("end", trial.number, status, value, error))

    def on_sweep_end(self) -> None:
        self.events.append(("sweep_end",))

    def of(self, number: int) -> list[tuple[Any, ...]]:
        return [e for e in self.events if len(e) > 1 and e[0] != "sweep_start" and e[1] == number]


class Broken(hs.Callback):
    """Raises at every evaluation; counts the calls it gets."""

    name = "broken"

    def __init__(self) -> None:
        self.calls = 0

    def on_evaluation(self, *args: Any) -> None:
        self.calls += 1
        raise RuntimeError("the tracking server has gone")


def _tracking_warnings(caught: list[warnings.WarningMessage]) -> list[str]:
    return [str(w.message) for w in caught if issubclass(w.category, TrackingWarning)]


def test_every_trial_starts_reports_and_ends_once(tmp_path: Path) -> None:
    recorder = Recorder()
    config = small_sweep(
        tmp_path / "run",
        scheduler={"name": "asha", "options": {"grace_period": 1, "reduction_factor": 2}},
    )
    result = hs.sweep(config, progress=False, callbacks=[recorder])
    assert recorder.events[0] == ("sweep_start", "sweep", False)
    assert recorder.events[-1] == ("sweep_end",)
    study = trials(result)
    assert {t.state for t in study} == {TrialState.COMPLETE, TrialState.PRUNED}  # ASHA stopped some
    for t in study:
        events = recorder.of(t.number)
        kinds = [e[0] for e in events]
        assert kinds[0] == "start" and kinds[-1] == "end" and set(kinds[1:-1]) == {"eval"}
        _, _, array, params = events[0]
        assert array == t.user_attrs["array"] and params == t.params
        evals = events[1:-1]
        # one evaluation per epoch trained, with the value the study holds at that epoch
        assert {int(e[3]): e[4] for e in evals} == t.intermediate_values
        _, _, status, value, error = events[-1]
        assert isinstance(status, Status) and status == Status(t.user_attrs["status"])
        assert status is Status.of_trial_state(t.state)
        assert value == evals[-1][4] and error is None
        if t.state == TrialState.COMPLETE:
            assert value == t.value


def test_a_failing_callback_warns_once_and_the_sweep_goes_on(tmp_path: Path) -> None:
    broken, recorder = Broken(), Recorder()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = hs.sweep(
            small_sweep(tmp_path / "run"), progress=False, callbacks=[broken, recorder]
        )
    assert result.counts["completed"] == 6
    (message,) = _tracking_warnings(caught)
    assert "broken failed in on_evaluation: RuntimeError: the tracking server has gone" in message
    assert broken.calls == 1  # dropped after its first failure
    # the callback after it received everything
    assert sum(e[0] == "eval" for e in recorder.events) == 12
    assert sum(e[0] == "end" for e in recorder.events) == 6
    assert "the tracking server has gone" in (tmp_path / "run" / "sweep.log").read_text()


def test_a_tracking_server_that_is_gone_costs_one_warning(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("mlflow", reason="the mlflow extra is not installed")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "5")
    recorder = Recorder()
    # nothing listens on the discard port of the loopback: every request is refused
    config = small_sweep(
        tmp_path / "run", tracking=[{"mlflow": {"tracking_uri": "http://127.0.0.1:9"}}]
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = hs.sweep(config, progress=False, callbacks=[recorder])
    assert result.counts["completed"] == 6
    (message,) = _tracking_warnings(caught)
    assert message.startswith("tracker mlflow failed in on_sweep_start")
    assert sum(e[0] == "end" for e in recorder.events) == 6


class Interrupt(hs.Callback):
    """Stops the sweep as Ctrl-C would, at its ``after``-th evaluation."""

    def __init__(self, after: int) -> None:
        self.left = after

    def on_evaluation(self, *args: Any) -> None:
        self.left -= 1
        if self.left == 0:
            raise KeyboardInterrupt


def test_a_resumed_sweep_repeats_no_event_and_no_run(tmp_path: Path, quiet_wandb: None) -> None:
    pytest.importorskip("mlflow", reason="the mlflow extra is not installed")
    pytest.importorskip("tensorboard", reason="the tensorboard extra is not installed")
    pytest.importorskip("wandb", reason="the wandb extra is not installed")
    from mlflow.tracking import MlflowClient
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run_dir = tmp_path / "run"
    config = small_sweep(run_dir, tracking=["mlflow", "tensorboard", "wandb"])
    first = Recorder()
    with pytest.raises(KeyboardInterrupt):
        hs.sweep(config, progress=False, callbacks=[first, Interrupt(after=7)])
    ended_first = {e[1] for e in first.events if e[0] == "end"}
    started_first = {e[1] for e in first.events if e[0] == "start"}
    assert first.events[-1] == ("sweep_end",)
    assert ended_first and started_first - ended_first  # some ended, some were training
    second = Recorder()
    result = hs.sweep(config, progress=False, resume=True, callbacks=[second])
    assert second.events[0] == ("sweep_start", "sweep", True)
    study = trials(result)
    assert {t.state for t in study} == {TrialState.COMPLETE}
    # trials that ended before the interruption are not announced again
    assert not ended_first & {e[1] for e in second.events if len(e) > 1 and e[0] != "sweep_start"}
    for t in study:
        evals = [e for e in first.of(t.number) + second.of(t.number) if e[0] == "eval"]
        ends = [e for e in first.of(t.number) + second.of(t.number) if e[0] == "end"]
        assert sorted(int(e[3]) for e in evals) == [1, 2], t.number  # each evaluation once
        assert len(ends) == 1
    # MLflow: one run per trial, the interrupted trials' runs reopened and finished
    client = MlflowClient(tracking_uri=f"sqlite:///{run_dir / 'mlflow.db'}")
    experiment = client.get_experiment_by_name("sweep")
    assert experiment is not None
    runs = client.search_runs([experiment.experiment_id], max_results=100)
    assert Counter(r.data.tags["hfsweep.trial"] for r in runs) == {str(t.number): 1 for t in study}
    assert {r.info.status for r in runs} == {"FINISHED"}
    for r in runs:
        history = client.get_metric_history(r.info.run_id, "epoch")
        assert sorted(m.value for m in history) == [1.0, 2.0]
    # TensorBoard: a resumed trial's second event file in the same log dir, no step twice
    steps: dict[int, list[int]] = defaultdict(list)
    for t in study:
        events = EventAccumulator(str(run_dir / "tensorboard" / f"trial-{t.number}"))
        events.Reload()
        steps[t.number] = [e.step for e in events.Scalars("val_accuracy")]
        assert len(set(steps[t.number])) == 2, (t.number, steps[t.number])
    resumed = started_first - ended_first
    assert any(len(os.listdir(run_dir / "tensorboard" / f"trial-{n}")) == 2 for n in resumed)
    # W&B offline: a resumed trial's run continues under the same id in a second folder
    # (`wandb sync` uploads both into one run); together they hold each evaluation once
    from ._wandb_log import read_run

    by_trial: dict[int, list[dict[str, Any]]] = defaultdict(list)
    for folder in sorted((run_dir / "wandb").glob("offline-run-*")):
        run = read_run(folder)
        by_trial[run["config"]["hfsweep.trial"]].append(run)
    assert sorted(by_trial) == [t.number for t in study]
    for number, parts in by_trial.items():
        assert len({p["id"] for p in parts}) == 1
        assert len(parts) == (2 if number in resumed else 1)
        assert sorted(h["epoch"] for p in parts for h in p["history"]) == [1, 2]
        assert [p["summary"].get("hfsweep.status") for p in parts].count("completed") == 1


def test_trials_a_failure_stops_end_failed_in_every_tracker(tmp_path: Path) -> None:
    """The task's model raises at the first evaluation (its short last batch): the sweep stops,
    every unfinished trial is FAIL in the study, and each tracker hears of it, with the error."""
    pytest.importorskip("mlflow", reason="the mlflow extra is not installed")
    from mlflow.tracking import MlflowClient
    from sweep import _broken

    run_dir = tmp_path / "run"
    recorder = Recorder()
    config = {
        "task": _broken.BATCH_16,
        "search_space": {"lr": {"type": "float", "low": 1e-3, "high": 0.5, "log": True}},
        "searcher": "random",
        "budget": {"trials": 6, "epochs": 2},
        "metric": "val_loss",
        "mode": "min",
        "fusion": {"size": 2, "device": "cpu"},
        "output": str(run_dir),
        "tracking": ["mlflow"],
    }
    with pytest.raises(hs.TrainingError):
        hs.sweep(config, progress=False, callbacks=[recorder])
    ends = [e for e in recorder.events if e[0] == "end"]
    assert ends and {e[2] for e in ends} == {Status.FAILED}
    assert all(e[3] is None and "this model takes batches of 16" in e[4] for e in ends)
    assert recorder.events[-1] == ("sweep_end",)
    client = MlflowClient(tracking_uri=f"sqlite:///{run_dir / 'mlflow.db'}")
    experiment = client.get_experiment_by_name("sweep")
    assert experiment is not None
    runs = client.search_runs([experiment.experiment_id], max_results=100)
    assert sorted(int(r.data.tags["hfsweep.trial"]) for r in runs) == sorted(e[1] for e in ends)
    for r in runs:
        assert r.info.status == "FAILED" and r.data.tags["hfsweep.status"] == "failed"
        assert "this model takes batches of 16" in r.data.tags["hfsweep.error"]
