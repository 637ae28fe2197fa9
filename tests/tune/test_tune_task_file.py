"""A task given as ``path/to/file.py:TASK`` is imported under the same module name in every
process, whatever its ``PYTHONHASHSEED``: Tune pickles the Fusion's searcher (and with it the
task's functions, by module and name) into the experiment, and ``Tuner.restore`` in a new
process unpickles it after the user's ``Fusion("path/to/file.py:TASK", ...)`` imported the file
again. With a module name from ``hash(path)`` that unpickling failed (``No module named
'_hfsweep_entry_<n>'``)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("ray")

TASK_FILE = """
from torch import nn

import hfsweep as hs
from hfsweep.tasks import TensorBatches


def model(config):
    return nn.Linear(4, config["hidden"])


def data(config):
    raise AssertionError("not trained here")


TASK = hs.Task(name="file_task", model=model, data=data, defaults={"hidden": 3})
"""

#: imports the task file by its spec, then pickles the task as Tune does (ray's cloudpickle)
#: or unpickles the task pickled by another process and checks it is the file's
SCRIPT = """
import sys
from ray import cloudpickle
from hfsweep.config.entry import load_task

action, spec, pickled = sys.argv[1:]
task = load_task(spec)
if action == "dump":
    with open(pickled, "wb") as f:
        cloudpickle.dump(task, f)
else:
    with open(pickled, "rb") as f:
        loaded = cloudpickle.load(f)
    assert loaded.model is task.model and loaded.data is task.data, "another module"
    print(loaded.build_model(loaded.resolve({})))
print(task.model.__module__)
"""


def _run(action: str, spec: str, pickled: Path, seed: str, cwd: Path) -> str:
    env = {**os.environ, "PYTHONHASHSEED": seed}
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT, action, spec, str(pickled)],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


@pytest.mark.slow  # two Python processes importing torch: about 6 s
def test_a_task_file_pickled_in_one_process_loads_in_another_with_another_hash_seed(
    tmp_path: Path,
) -> None:
    (tmp_path / "tasks").mkdir()
    (tmp_path / "tasks" / "file_task.py").write_text(TASK_FILE)
    pickled = tmp_path / "task.pkl"
    # the first process names the file relative to its working directory, the second by its
    # absolute path (as Fusion passes it to Ray's workers): the same file, the same module
    first = _run("dump", "tasks/file_task.py:TASK", pickled, "1", tmp_path)
    second = _run("load", f"{tmp_path}/tasks/file_task.py:TASK", pickled, "2", Path.cwd())
    assert "Linear(in_features=4, out_features=3" in second
    module = first.split()[-1]
    assert module.startswith("_hfsweep_entry_") and second.split()[-1] == module
