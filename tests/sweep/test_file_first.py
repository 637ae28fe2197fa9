"""A sweep file's own problems come first: ``hfsweep validate --file-only`` checks the file
without importing the task or torch, and ``hfsweep run`` reports a file's problem before it
imports either. A run directory that holds a sweep already is refused by one rule, before the
machine's checks and the dry run, with the same message in ``validate`` and ``run``."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from hfsweep.cli import main

from . import _broken

#: runs the CLI in a fresh interpreter, then prints its exit status and whether it imported
#: torch or a task module (hfsweep imports a task file under a name starting _hfsweep_entry_)
_RUNNER = """
import json, sys
from hfsweep.cli import main
code = main(sys.argv[1:])
imported = sorted(m for m in sys.modules if m == "torch" or m.startswith("_hfsweep_entry_"))
print(json.dumps({"code": code, "imported": imported}))
"""


def _cli(*args: str, cwd: Path) -> tuple[dict[str, object], str]:
    done = subprocess.run(
        [sys.executable, "-c", _RUNNER, *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=300,
    )
    return json.loads(done.stdout.strip().splitlines()[-1]), done.stderr


@pytest.mark.slow
def test_file_only_and_a_runs_file_error_import_neither_torch_nor_the_task(
    tmp_path: Path,
) -> None:
    good = tmp_path / "good.yaml"
    good.write_text(_broken.sweep_yaml("TASK"))
    result, err = _cli("validate", "--file-only", str(good), cwd=tmp_path)
    assert result == {"code": 0, "imported": []}, err
    typo = tmp_path / "typo.yaml"
    typo.write_text(_broken.sweep_yaml("TASK").replace("budget:", "budgte:"))
    for command in (["validate", "--file-only"], ["validate"], ["run"]):
        result, err = _cli(*command, str(typo), cwd=tmp_path)
        assert result == {"code": 2, "imported": []}, err
        assert "unknown key 'budgte' (did you mean 'budget'?)" in err
    assert not (tmp_path / "run").exists()


def test_a_run_directory_holding_a_sweep_is_refused_first_by_validate_and_run(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    sweep = tmp_path / "sweep.yaml"
    sweep.write_text(_broken.sweep_yaml("SHAPE"))  # its dry run would fail: it must not run
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "optuna.journal").write_text("")  # a sweep's study, as run leaves it
    messages = []
    for command in (["validate", str(sweep)], ["run", str(sweep), "--quiet"]):
        assert main(command) == 2
        err = capsys.readouterr().err
        assert "already holds a sweep" in err and f"hfsweep run {sweep} --resume" in err, err
        assert "dry run" not in err
        messages.append(err.split(": ", 1)[1])
    assert messages[0] == messages[1]  # one rule, one message
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == ["optuna.journal"]


def test_the_ready_task_names_a_file_is_checked_against_are_the_ready_tasks() -> None:
    from hfsweep import tasks
    from hfsweep._names import READY_TASKS

    assert tuple(sorted(tasks.TASKS)) == READY_TASKS


def test_a_task_name_that_is_not_ready_is_refused_by_the_file_check(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    sweep = tmp_path / "sweep.yaml"
    text = _broken.sweep_yaml("TASK")
    sweep.write_text("task: digits_mpl\n" + text[text.index("\n") + 1 :])
    assert main(["validate", "--file-only", str(sweep)]) == 2
    err = capsys.readouterr().err
    assert "task: task 'digits_mpl' is not a ready task (did you mean 'digits_mlp'?)" in err
