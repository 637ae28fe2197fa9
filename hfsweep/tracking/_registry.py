"""The built-in trackers a sweep file may name under ``tracking:``: each one's options, the
library it needs and the extra that installs it. :mod:`hfsweep.config` validates a sweep's
``tracking:`` against this table; :func:`hfsweep.tracking.make_tracker` builds the trackers."""

from __future__ import annotations

import importlib
import importlib.util
from dataclasses import dataclass, field

__all__ = ["TRACKERS", "Option", "TrackerSpec", "import_problem", "missing"]


@dataclass(frozen=True)
class Option:
    """One option of a tracker: its ``kind`` (``string``; ``path``, a string taken relative to
    the sweep file's folder; ``choice`` among ``choices``; ``strings``, a list of strings;
    ``tags``, a mapping of strings to strings) and what it sets (``help``, for messages)."""

    kind: str
    help: str
    choices: tuple[str, ...] = ()


@dataclass(frozen=True)
class TrackerSpec:
    """A built-in tracker: the ``module`` it imports, the library's display name ``library``,
    the extra of hfsweep that installs it, and its ``options``."""

    name: str
    module: str
    library: str
    extra: str
    options: dict[str, Option] = field(default_factory=dict)

    @property
    def install(self) -> str:
        """The command that installs what it needs."""
        return f'pip install "hfsweep[{self.extra}]"'


#: tracker name -> its spec
TRACKERS: dict[str, TrackerSpec] = {
    "mlflow": TrackerSpec(
        "mlflow",
        "mlflow",
        "MLflow",
        "mlflow",
        {
            "tracking_uri": Option(
                "string",
                "the MLflow tracking URI (default: sqlite:///<run dir>/mlflow.db); "
                "http://host:5000 for a tracking server",
            ),
            "experiment": Option("string", "the MLflow experiment (default: the study name)"),
            "tags": Option("tags", "tags every trial's run gets, {name: value}"),
        },
    ),
    "tensorboard": TrackerSpec(
        "tensorboard",
        "tensorboard",
        "TensorBoard",
        "tensorboard",
        {
            "log_dir": Option(
                "path", "the folder of the trials' log dirs (default: <run dir>/tensorboard)"
            ),
        },
    ),
    "wandb": TrackerSpec(
        "wandb",
        "wandb",
        "Weights & Biases (wandb)",
        "wandb",
        {
            "mode": Option(
                "choice",
                "offline (default: runs written under dir, `wandb sync` uploads them), "
                "online or disabled",
                ("offline", "online", "disabled"),
            ),
            "project": Option("string", "the W&B project (default: the study name)"),
            "entity": Option("string", "the W&B entity (user or team)"),
            "group": Option("string", "the runs' group (default: the study name)"),
            "dir": Option("path", "where the runs are written (default: the run dir)"),
            "tags": Option("strings", "tags every trial's run gets, besides array:<index>"),
        },
    ),
}


def missing(name: str) -> str | None:
    """Why tracker ``name``'s library cannot be imported here (not installed), or ``None``.
    Cheap: it looks the module up without importing it."""
    spec = TRACKERS[name]
    try:
        found = importlib.util.find_spec(spec.module) is not None
    except (ImportError, ValueError):
        found = False
    if found:
        return None
    return f"tracker {name!r} needs {spec.library}, which is not installed: {spec.install}"


def import_problem(name: str) -> str | None:
    """Why tracker ``name``'s library fails to import (missing, or broken), or ``None`` after
    importing it: the check made before a sweep trains."""
    spec = TRACKERS[name]
    problem = missing(name)
    if problem is not None:
        return problem
    modules = [spec.module]
    if name == "tensorboard":  # the writer is torch's, which needs tensorboard
        modules.append("torch.utils.tensorboard")
    for module in modules:
        try:
            importlib.import_module(module)
        except Exception as exc:
            return (
                f"tracker {name!r} needs {spec.library}, which fails to import "
                f"({module}: {type(exc).__name__}: {exc}); reinstall it: {spec.install}"
            )
    return None
