"""Every code block of README.md and of the documentation site (docs/) runs, or is checked, as
written: Python blocks run in a scratch directory, sweep YAML is validated, search-space YAML is
loaded, and every `hfsweep ...` command line parses with the CLI's own parser.

A block that should be checked beyond "it runs" has an entry in :data:`CHECKS`; every other
Python block runs with no check but its own assertions.
"""

from __future__ import annotations

import re
import runpy
import shlex
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
_FENCE = re.compile(r"^```(\w+)\n(.*?)^```", re.S | re.M)


def _blocks(kind: str) -> list[tuple[str, int, str]]:
    """``(page, index among the page's blocks of that kind, code)`` for every fenced block."""
    found = []
    for page in PAGES:
        blocks = [code for lang, code in _FENCE.findall(page.read_text()) if lang == kind]
        found += [(str(page.relative_to(ROOT)), k, code) for k, code in enumerate(blocks)]
    return found


def _id(block: tuple[str, int, str]) -> str:
    return f"{block[0]}#{block[1]}"


def _run(code: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    script = tmp_path / "doc_block.py"
    script.write_text(code)
    monkeypatch.chdir(tmp_path)
    return runpy.run_path(str(script))


# ------------------------------------------------------------------ what some blocks must do
def _quick_start_sweep(scope: dict[str, Any], tmp_path: Path) -> None:
    result = scope["result"]
    assert sum(result.counts.values()) == 8 and result.counts["running"] == 0
    assert (tmp_path / "runs" / "python_sweep" / "trials.csv").exists()


def _quick_start_fuse(scope: dict[str, Any], tmp_path: Path) -> None:
    assert (tmp_path / "best.pt").exists()


def _training_arrays(scope: dict[str, Any], tmp_path: Path) -> None:
    results = scope["results"]
    assert len(results) == 4 and {r.status for r in results} <= {"completed", "stopped"}
    assert (tmp_path / "ckpt" / "array.pt").exists()
    assert all((tmp_path / "ckpt" / "members" / f"{r.id}.pt").exists() for r in results)


def _trainer_with_asha(scope: dict[str, Any], tmp_path: Path) -> None:
    study = scope["study"]
    states = [t.state.name for t in study.trials]
    assert len(states) == 16 and set(states) <= {"COMPLETE", "PRUNED"}
    assert "PRUNED" in states and study.best_value > 0.5


def _tune_quick_start(scope: dict[str, Any], tmp_path: Path) -> None:
    from hfsweep.schedulers.tune import member_results

    rows = member_results(scope["results"])
    assert len(rows) == 64
    assert scope["results"].num_errors == 0
    weights = scope["best"].state_dict()  # the best member's, loaded into the task's model
    loaded = scope["model"].state_dict()
    assert loaded.keys() == weights.keys()
    assert all(torch.equal(loaded[k], weights[k]) for k in weights)


#: (page, index of its Python block) -> a check of the block's globals after it ran
CHECKS: dict[tuple[str, int], Callable[[dict[str, Any], Path], None]] = {
    ("README.md", 0): _quick_start_sweep,
    ("README.md", 1): _quick_start_fuse,
    ("README.md", 2): _tune_quick_start,
    ("docs/training.md", 0): _training_arrays,
    ("docs/search-spaces.md", 0): _trainer_with_asha,
}
#: blocks that start Ray: run with the test suite's shared local Ray (2 CPUs, loopback)
RAY_BLOCKS = {("README.md", 2)}

PYTHON = _blocks("python")


def test_every_check_names_a_block() -> None:
    """A moved or deleted block must not leave its check silently unused."""
    present = {(page, k) for page, k, _ in PYTHON}
    assert set(CHECKS) <= present, sorted(set(CHECKS) - present)


@pytest.mark.parametrize("block", [b for b in PYTHON if (b[0], b[1]) not in RAY_BLOCKS], ids=_id)
def test_python_block_runs(block, tmp_path, monkeypatch) -> None:
    page, index, code = block
    scope = _run(code, tmp_path, monkeypatch)
    check = CHECKS.get((page, index))
    if check is not None:
        check(scope, tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("block", [b for b in PYTHON if (b[0], b[1]) in RAY_BLOCKS], ids=_id)
def test_python_block_with_ray_runs(block, tmp_path, monkeypatch, shared_ray) -> None:
    shared_ray.start()
    page, index, code = block
    CHECKS[(page, index)](_run(code, tmp_path, monkeypatch), tmp_path)


# ------------------------------------------------------------------ YAML
_QUICK = ROOT / "examples" / "digits_quick.yaml"


def _schema_lines() -> list[str]:
    """The sweep.yaml reference: ``hfsweep.config``'s docstring, every key with its default."""
    import hfsweep.config

    assert hfsweep.config.__doc__ is not None
    block = hfsweep.config.__doc__.split("Every key, with its default::\n\n", 1)[1]
    return [line[4:] for line in block.split("\n\n", 1)[0].splitlines()]


@pytest.mark.parametrize("block", _blocks("yaml"), ids=_id)
def test_yaml_block_is_valid(block, tmp_path, capsys) -> None:
    """A sweep file passes `hfsweep validate` as it stands; a fragment of one (its keys are the
    sweep's) passes it inside the quick example; anything else is a search space."""
    from hfsweep.search_spaces import load_space

    from hfsweep.cli import main

    page, index, code = block
    if code.rstrip("\n").splitlines() == _schema_lines():
        return  # the reference of every key (ray settings beside backend: local): checked below
    data = yaml.safe_load(code)
    assert isinstance(data, dict), f"{page}: YAML block {index} is not a mapping"
    sweep_keys = {line.split(":", 1)[0] for line in _schema_lines() if line[:1].isalpha()}
    if "task" in data:
        sweep = data
    elif set(data) <= sweep_keys:
        sweep = {**yaml.safe_load(_QUICK.read_text()), **data}
    else:
        load_space(data)
        return
    path = tmp_path / "sweep.yaml"
    path.write_text(yaml.safe_dump(sweep))
    assert main(["validate", str(path)]) == 0, capsys.readouterr()


def test_the_readme_shows_the_quick_example_as_it_is() -> None:
    shown = next(code for page, _, code in _blocks("yaml") if page == "README.md")
    assert shown == _QUICK.read_text()


def test_the_yaml_reference_is_the_schema_docstring() -> None:
    """docs/cli.md's sweep.yaml reference is the config module's own text, so it cannot drift."""
    reference = (ROOT / "docs" / "cli.md").read_text().split("every key with its default", 1)[1]
    shown = re.search(r"```yaml\n(.*?)```", reference, re.S)
    assert shown is not None
    assert shown.group(1).rstrip("\n").splitlines() == _schema_lines()


# ------------------------------------------------------------------ shell
def _command_lines() -> list[tuple[str, str]]:
    lines = []
    for page, index, code in _blocks("bash"):
        for line in code.splitlines():
            for part in line.split("#", 1)[0].split("&&"):
                words = shlex.split(part)
                if words and (words[0] == "hfsweep" or words[0].endswith("/hfsweep")):
                    lines.append((f"{page}#{index}", part.strip()))
    return lines


@pytest.mark.parametrize("where, line", _command_lines())
def test_hfsweep_command_parses(where: str, line: str) -> None:
    from hfsweep.cli import build_parser

    build_parser().parse_args(shlex.split(line)[1:])


def test_main_job_is_hfsweep_run_on_an_example() -> None:
    setup = (ROOT / "README.md").read_text().split("## Set up", 1)[1].split("\n## ", 1)[0]
    commands = re.findall(r"```bash\n(.*?)```", setup, re.S)
    assert len(commands) == 2
    assert commands[0].strip().endswith("hfsweep run examples/digits_quick.yaml")
    assert "pytest" in commands[1]


def test_readme_stays_short() -> None:
    assert len((ROOT / "README.md").read_text().splitlines()) <= 250


# ------------------------------------------------------------------ the site's links and its build
_LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")


def _relative_links(page: Path) -> list[str]:
    """The link targets of a docs page that point at a file (not a URL or an anchor alone)."""
    text = _FENCE.sub("", page.read_text())
    targets = [m.group(1).split("#", 1)[0] for m in _LINK.finditer(text)]
    return [t for t in targets if t and "://" not in t and not t.startswith("mailto:")]


@pytest.mark.parametrize("page", sorted((ROOT / "docs").rglob("*.md")), ids=lambda p: p.name)
def test_every_docs_link_stays_inside_the_site(page: Path) -> None:
    """mkdocs --strict fails on a link to a file outside docs/ (the site holds only docs/), so a
    link to ``../benchmarks/...`` must be written as a path, not a link; this says which at once,
    without the 20 s build."""
    docs = (ROOT / "docs").resolve()
    for target in _relative_links(page):
        resolved = (page.parent / target).resolve()
        assert resolved.is_relative_to(docs) and resolved.exists(), (
            f"{page.relative_to(ROOT)} links to {target!r}, which is not a file of the site "
            "(docs/): write a path outside docs/ as `code`, not as a link"
        )


def test_ci_builds_the_docs_strictly_and_shows_the_warnings() -> None:
    """``--quiet`` hides the warnings ``--strict`` counts, so a build with both cannot fail."""
    builds = [
        line
        for line in (ROOT / ".ci" / "run").read_text().splitlines()
        if "mkdocs build" in line and not line.lstrip().startswith(("#", "echo"))
    ]
    assert builds, ".ci/run does not build the documentation site"
    for line in builds:
        words = shlex.split(line)
        assert "--strict" in words, line
        assert not {"--quiet", "-q"} & set(words), line
