"""The sweep engine end to end on a toy task: packing, refill, scheduling, study, run dir, resume."""

from __future__ import annotations

import copy
import csv
import json
import math
import os
from collections import Counter
from pathlib import Path
from typing import Any

import optuna
import pytest
import torch
from optuna.storages.journal import JournalFileSymlinkLock
from optuna.trial import TrialState

import hfsweep as hs
from hfsweep.config import ConfigError, parse_sweep
from hfsweep.core import loop as _engine
from hfsweep.core._rundir import RunDir
from hfsweep.searchers._source import SearcherError
from hfsweep.storage import journal as _journal

from ._clock import FakeTime, TickingClock
from ._toy import TASK, sweep_config

FINAL = (TrialState.COMPLETE, TrialState.PRUNED, TrialState.FAIL)


def _states(result: hs.SweepResult) -> Counter[str]:
    return Counter(t.state.name for t in result.study.get_trials())


def _csv(path: Path) -> list[dict[str, str]]:
    with path.open(newline="") as f:
        return list(csv.DictReader(f))


def test_fifo_sweep_fills_the_run_directory(tmp_path: Path) -> None:
    result = hs.sweep(sweep_config(tmp_path / "run"), progress=False)
    trials = result.study.get_trials()
    assert [t.number for t in trials] == list(range(8))
    assert all(t.state == TrialState.COMPLETE for t in trials)
    assert result.counts == {"completed": 8, "stopped": 0, "failed": 0, "running": 0}
    # one array of four slots: the second four trials took the slots the first four freed
    assert result.arrays == 1
    assert Counter(t.user_attrs["array"] for t in trials) == {0: 8}
    best = max(trials, key=lambda t: (t.value, -t.number))
    assert result.best_trial is not None and result.best_trial.number == best.number
    assert result.best_value == best.value

    run = tmp_path / "run"
    rows = _csv(run / "trials.csv")
    assert [int(r["number"]) for r in rows] == list(range(8))
    columns = {"params_lr", "params_momentum", "user_attrs_array", "state", "status", "array"}
    assert columns <= set(rows[0])
    assert {r["state"] for r in rows} == {"COMPLETE"}  # Optuna's name
    assert {r["status"] for r in rows} == {"completed"}  # the sweep core's word
    for t, r in zip(trials, rows, strict=True):
        assert float(r["value"]) == t.value and int(r["array"]) == t.user_attrs["array"]
        history = _csv(run / "histories" / f"trial-{t.number}.csv")
        assert [float(h["epoch"]) for h in history] == [1.0, 2.0, 3.0]
        assert float(history[-1]["val_accuracy"]) == t.value
        # intermediate values are in the study, at the epoch
        assert sorted(t.intermediate_values) == [1, 2, 3]
    saved = json.loads((run / "best.json").read_text())
    assert saved["number"] == best.number and saved["value"] == best.value
    assert saved["config"]["lr"] == best.params["lr"] and saved["config"]["epochs"] == 3
    # the three best completed trials keep their weights, as state_dicts of the task's model
    ranked = sorted(trials, key=lambda t: (-t.value, t.number))
    kept = sorted(p.name for p in (run / "checkpoints").iterdir())
    assert kept == sorted(f"trial-{t.number}.pt" for t in ranked[:3])
    model = TASK.build_model(TASK.resolve({}))
    model.load_state_dict(torch.load(run / "checkpoints" / f"trial-{best.number}.pt"))
    assert json.loads((run / "sweep.json").read_text())["budget"]["trials"] == 8
    assert not list((run / "arrays").iterdir())  # finished arrays leave no checkpoint behind
    assert "trial 0 completed" in (run / "sweep.log").read_text()
    assert "Best val_accuracy" in result.summary()


def test_a_trial_in_an_array_trains_as_it_would_alone(tmp_path: Path) -> None:
    """The members of an array started together train as each would alone (float64)."""
    fusion = {"size": 8, "device": "cpu", "dtype": "float64"}
    result = hs.sweep(sweep_config(tmp_path / "run", fusion=fusion), progress=False)
    sc = parse_sweep(sweep_config(tmp_path / "unused", fusion=fusion))
    for t in result.study.get_trials():
        assert t.user_attrs["array"] == 0
        config = sc.trial_config(sc.space.sample(optuna.trial.FixedTrial(t.params)))
        trainer = hs.ArrayTrainer(TASK, dtype=torch.float64)
        (alone,) = trainer.run([hs.Member("alone", config)])
        history = _csv(tmp_path / "run" / "histories" / f"trial-{t.number}.csv")
        assert len(history) == len(alone.history) == 3
        for row, want in zip(history, alone.history, strict=True):
            for name, value in want.items():
                assert float(row[name]) == pytest.approx(value, rel=1e-7, abs=1e-12)


def test_asha_prunes_and_refills_freed_slots(tmp_path: Path) -> None:
    config = sweep_config(
        tmp_path / "run",
        scheduler={"name": "asha", "options": {"grace_period": 1, "reduction_factor": 2}},
        budget={"trials": 14, "epochs": 4},
    )
    result = hs.sweep(config, progress=False)
    trials = result.study.get_trials()
    assert len(trials) == 14 and all(t.state in FINAL for t in trials)
    states = _states(result)
    assert states["PRUNED"] > 0 and states["COMPLETE"] > 0
    # freed slots were refilled: the first array trained more trials than its size
    per_array = Counter(t.user_attrs["array"] for t in trials)
    assert per_array[0] > 4
    for t in trials:
        if t.state == TrialState.PRUNED:
            assert t.user_attrs["status"] == "stopped"
            assert t.value == t.intermediate_values[max(t.intermediate_values)]
            assert max(t.intermediate_values) < 4
        else:
            assert max(t.intermediate_values) == 4
    state = json.loads((tmp_path / "run" / "state.json").read_text())
    assert sorted(state["ended"]) == sorted(f"trial-{t.number}" for t in trials)


def test_arrays_follow_compatibility_keys(tmp_path: Path) -> None:
    space = {
        "lr": {"type": "float", "low": 0.01, "high": 0.3, "log": True},
        "hidden": {"type": "categorical", "choices": [4, 16]},
    }
    result = hs.sweep(sweep_config(tmp_path / "run", search_space=space), progress=False)
    trials = result.study.get_trials()
    assert len(trials) == 8 and all(t.state == TrialState.COMPLETE for t in trials)
    state = json.loads((tmp_path / "run" / "state.json").read_text())
    width = {a["index"]: json.loads(a["key"])["hidden"] for a in state["arrays"]}
    assert set(width.values()) == {4, 16}
    for t in trials:
        assert width[t.user_attrs["array"]] == t.params["hidden"]


def test_optuna_pruner_scheduler(tmp_path: Path) -> None:
    config = sweep_config(
        tmp_path / "run",
        scheduler={
            "name": "optuna:successive_halving",
            "options": {"min_resource": 1, "reduction_factor": 2},
        },
        budget={"trials": 10, "epochs": 4},
    )
    result = hs.sweep(config, progress=False)
    trials = result.study.get_trials()
    assert len(trials) == 10 and all(t.state in FINAL for t in trials)
    assert _states(result)["PRUNED"] > 0
    assert all(t.intermediate_values for t in trials)


def test_non_finite_trial_is_told_failed(tmp_path: Path) -> None:
    space = {"lr": {"type": "categorical", "choices": [0.05, 3.0e38]}}
    result = hs.sweep(
        sweep_config(tmp_path / "run", search_space=space, budget={"trials": 6, "epochs": 2}),
        progress=False,
    )
    trials = result.study.get_trials()
    assert all(t.state in FINAL for t in trials)
    for t in trials:
        if t.params["lr"] > 1:
            assert t.state == TrialState.FAIL and t.user_attrs["status"] == "failed"
            assert "non-finite" in t.user_attrs["error"]
        else:
            assert t.state == TrialState.COMPLETE
    assert {t.params["lr"] for t in trials} == {0.05, 3.0e38}


def test_grid_searcher_is_capped_at_the_grid(tmp_path: Path) -> None:
    space = {"lr": {"type": "categorical", "choices": [0.01, 0.1, 0.3]}}
    result = hs.sweep(
        sweep_config(tmp_path / "run", search_space=space, searcher="grid"), progress=False
    )
    trials = result.study.get_trials()
    assert len(trials) == 3
    assert sorted(t.params["lr"] for t in trials) == [0.01, 0.1, 0.3]


def test_time_limit_stops_asking_and_leaves_nothing_running(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The engine asks a trial only after reading its clock (one tick each), so with the limit
    at five ticks past the start at most five trials are asked, on any machine."""
    clock = TickingClock(tick=0.1)
    monkeypatch.setattr(_engine, "_clock", clock)
    config = sweep_config(tmp_path / "run", budget={"trials": 40, "epochs": 2, "time_limit": 0.55})
    result = hs.sweep(config, progress=False)
    trials = result.study.get_trials()
    assert 1 <= len(trials) <= 5
    assert all(t.state in FINAL for t in trials)
    assert json.loads((tmp_path / "run" / "state.json").read_text())["elapsed_s"] >= 0.55


def test_existing_run_directory_needs_resume(tmp_path: Path) -> None:
    hs.sweep(sweep_config(tmp_path / "run", budget={"trials": 2, "epochs": 1}), progress=False)
    with pytest.raises(hs.SweepError, match=r"already holds a sweep.*--resume"):
        hs.sweep(sweep_config(tmp_path / "run", budget={"trials": 2, "epochs": 1}), progress=False)
    changed = sweep_config(tmp_path / "run", budget={"trials": 2, "epochs": 2})
    with pytest.raises(hs.SweepError, match=r"budget\.epochs: 1 -> 2"):
        hs.sweep(changed, resume=True, progress=False)
    # more trials may be added to a finished sweep
    more = hs.sweep(
        sweep_config(tmp_path / "run", budget={"trials": 5, "epochs": 1}),
        resume=True,
        progress=False,
    )
    trials = more.study.get_trials()
    assert [t.number for t in trials] == list(range(5))
    assert all(t.state == TrialState.COMPLETE for t in trials)


def test_a_run_directory_in_use_is_refused_before_anything_is_written(tmp_path: Path) -> None:
    run = tmp_path / "run"
    config = sweep_config(run, budget={"trials": 2, "epochs": 1})
    with RunDir(run).exclusive():
        for resume in (False, True):
            with pytest.raises(
                hs.SweepError, match=rf"in use by another sweep \(process [^:]+:{os.getpid()},"
            ):
                hs.sweep(config, resume=resume, progress=False)
        assert [p.name for p in run.iterdir()] == [".lock"]
    result = hs.sweep(config, progress=False)  # free again
    assert _states(result) == Counter({"COMPLETE": 2})


def test_a_journal_lock_left_by_a_killed_sweep_does_not_stall_the_resume(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A sweep killed while it held the journal's lock leaves ``optuna.journal.lock``; Optuna
    would wait 30 s before breaking it. The run directory is locked to the resuming sweep, so
    the lock is known stale and removed at once (after a short wait)."""
    run = tmp_path / "run"
    config = sweep_config(run, budget={"trials": 2, "epochs": 1})
    hs.sweep(config, progress=False)
    lock = run / "optuna.journal.lock"
    lock.symlink_to(run / "optuna.journal")
    fake = FakeTime()  # the short wait passes without waiting
    monkeypatch.setattr(_journal, "_clock", fake.now)
    monkeypatch.setattr(_journal, "_sleep", fake.sleep)
    found: list[bool] = []  # whether Optuna's lock found a lock there, which it waits 30 s for
    acquire = JournalFileSymlinkLock.acquire

    def acquiring(self: JournalFileSymlinkLock) -> bool:
        found.append(os.path.lexists(lock))
        return acquire(self)

    monkeypatch.setattr(JournalFileSymlinkLock, "acquire", acquiring)
    more = sweep_config(run, budget={"trials": 3, "epochs": 1})
    with caplog.at_level("WARNING", logger="hfsweep.sweep"):
        result = hs.sweep(more, resume=True, progress=False)
    assert found and not any(found)
    assert fake.now() >= 2.0  # the default wait
    assert _states(result) == Counter({"COMPLETE": 3})
    assert any("journal lock a killed sweep had left" in r.getMessage() for r in caplog.records)
    assert not (run / "optuna.journal.lock").is_symlink()


def test_a_file_system_without_locks_only_warns(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import fcntl

    def no_locks(fd: int, op: int) -> None:
        raise OSError(37, "No locks available")

    with monkeypatch.context() as patch:
        patch.setattr(fcntl, "flock", no_locks)
        with pytest.warns(UserWarning, match="cannot lock the run directory") as seen:
            result = hs.sweep(
                sweep_config(tmp_path / "run", budget={"trials": 2, "epochs": 1}), progress=False
            )
    assert _states(result) == Counter({"COMPLETE": 2})
    assert seen[0].filename == __file__  # the warning points at the caller of hs.sweep
    # a .lock that cannot be opened (here a folder) warns the same way
    (tmp_path / "other" / ".lock").mkdir(parents=True)
    with pytest.warns(UserWarning, match="cannot lock the run directory"):
        result = hs.sweep(
            sweep_config(tmp_path / "other", budget={"trials": 2, "epochs": 1}), progress=False
        )
    assert _states(result) == Counter({"COMPLETE": 2})


class _Interrupt(Exception):
    pass


def test_resume_after_a_crash_finishes_exactly_as_an_uninterrupted_sweep(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """All trials are asked up front (one array of 8), so the resumed sweep must reproduce
    every value of the uninterrupted one; no trial is lost or told twice."""
    fusion = {"size": 8, "device": "cpu"}
    scheduler = {"name": "asha", "options": {"grace_period": 1, "reduction_factor": 2}}
    kw: dict[str, Any] = {
        "fusion": fusion,
        "scheduler": scheduler,
        "budget": {"trials": 8, "epochs": 4},
    }
    reference = hs.sweep(sweep_config(tmp_path / "ref", **kw), progress=False)

    told: Counter[int] = Counter()
    real_tell = optuna.Study.tell

    def counting_tell(self: optuna.Study, trial: Any, *args: Any, **kwargs: Any) -> Any:
        if self.study_name == "sweep":  # not the in-memory study validation samples with
            told[trial if isinstance(trial, int) else trial.number] += 1
        return real_tell(self, trial, *args, **kwargs)

    monkeypatch.setattr(optuna.Study, "tell", counting_tell)
    calls = {"n": 0}
    real_report = _engine._Engine._report

    def crashing_report(self: Any, evaluations: Any) -> Any:
        calls["n"] += 1
        if calls["n"] == 3:
            raise _Interrupt
        return real_report(self, evaluations)

    monkeypatch.setattr(_engine._Engine, "_report", crashing_report)
    with pytest.raises(_Interrupt):
        hs.sweep(sweep_config(tmp_path / "run", **kw), progress=False)
    monkeypatch.setattr(_engine._Engine, "_report", real_report)
    resumed = hs.sweep(sweep_config(tmp_path / "run", **kw), resume=True, progress=False)

    got = {t.number: t for t in resumed.study.get_trials()}
    want = {t.number: t for t in reference.study.get_trials()}
    assert sorted(got) == sorted(want) == list(range(8))
    assert told == Counter(range(8))
    for n, t in want.items():
        assert got[n].state == t.state
        assert got[n].params == t.params
        assert got[n].intermediate_values == pytest.approx(t.intermediate_values)


def test_a_crash_between_saving_and_telling_tells_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """on_finish runs at least once per member: a crash after the engine saved a trial's end
    but before the study was told must tell it on resume, and only once."""
    real_tell = optuna.Study.tell
    state = {"armed": True}

    def crash_once(self: optuna.Study, trial: Any, *args: Any, **kwargs: Any) -> Any:
        if state["armed"]:
            state["armed"] = False
            raise _Interrupt
        return real_tell(self, trial, *args, **kwargs)

    monkeypatch.setattr(optuna.Study, "tell", crash_once)
    config = sweep_config(tmp_path / "run", budget={"trials": 4, "epochs": 2})
    with pytest.raises(_Interrupt):
        hs.sweep(config, progress=False)
    result = hs.sweep(config, resume=True, progress=False)
    trials = result.study.get_trials()
    assert len(trials) == 4 and all(t.state == TrialState.COMPLETE for t in trials)
    # the trial told twice over the crash is kept once among the best three checkpoints
    ranked = sorted(trials, key=lambda t: (-t.value, t.number))
    kept = sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir())
    assert kept == sorted(f"trial-{t.number}.pt" for t in ranked[:3])
    best = json.loads((tmp_path / "run" / "best.json").read_text())
    assert best["number"] == ranked[0].number


def test_resume_with_more_trials_draws_new_configs(tmp_path: Path) -> None:
    """The sampler is reseeded past the trials it drew, not restarted from the same seed."""
    hs.sweep(sweep_config(tmp_path / "run", budget={"trials": 3, "epochs": 1}), progress=False)
    more = hs.sweep(
        sweep_config(tmp_path / "run", budget={"trials": 6, "epochs": 1}),
        resume=True,
        progress=False,
    )
    params = [tuple(sorted(t.params.items())) for t in more.study.get_trials()]
    assert len(params) == 6 and len(set(params)) == 6


def test_a_config_the_task_rejects_fails_alone(tmp_path: Path) -> None:
    import dataclasses

    task = copy.copy(TASK)
    real_key = TASK.compatibility_key

    def rejecting(config: Any) -> str:
        if config["lr"] > 0.05:
            raise ValueError(f"lr={config['lr']} is too large for this test task")
        return real_key(config)

    object.__setattr__(task, "compatibility_key", rejecting)  # Task is frozen
    sc = dataclasses.replace(parse_sweep(sweep_config(tmp_path / "run")), task=task)
    result = hs.sweep(sc, progress=False)
    trials = result.study.get_trials()
    assert len(trials) == 8 and all(t.state in FINAL for t in trials)
    for t in trials:
        if t.params["lr"] > 0.05:
            assert t.state == TrialState.FAIL and "too large" in t.user_attrs["error"]
        else:
            assert t.state == TrialState.COMPLETE
    assert {t.state for t in trials} == {TrialState.FAIL, TrialState.COMPLETE}


class _ListSearcher(hs.Searcher):
    """Proposes the given configs in order, then says it has no more."""

    def __init__(self, configs: list[dict[str, Any]]) -> None:
        self.configs = list(configs)
        self.asked: list[int] = []
        self.told: dict[int, tuple[str, float | None]] = {}
        self.reports: Counter[int] = Counter()

    def ask(self, numbers: Any) -> list[dict[str, Any]]:
        out, self.configs = self.configs[: len(numbers)], self.configs[len(numbers) :]
        self.asked += list(numbers)[: len(out)]
        return out

    def report(self, number: int, step: int, value: float) -> None:
        self.reports[number] += 1

    def tell(self, number: int, config: Any, state: str, value: float | None) -> None:
        assert number not in self.told
        self.told[number] = (state, value)


def test_custom_searcher(tmp_path: Path) -> None:
    configs = [{"lr": lr, "momentum": 0.5} for lr in (0.01, 0.05, 0.1, 0.2, 0.3)]
    searcher = _ListSearcher(configs)
    result = hs.sweep(sweep_config(tmp_path / "run"), searcher=searcher, progress=False)
    trials = result.study.get_trials()
    # the searcher ran out after 5 of the 8 budgeted trials
    assert [t.params["lr"] for t in trials] == [0.01, 0.05, 0.1, 0.2, 0.3]
    assert searcher.asked == [0, 1, 2, 3, 4]
    assert searcher.told == {t.number: ("complete", t.value) for t in trials}
    assert all(searcher.reports[t.number] == 3 for t in trials)


def test_custom_searcher_values_are_checked(tmp_path: Path) -> None:
    with pytest.raises(SearcherError, match=r"trial 0: lr=5\.0 is outside the search space"):
        hs.sweep(
            sweep_config(tmp_path / "a"),
            searcher=_ListSearcher([{"lr": 5.0, "momentum": 0.5}]),
            progress=False,
        )
    with pytest.raises(SearcherError, match="no value for param 'momentum'"):
        hs.sweep(
            sweep_config(tmp_path / "b"), searcher=_ListSearcher([{"lr": 0.1}]), progress=False
        )
    with pytest.raises(SearcherError, match=r"'width'.*not in the search space"):
        hs.sweep(
            sweep_config(tmp_path / "c"),
            searcher=_ListSearcher([{"lr": 0.1, "momentum": 0.1, "width": 3}]),
            progress=False,
        )


def test_min_mode_keeps_the_lowest_values(tmp_path: Path) -> None:
    result = hs.sweep(sweep_config(tmp_path / "run", metric="val_loss", mode="min"), progress=False)
    values = [t.value for t in result.study.get_trials()]
    assert result.best_value == min(values)
    assert all(math.isfinite(v) for v in values)


def test_a_storage_without_its_database_driver_is_a_clear_error(tmp_path: Path) -> None:
    """Refused before the run directory is created (tests/sweep/test_preflight.py has more)."""
    pytest.importorskip("sqlalchemy")
    from sqlalchemy.engine import make_url

    url = "postgresql://user@127.0.0.1:1/optuna"
    driver = make_url(url).get_dialect().driver  # psycopg2, or psycopg from SQLAlchemy 2.1
    try:
        __import__(driver)
    except ImportError:
        pass
    else:
        pytest.skip(f"{driver} is installed")
    config = sweep_config(tmp_path / "run", storage=url)
    with pytest.raises(ConfigError, match=rf"needs the database driver {driver}\b.*pip install"):
        hs.sweep(config, progress=False)
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize(("searcher", "size"), [("tpe", 4), ("random", 7), ("qmc", 7)])
def test_auto_size_leaves_a_learning_searcher_half_the_trials_to_draw(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, searcher: str, size: int
) -> None:
    """The profiler says 64 (stubbed); a sweep of 7 trials gets arrays of at most 4 with TPE,
    so 3 trials are drawn after the first results, and all 7 with a searcher that does not
    learn."""
    from hfsweep.executors import LocalExecutor

    monkeypatch.setattr(LocalExecutor, "array_size", lambda self, config: (64, "stub"))
    config = sweep_config(
        tmp_path / "run",
        searcher={"name": searcher},
        budget={"trials": 7, "epochs": 2},
        fusion={"size": "auto", "device": "cpu"},
    )
    result = hs.sweep(config, progress=False)
    assert result.counts["completed"] == 7
    state = json.loads((tmp_path / "run" / "state.json").read_text())
    assert list(state["sizes"].values()) == [size]
    log = (tmp_path / "run" / "sweep.log").read_text()
    assert ("at most half the 7 trials (4)" in log) == (searcher == "tpe")


def test_the_profiler_and_the_arrays_share_the_loaded_data(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The profiler's lookup and the arrays of one compatibility key load the data once."""
    from types import SimpleNamespace

    from hfsweep.sizing import task as _sizing

    from . import _toy

    loads: list[int] = []

    def data(config: Any) -> Any:
        loads.append(config["data_seed"])
        return _toy._data(config)

    given: list[Any] = []

    def profile(task: hs.Task, config: Any, **kwargs: Any) -> Any:
        given.append(kwargs["data"])
        return SimpleNamespace(chosen=2, reason="stub", compile=None, offload=None)

    monkeypatch.setattr(_sizing, "profile_task", profile)
    task = hs.Task(name="toy", model=_toy._model, data=data, defaults=dict(TASK.defaults))
    config = sweep_config(
        tmp_path / "run",
        task=task,
        budget={"trials": 6, "epochs": 1},
        fusion={"size": "auto", "device": "cpu"},
    )
    result = hs.sweep(config, progress=False)
    assert result.counts["completed"] == 6
    assert len(loads) == 1 and len(given) == 1 and given[0] is not None


@pytest.mark.slow
def test_a_sweep_reusing_a_cached_profile_says_where_from_and_how_old(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """size: auto reads the profile cache every process of the user shares: a profile it
    reuses is shown with its file, age and the conditions it was measured under, and
    HFSWEEP_PROFILE_REFRESH=1 measures again."""
    monkeypatch.setenv("HFSWEEP_CACHE_DIR", str(tmp_path / "cache"))
    cache = tmp_path / "cache" / "profiles.json"

    def run(name: str) -> str:
        config = sweep_config(
            tmp_path / name, budget={"trials": 2, "epochs": 1}, fusion={"size": "auto"}
        )
        hs.sweep(config, progress=True)
        return (tmp_path / name / "sweep.log").read_text()

    first = run("first")
    assert "array size" in first and "cached profile" not in first
    second = run("second")
    assert f"(cached profile from {cache}, measured " in second
    assert "threads" in second and "HFSWEEP_PROFILE_REFRESH=1" in second
    assert f"(cached profile from {cache}" in capsys.readouterr().err  # on the progress line
    monkeypatch.setenv("HFSWEEP_PROFILE_REFRESH", "1")
    assert "cached profile" not in run("third")
