"""Two drivers (``hfsweep run --resume`` in two run directories) sharing one study in a database
or a journal file:
together they ask exactly ``budget.trials``, each trains only its own trials and those of a
driver that is gone, and none is trained by both at once, with either killed (SIGKILL) and
resumed at any moment."""

from __future__ import annotations

import json
import os
import random
import re
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

import optuna
import pytest
from optuna.storages.journal import JournalFileBackend
from optuna.trial import TrialState

from hfsweep.training import ArrayTrainer

from ._killed import _default_sigint
from ._toy import HOLD_AFTER, _tells

HERE = Path(__file__).resolve().parent
SLOW = f"{HERE / '_toy.py'}:SLOW_TASK"
HELD = f"{HERE / '_toy.py'}:HELD_TASK"
GATED = f"{HERE / '_toy.py'}:START_GATED_TASK"
TRIALS = 12
STUDY = "shared"
#: fast heartbeats, so that a killed driver's pid or heartbeat gives it away within seconds
ENV = {"HFSWEEP_DRIVER_HEARTBEAT_S": "0.5", "HFSWEEP_DRIVER_GRACE_S": "3"}

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not hasattr(signal, "SIGKILL"), reason="needs POSIX signals"),
]


@pytest.fixture(params=["postgresql", "sqlite", "journal"])
def storage(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """The study's storage: a fresh PostgreSQL database, an SQLite file, or a journal file
    outside both run directories."""
    if request.param == "postgresql":
        return str(request.getfixturevalue("postgres"))
    if request.param == "journal":
        (tmp_path / "shared").mkdir()
        return f"journal://{tmp_path / 'shared' / 'study.log'}"
    return f"sqlite:///{tmp_path / 'study.db'}"


@pytest.fixture(params=["postgresql", "journal"])
def shared(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """A study's storage for the adoption tests: a fresh PostgreSQL database, or a journal
    file outside both run directories."""
    if request.param == "postgresql":
        return str(request.getfixturevalue("postgres"))
    (tmp_path / "shared").mkdir()
    return f"journal://{tmp_path / 'shared' / 'study.log'}"


def _opened(storage: Any) -> Any:
    """What ``optuna.load_study`` takes for ``storage``: a journal storage for a
    ``journal://`` one (read only here: its file is created by the drivers), else as given."""
    if isinstance(storage, str) and storage.startswith("journal://"):
        return optuna.storages.JournalStorage(JournalFileBackend(storage[len("journal://") :]))
    return storage


class _Driver:
    """One run directory's ``hfsweep run --resume`` processes, one after another."""

    def __init__(
        self, folder: Path, storage: str | None, task: str = SLOW, trials: int = TRIALS
    ) -> None:
        folder.mkdir()
        self.folder = folder
        self.run = folder / "run"
        self.sweep = folder / "sweep.yaml"
        self.sweep.write_text(
            f"""
task: "{task}"
search_space:
  lr: {{type: float, low: 1.0e-3, high: 0.5, log: true}}
  momentum: {{type: float, low: 0.0, high: 0.9}}
searcher: random
scheduler: {{name: asha, options: {{grace_period: 1, reduction_factor: 2}}}}
budget: {{trials: {trials}, epochs: 3}}
metric: val_accuracy
mode: max
fusion: {{size: 4, device: cpu}}
storage: {json.dumps(storage)}
study_name: {STUDY}
output: run
"""
        )
        self.proc: subprocess.Popen[str] | None = None
        #: wall times at which a process of this driver was killed
        self.kills: list[float] = []

    def start(self, *, launcher: tuple[str, ...] = ("-m", "hfsweep.cli"), **env: str) -> None:
        """Start ``hfsweep run --resume`` (through ``launcher``: Python's arguments before
        the CLI's) with ``env`` added to the test's environment."""
        self.proc = subprocess.Popen(
            [sys.executable, *launcher, "run", str(self.sweep), "--quiet", "--resume"],
            cwd=self.folder,
            env={
                **os.environ,
                **ENV,
                **env,
                "PYTHONUNBUFFERED": "1",
                "PYTHONFAULTHANDLER": "1",
                "HFSWEEP_CACHE_DIR": str(self.folder),
            },
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            preexec_fn=_default_sigint,  # the test's SIGINT reaches the sweep
        )

    def kill(self) -> bool:
        """SIGKILL the running process; whether it was still running."""
        assert self.proc is not None
        if self.proc.poll() is not None:
            self.finished()
            return False
        self.kills.append(time.time())  # before the kill: it trained until a moment after
        self.proc.kill()
        self.proc.communicate(timeout=60)
        return True

    def finished(self, timeout: float = 120) -> str:
        """Wait for the process; it must have exited 0. Returns its stderr."""
        _out, err = self.communicate(timeout)
        assert self.proc is not None and self.proc.returncode == 0, err
        return err

    def communicate(self, timeout: float) -> tuple[str, str]:
        """The process's output once it exits; one that does not within ``timeout`` seconds
        is made to print every thread's stack (SIGABRT, caught by ``faulthandler``) and the
        test fails with it, so that a hang says where it hangs."""
        assert self.proc is not None
        try:
            return self.proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.send_signal(signal.SIGABRT)
            _out, err = self.proc.communicate(timeout=30)
            pytest.fail(
                f"{self.sweep}: still running after {timeout} s; its stacks:\n{err[-20000:]}"
            )

    def log(self) -> str:
        path = self.run / "sweep.log"
        return path.read_text() if path.exists() else ""


def _finished(storage: str) -> int:
    """Finished trials in the study (0 before it exists)."""
    if storage.startswith("journal://") and not Path(storage[len("journal://") :]).exists():
        return 0
    try:
        study = optuna.load_study(study_name=STUDY, storage=_opened(storage))
    except KeyError:
        return 0
    done = (TrialState.COMPLETE, TrialState.PRUNED, TrialState.FAIL)
    return len(study.get_trials(deepcopy=False, states=done))


def _wait(what: str, ready: object, *drivers: _Driver) -> None:
    deadline = time.monotonic() + 120
    while not ready():  # type: ignore[operator]
        for d in drivers:
            if d.proc is not None and d.proc.poll() not in (None, 0):
                _out, err = d.proc.communicate()
                pytest.fail(f"{d.folder.name} exited {d.proc.returncode} before {what}:\n{err}")
        if time.monotonic() > deadline:
            pytest.fail(f"no {what} within 120 s")
        time.sleep(0.05)


# ---------------------------------------------------------------------- training intervals
_LINE = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) \w+ [\w.]+: (.*)$")
_STARTS = (
    re.compile(r"^array \d+ \(.*\): training \d+ trials: (.*)$"),
    re.compile(r"^array \d+: resuming (.*) from its checkpoint$"),
    re.compile(r"^member (trial-\d+) joined the array"),
)
_ENDS = (
    re.compile(r"^member (trial-\d+) \w+ after \d+ steps"),
    re.compile(r"^member (trial-\d+) failed before training"),
    re.compile(r"^trial (\d+) (?:completed|stopped|failed)"),
)


def _events(log: str) -> Iterator[tuple[float, str, int]]:
    """``(wall time, "start" or "end", trial number)`` of every training start and end."""
    for line in log.splitlines():
        m = _LINE.match(line)
        if m is None:
            continue
        when = datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp()
        for kind, patterns in (("start", _STARTS), ("end", _ENDS)):
            for pattern in patterns:
                found = pattern.match(m.group(2))
                if found is not None:
                    for member in found.group(1).split(", "):
                        yield when, kind, int(member.removeprefix("trial-"))


def _intervals(driver: _Driver) -> list[tuple[int, float, float]]:
    """``(trial, start, end)`` of each stretch in which the driver trained a trial: from the
    log's start of it to its end, or to the kill of the process training it."""
    out = []
    open_: dict[int, float] = {}
    kills = list(driver.kills)
    for when, kind, number in _events(driver.log()):
        while kills and kills[0] < when:  # a process of this driver died before this line
            out += [(n, s, kills[0]) for n, s in open_.items()]
            open_.clear()
            kills.pop(0)
        if kind == "start":
            open_.setdefault(number, when)
        elif number in open_:
            out.append((number, open_.pop(number), when))
    end = kills[0] if kills else float("inf")
    return out + [(n, s, end) for n, s in open_.items()]


def _check(
    storage: Any,
    *drivers: _Driver,
    elsewhere: int | None = None,
    void: bool = False,
    trials: int = TRIALS,
    kills: int | None = None,
) -> None:
    """The study holds exactly the budget (``trials``), every trial ended, no trial was told
    twice (trial ``elsewhere`` by no driver here), and no trial was trained by two drivers at
    once. ``void``: the storage went away while the drivers asked, so a trial asked twice
    across it may be void (FAIL, not counted; see hfsweep.storage.drivers), beside the budget.
    ``kills``: how many processes were SIGKILLed (one per driver unless given), each of which
    may have lost the log line of one tell."""
    study = optuna.load_study(study_name=STUDY, storage=_opened(storage))
    everything = study.get_trials()
    voided = [t for t in everything if t.user_attrs.get("void")]
    assert (void or not voided) and {t.state for t in voided} <= {TrialState.FAIL}
    counted = [t for t in everything if not t.user_attrs.get("void")]
    assert [t.number for t in everything] == list(range(len(everything)))
    assert len(counted) == trials, [(t.number, t.state.name) for t in everything]
    ended = (TrialState.COMPLETE, TrialState.PRUNED)
    assert all(t.state in ended for t in counted), [
        (t.number, t.state.name, t.params, t.user_attrs) for t in counted if t.state not in ended
    ]
    numbers = [t.number for t in counted]
    told = Counter(
        n
        for d in drivers
        for n in re.findall(r"hfsweep\.sweep: trial (\d+) (?:completed|stopped|failed)", d.log())
    )
    # told at most once; a trial's log line can be missing where a SIGKILL came between its
    # tell and the line (the study, checked above, has every trial ended)
    assert max(told.values()) == 1, told
    assert set(told) <= {str(n) for n in numbers if n != elsewhere}
    lost = len(drivers) if kills is None else kills
    assert len(told) >= trials - lost - (elsewhere is not None), told
    stretches = [[(n, s, e) for n, s, e in _intervals(d)] for d in drivers]
    for i, mine in enumerate(stretches):
        for theirs in stretches[i + 1 :]:
            both = [
                (n, (s1, e1), (s2, e2))
                for n, s1, e1 in mine
                for m, s2, e2 in theirs
                if n == m and s1 < e2 and s2 < e1
            ]
            assert both == [], "trained by two drivers at once"


# ---------------------------------------------------------------------- tests
def test_two_drivers_killed_and_resumed_ask_exactly_the_budget(
    tmp_path: Path, storage: str
) -> None:
    """Both drivers start together; each is SIGKILLed when the study has a (seeded) random
    number of finished trials and resumed at once."""
    rng = random.Random(2028)
    a, b = _Driver(tmp_path / "a", storage), _Driver(tmp_path / "b", storage)
    a.start()
    b.start()
    first = rng.randint(2, 4)
    second = rng.randint(first + 2, TRIALS - 4)
    _wait(f"{first} finished trials", lambda: _finished(storage) >= first, a, b)
    assert a.kill()
    a.start()
    _wait(f"{second} finished trials", lambda: _finished(storage) >= second, a, b)
    b.kill()
    b.start()
    a.finished()
    b.finished()
    _check(storage, a, b)
    kinds = {"postgresql": "PostgreSQL advisory lock", "sqlite": "SQLite file lock"}
    kind = kinds.get(storage.split(":", 1)[0], "journal file lock")
    assert f"asks and adoptions under a {kind}" in a.log()


def test_a_driver_adopts_a_dead_drivers_trials_which_then_resumes_cleanly(
    tmp_path: Path, shared: str
) -> None:
    """Driver a is killed while its trials run (its training holds after two tells); driver b
    adopts them and finishes the budget; a, resumed, finds its trials ended by b."""
    a, b = _Driver(tmp_path / "a", shared, HELD), _Driver(tmp_path / "b", shared, HELD)
    a.start(HFSWEEP_TEST_HOLD_LOG=str(a.run / "sweep.log"))
    _wait(f"{HOLD_AFTER} tells", lambda: _tells(str(a.run / "sweep.log")) >= HOLD_AFTER, a)
    assert a.kill()
    b.start()
    b.finished()
    assert _finished(shared) == TRIALS
    assert "adopted from driver" in b.log()
    a.start()
    a.finished()
    assert "none of its trials is left to this driver; dropped" in a.log()
    _check(shared, a, b)


def test_a_running_driver_adopts_the_trials_of_one_that_dies(tmp_path: Path, shared: str) -> None:
    """Driver b starts while a trains (held after two tells) and waits at its first batch;
    a is killed; b, let go, adopts a's trials while it runs and trains them too."""
    a, b = _Driver(tmp_path / "a", shared, HELD), _Driver(tmp_path / "b", shared, GATED)
    a.start(HFSWEEP_TEST_HOLD_LOG=str(a.run / "sweep.log"))
    _wait(f"{HOLD_AFTER} tells", lambda: _tells(str(a.run / "sweep.log")) >= HOLD_AFTER, a)
    gate = tmp_path / "gate"
    gate.touch()
    b.start(HFSWEEP_TEST_GATE=str(gate), HFSWEEP_TEST_GATE_LOG=str(b.run / "sweep.log"))
    _wait("b's first array", lambda: ": training " in b.log(), a, b)
    assert "adopted" not in b.log()
    assert a.kill()
    gate.unlink()
    b.finished()
    assert _finished(shared) == TRIALS
    log = b.log()
    assert log.index(": training ") < log.index("adopted from driver")
    a.start()
    a.finished()
    _check(shared, a, b)


def test_a_live_drivers_trials_are_left_alone(tmp_path: Path, shared: str) -> None:
    """The issue's case: a second driver started while the first trains (held after two
    tells) asks the rest of the budget, leaves the first one's running trials to it and ends;
    the first, interrupted and resumed, finishes them."""
    a, b = _Driver(tmp_path / "a", shared, HELD), _Driver(tmp_path / "b", shared, HELD)
    a.start(HFSWEEP_TEST_HOLD_LOG=str(a.run / "sweep.log"))
    _wait(f"{HOLD_AFTER} tells", lambda: _tells(str(a.run / "sweep.log")) >= HOLD_AFTER, a)
    study = optuna.load_study(study_name=STUDY, storage=_opened(shared))
    theirs = {t.number for t in study.get_trials(states=(TrialState.RUNNING,))}
    assert theirs
    b.start()
    b.finished()
    assert len(study.get_trials()) == TRIALS
    running = {t.number for t in study.get_trials(states=(TrialState.RUNNING,))}
    assert running >= theirs  # still a's
    assert re.search(rf"{len(theirs)} running trials belong to other drivers", b.log())
    assert a.proc is not None
    a.proc.send_signal(signal.SIGINT)
    _out, err = a.communicate(60)
    assert a.proc.returncode == 130, err
    a.start()
    a.finished()
    _check(shared, a, b)


def test_a_resumed_driver_leaves_trials_adopted_between_its_first_read_and_its_lock(
    tmp_path: Path, shared: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """CI's ``UpdateFinishedTrialError``, made to happen: driver a is killed while its trials
    run; resumed (here, in this process), it reads the study, and before it takes the study lock
    to claim its running trials, live driver b adopts them (done here by hand, as b's adoption
    writes it). a must claim from what the study says under the lock: b's trials are left to
    b, untrained and untold by a. Before the fix a claimed them from its first read and trained
    them while b trained them too (here a's tells were then refused as another driver's; in
    CI, where b had finished one first, a's tell crashed)."""
    import hfsweep as hs
    from hfsweep.core._resume import _Resume
    from hfsweep.storage.drivers import DRIVER_ATTR, Drivers

    a = _Driver(tmp_path / "a", shared, HELD)
    a.start(HFSWEEP_TEST_HOLD_LOG=str(a.run / "sweep.log"))
    _wait(f"{HOLD_AFTER} tells", lambda: _tells(str(a.run / "sweep.log")) >= HOLD_AFTER, a)
    assert a.kill()
    study = optuna.load_study(study_name=STUDY, storage=_opened(shared))
    b = Drivers(study, tmp_path / "b", shared=True)
    b.start()  # beats from this process: live all through a's resume
    adopted: list[int] = []
    catch_up = _Resume._catch_up

    def adopt_after_the_first_read(self: Any, trials: list[optuna.trial.FrozenTrial]) -> None:
        catch_up(self, trials)  # after the resume's first read, before its lock
        if adopted:
            return
        for t in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
            study._storage.set_trial_user_attr(t._trial_id, DRIVER_ATTR, b.id)
            adopted.append(t.number)

    monkeypatch.setattr(_Resume, "_catch_up", adopt_after_the_first_read)
    monkeypatch.chdir(a.folder)
    monkeypatch.setenv("HFSWEEP_CACHE_DIR", str(a.folder))
    try:
        hs.sweep(str(a.sweep), resume=True, progress=False)
    finally:
        b.close()
    assert adopted, "no running trial of a's to adopt: the race was not set up"
    after = {t.number: t for t in study.get_trials()}
    for n in adopted:  # still b's, running: a neither trained nor told them
        assert after[n].state == TrialState.RUNNING, (n, after[n].state)
        assert after[n].user_attrs[DRIVER_ATTR] == b.id
    log = a.log()
    resumed = {n for when, kind, n in _events(log) if kind == "start" and when > a.kills[-1]}
    assert resumed and not resumed & set(adopted), (resumed, adopted)  # its own, not b's
    assert re.search(rf"{len(adopted)} running trials belong to other drivers", log)
    told = re.findall(r"hfsweep\.sweep: trial (\d+) (?:completed|stopped|failed)", log)
    assert not {int(n) for n in told} & set(adopted)


def test_a_run_directory_whose_trial_another_driver_finished_resumes(tmp_path: Path) -> None:
    """The issue's ``KeyError: 0``: a driver killed while an array trains; one of that array's
    trials is then finished by another driver (done here by hand, in the driver's own journal);
    resumed, the driver stops that member at its first evaluation, tells it nothing and
    finishes the rest."""
    a = _Driver(tmp_path / "a", None, HELD)
    a.start(HFSWEEP_TEST_HOLD_LOG=str(a.run / "sweep.log"))
    _wait(f"{HOLD_AFTER} tells", lambda: _tells(str(a.run / "sweep.log")) >= HOLD_AFTER, a)
    assert a.kill()
    storage = optuna.storages.JournalStorage(JournalFileBackend(str(a.run / "optuna.journal")))
    study = optuna.load_study(study_name=STUDY, storage=storage)
    running = {t.number: t for t in study.get_trials(states=(TrialState.RUNNING,))}
    held = [
        n
        for n in sorted(running)
        if f"trial-{n}" in ArrayTrainer.checkpointed_members(a.run / "arrays" / "0")
    ]
    assert len(held) >= 2  # one to be finished elsewhere, one that stays a's
    other = running[held[0]]
    study._storage.set_trial_user_attr(other._trial_id, "driver", "another driver")
    study.tell(other.number, 0.5)
    a.start()
    a.finished()
    assert re.search(rf"member trial-{other.number} stopped after", a.log())
    _check(storage, a, elsewhere=other.number)
