"""The pre-flight check of an existing run directory covers everything a resume writes to: its
lock (one this user cannot open would leave the sweep unlocked, with only a warning), the
folders that get new files (histories/, checkpoints/, arrays/ and each array's folder), and a
probe folder that cannot be removed again is no reason to refuse."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

import hfsweep as hs
from hfsweep.config import ConfigError, parse_sweep
from hfsweep.core import _preflight
from hfsweep.core._preflight import preflight


def _sweep(run: Path) -> hs.SweepConfig:
    return parse_sweep(
        {
            "task": "digits_mlp",
            "search_space": "sgd_momentum",
            "metric": "val_accuracy",
            "mode": "max",
            "budget": {"trials": 2, "epochs": 1},
            "output": str(run),
        }
    )


@pytest.mark.parametrize("name", [".lock", "histories", "checkpoints", "arrays", "arrays/0"])
def test_a_part_of_the_run_directory_we_cannot_write_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str
) -> None:
    run = tmp_path / "run"
    (run / "arrays" / "0").mkdir(parents=True)
    (run / "histories").mkdir()
    (run / "checkpoints").mkdir()
    (run / ".lock").write_text("")
    (run / "state.json").write_text("{}")
    preflight(_sweep(run))  # all of it writable
    real = os.access
    monkeypatch.setattr(
        _preflight.os, "access", lambda p, mode: Path(p) != run / name and real(p, mode)
    )
    with pytest.raises(ConfigError) as info:
        preflight(_sweep(run))
    assert info.value.path == "output"
    assert info.value.problem.startswith(f"{run / name} cannot be written by this user")
    assert "fix its permissions" in info.value.problem


def test_a_probe_folder_that_cannot_be_removed_is_no_reason_to_refuse(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The folder took the probe, which is all the check asks; its rmdir failing (a network
    file system's delay, a race with a cleaner) used to read "cannot check the run
    directory"."""
    run = tmp_path / "run"
    run.mkdir()
    real = Path.rmdir

    def refuse(self: Path) -> None:
        if self.name.startswith(".hfsweep-preflight-"):
            raise OSError(16, "Device or resource busy", str(self))
        real(self)

    monkeypatch.setattr(Path, "rmdir", refuse)
    preflight(_sweep(run))
    preflight(_sweep(run / "new"))  # the folder it would be created in
