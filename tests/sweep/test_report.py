"""``hfsweep report``: the plots drawn from a run directory, the ones skipped, and the errors.

Run directories are fabricated here in the layout the sweep engine writes (sweep.json, an Optuna
journal study, trials.csv, histories/trial-<n>.csv), so these tests need no training.
"""

from __future__ import annotations

import ast
import csv
import json
import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import matplotlib.image
import optuna
import pytest
from matplotlib.figure import Figure
from optuna.storages import JournalStorage
from optuna.storages.journal import JournalFileBackend
from optuna.trial import TrialState

from hfsweep import report
from hfsweep.cli import main
from hfsweep.report import NothingToReport, ReportError, write_report
from hfsweep.report._histories import _read_history as read_history
from hfsweep.report._parallel import _Axis as Axis
from hfsweep.report._trials import _best_so_far as best_so_far

ALL = ["history.png", "importance.png", "parallel.png", "curves.png"]
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"

_STATUS = {
    TrialState.COMPLETE: "completed",
    TrialState.PRUNED: "stopped",
    TrialState.FAIL: "failed",
}


@dataclass
class Spec:
    """One fabricated trial: how it ends, the metric at each epoch, and its parameters."""

    state: TrialState
    curve: list[float]
    params: dict[str, Any] = field(default_factory=dict)


def _params(i: int) -> dict[str, Any]:
    """Distinct parameters for trial i: a log float, an int and a categorical."""
    return {
        "lr": 10 ** -(1 + (i % 4) * 0.7),
        "width": 16 + 8 * (i % 5),
        "opt": ["sgd", "adam"][i % 2],
    }


def _suggest(trial: optuna.Trial, vary: Sequence[str]) -> None:
    """Suggest the varying parameters (their values come from the enqueued trial)."""
    if "lr" in vary:
        trial.suggest_float("lr", 1e-4, 1e-1, log=True)
    if "width" in vary:
        trial.suggest_int("width", 16, 64)
    if "opt" in vary:
        trial.suggest_categorical("opt", ["sgd", "adam"])


def make_run(
    root: Path,
    specs: Sequence[Spec],
    *,
    mode: str = "max",
    metric: str = "val_accuracy",
    unit: str = "epochs",
    vary: Sequence[str] = ("lr", "width", "opt"),
    storage: str | None = None,
    histories: bool = True,
) -> Path:
    """A run directory as the engine leaves it; trials are told in the order of ``specs``."""
    run = root / "run"
    run.mkdir()
    budget = {"trials": len(specs), unit: max((len(s.curve) for s in specs), default=1)}
    config = {
        "task": "digits_mlp",
        "metric": metric,
        "mode": mode,
        "storage": storage,
        "study_name": "demo",
        "budget": {**budget, "time_limit": None},
    }
    (run / "sweep.json").write_text(json.dumps(config), encoding="utf-8")
    backend: str | JournalStorage = (
        JournalStorage(JournalFileBackend(str(run / "optuna.journal")))
        if storage is None
        else storage
    )
    study = optuna.create_study(
        study_name="demo",
        storage=backend,
        direction="maximize" if mode == "max" else "minimize",
    )
    (run / "histories").mkdir()
    for i, spec in enumerate(specs):
        params = spec.params or _params(i)
        study.enqueue_trial({k: v for k, v in params.items() if k in vary})
        trial = study.ask()
        _suggest(trial, vary)
        trial.set_user_attr("array", i // 3)
        for step, value in enumerate(spec.curve):
            trial.report(value, step)
        if spec.state == TrialState.RUNNING:
            continue
        trial.set_user_attr("status", _STATUS[spec.state])
        if spec.state == TrialState.COMPLETE:
            study.tell(trial, spec.curve[-1])
        else:
            study.tell(trial, state=spec.state)
        if histories and spec.curve:
            with (run / "histories" / f"trial-{trial.number}.csv").open("w", newline="") as f:
                w = csv.writer(f)
                w.writerow(["step", "epoch", "train_loss", "val_loss", metric])
                for epoch, value in enumerate(spec.curve, start=1):
                    w.writerow([epoch * 10, epoch, 1.0 / epoch, 1.2 / epoch, value])
    _write_trials_csv(run, study)
    return run


def _write_trials_csv(run: Path, study: optuna.Study) -> None:
    names = sorted({k for t in study.trials for k in t.params})
    with (run / "trials.csv").open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(
            ["number", "value", "datetime_start", "datetime_complete", "duration"]
            + [f"params_{n}" for n in names]
            + ["user_attrs_array", "user_attrs_status", "state", "array"]
        )
        for t in study.trials:
            w.writerow(
                [t.number, "" if t.value is None else t.value, t.datetime_start,
                 t.datetime_complete, t.duration]
                + [t.params.get(n, "") for n in names]
                + [t.user_attrs.get("array"), t.user_attrs.get("status", ""), t.state.name,
                   t.user_attrs.get("array")]
            )  # fmt: skip


def _rising(top: float, n: int = 4) -> list[float]:
    return [top * (k + 1) / n for k in range(n)]


def mixed_specs() -> list[Spec]:
    """Six finished trials (four complete, one pruned, one failed) and one still running."""
    return [
        Spec(TrialState.COMPLETE, _rising(0.80)),
        Spec(TrialState.COMPLETE, _rising(0.91)),
        Spec(TrialState.PRUNED, _rising(0.40)[:2]),
        Spec(TrialState.COMPLETE, _rising(0.62)),
        Spec(TrialState.FAIL, [0.3]),
        Spec(TrialState.COMPLETE, _rising(0.88)),
        Spec(TrialState.RUNNING, [0.2]),
    ]


def names(paths: Sequence[Path]) -> list[str]:
    return [p.name for p in paths]


def assert_pngs(paths: Sequence[Path]) -> None:
    for path in paths:
        assert path.is_file(), path
        assert path.read_bytes()[:8] == PNG_SIGNATURE, path
        image = matplotlib.image.imread(path)
        assert image.ndim == 3 and image.shape[0] > 100 and image.shape[1] > 100, path
        assert image.std() > 0, f"{path} is blank"


@pytest.fixture(autouse=True)
def _quiet_optuna() -> None:
    optuna.logging.set_verbosity(optuna.logging.WARNING)


@pytest.fixture
def no_render(monkeypatch: pytest.MonkeyPatch) -> None:
    """Build each figure but skip laying it out and rasterising it (most of a plot's time), for
    tests about which plots are drawn rather than how; the tests without it render for real."""

    def savefig(fig: object, fname: str, **kwargs: object) -> None:
        Path(fname).write_bytes(PNG_SIGNATURE)

    monkeypatch.setattr(Figure, "savefig", savefig)


# --------------------------------------------------------------------------------------------------
# plots


def test_full_sweep_draws_all_four_plots_into_run_report(tmp_path: Path) -> None:
    run = make_run(tmp_path, mixed_specs())
    paths = write_report(run)
    assert names(paths) == ALL
    assert all(p.parent == run / "report" for p in paths)
    assert_pngs(paths)


def test_min_mode_sweep_into_out_dir(tmp_path: Path) -> None:
    specs = [
        Spec(TrialState.COMPLETE, [0.9, 0.5, 0.3]),
        Spec(TrialState.COMPLETE, [0.8, 0.6, 0.45]),
        Spec(TrialState.PRUNED, [1.2]),
        Spec(TrialState.COMPLETE, [0.7, 0.3, 0.12]),
    ]
    run = make_run(tmp_path, specs, mode="min", metric="val_loss")
    out = tmp_path / "elsewhere" / "plots"
    paths = write_report(str(run), out_dir=str(out))
    assert names(paths) == ALL
    assert all(p.parent == out for p in paths)
    assert sorted(p.name for p in out.iterdir()) == sorted(ALL)
    assert not (run / "report").exists()
    assert_pngs(paths)


def test_budget_in_steps_draws_curves_against_step(tmp_path: Path, no_render: None) -> None:
    run = make_run(tmp_path, mixed_specs(), unit="steps")
    # Histories of a step budget need no epoch column.
    for path in (run / "histories").iterdir():
        rows = list(csv.DictReader(path.open()))
        with path.open("w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=["step", "val_accuracy"], extrasaction="ignore")
            w.writeheader()
            w.writerows(rows)
    assert names(write_report(run)) == ALL


def test_one_trial_skips_importance(tmp_path: Path) -> None:
    run = make_run(tmp_path, [Spec(TrialState.COMPLETE, _rising(0.7))])
    paths = write_report(run)
    assert names(paths) == ["history.png", "parallel.png", "curves.png"]
    assert not (run / "report" / "importance.png").exists()
    assert_pngs(paths)


def test_no_complete_trial_skips_importance_and_parallel(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    specs = [
        Spec(TrialState.PRUNED, [0.2, 0.3]),
        Spec(TrialState.FAIL, [0.1]),
        Spec(TrialState.PRUNED, [0.25]),
    ]
    run = make_run(tmp_path, specs)
    with caplog.at_level(logging.INFO, logger="hfsweep.report"):
        paths = write_report(run)
    # Pruned trials still have values to show, and every trial has a history.
    assert names(paths) == ["history.png", "curves.png"]
    assert "importance.png skipped: 0 completed" in caplog.text
    assert "parallel.png skipped: no completed trial" in caplog.text
    assert_pngs(paths)


def test_nothing_to_draw_is_nothing_to_report(tmp_path: Path, no_render: None) -> None:
    specs = [Spec(TrialState.FAIL, []), Spec(TrialState.RUNNING, [])]
    run = make_run(tmp_path, specs)
    with pytest.raises(NothingToReport) as info:
        write_report(run)
    message = str(info.value)
    assert message.startswith(f"{run}: nothing to report yet: 2 trial(s): 1 failed, 1 running")
    assert "no finished trial has a value or a history" in message
    assert not (run / "report").exists()


def test_study_without_trials_is_nothing_to_report(tmp_path: Path, no_render: None) -> None:
    run = make_run(tmp_path, [])
    with pytest.raises(NothingToReport, match="nothing to report yet: the study has no trials"):
        write_report(run)
    assert not (run / "report").exists()


def test_only_running_trials_is_nothing_to_report(tmp_path: Path, no_render: None) -> None:
    run = make_run(tmp_path, [Spec(TrialState.RUNNING, [0.5])] * 3)
    with pytest.raises(NothingToReport) as info:
        write_report(run)
    assert "3 trial(s): 3 running, none finished" in str(info.value)
    assert "hfsweep run SWEEP --resume" in str(info.value)
    assert not (run / "report").exists()


def test_cli_exits_1_when_there_is_nothing_to_report(
    tmp_path: Path, no_render: None, capsys: pytest.CaptureFixture[str]
) -> None:
    run = make_run(tmp_path, [Spec(TrialState.RUNNING, [0.5])] * 2)
    assert main(["report", str(run)]) == 1
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.startswith(f"hfsweep report: {run}: nothing to report yet: 2 trial(s)")
    assert sorted(p.name for p in run.iterdir()) == [
        "histories",
        "optuna.journal",
        "sweep.json",
        "trials.csv",
    ]


def test_cli_exits_0_with_the_paths_once_a_trial_finished(
    tmp_path: Path, no_render: None, capsys: pytest.CaptureFixture[str]
) -> None:
    run = make_run(tmp_path, [Spec(TrialState.COMPLETE, [0.5, 0.6]), Spec(TrialState.RUNNING, [])])
    assert main(["report", str(run)]) == 0
    assert capsys.readouterr().out.split() == [
        str(run / "report" / n) for n in ("history.png", "parallel.png", "curves.png")
    ]


def test_cli_exits_2_for_what_is_not_a_run_directory(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["report", str(tmp_path / "nope")]) == 2
    assert "no such run directory" in capsys.readouterr().err
    # a folder of run directories (the README's runs/) names them
    runs = tmp_path / "runs"
    runs.mkdir()
    make_run(tmp_path, mixed_specs()).rename(runs / "a")
    assert main(["report", str(runs)]) == 2
    err = capsys.readouterr().err
    assert f"{runs / 'sweep.json'}: missing, so {runs} is not a run directory" in err
    assert f"the run directories in it: a (e.g. `hfsweep report {runs / 'a'}`)" in err
    # a sweep file names its run directory
    sweep = tmp_path / "my_sweep.yaml"
    sweep.write_text("task: digits_mlp\n")
    assert main(["report", str(sweep)]) == 2
    err = capsys.readouterr().err
    assert "not a directory" in err and f"`hfsweep report {tmp_path / 'runs' / 'my_sweep'}`" in err
    sweep.write_text("task: digits_mlp\noutput: elsewhere/run\n")
    assert main(["report", str(sweep)]) == 2
    assert f"`hfsweep report {tmp_path / 'elsewhere' / 'run'}`" in capsys.readouterr().err


def test_one_varying_parameter_skips_importance(tmp_path: Path, no_render: None) -> None:
    run = make_run(tmp_path, mixed_specs(), vary=("lr",))
    assert names(write_report(run)) == ["history.png", "parallel.png", "curves.png"]


def test_missing_histories_skip_curves_only(tmp_path: Path, no_render: None) -> None:
    run = make_run(tmp_path, mixed_specs(), histories=False)
    assert names(write_report(run)) == ALL[:3]


def test_history_without_the_metric_is_skipped_with_a_warning(
    tmp_path: Path, no_render: None, caplog: pytest.LogCaptureFixture
) -> None:
    run = make_run(tmp_path, mixed_specs(), metric="val_accuracy")
    bad = run / "histories" / "trial-0.csv"
    bad.write_text("step,epoch,train_loss\n10,1,0.5\n")
    with caplog.at_level(logging.INFO, logger="hfsweep.report"):
        assert names(write_report(run)) == ALL
    assert str(bad) in caplog.text and "'val_accuracy'" in caplog.text
    for path in (run / "histories").iterdir():
        path.write_text("step,epoch,val_loss\n10,1,0.5\n")
    assert names(write_report(run)) == ALL[:3]


def test_storage_url_is_loaded_instead_of_the_journal(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, no_render: None
) -> None:
    # A real SQLite study costs seconds of schema creation; the report only hands the URL to
    # optuna.load_study, so that call is checked and answered with a journal study.
    journal_run = make_run(tmp_path, mixed_specs())
    study = optuna.load_study(
        study_name="demo",
        storage=JournalStorage(JournalFileBackend(str(journal_run / "optuna.journal"))),
    )
    database = tmp_path / "study.db"
    database.touch()
    url = f"sqlite:///{database}"
    config = json.loads((journal_run / "sweep.json").read_text())
    run = tmp_path / "rdb-run"
    run.mkdir()
    (run / "sweep.json").write_text(json.dumps({**config, "storage": url}))
    calls: list[tuple[object, object]] = []

    def load_study(*, study_name: str, storage: object) -> optuna.Study:
        calls.append((study_name, storage))
        return study

    monkeypatch.setattr(optuna, "load_study", load_study)
    assert names(write_report(run)) == ["history.png", "importance.png", "parallel.png"]
    assert calls == [("demo", url)]
    assert not (run / "optuna.journal").exists()


# --------------------------------------------------------------------------------------------------
# helpers behind the plots


def test_best_so_far_follows_the_mode() -> None:
    values = [0.5, 0.7, 0.6, 0.9, 0.2]
    assert best_so_far(values, "max") == [0.5, 0.7, 0.7, 0.9, 0.9]
    assert best_so_far(values, "min") == [0.5, 0.5, 0.5, 0.5, 0.2]
    assert best_so_far([], "max") == []


def test_parallel_axes_normalise_linear_log_and_categorical() -> None:
    linear = Axis("width", low=16, high=64)
    assert linear.position(16) == 0.0 and linear.position(40) == 0.5 and linear.position(64) == 1
    log = Axis("lr", low=1e-4, high=1e-0, log=True)
    assert log.position(1e-2) == pytest.approx(0.5)
    assert log.position(1e-3) == pytest.approx(0.25)
    assert [label for _, label in log.ticks()] == ["0.0001", "0.01", "1"]
    cat = Axis("opt", choices=("sgd", "adam", "rmsprop"))
    assert [cat.position(c) for c in ("sgd", "adam", "rmsprop")] == [0.0, 0.5, 1.0]
    assert cat.ticks() == [(0.0, "sgd"), (0.5, "adam"), (1.0, "rmsprop")]
    assert math.isnan(cat.position("lion"))
    assert math.isnan(linear.position(None))
    assert Axis("fixed", low=3, high=3).position(3) == 0.5


def test_read_history_keeps_finite_points_only(tmp_path: Path) -> None:
    path = tmp_path / "trial-3.csv"
    path.write_text(
        "step,epoch,train_loss,val_loss,val_accuracy\n"
        "10,1,0.9,1.0,0.5\n20,2,0.8,0.9,\n30,3,0.7,nan,nan\n40,4,0.6,0.7,0.8\n"
    )
    curve = read_history(path, 3, "epoch", "val_accuracy")
    assert curve is not None
    assert (curve.number, curve.xs, curve.ys) == (3, [1.0, 4.0], [0.5, 0.8])
    assert read_history(path, 3, "epoch", "val_f1") is None


# --------------------------------------------------------------------------------------------------
# errors


def test_missing_run_dir(tmp_path: Path) -> None:
    missing = tmp_path / "no-such-run"
    with pytest.raises(ReportError, match="no such run directory") as info:
        write_report(missing)
    assert str(missing) in str(info.value) and "hfsweep run" in str(info.value)
    assert not missing.exists()


def test_run_dir_that_is_a_file(tmp_path: Path) -> None:
    path = tmp_path / "run"
    path.write_text("")
    with pytest.raises(ReportError, match="not a directory"):
        write_report(path)


def test_missing_sweep_json(tmp_path: Path) -> None:
    run = make_run(tmp_path, mixed_specs())
    (run / "sweep.json").unlink()
    with pytest.raises(ReportError) as info:
        write_report(run)
    assert str(run / "sweep.json") in str(info.value)
    assert "hfsweep run" in str(info.value)
    assert not (run / "report").exists()


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("{not json", "cannot be read as JSON"),
        ("[1, 2]", "expected a JSON object"),
        ('{"mode": "max", "storage": null, "study_name": "demo"}', "metric is missing"),
        (
            '{"metric": "val_loss", "mode": "best", "storage": null, "study_name": "demo"}',
            "mode is 'best'; expected 'max' or 'min'",
        ),
        ('{"metric": "m", "mode": "min", "storage": 3, "study_name": "demo"}', "storage is 3"),
    ],
)
def test_bad_sweep_json(tmp_path: Path, text: str, expected: str) -> None:
    run = tmp_path / "run"
    run.mkdir()
    (run / "sweep.json").write_text(text)
    with pytest.raises(ReportError, match=expected) as info:
        write_report(run)
    assert str(run / "sweep.json") in str(info.value)


def test_missing_journal_is_reported_not_created(tmp_path: Path) -> None:
    run = make_run(tmp_path, mixed_specs())
    journal = run / "optuna.journal"
    journal.unlink()
    with pytest.raises(ReportError, match="missing") as info:
        write_report(run)
    assert str(journal) in str(info.value) and "hfsweep run" in str(info.value)
    assert not journal.exists()


def test_missing_sqlite_database_is_reported_not_created(tmp_path: Path) -> None:
    db = tmp_path / "gone.db"
    run = tmp_path / "run"
    run.mkdir()
    config = {"metric": "m", "mode": "max", "storage": f"sqlite:///{db}", "study_name": "demo"}
    (run / "sweep.json").write_text(json.dumps(config))
    with pytest.raises(ReportError, match="database file") as info:
        write_report(run)
    assert str(db) in str(info.value)
    assert not db.exists()


def test_unknown_study_name_lists_the_studies_there(tmp_path: Path) -> None:
    run = make_run(tmp_path, mixed_specs())
    config = json.loads((run / "sweep.json").read_text())
    (run / "sweep.json").write_text(json.dumps({**config, "study_name": "other"}))
    with pytest.raises(ReportError) as info:
        write_report(run)
    message = str(info.value)
    assert str(run / "optuna.journal") in message
    assert "no study named 'other'" in message and "['demo']" in message


def test_matplotlib_and_optuna_are_imported_lazily() -> None:
    """Only under TYPE_CHECKING or inside functions, in every module of the package, so
    ``import hfsweep`` stays light."""
    modules = sorted(Path(report.__file__).parent.glob("*.py"))
    assert len(modules) > 1, modules
    top: list[str] = []
    for module in modules:
        tree = ast.parse(module.read_text(encoding="utf-8"))
        for node in tree.body:  # module level only: not TYPE_CHECKING blocks, not function bodies
            if isinstance(node, ast.Import):
                top += [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                top.append(node.module or "")
    assert top and not [m for m in top if m.split(".")[0] in ("matplotlib", "optuna")], top
