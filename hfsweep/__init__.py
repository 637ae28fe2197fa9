"""hfsweep: hyperparameter sweeps of PyTorch models trained as horizontally fused arrays.

``hs.fuse(models)`` turns B models of one architecture into one :class:`FusedArray` that trains
every member exactly as it would train alone, in one pass. ``import hfsweep`` stays light: Ray and
Optuna are imported only where a sweep uses them.
"""

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

__version__ = "0.1.0.dev0"

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
