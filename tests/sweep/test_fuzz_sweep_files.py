"""Fuzz: mutated sweep files and broken task files never end in a traceback.

From a small valid sweep of a tiny task (written here; a run takes well under a second), a
seeded generator makes :data:`MUTATIONS` mutants: keys dropped, duplicated (a second line with
the same key), retyped and given wrong values at every depth, unknown keys added, and the
task file broken in one of the ways users break theirs. Every mutant goes through
``hfsweep validate``; those it accepts, and a seeded sample of one in :data:`RUN_EVERY` of
those it refuses, go through ``hfsweep run`` too, all in this process (``hfsweep.cli.main``). Each must end in exit 0, or exit 2 with one message and no
traceback, having written nothing (``__pycache__`` aside: that is Python's import, not
hfsweep); a run that exits 0 leaves no trial RUNNING. A broken task file must exit 2, and so
must a duplicated key.

A mutant that only changes how long a run takes (a budget of 10**6 trials, say) or that runs
on Ray is validated but not run: only budgets up to :data:`RUN_BUDGET` run, on the local
backend.
"""

from __future__ import annotations

import contextlib
import copy
import io
import json
import os
import random
import re
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from hfsweep.cli import main

pytestmark = pytest.mark.slow

SEED = 20261125
MUTATIONS = 260
RUN_EVERY = 8
#: the largest budget (trials x epochs-or-steps) a sampled run may have
RUN_BUDGET = 16

TASK_FILE = """\
import torch
from torch import nn

import hfsweep as hs
from hfsweep.tasks import TensorBatches


def model(config):
    return nn.Sequential(
        nn.Linear(4, config["hidden"]), nn.Tanh(), nn.Linear(config["hidden"], 3)
    )


def data(config):
    gen = torch.Generator().manual_seed(config["data_seed"])
    x = torch.randn(48, 4, generator=gen)
    y = x[:, :3].argmax(1)
    b = config["batch_size"]
    return TensorBatches(x[:32], y[:32], b, shuffle=True), TensorBatches(
        x[32:], y[32:], 16, shuffle=False
    )


TASK = hs.Task(name="fuzz", model=model, data=data, defaults={"hidden": 8, "batch_size": 16})
"""

#: ways users break a task file: (name, text replaced, replacement)
TASK_BREAKS: list[tuple[str, str, str]] = [
    ("shape", 'nn.Linear(config["hidden"], 3)', 'nn.Linear(config["hidden"] + 1, 3)'),
    ("model raises", "def model(config):\n", 'def model(config):\n    raise RuntimeError("no")\n'),
    (
        "model rejects the large lr",
        "def model(config):\n",
        'def model(config):\n    if config["lr"] > 0.2:\n        raise ValueError("lr")\n',
    ),
    ("model is no module", "    return nn.Sequential(", "    return 3 or nn.Sequential("),
    ("float targets", "y = x[:, :3].argmax(1)", "y = x[:, :3].argmax(1).float()"),
    ("labels out of range", "y = x[:, :3].argmax(1)", "y = x[:, :3].argmax(1) + 3"),
    ("two classes", 'nn.Linear(config["hidden"], 3)', 'nn.Linear(config["hidden"], 2)'),
    ("forward breaks", "nn.Tanh(),", "nn.Tanh(), nn.Unflatten(1, (5, -1)),"),
    ("data not a pair", "return TensorBatches(x[:32]", "return (TensorBatches(x[:32]"),
    ("no training data", "x[:32], y[:32]", "x[:0], y[:0]"),
    (
        "data raises",
        "def data(config):\n",
        'def data(config):\n    raise FileNotFoundError("/data/missing.npz")\n',
    ),
    ("data reads lr", 'b = config["batch_size"]', 'b = config["batch_size"] + 0 * config["lr"]'),
    ("syntax error", "def data(config):", "def data(config)"),
    ("import error", "import torch\n", "import torch\nimport hfsweep_fuzz_not_a_module\n"),
    ("no TASK", "TASK = hs.Task(", "TASKS = hs.Task("),
    ("TASK not a task", "TASK = hs.Task(", "TASK = 3 or hs.Task("),
    ("invalid task", 'name="fuzz",', 'name="fuzz", loss="mae",'),
    ("loss per sample", 'name="fuzz",', 'name="fuzz", loss=lambda o, t: (o - 0).sum(-1),'),
    ("loss for all", 'name="fuzz",', 'name="fuzz", loss=lambda o, t: o.mean(),'),
    ("metric breaks", 'name="fuzz",', 'name="fuzz", metrics={"bad": lambda o, t: o[0, 0]},'),
]

BASE: dict[str, Any] = {
    "task": "task.py:TASK",
    "config": {"hidden": 4},
    "search_space": {
        "lr": {"type": "float", "low": 0.001, "high": 0.5, "log": True},
        "momentum": {"type": "float", "low": 0.0, "high": 0.9},
    },
    "searcher": {"name": "random", "seed": 0},
    "scheduler": {"name": "asha", "options": {"grace_period": 1, "reduction_factor": 2}},
    "budget": {"trials": 4, "epochs": 2},
    "metric": "val_accuracy",
    "mode": "max",
    "fusion": {"size": 2, "device": "cpu", "dtype": "float32", "eval_every": None},
    "backend": "local",
    "storage": None,
    "output": "run",
    "study_name": "fuzz",
    "seed": 0,
}

#: values of every type, for retyping
ANY_VALUES: list[Any] = [
    None, True, False, 0, 1, -1, 3, 10**30, 0.5, -2.5, 1e23, float("nan"), float("inf"),
    "", "x", "auto", "1e23", "cpu", [], [1, 2], ["a"], {}, {"a": 1}, {"name": "tpe"},
]  # fmt: skip

#: wrong (or valid but unusual) values by key name
WRONG: dict[str, list[Any]] = {
    "task": ["task.py:NOPE", "nope.py:TASK", "task.py", "digits_mlpp", "os:path", ":TASK"],
    "hidden": [0, -4, 2.5, "wide", 10**9],
    "type": ["floaty", "int", "categorical", "loguniform"],
    "low": [-1.0, 0.0, 2.0, 0.9],
    "high": [0.0, -1.0, 1e-4, 1e30],
    "log": ["yes", 2],
    "name": ["tpee", "grid", "cmaes", "gp", "qmc", "os:path", "optuna:median", "fifo"],
    "grace_period": [0, 100, -1],
    "reduction_factor": [1, 0, 1.5],
    "trials": [0, -3, 10**23, 1e23, "1e23", 10**6],
    "epochs": [0, -1, 10**9],
    "steps": [0, 3],
    "time_limit": [0, -5, "1h", "soon", 1e-9, "90s"],
    "metric": ["val_acc", "train_loss", "val_loss", "accuracy"],
    "mode": ["maximize", "MAX", "min"],
    "size": [0, -1, "auto", 64, 1.5],
    "device": ["cuda", "cuda:7", "tpu", "gpu", "auto"],
    "dtype": ["float16", "float64", "bfloat16", "int8"],
    "eval_every": [0, 1, -2, 1000],
    "backend": ["ray", "dask", "Local"],
    "storage": ["{folder}/s.db", "sqlite:///{folder}/study.db", "redis://x", "postgresql://u@127.0.0.1:1/db"],
    "output": ["/proc/hfsweep-fuzz/run", "", "{folder}/out/deeper"],
    "study_name": ["", "other"],
    "seed": [-1, 2**40, 1.0],
}  # fmt: skip

#: problems known and reported, not yet fixed: (mutant description, hfsweep command) -> why.
#: They are not counted as failures but each one still found is shown as a warning, and one
#: that no longer happens fails the test, so that it is taken off this list.
KNOWN: dict[tuple[str, str], str] = {}

UNKNOWN_KEYS = ["epoch", "lr", "trails", "searcher_options", "devices", "hidden"]


@dataclass
class Mutant:
    """One mutated sweep: the YAML text, the task file and what was done."""

    what: str
    sweep: str
    task: str
    task_broken: bool = False
    duplicated: bool = False


def _paths(d: Any, prefix: tuple[Any, ...] = ()) -> Iterator[tuple[Any, ...]]:
    if isinstance(d, dict):
        for k, v in d.items():
            yield (*prefix, k)
            yield from _paths(v, (*prefix, k))


def _get(d: Any, path: tuple[Any, ...]) -> Any:
    for k in path:
        d = d[k]
    return d


def _parent(d: Any, path: tuple[Any, ...]) -> dict[Any, Any]:
    return _get(d, path[:-1])  # type: ignore[no-any-return]


def _dump(d: Any) -> str:
    return yaml.safe_dump(d, sort_keys=False, default_flow_style=False, allow_unicode=True)


def _systematic() -> list[Mutant]:
    """Every wrong value at the first place its key appears (in ``budget`` for the budget keys
    the base leaves out), and every broken task file."""
    out: list[Mutant] = []
    for key, values in WRONG.items():
        path = next((p for p in _paths(BASE) if p[-1] == key), ("budget", key))
        for value in values:
            doc = copy.deepcopy(BASE)
            _parent(doc, path)[path[-1]] = value
            out.append(Mutant(f"{'.'.join(map(str, path))}={value!r}", _dump(doc), TASK_FILE))
    for name, old, new in TASK_BREAKS:
        assert old in TASK_FILE, name
        out.append(Mutant(f"task file: {name}", _dump(BASE), TASK_FILE.replace(old, new, 1), True))
    return out


def _mutants(seed: int, count: int) -> list[Mutant]:
    """:func:`_systematic`, then seeded random mutants up to ``count`` in all."""
    rng = random.Random(seed)
    out = _systematic()
    ops = ["drop", "retype", "wrong", "wrong", "add", "duplicate", "task", "two"]
    for n in range(count - len(out)):
        op = ops[n % len(ops)]
        doc = copy.deepcopy(BASE)
        steps = (
            [rng.choice(["drop", "retype", "wrong", "add"]) for _ in range(2)]
            if op == "two"
            else [op]
        )
        what: list[str] = []
        task = TASK_FILE
        task_broken = duplicated = False
        text: str | None = None
        for step in steps:
            paths = list(_paths(doc))
            if step == "drop" and paths:
                path = rng.choice(paths)
                del _parent(doc, path)[path[-1]]
                what.append(f"drop {'.'.join(map(str, path))}")
            elif step == "retype" and paths:
                path = rng.choice(paths)
                value = copy.deepcopy(rng.choice(ANY_VALUES))
                _parent(doc, path)[path[-1]] = value
                what.append(f"retype {'.'.join(map(str, path))}={value!r}")
            elif step == "wrong" and any(p[-1] in WRONG for p in paths):
                path = rng.choice([p for p in paths if p[-1] in WRONG])
                value = rng.choice(WRONG[path[-1]])
                _parent(doc, path)[path[-1]] = value
                what.append(f"{'.'.join(map(str, path))}={value!r}")
            elif step == "add":
                maps = [()] + [p for p in paths if isinstance(_get(doc, p), dict)]
                where = rng.choice(maps)
                key = rng.choice(UNKNOWN_KEYS)
                _get(doc, where)[key] = copy.deepcopy(rng.choice(ANY_VALUES))
                what.append(f"add {'.'.join(map(str, (*where, key)))}")
            elif step == "duplicate":
                lines = _dump(doc).splitlines()
                keyed = [i for i, line in enumerate(lines) if re.match(r"^\s*[A-Za-z_]+: \S", line)]
                i = rng.choice(keyed)
                indent, key = re.match(r"^(\s*)([A-Za-z_]+):", lines[i]).groups()  # type: ignore[union-attr]
                if rng.random() < 0.3:
                    lines.insert(i + 1, lines[i])  # the same line twice
                else:
                    value = json.dumps(rng.choice([*WRONG.get(key, []), None]))
                    lines.insert(i + 1, f"{indent}{key}: {value}")
                text = "\n".join(lines) + "\n"
                duplicated = True
                what.append(f"duplicate {key} (line {i + 2})")
            elif step == "task":
                name, old, new = rng.choice(TASK_BREAKS)
                task = task.replace(old, new, 1)
                task_broken = True
                what.append(f"task file: {name}")
        out.append(
            Mutant(
                what="; ".join(what),
                sweep=text if text is not None else _dump(doc),
                task=task,
                task_broken=task_broken,
                duplicated=duplicated,
            )
        )
    return out


def _listing(folder: Path) -> set[str]:
    return {str(p.relative_to(folder)) for p in folder.rglob("*") if "__pycache__" not in p.parts}


def _call(argv: list[str]) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            rc = main(argv)
        except SystemExit as exc:  # argparse
            rc = int(exc.code or 0)
    return rc, out.getvalue(), err.getvalue()


def _small_budget(sweep: str) -> bool:
    try:
        doc = yaml.safe_load(sweep)
        budget = doc["budget"]
        size = budget["trials"] * (budget.get("epochs") or budget.get("steps") or 1)
        return doc.get("backend", "local") == "local" and 0 < size <= RUN_BUDGET
    except Exception:
        return True  # not a mapping of numbers: it is refused anyway


def _running(folder: Path, sweep: str) -> list[int]:
    """Numbers of the trials left RUNNING in the run's study, wherever its storage is."""
    import optuna

    doc = yaml.safe_load(sweep)
    storage: Any = doc.get("storage")
    if storage is None:
        from optuna.storages import JournalStorage
        from optuna.storages.journal import JournalFileBackend

        output = folder / (doc.get("output") or "runs/sweep")
        storage = JournalStorage(JournalFileBackend(str(output / "optuna.journal")))
    study = optuna.load_study(study_name=doc.get("study_name") or "sweep", storage=storage)
    return [t.number for t in study.get_trials() if t.state.name == "RUNNING"]


def _problems(
    name: str, m: Mutant, folder: Path, before: set[str], command: str, rc: int, err: str
) -> list[str]:
    """What is wrong with how ``hfsweep COMMAND`` ended on mutant ``m`` (nothing: ``[]``)."""
    where = f"{name}, hfsweep {command}: exit {rc}"
    lines = err.strip().splitlines()
    if "Traceback" in err:
        return [f"{where}: a traceback:\n{err[-2000:]}"]
    if rc not in (0, 2):
        return [f"{where}: {err.strip()[-600:]}"]
    if rc == 2 and not (lines and lines[-1].startswith(f"hfsweep {command}: ")):
        return [f"{where}: no message: {err!r}"]
    if rc == 2 and _listing(folder) != before:
        return [f"{where}: wrote {sorted(_listing(folder) - before)}: {err.strip()}"]
    if rc == 0 and (m.task_broken or m.duplicated):
        return [f"{where}: accepted"]
    return []


@pytest.mark.filterwarnings("ignore:Initializing zero-element tensors")  # hidden: 0
def test_mutated_sweep_files_end_in_exit_0_or_a_message(tmp_path: Path) -> None:
    mutants = _mutants(SEED, MUTATIONS)
    assert len(mutants) >= 200
    problems: list[str] = []
    runs = 0
    sampled = set(random.Random(SEED + 1).sample(range(MUTATIONS), MUTATIONS // RUN_EVERY))
    for n, m in enumerate(mutants):
        folder = tmp_path / f"m{n:03d}"
        folder.mkdir()
        (folder / "task.py").write_text(m.task)
        sweep_text = m.sweep.replace("{folder}", str(folder))
        (folder / "sweep.yaml").write_text(sweep_text)
        before = _listing(folder)

        rc, out, err = _call(["validate", str(folder / "sweep.yaml")])
        problems += _problems(f"mutant {n} ({m.what})", m, folder, before, "validate", rc, err)
        if (rc == 0 and _small_budget(sweep_text)) or (rc != 0 and n in sampled):
            runs += 1
            rc, out, err = _call(["run", str(folder / "sweep.yaml"), "--quiet"])
            problems += _problems(f"mutant {n} ({m.what})", m, folder, before, "run", rc, out + err)
            if rc == 0:
                left = _running(folder, sweep_text)
                if left:
                    problems.append(f"mutant {n} ({m.what}): trials {left} left RUNNING")
    assert runs >= MUTATIONS // RUN_EVERY
    found = {key for key in KNOWN for p in problems if p.startswith(_known_prefix(mutants, key))}
    for key in found:
        warnings.warn(f"known fuzz problem still there: {key}: {KNOWN[key]}", stacklevel=1)
    problems = [
        p for p in problems if not any(p.startswith(_known_prefix(mutants, k)) for k in found)
    ]
    assert not problems, f"{len(problems)} of {len(mutants)} mutants:\n\n" + "\n\n".join(problems)
    gone = [key for key in KNOWN if key not in found and os.geteuid() == 0]
    assert not gone, f"fixed: take {gone} off KNOWN"


def _known_prefix(mutants: list[Mutant], key: tuple[str, str]) -> str:
    """The start of a problem line of the first mutant described as ``key[0]``."""
    what, command = key
    n = next(i for i, m in enumerate(mutants) if m.what == what)
    return f"mutant {n} ({what}), hfsweep {command}: "
