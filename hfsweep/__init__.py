"""hfsweep: hyperparameter sweeps of PyTorch models trained as horizontally fused arrays.

``hs.fuse(models)`` turns B models of one architecture into one :class:`FusedArray` that trains
every member exactly as it would train alone, in one pass. ``import hfsweep`` stays light: each
public name is imported where it is first used (torch with the first that needs it), and Ray and
Optuna only where a sweep uses them.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from ._version import __version__

if TYPE_CHECKING:
    from . import optim
    from ._errors import FusionError
    from ._retrain import Retrained, retrain
    from .core.loop import SweepError, SweepResult, TrainingError, sweep
    from .fusion import FusedArray, fuse, member_losses
    from .searchers import Searcher
    from .sizing.task import profile_task
    from .tracking import Callback
    from .training import ArrayJob, ArrayTrainer, Evaluation, Member, MemberResult, train_together
    from .training.task import Task, TaskError

#: public name -> the module it is defined in; imported on first use (PEP 562), so that a
#: command that never trains (``hfsweep validate --file-only``, a sweep file's own checks in
#: ``hfsweep run``) answers without importing torch
_WHERE = {
    "optim": ".optim",
    "FusionError": "._errors",
    "Retrained": "._retrain",
    "retrain": "._retrain",
    "SweepError": ".core.loop",
    "SweepResult": ".core.loop",
    "TrainingError": ".core.loop",
    "sweep": ".core.loop",
    "FusedArray": ".fusion",
    "fuse": ".fusion",
    "member_losses": ".fusion",
    "Searcher": ".searchers",
    "profile_task": ".sizing.task",
    "Callback": ".tracking",
    "ArrayJob": ".training",
    "ArrayTrainer": ".training",
    "Evaluation": ".training",
    "Member": ".training",
    "MemberResult": ".training",
    "train_together": ".training",
    "Task": ".training.task",
    "TaskError": ".training.task",
}


def __getattr__(name: str) -> Any:
    where = _WHERE.get(name)
    if where is None:  # a subpackage, as `hs.config` after `import hfsweep as hs`
        if name.startswith("__"):
            raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
        try:
            return importlib.import_module(f"{__name__}.{name}")
        except ModuleNotFoundError as exc:
            if exc.name != f"{__name__}.{name}":
                raise
            raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None
    module = importlib.import_module(where, __name__)
    value = module if name == "optim" else getattr(module, name)
    globals()[name] = value  # later uses find it without this function
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_WHERE})


__all__ = [
    "ArrayJob",
    "ArrayTrainer",
    "Callback",
    "Evaluation",
    "FusedArray",
    "FusionError",
    "Member",
    "MemberResult",
    "Retrained",
    "Searcher",
    "SweepError",
    "SweepResult",
    "Task",
    "TaskError",
    "TrainingError",
    "__version__",
    "fuse",
    "member_losses",
    "optim",
    "profile_task",
    "retrain",
    "sweep",
    "train_together",
]
