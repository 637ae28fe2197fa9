"""optuna-dashboard serves a finished sweep's study as hfsweep wrote it, and its HTTP API gives
back exactly the trials Optuna reads from the same storage.

The dashboard runs as users start it, the README's ``optuna-dashboard`` command (its console
script, in a subprocess this test starts and stops by pid), on 127.0.0.1 and a free port, for:

- the run directory's journal file (``storage: null``, hfsweep's default: ``<run>/optuna.journal``,
  written by hfsweep's own journal backend, ``hfsweep.storage.journal``);
- a journal file shared by drivers (``storage: journal:///abs/path``);
- a PostgreSQL study (a real server on loopback, tests/_postgres.py; skipped without its binaries).

Each sweep uses ASHA, so the study holds completed and pruned trials with intermediate values.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import optuna
import pytest
from sweep import _gated
from sweep._toy import sweep_config

import hfsweep as hs

pytest.importorskip("optuna_dashboard")

ROOT = Path(__file__).resolve().parent.parent
#: the dashboard's console script, beside this interpreter (the venv's bin/)
_DASHBOARD = Path(sys.executable).with_name("optuna-dashboard")
#: seconds the dashboard has to answer after it starts
_START_S = 60.0


def _readme_command() -> list[str]:
    """The README's one command that watches a sweep with optuna-dashboard, split in words."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    lines = [
        line.split("#", 1)[0].strip()
        for block in re.findall(r"```bash\n(.*?)```", text, re.S)
        for line in block.splitlines()
        if line.startswith("optuna-dashboard ")
    ]
    assert len(lines) == 1, lines
    return shlex.split(lines[0])


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _get(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=30) as answer:  # loopback only
        assert answer.status == 200
        return json.loads(answer.read())


class Dashboard:
    """``optuna-dashboard STORAGE`` on 127.0.0.1, a free port, in a subprocess of this test."""

    def __init__(self, storage: str, log: Path) -> None:
        self.storage = storage
        self.log = log
        self.proc: subprocess.Popen[bytes] | None = None
        self.base = ""

    def start(self) -> None:
        for _ in range(3):  # a free port taken by someone else before the server binds it
            port = _free_port()
            argv = [str(_DASHBOARD), self.storage, "--host", "127.0.0.1", "--port", str(port)]
            with self.log.open("ab") as out:
                self.proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT)
            self.base = f"http://127.0.0.1:{port}"
            if self._answers():
                return
            self.stop()
        pytest.fail(f"optuna-dashboard did not answer:\n{self.log.read_text(errors='replace')}")

    def _answers(self) -> bool:
        assert self.proc is not None
        deadline = time.monotonic() + _START_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                return False
            try:
                _get(self.base + "/api/meta")
                return True
            except (urllib.error.URLError, ConnectionError):
                time.sleep(0.1)
        return False

    def get(self, path: str) -> Any:
        return _get(self.base + path)

    def stop(self) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        self.proc = None


@pytest.fixture
def serve(tmp_path: Path) -> Iterator[Any]:
    """``serve(storage)``: a started :class:`Dashboard`; every one is stopped after the test."""
    started: list[Dashboard] = []

    def start(storage: str) -> Dashboard:
        dashboard = Dashboard(storage, tmp_path / f"dashboard-{len(started)}.log")
        started.append(dashboard)
        dashboard.start()
        return dashboard

    try:
        yield start
    finally:
        for dashboard in started:
            dashboard.stop()


def _sweep(run: Path, **overrides: Any) -> hs.SweepResult:
    """8 trials of the toy task in arrays of 4, random search and ASHA over 3 epochs: a study
    with completed and pruned trials, each with intermediate values."""
    config = sweep_config(
        run,
        scheduler={"name": "asha", "options": {"grace_period": 1, "reduction_factor": 2}},
        **overrides,
    )
    result = hs.sweep(config, progress=False)
    assert result.counts["running"] == 0
    return result


def _as_served(trial: optuna.trial.FrozenTrial) -> dict[str, Any]:
    """What the dashboard's API says of ``trial``, as Optuna reads it."""
    return {
        "number": trial.number,
        "state": trial.state.name.capitalize(),
        "values": trial.values,
        "params": {k: str(v) for k, v in trial.params.items()},
        "intermediate_values": sorted(trial.intermediate_values.items()),
        "user_attrs": sorted(trial.user_attrs),
    }


def _served(trial: dict[str, Any]) -> dict[str, Any]:
    """The same fields from one trial of the dashboard's ``/api/studies/<id>``."""
    return {
        "number": trial["number"],
        "state": trial["state"],
        "values": trial.get("values"),
        "params": {p["name"]: p["param_external_value"] for p in trial["params"]},
        "intermediate_values": sorted(
            (v["step"], v["value"]) for v in trial["intermediate_values"]
        ),
        "user_attrs": sorted(a["key"] for a in trial["user_attrs"]),
    }


def _assert_serves(dashboard: Dashboard, study: optuna.Study) -> None:
    """The dashboard lists ``study`` and serves each of its trials as Optuna reads them."""
    listed = dashboard.get("/api/studies")["study_summaries"]
    assert [(s["study_name"], s["directions"]) for s in listed] == [
        (study.study_name, ["maximize"])
    ]
    detail = dashboard.get(f"/api/studies/{listed[0]['study_id']}")
    assert detail["name"] == study.study_name
    trials = study.get_trials(deepcopy=False)
    assert len(trials) == 8
    states = {t.state.name for t in trials}
    assert {"COMPLETE", "PRUNED"} <= states <= {"COMPLETE", "PRUNED", "FAIL"}, states
    assert all(t.params and t.intermediate_values for t in trials)
    assert [_served(t) for t in detail["trials"]] == [_as_served(t) for t in trials]
    best = [t["number"] for t in detail["best_trials"]]
    assert best == [study.best_trial.number]


def test_the_readme_command_names_the_quick_examples_journal() -> None:
    """The README's command is ``optuna-dashboard RUN_DIR/optuna.journal`` for the run directory
    the quick example writes (its ``output``), the file the next test serves."""
    from hfsweep.config import load_sweep

    command = _readme_command()
    output = load_sweep(ROOT / "examples" / "digits_quick.yaml").output
    assert command == ["optuna-dashboard", f"{Path(output).relative_to(ROOT)}/optuna.journal"]


def test_the_run_directorys_journal_is_served_as_optuna_reads_it(
    serve: Any, tmp_path: Path
) -> None:
    run = tmp_path / "run"
    result = _sweep(run)
    journal = run / "optuna.journal"  # the default storage's file, as the README names it
    assert journal.is_file()
    dashboard = serve(str(journal))  # the README's command on this run's journal
    study = optuna.load_study(
        study_name="sweep",
        storage=optuna.storages.JournalStorage(
            optuna.storages.journal.JournalFileBackend(str(journal))
        ),
    )
    assert study.best_value == result.best_value
    _assert_serves(dashboard, study)
    # the dashboard only read: no lock left behind
    assert not Path(str(journal) + ".lock").exists()


def _served_study(dashboard: Dashboard) -> dict[str, Any]:
    listed = dashboard.get("/api/studies")["study_summaries"]
    assert len(listed) == 1, listed
    return dashboard.get(f"/api/studies/{listed[0]['study_id']}")  # type: ignore[no-any-return]


def test_a_running_sweep_is_watched_live_and_its_end_shows(
    serve: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The dashboard started on the journal while the sweep trains shows its running trials
    with their first evaluations (training holds after the first evaluation until the test has
    seen them, tests/sweep/_gated.py), and, once the sweep ends, the final study: the journal's
    lock, which the sweep holds around its appends, does not stand in the reader's way."""
    gate = tmp_path / "gate"
    gate.mkdir()
    monkeypatch.setenv("HFSWEEP_TEST_GATE", str(gate))
    monkeypatch.setattr(_gated, "_drawn", 0)
    run = tmp_path / "run"
    journal = run / "optuna.journal"
    seen: dict[str, Any] = {}

    def watch() -> None:
        try:
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline and not _has_trials(journal):
                time.sleep(0.05)
            seen["dashboard"] = dashboard = serve(str(journal))
            while time.monotonic() < deadline:
                trials = _served_study(dashboard)["trials"]
                running = [t for t in trials if t["state"] == "Running"]
                if any(t["intermediate_values"] for t in running):
                    seen["running"] = running
                    seen["gate_held"] = not (gate / "go").exists()
                    return
                time.sleep(0.2)
        except BaseException as exc:  # reported by the test's thread
            seen["error"] = exc
        finally:
            (gate / "go").touch()

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    _sweep(run, task=_gated.TASK)
    watcher.join(timeout=60)
    assert "error" not in seen, seen.get("error")
    assert seen.get("running") and seen["gate_held"], "no running trial was seen"
    study = optuna.load_study(
        study_name="sweep",
        storage=optuna.storages.JournalStorage(
            optuna.storages.journal.JournalFileBackend(str(journal))
        ),
    )
    for t in seen["running"]:  # what was seen mid-sweep is the start of what was recorded
        steps = [(v["step"], v["value"]) for v in t["intermediate_values"]]
        assert steps == sorted(study.trials[t["number"]].intermediate_values.items())[: len(steps)]
    # the dashboard keeps trials for 2 s before it reads them again: wait for the end to show
    deadline = time.monotonic() + 30
    while any(t["state"] == "Running" for t in _served_study(seen["dashboard"])["trials"]):
        assert time.monotonic() < deadline, "the dashboard still shows running trials"
        time.sleep(0.5)
    _assert_serves(seen["dashboard"], study)


def _has_trials(journal: Path) -> bool:
    """Whether the journal holds a created trial (the sweep has asked its first array)."""
    try:
        return '"op_code":4' in journal.read_text(encoding="utf-8")
    except FileNotFoundError:
        return False


def test_a_shared_journal_file_is_served(serve: Any, tmp_path: Path) -> None:
    shared = tmp_path / "shared" / "study.log"
    shared.parent.mkdir()
    _sweep(tmp_path / "run", storage=f"journal://{shared}")
    dashboard = serve(str(shared))
    storage = optuna.storages.JournalStorage(
        optuna.storages.journal.JournalFileBackend(str(shared))
    )
    _assert_serves(dashboard, optuna.load_study(study_name="sweep", storage=storage))


@pytest.mark.slow
def test_a_postgresql_study_is_served(serve: Any, postgres: str, tmp_path: Path) -> None:
    _sweep(tmp_path / "run", storage=postgres)
    dashboard = serve(postgres)
    _assert_serves(dashboard, optuna.load_study(study_name="sweep", storage=postgres))


def test_the_dashboard_is_in_the_dashboard_and_test_extras() -> None:
    """``pip install "hfsweep[dashboard]"`` gives the command the README shows."""
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"
    ]
    for extra in ("dashboard", "test"):
        assert any(d.startswith("optuna-dashboard") for d in extras[extra]), extra
    assert os.access(_DASHBOARD, os.X_OK)
