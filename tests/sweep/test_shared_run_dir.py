"""A run directory shared with a team: the files and folders a sweep writes get the permissions
of the process's umask, as other tools' do (with umask 002 the team can read and write each
other's files), and resuming from it never runs code planted in its files."""

from __future__ import annotations

import json
import os
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

import hfsweep as hs
from hfsweep._io import append_lines, atomic_save, atomic_write_text
from hfsweep.training.packed import pack

from ._toy import sweep_config

UMASKS = [0o022, 0o002]


@pytest.fixture(params=UMASKS, ids=["umask022", "umask002"])
def umask(request: pytest.FixtureRequest) -> Iterator[int]:
    """The process's umask set to the parameter for the test (and restored after)."""
    old = os.umask(request.param)
    try:
        yield request.param
    finally:
        os.umask(old)


def _modes(root: Path) -> dict[str, tuple[str, int]]:
    """``{relative path: (kind, permission bits)}`` of every file and folder under ``root``
    (symbolic links have no permissions of their own)."""
    out = {}
    for folder, dirs, files in os.walk(root):
        for name in [*dirs, *files]:
            path = Path(folder) / name
            st = path.lstat()
            if stat.S_ISLNK(st.st_mode):
                continue
            kind = "dir" if stat.S_ISDIR(st.st_mode) else "file"
            out[str(path.relative_to(root))] = (kind, stat.S_IMODE(st.st_mode))
    return out


def _expected(kind: str, umask: int) -> int:
    return (0o777 if kind == "dir" else 0o666) & ~umask


def test_written_files_follow_the_umask(tmp_path: Path, umask: int) -> None:
    atomic_write_text(tmp_path / "a" / "state.json", "{}")
    atomic_save({"w": torch.zeros(2)}, tmp_path / "b" / "array.pt")
    append_lines(tmp_path / "c" / "delivered.log", ["x"])
    modes = _modes(tmp_path)
    assert len(modes) == 6
    for name, (kind, mode) in modes.items():
        assert mode == _expected(kind, umask), (name, oct(mode))


def test_a_sweeps_run_directory_follows_the_umask(tmp_path: Path, umask: int) -> None:
    run = tmp_path / "run"
    config = sweep_config(
        run, budget={"trials": 2, "epochs": 1}, fusion={"size": 2, "device": "cpu"}
    )
    hs.sweep(config, progress=False)
    modes = _modes(run)
    for name in ("state.json", "trials.csv", "best.json", "optuna.journal", ".lock"):
        assert name in modes, sorted(modes)
    assert any(kind == "file" and name.endswith(".pt") for name, (kind, _) in modes.items())
    wrong = {n: oct(m) for n, (k, m) in modes.items() if m != _expected(k, umask)}
    assert wrong == {}


class _Planted:
    """Pickles as a call of ``exec`` that leaves ``marker`` behind when loaded with pickle."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[object, ...]:
        return (exec, (f"open({str(self.marker)!r}, 'w').close()",))


def test_a_resume_refuses_a_planted_checkpoint_and_runs_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """An array's checkpoint replaced by a booby-trapped file: the resume stops with a
    SweepError naming the file (which ``hfsweep run --resume`` prints, exit 2)."""
    run = tmp_path / "run"
    config = sweep_config(
        run, budget={"trials": 2, "epochs": 1}, fusion={"size": 2, "device": "cpu"}
    )
    hs.sweep(config, progress=False)
    state = json.loads((run / "state.json").read_text())
    state["arrays"][0]["done"] = False  # as if the sweep had been killed while it trained
    (run / "state.json").write_text(json.dumps(state))
    marker = tmp_path / "ran"
    planted = run / "arrays" / "0" / "array.pt"
    planted.parent.mkdir(parents=True, exist_ok=True)
    torch.save(pack({"version": 3, "order": ["0"], "key": _Planted(marker)}), planted)
    with pytest.raises(hs.SweepError, match=rf"^{planted}: not loaded: it needs builtins\.exec"):
        hs.sweep(config, resume=True, progress=False)
    assert not marker.exists()
