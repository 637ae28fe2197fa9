"""The README's quick start runs as written."""

from __future__ import annotations

import re
import runpy
from pathlib import Path

README = Path(__file__).resolve().parent.parent / "README.md"


def _run_first_block(heading: str, tmp_path: Path, monkeypatch) -> dict:
    """Run the first Python block after ``heading`` in a scratch directory; its globals."""
    section = README.read_text().split(heading, 1)[1]
    code = re.search(r"```python\n(.*?)```", section, re.S)
    assert code is not None, f"README has no Python block after {heading!r}"
    script = tmp_path / "readme_block.py"
    script.write_text(code.group(1))
    monkeypatch.chdir(tmp_path)
    return runpy.run_path(str(script))


def test_quick_start_runs(tmp_path, monkeypatch) -> None:
    _run_first_block("## Quick start", tmp_path, monkeypatch)
    assert (tmp_path / "best.pt").exists()


def test_training_arrays_example_runs(tmp_path, monkeypatch) -> None:
    results = _run_first_block("## Training arrays", tmp_path, monkeypatch)["results"]
    assert len(results) == 4 and {r.status for r in results} <= {"completed", "stopped"}
    assert (tmp_path / "ckpt" / "array.pt").exists()
    assert all((tmp_path / "ckpt" / "members" / f"{r.id}.pt").exists() for r in results)


def test_search_space_and_scheduler_example_runs(tmp_path, monkeypatch) -> None:
    section = "## Search spaces and early stopping"
    text = README.read_text().split(section, 1)[1]
    blocks = re.findall(r"```python\n(.*?)```", text.split("\n## ", 1)[0], re.S)
    assert len(blocks) == 1
    script = tmp_path / "sweep_example.py"
    script.write_text(blocks[0])
    monkeypatch.chdir(tmp_path)
    scope = runpy.run_path(str(script))
    study = scope["study"]
    states = [t.state.name for t in study.trials]
    assert len(states) == 16 and set(states) <= {"COMPLETE", "PRUNED"}
    assert "PRUNED" in states and study.best_value > 0.5


def test_sweep_from_python_example_runs(tmp_path, monkeypatch) -> None:
    section = "## Sweeps: `hfsweep run`"
    text = README.read_text().split(section, 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```python\n(.*?)```", text, re.S)
    assert len(blocks) == 1
    script = tmp_path / "sweep_api.py"
    script.write_text(blocks[0])
    monkeypatch.chdir(tmp_path)
    result = runpy.run_path(str(script))["result"]
    assert sum(result.counts.values()) == 8 and result.counts["RUNNING"] == 0
    assert (tmp_path / "runs" / "python_sweep" / "trials.csv").exists()


def test_main_job_is_hfsweep_run_on_an_example() -> None:
    setup = README.read_text().split("## Set up", 1)[1].split("\n## ", 1)[0]
    commands = re.findall(r"```bash\n(.*?)```", setup, re.S)
    assert len(commands) == 2
    assert commands[0].strip().endswith("hfsweep run examples/digits_quick.yaml")
    assert (README.parent / "examples" / "digits_quick.yaml").exists()


def test_sweep_yaml_reference_matches_the_schema_docstring() -> None:
    """The README's sweep.yaml reference is the config module's own, so it cannot drift."""
    import hfsweep.config

    block = hfsweep.config.__doc__.split("Every key, with its default::\n\n", 1)[1]
    schema = [line[4:] for line in block.split("\n\n", 1)[0].splitlines()]
    text = README.read_text().split("The sweep.yaml reference", 1)[1]
    shown = re.search(r"```yaml\n(.*?)```", text, re.S)
    assert shown is not None
    assert shown.group(1).rstrip("\n").splitlines() == schema
