"""Find a task from a name a user typed: a ready task, ``module:attribute`` or
``path/to/file.py:attribute``."""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ..training.task import Task

__all__ = ["load_object", "load_task"]


def load_task(spec: str) -> Task:
    """The :class:`Task` named by ``spec``: ``digits_mlp`` (a ready task in
    :mod:`hfsweep.tasks`), ``package.module:attribute`` or ``path/to/file.py:attribute``."""
    from .. import tasks
    from ..training.task import Task, TaskError

    if ":" not in spec:
        if spec in tasks.TASKS:
            return tasks.TASKS[spec]
        raise TaskError(
            f"task {spec!r} is not a ready task ({', '.join(sorted(tasks.TASKS))}) nor an entry "
            "point; write module:attribute or path/to/file.py:attribute"
        )
    try:
        task = load_object(spec, "task")
    except ImportError as e:
        raise TaskError(str(e)) from e.__cause__
    if not isinstance(task, Task):
        raise TaskError(f"task {spec!r} is a {type(task).__name__}, not an hfsweep.Task")
    return task


def load_object(spec: str, what: str) -> Any:
    """The object ``package.module:attribute`` or ``path/to/file.py:attribute`` names; raises
    ``ImportError`` saying which part failed (``what`` names the object in the message)."""
    where, sep, attr = spec.rpartition(":")
    if not sep or not where or not attr:
        raise ImportError(f"{what} {spec!r}: write module:attribute or path/to/file.py:attribute")
    if where.endswith(".py"):
        path = Path(where)
        if not path.is_file():
            raise ImportError(f"{what} {spec!r}: file {where!r} does not exist")
        _on_path(str(path.resolve().parent))  # the file may import its neighbours
        name = _module_name(path)
        if name in sys.modules:
            module = sys.modules[name]
        else:
            module_spec = importlib.util.spec_from_file_location(name, path)
            if module_spec is None or module_spec.loader is None:
                raise ImportError(f"{what} {spec!r}: cannot import {where!r} as Python")
            module = importlib.util.module_from_spec(module_spec)
            sys.modules[name] = module
            try:
                module_spec.loader.exec_module(module)
            except Exception as e:
                del sys.modules[name]
                raise ImportError(f"{what} {spec!r}: importing {where!r} failed: {e!r}") from e
    else:
        _on_path(os.getcwd())  # as `python -m` does: modules in the working directory import
        try:
            module = importlib.import_module(where)
        except Exception as e:
            raise ImportError(f"{what} {spec!r}: importing module {where!r} failed: {e!r}") from e
    if not hasattr(module, attr):
        raise ImportError(f"{what} {spec!r}: {where!r} has no attribute {attr!r}")
    return getattr(module, attr)


def _module_name(path: Path) -> str:
    """The module name a task file is imported under: the same in every process for the same
    file (a digest of its resolved path, not ``hash()``, which changes with
    ``PYTHONHASHSEED``), because pickles of its objects (Tune's saved searcher, Ray's shipped
    trainables) name their module and are read in other processes."""
    digest = hashlib.sha256(os.fsencode(path.resolve())).hexdigest()[:16]
    return f"_hfsweep_entry_{digest}"


def _on_path(folder: str) -> None:
    if folder not in sys.path:
        sys.path.insert(0, folder)
