"""``tracking:`` in a sweep file: what it accepts, and the refusals (exit 2, before anything
trains) of an unknown tracker, a bad option and a tracker whose library is missing or broken,
each naming the YAML path and what would work."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

import hfsweep as hs
from hfsweep.cli import main
from hfsweep.config import ConfigError, TrackerConfig, load_sweep, parse_sweep
from hfsweep.tracking import _registry

from .conftest import small_sweep

TOY = Path(__file__).resolve().parents[1] / "sweep" / "_toy.py"


def _sweep_file(tmp_path: Path, tracking: str) -> Path:
    path = tmp_path / "sweep.yaml"
    path.write_text(
        f"task: {TOY}:TASK\n"
        "search_space: {lr: {type: float, low: 0.001, high: 0.5, log: true}}\n"
        "searcher: random\n"
        "budget: {trials: 2, epochs: 1}\n"
        "metric: val_accuracy\n"
        "mode: max\n"
        "fusion: {size: 2, device: cpu}\n"
        f"output: {tmp_path / 'run'}\n"
        f"tracking: {tracking}\n"
    )
    return path


def _error(tmp_path: Path, tracking: str) -> ConfigError:
    with pytest.raises(ConfigError) as caught:
        load_sweep(_sweep_file(tmp_path, tracking))
    return caught.value


@pytest.fixture
def installed(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every tracker's library counts as installed (these tests are about the file)."""
    monkeypatch.setattr("hfsweep.config.tracking.missing", lambda name: None)


def test_names_and_options_are_read(tmp_path: Path, installed: None) -> None:
    sc = load_sweep(
        _sweep_file(
            tmp_path,
            "[mlflow, {tensorboard: {log_dir: tb}}, "
            "{wandb: {mode: offline, project: p, tags: [a, b]}}, "
            "{mlflow: {tracking_uri: 'http://127.0.0.1:5000', tags: {team: x, n: 3}}}]",
        )
    )
    assert sc.tracking == (
        TrackerConfig("mlflow", {}),
        TrackerConfig("tensorboard", {"log_dir": str(tmp_path / "tb")}),  # from the file's folder
        TrackerConfig("wandb", {"mode": "offline", "project": "p", "tags": ["a", "b"]}),
        TrackerConfig(
            "mlflow", {"tracking_uri": "http://127.0.0.1:5000", "tags": {"team": "x", "n": "3"}}
        ),
    )
    assert "tracking: mlflow, tensorboard, wandb, mlflow" in sc.summary()
    assert parse_sweep(sc.to_dict(), source=sc.source) == sc  # the resolved form reads back
    # a sweep without trackers writes no tracking key (a run dir from before resumes)
    assert "tracking" not in load_sweep(_sweep_file(tmp_path, "[]")).to_dict()


@pytest.mark.parametrize(
    ("tracking", "path", "words"),
    [
        ("mlfow", "tracking", "is not a list of trackers"),
        (
            "[mlfow]",
            "tracking[0]",
            "unknown tracker 'mlfow' (did you mean 'mlflow'?); valid: mlflow, tensorboard, wandb",
        ),
        ("[tensorboard, {comet: {}}]", "tracking[1]", "unknown tracker 'comet'"),
        ("[{mlflow: {uri: x}}]", "tracking[0].mlflow.uri", "unknown key 'uri'"),
        (
            "[{mlflow: {tracking_uri: 3}}]",
            "tracking[0].mlflow.tracking_uri",
            "is not a non-empty string",
        ),
        (
            "[{wandb: {mode: online-ish}}]",
            "tracking[0].wandb.mode",
            "give one of: offline, online, disabled",
        ),
        ("[{wandb: {tags: a}}]", "tracking[0].wandb.tags", "is not a list of strings"),
        (
            "[{mlflow: {tags: [a]}}]",
            "tracking[0].mlflow.tags",
            "is not a mapping of names to values",
        ),
        ("[{mlflow: x, wandb: y}]", "tracking[0]", "is not a tracker"),
        ("[{tensorboard: [a]}]", "tracking[0].tensorboard", "is not a mapping"),
    ],
)
def test_bad_entries_name_their_path(
    tmp_path: Path, installed: None, tracking: str, path: str, words: str
) -> None:
    error = _error(tmp_path, tracking)
    assert error.path == path and error.file == str(tmp_path / "sweep.yaml")
    assert words in error.problem


@pytest.mark.parametrize("name", ["mlflow", "tensorboard", "wandb"])
def test_a_missing_library_names_the_extra(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str
) -> None:
    monkeypatch.setitem(sys.modules, name, None)  # as if not installed: importing it fails
    # the other trackers count as installed, whether they are here or not
    real = _registry.missing
    monkeypatch.setattr("hfsweep.config.tracking.missing", lambda n: real(n) if n == name else None)
    others = [n for n in ("mlflow", "tensorboard", "wandb") if n != name]
    error = _error(tmp_path, f"[{others[0]}, {name}, {others[1]}]")
    assert error.path == f"tracking[1].{name}"
    assert "which is not installed" in error.problem
    assert f'pip install "hfsweep[{name}]"' in error.problem


def test_the_cli_refuses_a_missing_tracker_with_exit_2(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setitem(sys.modules, "wandb", None)
    sweep = _sweep_file(tmp_path, "[{wandb: {mode: offline}}]")
    for command in (
        ["validate", str(sweep)],
        ["validate", "--file-only", str(sweep)],
        ["run", str(sweep)],
    ):
        assert main(command) == 2
        err = capsys.readouterr().err
        assert "tracking[0].wandb: tracker 'wandb' needs Weights & Biases (wandb)" in err
        assert 'pip install "hfsweep[wandb]"' in err
    assert not (tmp_path / "run").exists()  # refused before anything was written


def test_a_library_that_fails_to_import_is_refused_before_training(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("mlflow", reason="the mlflow extra is not installed")
    real = _registry.importlib.import_module

    def broken(name: str, *args: Any) -> Any:
        if name == "mlflow":
            raise ImportError("cannot import name 'x' from 'protobuf'")
        return real(name, *args)

    monkeypatch.setattr(_registry.importlib, "import_module", broken)
    with pytest.raises(ConfigError) as caught:
        hs.sweep(small_sweep(tmp_path / "run", tracking=["mlflow"]), progress=False)
    assert caught.value.path == "tracking[0].mlflow"
    assert "fails to import (mlflow: ImportError: cannot import name 'x'" in str(caught.value)
    assert 'pip install "hfsweep[mlflow]"' in str(caught.value)
    assert not (tmp_path / "run").exists()
    sweep = _sweep_file(tmp_path, "[mlflow]")
    assert main(["validate", str(sweep)]) == 2
    assert "fails to import" in capsys.readouterr().err


def test_trackers_may_be_added_on_resume(tmp_path: Path) -> None:
    pytest.importorskip("tensorboard", reason="the tensorboard extra is not installed")
    config = small_sweep(tmp_path / "run", budget={"trials": 2, "epochs": 1})
    hs.sweep(config, progress=False)
    config["budget"] = {"trials": 3, "epochs": 1}
    result = hs.sweep({**config, "tracking": ["tensorboard"]}, progress=False, resume=True)
    assert result.counts["completed"] == 3
    # only the trial trained after the resume is tracked
    assert [p.name for p in (tmp_path / "run" / "tensorboard").iterdir()] == ["trial-2"]
