"""Errors a sweep meets at run time that are neither the task's nor a config's: a full disk under
``torch.save`` (which raises ``RuntimeError``, not ``OSError``) stops the sweep as a run
directory that cannot be written, and an exception in hfsweep's own fused optimizer step is
said to be hfsweep's, not blamed on the task."""

from __future__ import annotations

import errno
import io
from pathlib import Path
from typing import Any

import optuna
import pytest
import torch

import hfsweep as hs
from hfsweep.cli import main
from hfsweep.core.result import _torch_write_failed

from . import _broken


def _states(run: Path) -> list[str]:
    from optuna.storages import JournalStorage
    from optuna.storages.journal import JournalFileBackend

    storage = JournalStorage(JournalFileBackend(str(run / "optuna.journal")))
    study = optuna.load_study(study_name="sweep", storage=storage)
    return [t.state.name for t in study.get_trials()]


class _FullDisk(io.RawIOBase):
    """A file on a disk with ``room`` bytes left: a write past them fails as the kernel's does
    (``OSError(ENOSPC)``), under torch.save's own writer, which then raises what it raises on a
    real full disk."""

    def __init__(self, room: int) -> None:
        self.room = room

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        size = len(memoryview(data))
        if size > self.room:
            raise OSError(errno.ENOSPC, "No space left on device")
        self.room -= size
        return size


def _save_on_a_full_disk(obj: Any, f: Any, *args: Any, **kwargs: Any) -> None:
    full: Any = _FullDisk(100)
    _real_save(obj, full, *args, **kwargs)


_real_save = torch.save


def test_torch_save_on_a_full_disk_raises_a_runtime_error_that_is_recognised(
    tmp_path: Path,
) -> None:
    """What torch.save raises when the disk fills under it (checked here against torch itself,
    as on a tmpfs filled up: "[enforce fail at inline_container.cc:672] . unexpected pos 704 vs
    598", the OSError only its context), and which errors are read as a full disk."""
    with pytest.raises(RuntimeError) as info:
        _save_on_a_full_disk({"w": torch.zeros(1000)}, None)
    exc = info.value
    assert "inline_container" in str(exc) and "unexpected pos" in str(exc), exc
    disk = _torch_write_failed(exc, tmp_path)
    assert disk is not None and disk.errno == errno.ENOSPC
    # another RuntimeError, or torch's message with no disk error behind it on a disk with
    # room, is not a full disk
    assert _torch_write_failed(RuntimeError("unexpected pos 3 vs 4"), tmp_path) is None
    bare = RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")
    assert _torch_write_failed(bare, tmp_path) is None
    assert _torch_write_failed(ValueError(str(exc)), tmp_path) is None


def test_a_full_disk_under_torch_save_stops_the_sweep_as_unwritable_and_it_resumes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """`hfsweep run` whose checkpoints meet a full disk: exit 1 with the run directory's
    message and the resume command (not "unexpected ... bug", not the task's error); the trials
    stay for a resume, which finishes the sweep once there is room."""
    monkeypatch.setattr(torch, "save", _save_on_a_full_disk)
    sweep = tmp_path / "sweep.yaml"
    sweep.write_text(_broken.sweep_yaml("TASK"))
    assert main(["run", str(sweep), "--quiet"]) == 1
    err = capsys.readouterr().err
    assert "cannot write" in err and "No space left on device" in err, err
    assert f"hfsweep run {sweep} --resume" in err, err
    assert "bug" not in err and "unexpected" not in err and "raised" not in err, err
    run = tmp_path / "run"
    assert "FAIL" not in _states(run) and "RUNNING" in _states(run)
    with pytest.raises(hs.SweepError, match="No space left on device") as info:
        hs.sweep(sweep, resume=True, progress=False)
    assert type(info.value).__name__ == "RunDirUnwritable"
    assert isinstance(info.value.__cause__, RuntimeError)

    monkeypatch.undo()
    assert main(["run", str(sweep), "--quiet", "--resume"]) == 0, capsys.readouterr().err
    assert sorted(_states(run)) == ["COMPLETE"] * 4


class _BrokenStep:
    """hfsweep's optimizer step with a bug from its ``after``-th call on."""

    def __init__(self, after: int, error: type[Exception] = ZeroDivisionError) -> None:
        from hfsweep.training import step

        self.real = step.update
        self.calls = 0
        self.after = after
        self.error = error

    def __call__(self, opt: Any, sched: Any, **options: Any) -> None:
        self.calls += 1
        if self.calls >= self.after:
            raise self.error("a bug in the fused optimizer step")
        self.real(opt, sched, **options)


def _no_dry_run(monkeypatch: pytest.MonkeyPatch) -> None:
    """Skip the dry run (which would meet the broken step first; see the validate test)."""
    import hfsweep.core._dryrun as dryrun

    monkeypatch.setattr(dryrun, "dry_run", lambda *args, **kwargs: None)


def test_an_error_in_hfsweeps_optimizer_step_is_hfsweeps_not_the_tasks(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The fused optimizer step is hfsweep's code (the task only names the optimizer): an
    exception there is reported as a bug in hfsweep with the traceback's place (exit 1, the
    resume command), not as the task's error that fails the trials; they stay RUNNING and the
    sweep resumes to the end once the bug is gone."""
    import hfsweep.training.run as run_module

    _no_dry_run(monkeypatch)
    monkeypatch.setattr(run_module, "update", _BrokenStep(after=5))
    sweep = tmp_path / "sweep.yaml"
    sweep.write_text(_broken.sweep_yaml("TASK"))
    assert main(["run", str(sweep), "--quiet"]) == 1
    err = capsys.readouterr().err
    run = tmp_path / "run"
    assert err.startswith("hfsweep run: unexpected ZeroDivisionError: a bug in the fused"), err
    assert "hfsweep's own fused optimizer code, not the task's" in err, err
    assert "bug in hfsweep" in err and "report it" in err and str(run / "sweep.log") in err, err
    assert f"hfsweep run {sweep} --resume" in err, err
    assert "training stopped" not in err and "of task" not in err and "Fix the task" not in err
    assert "FAIL" not in _states(run) and "RUNNING" in _states(run)
    log = (run / "sweep.log").read_text()
    assert "hfsweep's own code raised" in log and "Traceback" in log and "in _train" in log

    # the Python API: the exception itself, with the note, not a TrainingError
    monkeypatch.setattr(run_module, "update", _BrokenStep(after=1))
    with pytest.raises(ZeroDivisionError) as info:
        hs.sweep(sweep, resume=True, progress=False)
    assert not isinstance(info.value, hs.SweepError)
    assert any("not the task's" in n for n in getattr(info.value, "__notes__", []))

    monkeypatch.undo()
    assert main(["run", str(sweep), "--quiet", "--resume"]) == 0, capsys.readouterr().err
    assert sorted(_states(run)) == ["COMPLETE"] * 4


def test_out_of_memory_in_the_optimizer_step_still_stops_the_sweep_as_the_arrays(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Running out of memory in the optimizer step (its state is allocated at the first step)
    is the array's size, not a bug: a TrainingError, as before."""
    import hfsweep.training.run as run_module

    _no_dry_run(monkeypatch)
    monkeypatch.setattr(run_module, "update", _BrokenStep(after=1, error=torch.OutOfMemoryError))
    sweep = tmp_path / "sweep.yaml"
    sweep.write_text(_broken.sweep_yaml("TASK"))
    with pytest.raises(hs.TrainingError, match="in the optimizer step"):
        hs.sweep(sweep, progress=False)


def test_validate_does_not_blame_the_task_for_hfsweeps_optimizer_step(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The dry run (`hfsweep validate`) that meets a bug in the optimizer step does not say
    "fix the task" (exit 2): it is hfsweep's bug (exit 1)."""
    import hfsweep.training.run as run_module

    monkeypatch.setattr(run_module, "update", _BrokenStep(after=1))
    sweep = tmp_path / "sweep.yaml"
    sweep.write_text(_broken.sweep_yaml("TASK"))
    assert main(["validate", str(sweep)]) == 1
    err = capsys.readouterr().err
    assert "hfsweep's own fused optimizer code, not the task's" in err, err
    assert "fix the task" not in err and "--debug" in err, err
