"""The pre-flight checks: a sweep this machine cannot run is refused before anything is written.

Each case used to be found at run time, after the run directory, its lock and sweep.json were
written: an output that cannot be created or written, ``device: cuda`` without CUDA, and a
storage URL whose database driver is not installed.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from typing import Any

import pytest
import torch

import hfsweep as hs
from hfsweep.cli import main
from hfsweep.config import ConfigError
from hfsweep.core import _preflight

SWEEP = (
    "task: digits_mlp\nsearch_space: sgd_momentum\nmetric: val_accuracy\nmode: max\n"
    "budget: {trials: 2, epochs: 1}\n"
)


def write(folder: Path, extra: str) -> Path:
    path = folder / "sweep.yaml"
    path.write_text(SWEEP + extra, encoding="utf-8")
    return path


def files(folder: Path) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*"))


def refused(tmp_path: Path, monkeypatch: Any, capsys: Any, extra: str, path: str) -> str:
    """Check that validate, run and hs.sweep all refuse the sweep with exit 2 / ConfigError at
    YAML ``path`` and write nothing; return the message."""
    monkeypatch.chdir(tmp_path)
    file = write(tmp_path, extra)
    before = files(tmp_path)
    assert main(["validate", "sweep.yaml"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"hfsweep validate: sweep.yaml: {path}: "), err
    assert err.endswith(
        "--file-only checks the file alone, for a sweep meant for another machine)\n"
    )
    assert main(["validate", "--file-only", "sweep.yaml"]) == 0  # the file itself is valid
    assert capsys.readouterr().out.startswith("sweep.yaml is valid:")
    assert main(["run", "sweep.yaml"]) == 2
    captured = capsys.readouterr()
    assert captured.err.startswith(f"hfsweep run: sweep.yaml: {path}: "), captured.err
    assert captured.out == ""  # refused before the summary
    with pytest.raises(ConfigError) as info:
        hs.sweep(file, progress=False)
    assert info.value.path == path
    assert files(tmp_path) == before  # no run directory, no lock, no sweep.json
    return err


# ---------------------------------------------------------------------------- output
def test_an_output_under_a_file_is_refused(tmp_path: Path, monkeypatch, capsys) -> None:
    (tmp_path / "results").write_text("not a folder\n")
    err = refused(tmp_path, monkeypatch, capsys, "output: results/run1\n", "output")
    assert f"{tmp_path / 'results'} is a file, not a folder" in err


def test_an_output_that_is_a_file_is_refused(tmp_path: Path, monkeypatch, capsys) -> None:
    (tmp_path / "run1").write_text("")
    err = refused(tmp_path, monkeypatch, capsys, "output: run1\n", "output")
    assert f"{tmp_path / 'run1'} exists and is not a directory" in err


@pytest.mark.skipif(
    not hasattr(os, "geteuid") or os.geteuid() == 0, reason="root may write anywhere"
)
def test_an_output_in_a_read_only_folder_is_refused(tmp_path: Path, monkeypatch, capsys) -> None:
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o555)
    try:
        err = refused(tmp_path, monkeypatch, capsys, "output: locked/deeper/run1\n", "output")
    finally:
        locked.chmod(0o755)
    assert f"{locked}, where the run directory would be created, is not writable" in err


def test_an_output_the_os_will_not_let_us_write_is_refused(
    tmp_path: Path, monkeypatch, capsys
) -> None:
    """As above for any user (root included): os.access says no for that one folder."""
    locked = tmp_path / "locked"
    locked.mkdir()
    real = os.access
    monkeypatch.setattr(
        _preflight.os, "access", lambda p, mode: Path(p) != locked and real(p, mode)
    )
    err = refused(tmp_path, monkeypatch, capsys, "output: locked/run1\n", "output")
    assert "is not writable by this user" in err and "--output" in err


def test_a_resumed_run_directory_with_a_file_we_cannot_write(tmp_path: Path, monkeypatch) -> None:
    run = tmp_path / "runs" / "sweep"
    run.mkdir(parents=True)
    (run / "optuna.journal").write_text("")
    real = os.access
    monkeypatch.setattr(
        _preflight.os, "access", lambda p, mode: Path(p).name != "optuna.journal" and real(p, mode)
    )
    with pytest.raises(ConfigError) as info:
        hs.sweep(write(tmp_path, ""), resume=True, progress=False)
    assert info.value.path == "output"
    assert f"{run / 'optuna.journal'} cannot be written" in info.value.problem


# ---------------------------------------------------------------------------- device
def test_cuda_where_there_is_none_is_refused(tmp_path: Path, monkeypatch, capsys) -> None:
    device = f"cuda:{torch.cuda.device_count()}" if torch.cuda.is_available() else "cuda"
    err = refused(
        tmp_path, monkeypatch, capsys, f"fusion: {{device: '{device}'}}\n", "fusion.device"
    )
    if torch.cuda.is_available():
        assert f"this machine has {torch.cuda.device_count()} CUDA device(s)" in err
    else:
        assert f"'{device}' asks for CUDA, but" in err and "device: auto" in err


# ---------------------------------------------------------------------------- storage
def _missing(module: str) -> bool:
    return importlib.util.find_spec(module) is None


def _default_driver(url: str) -> str:
    from sqlalchemy.engine import make_url

    return str(make_url(url).get_dialect().driver)


@pytest.mark.skipif(_missing("sqlalchemy"), reason="needs SQLAlchemy (an Optuna dependency)")
@pytest.mark.parametrize(
    ("url", "driver", "fragment"),
    [
        ("postgresql+pg8000://u:secret@localhost/db", "pg8000", "pip install pg8000"),
        ("mysql+pymysql://u@localhost/db", "pymysql", "pip install pymysql"),
        ("postgresql://u:secret@localhost/db", None, "(SQLAlchemy's default for postgresql://)"),
        ("mysql://u@localhost/db", "mysqldb", "pip install mysqlclient"),
    ],
)
def test_a_storage_url_whose_driver_is_missing_is_refused(
    tmp_path: Path, monkeypatch, capsys, url: str, driver: str | None, fragment: str
) -> None:
    driver = driver or _default_driver(url)
    module = {"mysqldb": "MySQLdb"}.get(driver, driver)
    if not _missing(module):
        pytest.skip(f"{module} is installed here")
    err = refused(tmp_path, monkeypatch, capsys, f"storage: '{url}'\n", "storage")
    assert f"needs the database driver {driver}" in err and fragment in err
    assert "secret" not in err  # the password is not echoed
    if driver in ("psycopg2", "psycopg"):  # both come with the postgres extra
        assert 'pip install "hfsweep[postgres]"' in err


@pytest.mark.skipif(_missing("sqlalchemy"), reason="needs SQLAlchemy (an Optuna dependency)")
@pytest.mark.parametrize(
    ("url", "fragment"),
    [
        ("postgres://u@localhost/db", "write postgresql://"),
        (
            "postgresql+nosuchdriver://u@localhost/db",
            "knows no driver 'nosuchdriver' of postgresql",
        ),
        ("postgresql+asyncpg://u@localhost/db", "asyncio driver"),
        ("postgresql://u:secret@localhost:port/db", "u:***@localhost:port/db is not a database"),
    ],
)
def test_a_storage_url_sqlalchemy_cannot_use_is_refused(
    tmp_path: Path, monkeypatch, capsys, url: str, fragment: str
) -> None:
    err = refused(tmp_path, monkeypatch, capsys, f"storage: '{url}'\n", "storage")
    assert fragment in err and "secret" not in err


def test_an_output_with_a_nul_byte_is_refused(tmp_path: Path, monkeypatch, capsys) -> None:
    err = refused(tmp_path, monkeypatch, capsys, 'output: "run\\0x"\n', "output")
    assert "holds a NUL byte" in err


def test_a_sqlite_storage_passes(tmp_path: Path, monkeypatch, capsys) -> None:
    monkeypatch.chdir(tmp_path)
    write(tmp_path, f"storage: 'sqlite:///{tmp_path / 'study.db'}'\n")
    assert main(["validate", "sweep.yaml"]) == 0
    assert files(tmp_path) == ["sweep.yaml"]
