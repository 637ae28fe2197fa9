"""The schema of a sweep: the frozen dataclasses a validated ``sweep.yaml`` becomes, the names
and limits it may use, and :class:`ConfigError`.

Nothing here reads or checks a file (:mod:`hfsweep.config.parse` does); a new setting is a field
here, with its default, plus its parsing in :mod:`hfsweep.config.parse`. Users import these names
from :mod:`hfsweep.config`, whose ``__all__`` lists them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from .._errors import LocatedError
from ..search_spaces import FixedParam, SearchSpace
from ..settings import ArraySettings
from ..storage.db_url import mask

if TYPE_CHECKING:  # a sweep file is checked without torch, which the task module imports
    from ..training.task import Task

#: searcher name -> the Optuna sampler class it builds
_SAMPLERS = {
    "tpe": "TPESampler",
    "random": "RandomSampler",
    "grid": "GridSampler",
    "cmaes": "CmaEsSampler",
    "qmc": "QMCSampler",
    "gp": "GPSampler",
}
#: Every searcher name a sweep may use.
SEARCHER_NAMES = tuple(_SAMPLERS)

#: Array dtypes a sweep may train in.
DTYPES = ("float32", "float64", "bfloat16")
#: Executors a sweep may run on.
BACKENDS = ("local", "ray")
#: The largest budgets a sweep file may give: far past any sweep that could finish, they only
#: catch a typo or an exponent (``trials: 100000000000``), which would otherwise be accepted and
#: then fill the study with trials or never end (MAX_TRIALS also bounds the Tune plugin's members).
MAX_TRIALS = 1_000_000
_MAX_EPOCHS = 100_000
_MAX_STEPS = 1_000_000_000
_MAX_TIME_LIMIT_S = 366 * 24 * 3600.0


class ConfigError(LocatedError):
    """A sweep config is not valid.

    The message is ``"<file>: <path>: <problem>"`` (the parts that are known): the sweep file,
    the YAML path of the bad entry (``budget.trials``, ``search_space.lr.low``; ``""`` for the
    file as a whole), then the bad value and what would be valid. The parts are kept as
    :attr:`file`, :attr:`path` and :attr:`problem`.
    """


@dataclass(frozen=True)
class SearcherConfig:
    """The Optuna sampler a sweep asks configs from: ``name`` (one of :data:`SEARCHER_NAMES`),
    its ``seed`` and constructor ``options``. ``grid_size`` is the number of grid points for
    ``grid`` (the engine runs at most that many trials), ``None`` otherwise."""

    name: str = "tpe"
    seed: int = 0
    options: dict[str, Any] = field(default_factory=dict)
    grid_size: int | None = None

    @property
    def custom(self) -> bool:
        """``name`` is a :class:`hfsweep.Searcher` subclass (``module:Class``,
        ``file.py:Class``), not an Optuna sampler."""
        return ":" in self.name

    def to_dict(self) -> dict[str, Any]:
        """``{name, seed, options}``, as ``searcher:`` takes it."""
        return {"name": self.name, "seed": self.seed, "options": dict(self.options)}


@dataclass(frozen=True)
class SchedulerConfig:
    """The trial scheduler: a name from ``hfsweep.schedulers.SCHEDULER_NAMES`` and the options
    ``make_scheduler`` takes (besides ``mode`` and ``max_resource``, which come from the sweep)."""

    name: str = "fifo"
    options: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        """``{name, options}``, as ``scheduler:`` takes it."""
        return {"name": self.name, "options": dict(self.options)}


@dataclass(frozen=True)
class Budget:
    """How much a sweep trains: ``trials`` in all, each for ``epochs`` or ``steps`` (exactly one
    is set), and an optional wall-clock ``time_limit_s`` for the whole sweep."""

    trials: int
    epochs: int | None = None
    steps: int | None = None
    time_limit_s: float | None = None

    @property
    def resource(self) -> Literal["epochs", "steps"]:
        """The unit schedulers count in: ``"epochs"`` or ``"steps"``."""
        return "epochs" if self.epochs is not None else "steps"

    @property
    def max_resource(self) -> int:
        """A trial's whole budget in :attr:`resource` units."""
        value = self.epochs if self.epochs is not None else self.steps
        assert value is not None
        return value

    def trial_config(self) -> dict[str, int]:
        """The task config keys that give a trial this budget: ``{"epochs": n}`` or
        ``{"max_steps": n}``."""
        if self.epochs is not None:
            return {"epochs": self.epochs}
        assert self.steps is not None
        return {"max_steps": self.steps}

    def to_dict(self) -> dict[str, Any]:
        """``{trials, epochs or steps, time_limit}`` (the time limit in seconds)."""
        out: dict[str, Any] = {"trials": self.trials}
        out["epochs" if self.epochs is not None else "steps"] = self.max_resource
        out["time_limit"] = self.time_limit_s
        return out


@dataclass(frozen=True)
class FusionConfig:
    """How trials are fused: array ``size`` (an int, or ``"auto"`` for the profiler's choice),
    ``device`` (``auto``, ``cpu``, ``cuda``, ``cuda:N``), ``dtype`` (one of :data:`DTYPES`),
    ``eval_every`` (steps between evaluations; ``None``: one epoch), ``share_frozen``
    (frozen tensors identical in every member, a fine-tuning sweep's backbone, kept once:
    ``share_frozen`` of :func:`hfsweep.fuse`), ``compile`` (``True``: arrays compile their
    traced forward, backward and loss with ``torch.compile``; ``"auto"``: the profiler times
    both and keeps the faster; on the Ray backend too, elastic arrays included) and ``offload`` (``none``, ``host``: an array's state in host
    memory, streamed through the device shard by shard, or ``auto``: ``host`` only when the
    array does not fit the device; see docs/offload.md) with ``device_memory`` bytes for it on
    the device (``None``: a CUDA device's free memory; on the CPU ``auto`` then keeps arrays as
    they are). ``alternate`` (with ``offload: host``) trains that many offloaded arrays at once
    on the device (on the Ray backend, in each worker), their shards alternating so one array's
    transfers overlap another's compute (1: one array at a time). ``offload_step`` (with
    ``offload`` ``host`` or ``auto``) is where an offloaded array's optimizer steps: ``host``
    (the default), ``device`` (each shard on the device right after its backward) or ``auto``
    (both timed on the array's first steps, the faster kept)."""

    size: int | Literal["auto"] = "auto"
    device: str = "auto"
    dtype: str = "float32"
    eval_every: int | None = None
    share_frozen: bool = True
    compile: bool | Literal["auto"] = False
    offload: str = "none"
    device_memory: int | None = None
    alternate: int = 1
    offload_step: str = "host"

    def to_dict(self) -> dict[str, Any]:
        """The ``fusion:`` mapping."""
        return dataclasses.asdict(self)

    @property
    def arrays(self) -> ArraySettings:
        """Every setting but ``size``: how each array trains, as the executors take it."""
        values = self.to_dict()
        del values["size"]
        return ArraySettings(**values)


@dataclass(frozen=True)
class ElasticConfig:
    """``ray.elastic``: arrays on several workers, resized while they run by the allocator.

    ``enabled`` (default off); every array trains on ``min_workers_per_array`` to
    ``max_workers_per_array`` workers (``None``: up to the cluster); an array is resized at most
    once per ``resize_every_s`` seconds, a resize pauses an array for ``resize_cost_s`` seconds
    and must gain more than that (a grow before the array's next rung), and an array paused because workers are short waits at most ``max_wait_s`` seconds
    (:mod:`hfsweep.elastic.policy` carries the allocator's plans out on ``backend: ray``).
    ``scaling`` is how the allocator knows what more workers give an array: ``"model"`` (each
    compatibility key's profile modelled from a measured one-worker step and this machine's
    measured all-reduce cost, cached) or ``"perfect"`` (assumed: k workers are k times one).
    """

    enabled: bool = False
    min_workers_per_array: int = 1
    max_workers_per_array: int | None = None
    resize_every_s: float = 60.0
    resize_cost_s: float = 0.0
    max_wait_s: float = 600.0
    scaling: str = "model"

    def to_dict(self) -> dict[str, Any]:
        """The ``ray.elastic`` mapping."""
        return dataclasses.asdict(self)

    def summary(self) -> str:
        """One line for ``hfsweep validate``: ``elastic off`` or the settings."""
        most = self.max_workers_per_array or "the cluster"
        settings = (
            f"{self.min_workers_per_array} to {most} workers per array, resized at most every "
            f"{self.resize_every_s:g} s, {self.scaling} scaling"
        )
        return f"elastic {'on' if self.enabled else 'off'} ({settings})"


@dataclass(frozen=True)
class RayConfig:
    """Where ``backend: ray`` trains arrays: the cluster's ``address`` (``None``: a local Ray
    started for the run), the resources each array's actor reserves (``gpus_per_array`` ``None``
    means one GPU when the device may be CUDA), at most ``max_concurrent`` arrays at once
    (``None``: as many as the cluster's resources fit) and ``max_failures`` restarts of an array
    from its checkpoint when its worker dies; ``address``'s cluster must answer within
    ``connect_timeout_s`` seconds."""

    address: str | None = None
    cpus_per_array: float = 1.0
    gpus_per_array: float | None = None
    max_concurrent: int | None = None
    max_failures: int = 3
    connect_timeout_s: float = 30.0
    elastic: ElasticConfig = field(default_factory=ElasticConfig)

    def to_dict(self) -> dict[str, Any]:
        """The ``ray:`` mapping (``gpus_per_array`` ``None`` written as ``"auto"``)."""
        out = dataclasses.asdict(self)
        if self.gpus_per_array is None:
            out["gpus_per_array"] = "auto"
        out["elastic"] = self.elastic.to_dict()
        return out


@dataclass(frozen=True)
class TrackerConfig:
    """One entry of ``tracking:``: a tracker ``name`` (one of
    ``hfsweep.tracking.TRACKER_NAMES``) and its ``options`` (paths made absolute)."""

    name: str
    options: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        """``{name: options}``, as a ``tracking:`` entry takes it."""
        return {self.name: dict(self.options)}


@dataclass(frozen=True)
class SweepFile:
    """A sweep file checked on its own, without its task: what :func:`check_sweep_file`
    returns (``hfsweep validate --file-only``), and the part of a :class:`SweepConfig` that
    does not need the task.

    Every key, type, range and section is checked, the search space and the searcher and
    scheduler with their options too; what needs the task's code is not: whether ``config``
    and the search space use keys the task knows, whether ``metric`` is one it reports, whether
    sampled configs pass ``task.resolve``, a searcher of your own (``module:Class``).
    ``task_ref`` is the task's reference with a file path made absolute (the resolved form the
    engine saves); ``config`` the fixed values of every trial; ``space`` the search space;
    ``output`` the run directory (absolute when the sweep came from a file); ``source`` the
    sweep file, if any; ``storage_retry_s`` how long a lost database connection is retried
    (None: not at all); ``tracking`` the experiment trackers every trial is sent to.
    """

    task_ref: str
    config: dict[str, Any]
    space: SearchSpace
    searcher: SearcherConfig
    scheduler: SchedulerConfig
    budget: Budget
    metric: str
    mode: Literal["max", "min"]
    fusion: FusionConfig
    backend: str
    storage: str | None = field(repr=False)  # it may hold a password: summary() masks it
    output: Path
    study_name: str
    seed: int
    source: Path | None = None
    ray: RayConfig = field(default_factory=RayConfig)
    storage_retry_s: float | None = 120.0
    tracking: tuple[TrackerConfig, ...] = ()

    def trial_config(self, sampled: Mapping[str, Any]) -> dict[str, Any]:
        """A trial's task config: the fixed ``config``, the ``sampled`` values and the budget."""
        return {**self.config, **sampled, **self.budget.trial_config()}

    def to_dict(self) -> dict[str, Any]:
        """The resolved config as JSON-safe data, in the schema of a sweep file:
        ``parse_sweep(c.to_dict(), source=c.source)`` gives an equal config (the search space
        inline, paths absolute, every default written out), but for a password written in the
        storage URL: it is masked (``user:***@``), so that ``sweep.json`` holds no secret."""
        return {
            "task": self.task_ref,
            "config": dict(self.config),
            "search_space": self.space.to_dict(),
            "searcher": self.searcher.to_dict(),
            "scheduler": self.scheduler.to_dict(),
            "budget": self.budget.to_dict(),
            "metric": self.metric,
            "mode": self.mode,
            "fusion": self.fusion.to_dict(),
            "backend": self.backend,
            **({"ray": self.ray.to_dict()} if self.backend == "ray" else {}),
            "storage": mask(self.storage),  # a password written in the URL is not stored
            "storage_retry": self.storage_retry_s,
            "output": str(self.output),
            "study_name": self.study_name,
            "seed": self.seed,
            **({"tracking": [t.to_dict() for t in self.tracking]} if self.tracking else {}),
        }

    def _task_line(self) -> str:
        return (
            f"task {self.task_ref} (not imported: the file alone is checked, not the task's "
            "code, nor the config keys and metric against it)"
        )

    def summary(self) -> str:
        """A few lines describing the sweep, as ``hfsweep validate`` prints them."""
        b = self.budget
        per = f"{b.max_resource} {b.resource}"
        limit = (
            f"time limit {_seconds(b.time_limit_s)}"
            if b.time_limit_s is not None
            else "time limit unbounded"
        )
        searcher = self.searcher.name
        if self.searcher.grid_size is not None:
            searcher += f" ({self.searcher.grid_size} grid points"
            if b.trials > self.searcher.grid_size:
                searcher += f"; trials capped at {self.searcher.grid_size}"
            searcher += ")"
        sampled = [n for n in self.space.names if not isinstance(self.space[n], FixedParam)]
        fixed = {**self.config, **self.space.fixed}
        lines = [
            self._task_line(),
            f"{b.trials} trials of {per} each, {limit}",
            f"searcher {searcher}, scheduler {self.scheduler.name}",
            f"metric {self.metric} ({self.mode})",
            f"search space: {_names(sampled) or '(nothing sampled)'}",
        ]
        if fixed:
            lines.append("fixed: " + _names([f"{k}={v!r}" for k, v in fixed.items()]))
        lines += [
            f"fusion: size {self.fusion.size}, device {self.fusion.device}, {self.fusion.dtype}",
            f"backend {self.backend}, storage "
            + (mask(self.storage) or "journal file in the run directory"),
            f"output {self.output} (study {self.study_name!r})",
        ]
        if self.backend == "ray":
            lines.insert(-1, f"ray: {self.ray.elastic.summary()}")
        if self.tracking:
            lines.append("tracking: " + ", ".join(t.name for t in self.tracking))
        return "\n".join(lines)


@dataclass(frozen=True)
class SweepConfig(SweepFile):
    """A validated sweep: what :func:`load_sweep` and :func:`parse_sweep` return. Its fields
    are a :class:`SweepFile`'s, checked against the task too, and ``task``, the loaded
    :class:`hfsweep.Task`."""

    task: Task = field(kw_only=True)

    def _task_line(self) -> str:
        name = self.task.name
        return f"task {name} ({self.task_ref})" if self.task_ref != name else f"task {name}"


#: the most names a summary line lists (a generated space may have thousands)
_SHOWN = 40


def _names(items: list[str]) -> str:
    """``items`` joined, the first :data:`_SHOWN` of them and how many more."""
    shown = ", ".join(items[:_SHOWN])
    return shown + (f" and {len(items) - _SHOWN:,} more" if len(items) > _SHOWN else "")


def _seconds(seconds: float) -> str:
    """``5400 s (1h30m)``: seconds, and hours and minutes when that is easier to read."""
    text = f"{seconds:g} s"
    if seconds >= 60:
        h, rest = divmod(seconds, 3600)
        m, s = divmod(rest, 60)
        parts = [f"{h:.0f}h" if h else "", f"{m:.0f}m" if m else "", f"{s:g}s" if s else ""]
        text += f" ({''.join(parts)})"
    return text
