"""Each built-in tracker on a small real sweep, its runs read back with the library's own reader
(MLflow's ``MlflowClient``, TensorBoard's ``EventAccumulator``; for W&B offline, the run file
through wandb's public protobuf schema, see ``_wandb_log.py``) and compared with the study."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

import hfsweep as hs
from hfsweep.core.status import Status

from .conftest import small_sweep, trials

pytestmark = pytest.mark.slow


def _status(t: object) -> Status:
    return Status(t.user_attrs["status"])  # type: ignore[attr-defined]


def test_mlflow_gets_one_run_per_trial(tmp_path: Path) -> None:
    pytest.importorskip("mlflow", reason="the mlflow extra is not installed")
    from mlflow.tracking import MlflowClient

    run_dir = tmp_path / "run"
    result = hs.sweep(
        small_sweep(run_dir, tracking=[{"mlflow": {"tags": {"team": "a"}}}]), progress=False
    )
    client = MlflowClient(tracking_uri=f"sqlite:///{run_dir / 'mlflow.db'}")
    experiment = client.get_experiment_by_name("sweep")  # the study's name
    assert experiment is not None
    runs = client.search_runs([experiment.experiment_id], max_results=100)
    by_trial = {int(r.data.tags["hfsweep.trial"]): r for r in runs}
    study = trials(result)
    assert len(runs) == len(study) == 6 and sorted(by_trial) == [t.number for t in study]
    arrays = set()
    for t in study:
        run = by_trial[t.number]
        assert run.info.run_name == f"trial-{t.number}"
        assert run.info.status == "FINISHED"
        tags = run.data.tags
        assert tags["hfsweep.array"] == str(t.user_attrs["array"])
        assert tags["hfsweep.study"] == "sweep" and tags["team"] == "a"
        assert tags["hfsweep.status"] == _status(t) == "completed"
        arrays.add(tags["hfsweep.array"])
        # the params are the trial's config: what the searcher sampled, and the budget
        params = run.data.params
        for name, value in t.params.items():
            assert params[name] == str(value)
        assert params["epochs"] == "2"
        # one point per evaluation, at the trial's step; the study has them at its epoch
        history = client.get_metric_history(run.info.run_id, "val_accuracy")
        epochs = client.get_metric_history(run.info.run_id, "epoch")
        assert [m.value for m in epochs] == [1.0, 2.0]
        assert [m.step for m in history] == [m.step for m in epochs]
        assert [m.value for m in history] == [t.intermediate_values[e] for e in (1, 2)]
        assert run.data.metrics["final_val_accuracy"] == t.value
        assert {"train_loss", "val_loss"} <= set(run.data.metrics)
    assert len(arrays) >= 2  # the two keys trained in different arrays


def test_tensorboard_gets_one_log_dir_per_trial(tmp_path: Path) -> None:
    pytest.importorskip("tensorboard", reason="the tensorboard extra is not installed")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.plugins.hparams import plugin_data_pb2

    run_dir = tmp_path / "run"
    result = hs.sweep(small_sweep(run_dir, tracking=["tensorboard"]), progress=False)
    logs = run_dir / "tensorboard"
    study = trials(result)
    assert sorted(p.name for p in logs.iterdir()) == sorted(f"trial-{t.number}" for t in study)
    for t in study:
        events = EventAccumulator(str(logs / f"trial-{t.number}"))
        events.Reload()
        accuracy = events.Scalars("val_accuracy")
        epochs = events.Scalars("epoch")
        assert [e.value for e in epochs] == [1.0, 2.0]
        assert [e.step for e in accuracy] == [e.step for e in epochs]
        for event, epoch in zip(accuracy, (1, 2), strict=True):
            assert event.value == pytest.approx(t.intermediate_values[epoch], rel=1e-6)  # float32
        (final,) = events.Scalars("final_val_accuracy")
        assert final.value == pytest.approx(t.value, rel=1e-6)
        status = events.Tensors("hfsweep/status/text_summary")
        assert [s.tensor_proto.string_val[0].decode() for s in status] == ["completed"]
        # the HParams dashboard's session: the trial's config, its array, its end
        content = events.PluginTagToContent("hparams")
        start = plugin_data_pb2.HParamsPluginData.FromString(
            content["_hparams_/session_start_info"]
        ).session_start_info
        assert start.hparams["lr"].number_value == pytest.approx(t.params["lr"])
        assert start.hparams["hidden"].number_value == t.params["hidden"]
        assert start.hparams["hfsweep.array"].number_value == t.user_attrs["array"]
        assert start.hparams["hfsweep.trial"].number_value == t.number
        end = plugin_data_pb2.HParamsPluginData.FromString(
            content["_hparams_/session_end_info"]
        ).session_end_info
        assert end.status == 1  # STATUS_SUCCESS


def test_wandb_offline_gets_one_run_per_trial(tmp_path: Path, quiet_wandb: None) -> None:
    pytest.importorskip("wandb", reason="the wandb extra is not installed")
    from ._wandb_log import read_run

    run_dir = tmp_path / "run"
    result = hs.sweep(
        small_sweep(run_dir, tracking=[{"wandb": {"mode": "offline", "tags": ["ci"]}}]),
        progress=False,
    )
    folders = sorted((run_dir / "wandb").glob("offline-run-*"))
    runs = {r["config"]["hfsweep.trial"]: r for r in map(read_run, folders)}
    study = trials(result)
    assert len(folders) == len(study) == 6 and sorted(runs) == [t.number for t in study]
    for t in study:
        run = runs[t.number]
        assert run["name"] == f"trial-{t.number}" and run["group"] == "sweep"
        assert run["tags"] == [f"array:{t.user_attrs['array']}", "ci"]
        assert run["config"]["hfsweep.array"] == t.user_attrs["array"]
        for name, value in t.params.items():
            assert run["config"][name] == value
        rows = run["history"]
        assert [r["epoch"] for r in rows] == [1, 2]
        assert [r["val_accuracy"] for r in rows] == [t.intermediate_values[e] for e in (1, 2)]
        assert rows[0]["_step"] < rows[1]["_step"]
        assert run["summary"]["hfsweep.status"] == "completed"
        assert run["summary"]["final_val_accuracy"] == t.value
        assert run["exit_code"] == 0
    assert not math.isnan(result.best_value or math.nan)
