"""The README's quick start runs as written."""

from __future__ import annotations

import re
import runpy
from pathlib import Path

README = Path(__file__).resolve().parent.parent / "README.md"


def test_quick_start_runs(tmp_path, monkeypatch) -> None:
    text = README.read_text()
    section = text.split("## Quick start", 1)[1]
    code = re.search(r"```python\n(.*?)```", section, re.S)
    assert code is not None, "README has no Python quick start"
    script = tmp_path / "quick_start.py"
    script.write_text(code.group(1))
    monkeypatch.chdir(tmp_path)
    runpy.run_path(str(script))
    assert (tmp_path / "best.pt").exists()


def test_training_arrays_example_runs(tmp_path, monkeypatch) -> None:
    text = README.read_text()
    section = text.split("## Training arrays", 1)[1]
    code = re.search(r"```python\n(.*?)```", section, re.S)
    assert code is not None, "README has no Task example"
    script = tmp_path / "task_example.py"
    script.write_text(code.group(1))
    monkeypatch.chdir(tmp_path)
    scope = runpy.run_path(str(script))
    results = scope["results"]
    assert len(results) == 4 and {r.status for r in results} <= {"completed", "stopped"}
    assert (tmp_path / "ckpt" / "array.pt").exists()
    assert all((tmp_path / "ckpt" / "members" / f"{r.id}.pt").exists() for r in results)
