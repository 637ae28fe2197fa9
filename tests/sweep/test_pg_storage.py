"""A sweep's study in a real PostgreSQL server (tests/_postgres.py): a wrong password, port or
database is refused before anything is written; the password is never shown or stored; it can
come from the environment; a database restart mid-sweep is ridden out, and one that lasts
longer than ``storage_retry`` stops the sweep in one paragraph, resumable with nothing lost."""

from __future__ import annotations

import json
import re
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy.exc import OperationalError

import hfsweep as hs
from hfsweep import report
from hfsweep.cli import main
from hfsweep.config import ConfigError, parse_sweep
from hfsweep.storage.db_url import mask, scrub

from . import _gated
from ._toy import sweep_config
from .test_preflight import refused

PASSWORD = "s3cret-test"  # tests/_postgres.py's
TOY_SWEEP = """\
task: "sweep._toy:TASK"
search_space:
  lr: {type: float, low: 1.0e-3, high: 0.5, log: true}
  momentum: {type: float, low: 0.0, high: 0.9}
searcher: random
budget: {trials: 4, epochs: 2}
metric: val_accuracy
mode: max
fusion: {size: 2, device: cpu}
"""


def _tells(log: Path) -> Counter[int]:
    """How many times the sweep log says each trial ended."""
    text = log.read_text(encoding="utf-8")
    return Counter(
        int(n)
        for n in re.findall(r"hfsweep\.sweep: trial (\d+) (?:completed|stopped|failed)", text)
    )


def _all_outputs(capsys: pytest.CaptureFixture[str], run: Path) -> str:
    captured = capsys.readouterr()
    files = [
        p.read_text(encoding="utf-8")
        for p in run.rglob("*")
        if p.suffix in (".json", ".log", ".csv")
    ]
    return "\n".join([captured.out, captured.err, *files])


# ---------------------------------------------------------------------------- the URL
@pytest.mark.parametrize(
    ("url", "shown"),
    [
        ("postgresql://me:pw@db:5432/optuna", "postgresql://me:***@db:5432/optuna"),
        ("postgresql://me:p@s/s@db/optuna?x=1", "postgresql://me:***@db/optuna?x=1"),
        ("postgresql://me:${PW}@db/optuna", "postgresql://me:${PW}@db/optuna"),
        ("postgresql://me:a${PW}@db/optuna", "postgresql://me:***@db/optuna"),
        ("postgresql://me@db/optuna", "postgresql://me@db/optuna"),
        ("sqlite:///study.db", "sqlite:///study.db"),
        ("${DATABASE_URL}", "${DATABASE_URL}"),
    ],
)
def test_a_password_is_masked_and_a_reference_kept(url: str, shown: str) -> None:
    assert mask(url) == shown


def test_scrub_removes_the_password_as_written_and_decoded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HFSWEEP_TEST_PW", "p@ss")
    url = "postgresql://me:${HFSWEEP_TEST_PW}@db/optuna"
    assert scrub("auth p@ss failed", url) == "auth *** failed"
    assert scrub("auth x%40y failed (x@y)", "postgresql://me:x%40y@db/o") == "auth *** failed (***)"


def test_storage_retry_is_a_duration() -> None:
    base = sweep_config("run", task=_gated.TASK)
    assert parse_sweep(base).storage_retry_s == 120.0
    assert parse_sweep({**base, "storage_retry": "2m"}).storage_retry_s == 120.0
    assert parse_sweep({**base, "storage_retry": None}).storage_retry_s is None
    with pytest.raises(ConfigError, match="storage_retry: -1 is not a positive number"):
        parse_sweep({**base, "storage_retry": -1})


def test_a_storage_that_is_no_url_is_refused_without_its_password() -> None:
    base = sweep_config("run", task=_gated.TASK)
    with pytest.raises(ConfigError, match=r"storage: 'postgress://me:\*\*\*@db/x' is not") as info:
        parse_sweep({**base, "storage": "postgress://me:s3cret@db/x"})
    assert "s3cret" not in str(info.value)


# ---------------------------------------------------------------------------- opening it
@pytest.mark.parametrize("wrong", ["password", "port", "database"])
def test_a_wrong_password_port_or_database_is_refused_before_anything_is_written(
    postgres: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: Any, wrong: str
) -> None:
    port = re.search(r":(\d+)/", postgres).group(1)  # type: ignore[union-attr]
    url = {
        "password": postgres.replace(PASSWORD, "not-" + PASSWORD),
        "port": postgres.replace(f":{port}/", ":1/"),
        "database": postgres.rsplit("/", 1)[0] + "/no_such_db",
    }[wrong]
    err = refused(tmp_path, monkeypatch, capsys, f"storage: '{url}'\n", "storage")
    server_says = {
        "password": 'password authentication failed for user "hfsweep"',
        "port": "Connection refused",
        "database": 'database "no_such_db" does not exist',
    }[wrong]
    assert server_says in err, err
    assert "cannot connect to postgresql://hfsweep:***@127.0.0.1:" in err
    assert PASSWORD not in err


def test_a_port_that_never_answers_is_given_up_on() -> None:
    """Something listens (the kernel completes the handshake) but never speaks PostgreSQL: the
    check ends with the driver's timeout instead of hanging."""
    import socket

    from hfsweep.storage.database import check_connection

    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(1)
        port = listener.getsockname()[1]
        answer = check_connection(f"postgresql://me:pw@127.0.0.1:{port}/db", timeout_s=2)
    assert answer is not None and "timeout" in answer


def test_an_unset_variable_in_the_url_is_refused_naming_it(
    postgres: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: Any
) -> None:
    monkeypatch.delenv("HFSWEEP_TEST_DB_PASSWORD", raising=False)
    url = postgres.replace(PASSWORD, "${HFSWEEP_TEST_DB_PASSWORD}")
    err = refused(tmp_path, monkeypatch, capsys, f"storage: '{url}'\n", "storage")
    assert "environment variable HFSWEEP_TEST_DB_PASSWORD" in err and "not set" in err


@pytest.mark.slow
def test_the_password_and_the_whole_url_come_from_the_environment(
    postgres: str,
    postgres_server_shared: Any,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: Any,
) -> None:
    """A committed sweep file names ${VARIABLES}; sweep.json keeps the references, so resume
    and report expand them again; a variable that now names another database is refused on
    resume."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HFSWEEP_TEST_DB_PASSWORD", PASSWORD)
    url = postgres.replace(PASSWORD, "${HFSWEEP_TEST_DB_PASSWORD}")
    Path("sweep.yaml").write_text(TOY_SWEEP + f"storage: '{url}'\n", encoding="utf-8")
    assert main(["run", "sweep.yaml", "--quiet"]) == 0
    saved = json.loads(Path("runs/sweep/sweep.json").read_text(encoding="utf-8"))
    assert saved["storage"] == url
    assert main(["run", "sweep.yaml", "--quiet", "--resume"]) == 0
    run = Path("runs/sweep")
    assert len(report.load_study(run, report.read_sweep(run)).trials) == 4  # what report reads
    assert PASSWORD not in _all_outputs(capsys, tmp_path / "runs")

    monkeypatch.setenv("HFSWEEP_TEST_DB_URL", postgres)
    Path("whole.yaml").write_text(
        TOY_SWEEP + "storage: '${HFSWEEP_TEST_DB_URL}'\n", encoding="utf-8"
    )
    assert main(["validate", "whole.yaml"]) == 0
    assert main(["run", "whole.yaml", "--quiet"]) == 0  # a second study in that database
    saved = json.loads(Path("runs/whole/sweep.json").read_text(encoding="utf-8"))
    assert saved["storage"] == "${HFSWEEP_TEST_DB_URL}"
    monkeypatch.setenv("HFSWEEP_TEST_DB_URL", postgres_server_shared.create_database())
    assert main(["run", "whole.yaml", "--quiet", "--resume"]) == 2
    err = capsys.readouterr().err
    assert "holds no study 'whole', which this sweep started" in err and PASSWORD not in err
    assert PASSWORD not in _all_outputs(capsys, tmp_path / "runs")


# ---------------------------------------------------------------------------- never shown
@pytest.mark.slow
def test_the_password_is_masked_in_the_summary_sweep_json_log_errors_and_report(
    postgres: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: Any
) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("PGPASSWORD", raising=False)
    Path("sweep.yaml").write_text(TOY_SWEEP + f"storage: '{postgres}'\n", encoding="utf-8")
    assert main(["run", "sweep.yaml"]) == 0
    out = _all_outputs(capsys, tmp_path / "runs")
    assert "storage postgresql://hfsweep:***@127.0.0.1:" in out  # the summary
    saved = json.loads(Path("runs/sweep/sweep.json").read_text(encoding="utf-8"))
    assert saved["storage"] == mask(postgres) != postgres
    assert PASSWORD not in out

    # resuming compares the config with sweep.json's: the masked URL is the same sweep
    assert main(["run", "sweep.yaml", "--resume", "--quiet"]) == 0
    # an error that names the storage: the study exists already
    assert main(["run", "sweep.yaml", "--output", "other", "--quiet"]) == 2
    err = capsys.readouterr().err
    assert "already has a study named 'sweep'" in err and "hfsweep:***@" in err
    assert PASSWORD not in err

    # sweep.json has no password to report with: the driver's own PGPASSWORD gives it
    assert main(["report", "runs/sweep"]) == 2
    err = capsys.readouterr().err
    assert "PGPASSWORD" in err and PASSWORD not in err
    monkeypatch.setenv("PGPASSWORD", PASSWORD)
    assert main(["report", "runs/sweep"]) == 0
    assert PASSWORD not in _all_outputs(capsys, tmp_path / "runs")


# ---------------------------------------------------------------------------- restarts
def _stop_when_training(server: Any, gate: Path, down_s: float | None) -> threading.Thread:
    """A thread that stops ``server`` once the sweep's training reaches the gate, lets the
    training go on, and (unless ``down_s`` is None) starts the server again ``down_s`` later."""

    def run() -> None:
        deadline = time.monotonic() + 60
        while not (gate / "blocked").exists() and time.monotonic() < deadline:
            time.sleep(0.01)
        server.stop()
        (gate / "go").touch()
        if down_s is not None:
            time.sleep(down_s)
            server.start()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


@pytest.mark.slow
def test_a_database_restart_mid_sweep_is_ridden_out(
    postgres_server: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: Any
) -> None:
    gate = tmp_path / "gate"
    gate.mkdir()
    monkeypatch.setenv("HFSWEEP_TEST_GATE", str(gate))
    monkeypatch.setattr(_gated, "_drawn", 0)
    url = postgres_server.create_database()
    thread = _stop_when_training(postgres_server, gate, down_s=1.0)
    config = sweep_config(tmp_path / "run", task=_gated.TASK, storage=url, storage_retry=60)
    result = hs.sweep(config, progress=True)
    thread.join()
    shown = capsys.readouterr().err  # the progress line says why the sweep stalls
    assert "trying again for up to 60 s" in shown and "reachable again after" in shown
    assert (gate / "go").exists()  # the server was down while the sweep trained
    assert result.counts == {"completed": 8, "stopped": 0, "failed": 0, "running": 0}
    assert _tells(tmp_path / "run" / "sweep.log") == Counter(range(8))
    log = (tmp_path / "run" / "sweep.log").read_text(encoding="utf-8")
    assert "trying again for up to 60 s" in log and "reachable again after" in log
    assert PASSWORD not in log


@pytest.mark.slow
def test_a_database_down_longer_than_storage_retry_stops_the_sweep_then_resume_finishes(
    postgres_server: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: Any
) -> None:
    gate = tmp_path / "gate"
    gate.mkdir()
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HFSWEEP_TEST_GATE", str(gate))
    monkeypatch.setattr(_gated, "_drawn", 0)
    url = postgres_server.create_database()
    Path("sweep.yaml").write_text(
        TOY_SWEEP.replace("sweep._toy:TASK", "sweep._gated:TASK").replace("trials: 4", "trials: 6")
        + f"storage: '{url}'\nstorage_retry: 1\n",
        encoding="utf-8",
    )
    thread = _stop_when_training(postgres_server, gate, down_s=None)
    assert main(["run", "sweep.yaml", "--quiet"]) == 1
    thread.join()
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err  # one paragraph
    assert err.startswith("hfsweep run: the sweep's storage postgresql://hfsweep:***@127.0.0.1:")
    assert "could not be reached for 1 s (storage_retry: 1 s)" in err
    assert "Connection refused" in err  # the server's (here: the OS's) own message
    assert "continue with hfsweep run sweep.yaml --resume" in err and PASSWORD not in err

    postgres_server.start()
    text = Path("sweep.yaml").read_text(encoding="utf-8")  # storage_retry may change on resume
    Path("sweep.yaml").write_text(text.replace("storage_retry: 1", "storage_retry: 30"))
    assert main(["run", "sweep.yaml", "--quiet", "--resume"]) == 0
    trials = json.loads(Path("runs/sweep/state.json").read_text(encoding="utf-8"))
    assert trials["arrays"] and all(a["done"] for a in trials["arrays"])
    import optuna

    study = optuna.load_study(study_name="sweep", storage=url)
    assert [t.state.name for t in study.trials] == ["COMPLETE"] * 6
    assert _tells(Path("runs/sweep/sweep.log")) == Counter(range(6))  # none told twice


# ---------------------------------------------------------------------------- the retries
class _Flaky:
    """An Optuna storage whose named calls fail ``times`` times with a lost connection; with
    ``after=True`` the call's work is done first, as when a commit's answer is lost."""

    def __init__(self, inner: Any, name: str, times: int, after: bool = False) -> None:
        self.inner, self.name, self.times, self.after = inner, name, times, after

    def __getattr__(self, attr: str) -> Any:
        real = getattr(self.inner, attr)
        if attr != self.name:
            return real

        def call(*args: Any, **kwargs: Any) -> Any:
            if self.times > 0:
                self.times -= 1
                if self.after:
                    real(*args, **kwargs)
                raise OperationalError(
                    "UPDATE trials", {}, Exception("server closed the connection")
                )
            return real(*args, **kwargs)

        return call


def _retrying(inner: Any, retry_s: float) -> tuple[Any, list[float]]:
    from hfsweep.storage.database import RetryingStorage, _Retrier

    waits: list[float] = []
    now = [0.0]

    def sleep(s: float) -> None:
        waits.append(s)
        now[0] += s

    retrier = _Retrier(
        where="db", url="postgresql://me:pw@db/x", retry_s=retry_s, resume="--resume",
        sleep=sleep, clock=lambda: now[0],
    )  # fmt: skip
    return RetryingStorage(inner, retrier), waits


def test_a_trial_end_whose_answer_was_lost_is_not_told_twice() -> None:
    """The first try commits the end and loses the answer; the retry finds the trial already
    ended as asked, and counts as done instead of raising UpdateFinishedTrialError."""
    import optuna

    memory = optuna.storages.InMemoryStorage()
    flaky = _Flaky(memory, "set_trial_state_values", times=1, after=True)
    storage, waits = _retrying(flaky, retry_s=60)
    study = optuna.create_study(storage=storage)
    trial = study.ask()
    study.tell(trial, 0.5)
    assert waits == [0.5]
    assert [(t.state.name, t.value) for t in study.trials] == [("COMPLETE", 0.5)]


def test_after_giving_up_every_call_fails_at_once() -> None:
    """Once the retry time is spent, the sweep is stopping: its last calls (publishing results
    in a finally) raise the same error without waiting the whole time again."""
    import optuna

    from hfsweep.storage.database import StorageUnavailable

    memory = optuna.storages.InMemoryStorage()
    study_id = memory.create_new_study([optuna.study.StudyDirection.MINIMIZE], "s")
    storage, waits = _retrying(_Flaky(memory, "get_all_trials", times=100), retry_s=10)
    with pytest.raises(StorageUnavailable, match="could not be reached for 10 s") as first:
        storage.get_all_trials(study_id)
    assert sum(waits) == 10 and "pw" not in str(first.value)
    waited = len(waits)
    with pytest.raises(StorageUnavailable) as second:
        storage.get_all_trials(study_id)
    assert len(waits) == waited and second.value.__cause__ is first.value
