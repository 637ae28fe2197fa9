"""The hfsweep command line."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hfsweep.cli import main
from hfsweep.testing import MLP


def test_demo_trains_every_member_and_saves_a_loadable_best_member(tmp_path: Path, capsys) -> None:
    assert main(["demo", "--members", "3", "--epochs", "5", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "best member" in out and "speed-up" in out
    rows = [line.split() for line in out.splitlines() if line.strip()[:1].isdigit()]
    accuracies = [float(r[-1]) for r in rows[:3]]
    assert len({r[1] for r in rows[:3]}) == 3  # each member has its own learning rate
    assert all(acc > 0.5 for acc in accuracies), out  # five epochs beat chance (0.1) by far
    model = MLP(d_in=64, hidden=64, d_out=10, depth=2)
    model.load_state_dict(torch.load(tmp_path / "best_member.pt"))


def test_demo_rejects_bad_arguments(capsys) -> None:
    assert main(["demo", "--members", "0"]) == 2
    assert "at least 1" in capsys.readouterr().err


def test_console_script_entry_point() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "hfsweep.cli", "--version"],
        capture_output=True,
        text=True,
        check=True,
    )
    assert out.stdout.startswith("hfsweep ")


def test_unknown_command_exits_with_usage() -> None:
    with pytest.raises(SystemExit) as info:
        main(["nope"])
    assert info.value.code == 2


def test_python_m_hfsweep_is_the_cli(tmp_path) -> None:
    """``python -m hfsweep`` runs the same command line as the ``hfsweep`` script."""
    import subprocess
    import sys

    done = subprocess.run(
        [sys.executable, "-m", "hfsweep", "--help"], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert "validate" in done.stdout and "run" in done.stdout
