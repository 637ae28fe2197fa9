"""Broken task code: refused by the dry run before anything is written (exit 2), or, where only
a run meets it, ended cleanly: the trials it hit are FAIL with the error, the sweep stops
(exit 1, one paragraph, no traceback unless --debug), and no trial is left RUNNING. A config
the model rejects fails its trial alone, and the sweep goes on."""

from __future__ import annotations

import csv
import threading
from pathlib import Path
from typing import Any

import optuna
import pytest
import torch

import hfsweep as hs
from hfsweep.cli import main
from hfsweep.training import ArrayTrainer, Member

from . import _broken


def _write(tmp_path: Path, task: str, **overrides: str) -> Path:
    sweep = tmp_path / "sweep.yaml"
    sweep.write_text(_broken.sweep_yaml(task, **overrides))
    return sweep


def _files(folder: Path) -> set[Path]:
    return {p for p in folder.rglob("*")}


def _states(run: Path, study: str = "sweep") -> list[optuna.trial.FrozenTrial]:
    from optuna.storages import JournalStorage
    from optuna.storages.journal import JournalFileBackend

    storage = JournalStorage(JournalFileBackend(str(run / "optuna.journal")))
    return optuna.load_study(study_name=study, storage=storage).get_trials()


# ---------------------------------------------------------------------------- the dry run
@pytest.mark.parametrize(
    ("task", "expected"),
    [
        # the forward pass, and the submodule whose input does not fit
        ("SHAPE", ["in the forward pass", "submodule 'head'", "[2, 9]"]),
        # a loss that returns a value per sample instead of one per member
        ("PER_SAMPLE_LOSS", ["in the loss", "shape (2, 16)", "shape (2,)"]),
        # data of the wrong dtype for its loss
        ("FLOAT_TARGETS", ["in the loss", "takes class indices", "targets are torch.float32"]),
        # a model that raises in __init__ for some configs: the space's upper corner
        ("INIT_HIGH", ["model(config) raised ValueError: lr=0.5 is too large", "{lr: 0.5}"]),
    ],
)
def test_validate_runs_the_task_once_and_refuses_broken_code(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], task: str, expected: list[str]
) -> None:
    sweep = _write(tmp_path, task)
    before = _files(tmp_path)
    assert main(["validate", str(sweep)]) == 2
    err = capsys.readouterr().err
    assert f"{sweep}: task: task " in err and "fails a dry run" in err
    for text in expected:
        assert text in err
    assert "Traceback" not in err and err.count("\n") == 1
    # run refuses it the same way, before anything is written
    assert main(["run", str(sweep), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert "fails a dry run" in err and "Traceback" not in err
    assert _files(tmp_path) == before


def test_validate_debug_prints_the_tasks_traceback(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    sweep = _write(tmp_path, "SHAPE")
    assert main(["validate", str(sweep), "--debug"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("Traceback") and "in forward" in err and "_broken.py" in err
    assert err.rstrip().splitlines()[-1].startswith("hfsweep validate: ")


def test_validate_file_only_skips_the_dry_run_and_a_healthy_task_passes(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # --file-only: a sweep meant for another machine, whose data may not be here
    assert main(["validate", str(_write(tmp_path, "SHAPE")), "--file-only"]) == 0
    assert "is valid:" in capsys.readouterr().out
    assert main(["validate", str(_write(tmp_path, "TASK"))]) == 0


def test_a_model_too_large_for_the_machine_is_refused_before_it_is_built(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A typo such as ``hidden: 1000000000`` must not take the machine's memory: the model is
    counted on the meta device first (here the machine is made to have 1 MiB)."""
    from hfsweep.sizing import device as sizing_device

    built: list[int] = []
    real_build = hs.Task.build_model

    def counting_build(self: hs.Task, config: Any) -> Any:
        built.append(config["hidden"])
        return real_build(self, config)

    monkeypatch.setattr(sizing_device, "device_budget", lambda device, fraction=0.8: 2.0**20)
    monkeypatch.setattr(hs.Task, "build_model", counting_build)
    sweep = _write(tmp_path, "TASK", config="{hidden: 100000}")
    assert main(["validate", str(sweep)]) == 2
    err = capsys.readouterr().err
    assert "the model of the config {hidden: 100000, lr: 0.001} has 800,003 parameters" in err
    assert (
        "(3.1 MiB in float32); an array of 2 of it needs at least 18.3 MiB, and cpu has 1.0 MiB"
        in err
    )
    assert "Traceback" not in err and not built


def test_the_python_api_refuses_broken_code_before_writing(tmp_path: Path) -> None:
    config = _config(tmp_path, _broken.SHAPE)
    with pytest.raises(hs.config.ConfigError, match="in the forward pass") as info:
        hs.sweep(config, progress=False)
    assert isinstance(info.value.__cause__, RuntimeError)
    assert not (tmp_path / "run").exists()


def _config(tmp_path: Path, task: hs.Task, **overrides: Any) -> dict[str, Any]:
    config: dict[str, Any] = {
        "task": task,
        "search_space": {"lr": {"type": "float", "low": 1e-3, "high": 0.5, "log": True}},
        "searcher": "random",
        "budget": {"trials": 4, "epochs": 2},
        "metric": "val_loss",
        "mode": "min",
        "fusion": {"size": 2, "device": "cpu"},
        "output": str(tmp_path / "run"),
    }
    config.update(overrides)
    return config


# ---------------------------------------------------------------------------- at run time
def test_code_that_fails_at_run_time_fails_its_trials_and_stops_the_sweep(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The model takes batches of 16 only: the dry run's batches pass, the short last
    validation batch of the first evaluation does not."""
    sweep = _write(tmp_path, "BATCH_16")
    assert main(["run", str(sweep), "--quiet"]) == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.count("\n") == 1
    assert err.startswith(
        "hfsweep run: training stopped: array 0 (trials 0, 1) raised in the forward pass "
        "(evaluation) of task 'batch_16': RuntimeError: this model takes batches of 16, got 8"
    )
    assert "2 other unfinished trials" not in err  # trials 2 and 3 were never asked
    assert f"hfsweep run {sweep} --resume" in err
    trials = _states(tmp_path / "run")
    assert [t.state.name for t in trials] == ["FAIL", "FAIL"]
    for t in trials:
        assert t.user_attrs["status"] == "failed"
        assert "this model takes batches of 16, got 8" in t.user_attrs["error"]
    with (tmp_path / "run" / "trials.csv").open(newline="") as f:
        assert [r["state"] for r in csv.DictReader(f)] == ["FAIL", "FAIL"]
    assert "Traceback" in (tmp_path / "run" / "sweep.log").read_text()
    assert not list((tmp_path / "run" / "arrays").glob("*"))

    # --debug: the same, after the traceback of the task's exception
    assert main(["run", str(sweep), "--quiet", "--debug", "--output", str(tmp_path / "r2")]) == 1
    err = capsys.readouterr().err
    assert err.startswith("Traceback") and "this model takes batches of 16" in err
    assert err.rstrip().splitlines()[-1].startswith("hfsweep run: training stopped: array 0")


def test_the_python_api_raises_a_training_error_chained_to_the_tasks(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two arrays' worth of trials asked (refills), one array failing: every unfinished trial
    ends FAIL; a resume after the fix trains the rest of the budget."""
    config = _config(tmp_path, _broken.BATCH_16, budget={"trials": 6, "epochs": 2})
    with pytest.raises(hs.TrainingError, match=r"array 0 \(trials 0, 1\) raised") as info:
        hs.sweep(config, progress=False)
    assert isinstance(info.value, hs.SweepError)
    assert isinstance(info.value.__cause__, RuntimeError)
    assert "got 8" in str(info.value.__cause__)
    study = _states(tmp_path / "run")
    assert {t.state.name for t in study} == {"FAIL"}
    monkeypatch.setattr(_broken, "BATCH_16_FIXED", True)
    fixed = hs.sweep(config, resume=True, progress=False)
    assert fixed.counts == {
        "completed": 6 - len(study),
        "stopped": 0,
        "failed": len(study),
        "running": 0,
    }


def test_a_config_the_model_rejects_fails_its_trial_alone(tmp_path: Path) -> None:
    """INIT_MIDDLE's model raises for lr inside the space, away from the corners the dry run
    builds: those trials fail with the model's error, at array start or at a refill, and the
    sweep goes on with the others."""
    config = _config(tmp_path, _broken.INIT_MIDDLE, budget={"trials": 10, "epochs": 1})
    result = hs.sweep(config, progress=False)
    low, high = _broken.REJECTED_LR
    failed = [t for t in result.study.trials if t.state.name == "FAIL"]
    assert failed and result.counts["completed"] + len(failed) == 10
    assert result.counts["running"] == 0
    summary = result.summary().splitlines()
    assert summary[1].startswith("Failed: 1 x the task's model(config) raised ValueError: lr=")
    assert summary[1].endswith(
        f"; {len(failed) - 2} other reasons (trials.csv, column user_attrs_error)"
    )
    for t in result.study.trials:
        rejected = low < t.params["lr"] < high
        assert (t.state.name == "FAIL") == rejected, t.number
        if rejected:
            assert t.user_attrs["error"] == (
                f"the task's model(config) raised ValueError: lr={t.params['lr']} is not "
                "supported by this model"
            )
            assert t.user_attrs["steps"] == 0


def test_a_member_whose_model_raises_leaves_the_others_exact() -> None:
    """An array of [good, rejected, good]: the rejected member fails at once, and the good ones
    train as they do alone (float64)."""
    low, high = _broken.REJECTED_LR
    good = [{"lr": 0.005, "seed": 1}, {"lr": 0.2, "seed": 2}]
    rejected = {"lr": (low + high) / 2}
    trainer = ArrayTrainer(_broken.INIT_MIDDLE, dtype=torch.float64, keep_states=True)
    results = trainer.run([Member("a", good[0]), Member("bad", rejected), Member("b", good[1])])
    by_id = {r.id: r for r in results}
    assert by_id["bad"].status == "failed" and by_id["bad"].steps == 0
    assert "is not supported by this model" in (by_id["bad"].error or "")
    for member, config in zip("ab", good, strict=True):
        alone = ArrayTrainer(_broken.INIT_MIDDLE, dtype=torch.float64).run(
            [Member(member, config)]
        )[0]
        got = by_id[member]
        assert got.status == alone.status == "completed"
        assert got.state is not None and alone.state is not None
        for name, value in alone.state["model"].items():
            torch.testing.assert_close(got.state["model"][name], value, rtol=1e-7, atol=1e-12)


def test_a_member_out_of_memory_alone_fails_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    """Out of memory, an array splits until each member trains alone; a member that runs out
    of memory alone needs more than the device has: it fails, and the trainer goes on."""
    from hfsweep.fusion import FusedArray

    forward = FusedArray.forward
    sizes: list[int] = []

    def small_memory(self: FusedArray, *args: Any, **kwargs: Any) -> Any:
        """Arrays of 2 do not fit, nor does one member of hidden size 9."""
        if self.training:
            sizes.append(self.size)
            if self.size > 1 or self.member(0).body[0].out_features > 8:
                raise torch.OutOfMemoryError("simulated: CUDA out of memory")
        return forward(self, *args, **kwargs)

    monkeypatch.setattr(FusedArray, "forward", small_memory)
    wide = [Member("b", {"hidden": 9}), Member("c", {"hidden": 9, "lr": 0.1})]
    results = ArrayTrainer(_broken.TASK).run(wide)
    assert sizes == [2, 1, 1]  # the array of 2, then each member alone
    for r in results:
        assert r.status == "failed" and r.steps == 0
        assert r.error == (
            "out of memory on cpu training alone in an array: OutOfMemoryError: simulated: "
            "CUDA out of memory"
        )
    narrow = ArrayTrainer(_broken.TASK).run([Member("a", {"hidden": 8})])[0]
    assert narrow.status == "completed"


def test_the_dry_run_refuses_a_model_that_does_not_fit_alone(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from hfsweep.fusion import FusedArray

    def no_memory(self: FusedArray, *args: Any, **kwargs: Any) -> Any:
        raise torch.OutOfMemoryError("simulated: CUDA out of memory")

    monkeypatch.setattr(FusedArray, "forward", no_memory)
    assert main(["validate", str(_write(tmp_path, "TASK"))]) == 2
    err = capsys.readouterr().err
    assert "fails a dry run: an array of 2 of the config {lr: 0.001}: out of memory on cpu " in err


def test_a_failure_while_profiling_ends_the_same_way(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The loss takes arrays of up to 2 members: the dry run's array passes, the profiler's
    array of 4 (fusion.size: auto) does not. The profiler measures 1, 2 and 4 whatever their
    timings (on a loaded machine a slower B=2 would end its doubling before 4: past the knee)."""
    import hfsweep.sizing.task as sizing_task

    real = sizing_task.profile_sizes
    monkeypatch.setattr(
        sizing_task,
        "profile_sizes",
        lambda measure, **kw: real(measure, **{**kw, "sizes": [1, 2, 4]}),
    )
    config = _config(tmp_path, _broken.SMALL_ARRAYS_ONLY, fusion={"size": "auto", "device": "cpu"})
    with pytest.raises(hs.TrainingError) as info:
        hs.sweep(config, progress=False)
    assert str(info.value).startswith(
        "training stopped: profiling the array size for small_arrays_only raised in the loss of "
        "task 'small_arrays_only': RuntimeError: this loss takes arrays of up to 2 members, got 4"
    )
    assert "the 1 unfinished trial is marked failed" in str(info.value)
    trials = _states(tmp_path / "run")
    assert len(trials) == 1 and trials[0].state.name == "FAIL"
    assert "got 4" in trials[0].user_attrs["error"]


@pytest.mark.parametrize("where", ["hook", "checkpoint"])
def test_the_runs_own_errors_are_not_the_arrays(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, where: str
) -> None:
    """An error in the engine's hook (writing a history) or in an array's checkpoint (writing
    array.pt) is the run's, not the task's: a full disk stops the sweep with a SweepError that
    says so and how to continue, and the trials stay RUNNING for a resume, as after a crash."""
    import hfsweep.training.run as run_module
    from hfsweep.core._rundir import RunDir

    def full_disk(*args: Any, **kwargs: Any) -> None:
        raise OSError(28, "No space left on device")

    if where == "hook":
        monkeypatch.setattr(RunDir, "write_history", full_disk)
    else:
        monkeypatch.setattr(run_module, "atomic_save", full_disk)
    with pytest.raises(hs.SweepError, match="No space left") as info:
        hs.sweep(_config(tmp_path, _broken.TASK), progress=False)
    assert not isinstance(info.value, hs.TrainingError)
    assert "Free some space" in str(info.value) and "resume=True" in str(info.value)
    assert isinstance(info.value.__cause__, OSError)
    assert "RUNNING" in {t.state.name for t in _states(tmp_path / "run")}
    monkeypatch.undo()
    resumed = hs.sweep(_config(tmp_path, _broken.TASK), resume=True, progress=False)
    assert resumed.counts == {"completed": 4, "stopped": 0, "failed": 0, "running": 0}


def test_a_full_disk_is_one_paragraph_with_the_resume_command(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """`hfsweep run` on a disk that fills up: exit 1, the file and the remedy, no "bug"."""
    from hfsweep.core._rundir import RunDir

    def full_disk(*args: Any, **kwargs: Any) -> None:
        raise OSError(28, "No space left on device", str(tmp_path / "run" / "histories"))

    monkeypatch.setattr(RunDir, "write_history", full_disk)
    sweep = tmp_path / "sweep.yaml"
    sweep.write_text(_broken.sweep_yaml("TASK"))
    assert main(["run", str(sweep), "--quiet"]) == 1
    err = capsys.readouterr().err
    assert "cannot write" in err and "No space left on device" in err, err
    assert f"hfsweep run {sweep} --resume" in err and "bug" not in err, err


def test_an_error_in_hfsweeps_own_code_leaves_the_trials_for_a_resume(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An exception that no phase of the task's training labels (here: the trainer's own code,
    from its second array on) is not blamed on the task: it propagates as it is, no trial is
    marked FAIL, and the sweep resumes to the end once it is gone."""
    import hfsweep.training.live as live_module

    real = live_module.any_smoothing
    calls = {"n": 0}

    def internal_bug(configs: Any) -> bool:
        calls["n"] += 1
        if calls["n"] > 1:
            raise ZeroDivisionError("an hfsweep-internal bug")
        return real(configs)

    monkeypatch.setattr(live_module, "any_smoothing", internal_bug)
    with pytest.raises(ZeroDivisionError, match="internal bug"):
        hs.sweep(_config(tmp_path, _broken.TASK), progress=False)
    states = {t.state.name for t in _states(tmp_path / "run")}
    assert "FAIL" not in states and "RUNNING" in states
    monkeypatch.undo()
    resumed = hs.sweep(_config(tmp_path, _broken.TASK), resume=True, progress=False)
    assert resumed.counts == {"completed": 4, "stopped": 0, "failed": 0, "running": 0}


def test_an_unpicklable_exception_from_a_worker_is_described() -> None:
    from hfsweep._usercode import label, phase_of
    from hfsweep.executors._worker import _picklable

    exc = _broken._LockedError(threading.Lock())
    label(exc, "the forward pass")
    copy = _picklable(exc)
    assert type(copy) is RuntimeError and phase_of(copy) == "the forward pass"
    assert "_LockedError: an error holding a lock" in str(copy)
    fine = ValueError("plain")
    assert _picklable(fine) is fine


def test_an_unexpected_error_is_one_paragraph_unless_debug(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from hfsweep import report

    def broken(*args: Any, **kwargs: Any) -> Any:
        raise KeyError("surprise")

    monkeypatch.setattr(report, "write_report", broken)
    assert main(["report", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert err.startswith("hfsweep report: unexpected KeyError: 'surprise'") and "--debug" in err
    assert "Traceback" not in err
    with pytest.raises(KeyError):
        main(["report", str(tmp_path), "--debug"])


def test_a_loss_or_metric_of_the_wrong_shape_is_named() -> None:
    out, y = torch.zeros(2, 5, 3), torch.zeros(5, dtype=torch.long)
    with pytest.raises(hs.TaskError, match=r"loss returned a tensor of shape \(2, 5\)"):
        _broken.PER_SAMPLE_LOSS.member_loss(out, y, None)
    one_for_all = hs.Task(
        model=_broken.TASK.model,
        data=_broken.TASK.data,
        loss=lambda o, t: o.mean(),  # would train every member on the sum, silently
    )
    with pytest.raises(hs.TaskError, match=r"loss returned a tensor of shape \(\);"):
        one_for_all.member_loss(out, y, None)
    not_a_tensor = hs.Task(
        model=_broken.TASK.model, data=_broken.TASK.data, metrics={"zero": lambda o, t: 0}
    )
    with pytest.raises(hs.TaskError, match=r"metric 'zero' returned int; .* shape \(2,\)"):
        not_a_tensor.member_metrics(out, y)


def test_validate_skips_the_dry_run_exactly_where_run_does(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """For a cluster given by ray.address the task's code is checked by the workers (its data
    may exist there only), by `hfsweep run` and `hfsweep validate` alike."""
    import yaml

    from hfsweep.config import parse_sweep
    from hfsweep.core import _preflight
    from hfsweep.core._dryrun import runs_on_the_driver

    monkeypatch.setattr(_preflight, "_CHECKS", ())  # no cluster to reach in this test
    cluster = {"backend": "ray", "ray": {"address": "127.0.0.1:6379"}}
    for overrides, driver in (({}, True), ({"backend": "ray"}, True), (cluster, False)):
        config = _config(tmp_path, _broken.SHAPE, **overrides)
        config["task"] = f"{_broken.__file__}:SHAPE"
        assert runs_on_the_driver(parse_sweep(config)) is driver
        sweep = tmp_path / "sweep.yaml"
        sweep.write_text(yaml.safe_dump(config))
        assert main(["validate", str(sweep)]) == (2 if driver else 0), capsys.readouterr()
