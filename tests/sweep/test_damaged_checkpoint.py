"""An array's checkpoint (``arrays/K/array.pt``) damaged while the sweep was down: cut short,
emptied, overwritten, a pickle the safe loader cannot read, or a whole torch file that is not
the array's. The resume sets it aside, warns once naming it, trains the array's running trials
again from step 0 with the same seeds, and finishes the budget with every trial told once. (A
file that names a type the safe loader does not build, planted or of the user's own, is still
refused: tests/sweep/test_shared_run_dir.py.)"""

from __future__ import annotations

import os
import pickle
import shutil
import signal
import subprocess
import sys
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import optuna
import pytest
import torch
from optuna.storages.journal import JournalFileBackend
from optuna.trial import TrialState

import hfsweep.training.run
from hfsweep._io import atomic_save
from hfsweep.cli import main
from hfsweep.training.packed import load as load_packed
from hfsweep.training.packed import pack

from ._toy import write_sweep_file as _write_sweep

TRIALS = 4


def _run(sweep: Path, run: Path, *extra: str) -> int:
    return main(["run", str(sweep), "--output", str(run), "--quiet", *extra])


def _study(run: Path) -> optuna.Study:
    storage = optuna.storages.JournalStorage(JournalFileBackend(str(run / "optuna.journal")))
    return optuna.load_study(study_name="sweep", storage=storage)


@pytest.fixture(scope="module")
def undisturbed(tmp_path_factory: pytest.TempPathFactory) -> dict[int, float | None]:
    """Each trial's value in the same sweep run through without a crash."""
    folder = tmp_path_factory.mktemp("undisturbed")
    assert _run(_write_sweep(folder), folder / "run") == 0
    return {t.number: t.value for t in _study(folder / "run").get_trials()}


@pytest.fixture(scope="module")
def crashed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The sweep stopped right after its array wrote its first checkpoint (the first
    evaluation of every trial): all TRIALS trials are RUNNING in array 0 (copied by each
    test that damages the checkpoint)."""
    folder = tmp_path_factory.mktemp("crashed")
    sweep, run = _write_sweep(folder), folder / "run"
    real = hfsweep.training.run.atomic_save

    def crash_after(obj: Any, path: Path) -> None:
        real(obj, path)
        if path.name == "array.pt":
            raise KeyboardInterrupt  # stops the sweep where it is, as a kill would

    hfsweep.training.run.atomic_save = crash_after  # type: ignore[assignment]
    try:
        assert _run(sweep, run) == 130
    finally:
        hfsweep.training.run.atomic_save = real  # type: ignore[assignment]
    trials = _study(run).get_trials()
    assert [t.state for t in trials] == [TrialState.RUNNING] * TRIALS
    assert all(t.intermediate_values for t in trials)  # evaluated once before the stop
    assert (run / "arrays" / "0" / "array.pt").is_file()
    return folder


def _valid_but(change: Callable[[dict[str, Any]], None]) -> Callable[[Path], None]:
    """A damage that writes the checkpoint back whole, as a torch file, after ``change``."""

    def damage(path: Path) -> None:
        payload = load_packed(path)
        change(payload)
        atomic_save(pack(payload), path)

    return damage


def _reshape_first_weight(payload: dict[str, Any]) -> None:
    saved = payload["arrays"][0]["slots"][0]["saved"]
    name = next(iter(saved["model"]))
    saved["model"][name] = torch.zeros(7, 5, dtype=torch.float64)


def _other_key(payload: dict[str, Any]) -> None:
    payload["key"] = '{"batch_size": 1}'


DAMAGES: dict[str, Callable[[Path], None]] = {
    "cut short": lambda p: p.write_bytes(p.read_bytes()[: p.stat().st_size // 2]),
    "emptied": lambda p: p.write_bytes(b""),
    "overwritten with other bytes": lambda p: p.write_bytes(os.urandom(4096)),
    "a torch file of something else": lambda p: torch.save({"weights": torch.ones(3)}, p),
    "a plain pickle the safe loader refuses": lambda p: p.write_bytes(pickle.dumps([1, 2])),
    "another array's key": _valid_but(_other_key),
    "a state that does not fit the model": _valid_but(_reshape_first_weight),
}


#: the cases run by default; the others are slow-marked (each trains the sweep again)
_FAST = ("cut short", "emptied", "a state that does not fit the model")


@pytest.mark.parametrize(
    "damage",
    [d if d in _FAST else pytest.param(d, marks=pytest.mark.slow) for d in DAMAGES],
)
def test_a_damaged_array_checkpoint_is_set_aside_and_its_trials_train_again(
    crashed: Path,
    undisturbed: dict[int, float | None],
    tmp_path: Path,
    damage: str,
    capsys: pytest.CaptureFixture[str],
) -> None:
    shutil.copytree(crashed, tmp_path, dirs_exist_ok=True)
    sweep, run = tmp_path / "sweep.yaml", tmp_path / "run"
    checkpoint = run / "arrays" / "0" / "array.pt"
    DAMAGES[damage](checkpoint)
    damaged = checkpoint.read_bytes()

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert _run(sweep, run, "--resume") == 0, capsys.readouterr().err
    messages = [str(w.message) for w in caught if "is damaged" in str(w.message)]
    assert len(messages) == 1, messages
    copies = list((run / "arrays").glob("array-0.pt.damaged-*"))
    assert len(copies) == 1 and copies[0].read_bytes() == damaged
    assert str(checkpoint) in messages[0] and str(copies[0]) in messages[0]
    assert "running trials 0, 1, 2, 3 start again from step 0" in messages[0]
    assert "Traceback" not in capsys.readouterr().err
    log = (run / "sweep.log").read_text()
    assert log.count(" is damaged: ") == 1  # said once, in the log too

    # every trial trained again from step 0 with its seed: the values of an undisturbed
    # run, each told once
    trials = _study(run).get_trials()
    assert [t.state for t in trials] == [TrialState.COMPLETE] * TRIALS
    assert {t.number: t.value for t in trials} == undisturbed
    assert not (run / "arrays" / "0").exists()
    assert main(["report", str(run), "--out", str(tmp_path / "report")]) == 0


_KILLED_MID_WRITE = """
import os, signal, sys, torch
from pathlib import Path
from hfsweep._io import atomic_save

def killed(obj, f):
    f.write(b"PK\\x03\\x04" + bytes(1000))  # the start of a torch file, then the kill
    f.flush()
    os.kill(os.getpid(), signal.SIGKILL)

torch.save = killed
atomic_save({"w": torch.zeros(3)}, Path(sys.argv[1]))
"""


@pytest.mark.slow
@pytest.mark.skipif(not hasattr(signal, "SIGKILL"), reason="needs POSIX signals")
def test_a_checkpoint_write_cut_by_sigkill_leaves_the_old_checkpoint_whole(
    tmp_path: Path,
) -> None:
    """The trainer writes ``array.pt`` to a temporary file renamed over the old one: a
    SIGKILL in the middle of the write leaves the old checkpoint as it was."""
    path = tmp_path / "array.pt"
    atomic_save(pack({"w": torch.ones(3)}), path)
    before = path.read_bytes()
    proc = subprocess.run([sys.executable, "-c", _KILLED_MID_WRITE, str(path)], check=False)
    assert proc.returncode == -signal.SIGKILL
    assert path.read_bytes() == before
    assert torch.equal(load_packed(path)["w"], torch.ones(3))


@pytest.mark.slow
def test_on_the_ray_backend_a_damaged_checkpoint_is_set_aside_too(
    crashed: Path, undisturbed: dict[int, float | None], tmp_path: Path, shared_ray: Any
) -> None:
    """The Ray backend resumes arrays from the same run directory: the checkpoint is checked
    on the driver before any worker reads it (tests/conftest.py's local Ray: 2 CPUs,
    loopback)."""
    pytest.importorskip("ray")
    shared_ray.start()
    shutil.copytree(crashed, tmp_path, dirs_exist_ok=True)
    run = tmp_path / "run"
    (run / "arrays" / "0" / "array.pt").write_bytes(b"")
    sweep = _write_sweep(tmp_path, backend="ray")
    config = run / "sweep.json"  # the backend may change on resume
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert _run(sweep, run, "--resume") == 0
    assert len([w for w in caught if "is damaged" in str(w.message)]) == 1
    assert config.exists()
    trials = _study(run).get_trials()
    assert {t.number: t.value for t in trials} == undisturbed


@pytest.mark.slow
@pytest.mark.skipif(not hasattr(signal, "SIGKILL"), reason="needs POSIX signals")
def test_after_a_sigkill_every_damaged_checkpoint_is_set_aside_and_the_budget_finishes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The issue's case: ``hfsweep run`` SIGKILLed mid-sweep (tests/sweep/test_kill_resume.py's
    sweep: ASHA, refills, three arrays of 4), then every array checkpoint it left cut short.
    The resume warns once per file, trains their trials again, and ends with every budgeted
    trial finished and told once."""
    from ._killed import check_final_study, interrupt_after, reaped, start_cli, unlogged_tells
    from ._toy import HOLD_AFTER
    from .test_kill_resume import TRIALS as KILLED_TRIALS
    from .test_kill_resume import _write_sweep as write_killed_sweep

    sweep = write_killed_sweep(tmp_path)
    run = tmp_path / "run"
    monkeypatch.setenv("HFSWEEP_TEST_HOLD_LOG", str(run / "sweep.log"))
    with reaped(start_cli(sweep, session=True)) as proc:
        interrupt_after(proc, run, HOLD_AFTER, signal.SIGKILL)
        proc.wait(timeout=60)
    assert proc.returncode == -signal.SIGKILL
    monkeypatch.delenv("HFSWEEP_TEST_HOLD_LOG")
    unlogged = unlogged_tells(run)
    checkpoints = sorted((run / "arrays").glob("*/array.pt"))
    assert checkpoints  # killed while arrays trained
    for path in checkpoints:
        path.write_bytes(path.read_bytes()[:100])

    with reaped(start_cli(sweep, "--resume", session=True)) as resumed:
        _out, err = resumed.communicate(timeout=300)
    assert resumed.returncode == 0, err
    assert err.count(" is damaged: ") == len(checkpoints), err
    assert "bug in hfsweep" not in err
    assert len(list((run / "arrays").glob("array-*.pt.damaged-*"))) == len(checkpoints)
    check_final_study(run, KILLED_TRIALS, unlogged)
