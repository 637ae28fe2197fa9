"""``sweep.yaml``: the schema of a sweep, read and validated before anything trains.

A sweep file is one YAML mapping. Every key, with its default::

    task: digits_mlp            # required. A ready task (hfsweep.tasks: digits_mlp, digits_cnn,
                                #   cifar_resnet, token_transformer), "package.module:attribute"
                                #   (imported from the working directory / sys.path) or
                                #   "path/to/file.py:attribute" (relative to the sweep file's folder)
    config: {hidden: 64}        # fixed config values of every trial; keys the task knows
    search_space: sgd_momentum  # required. A ready space (sgd_momentum, adamw, sgd_or_adamw), a
                                #   path to a YAML space file (relative to the sweep file's folder,
                                #   ending in .yaml/.yml or containing a "/"), or the space inline:
                                #   {lr: {type: float, low: 1.0e-3, high: 1.0, log: true}, ...}
    searcher: tpe               # tpe, random, grid, cmaes, qmc or gp (Optuna's samplers), or
                                #   {name: tpe, seed: 0, options: {constant_liar: true}}; options
                                #   are the sampler's constructor arguments; seed defaults to
                                #   the sweep's seed. grid needs a space grid() can build (floats
                                #   with a step, no conditional params); the engine caps the
                                #   trials at the grid size (SearcherConfig.grid_size). A search
                                #   algorithm of your own: {name: "file.py:Class" or
                                #   "module:Class", options: {...}}, an hfsweep.Searcher subclass
                                #   built with the options as keyword arguments.
    scheduler: fifo             # fifo, asha, hyperband, median or optuna:<pruner> (optuna:median,
                                #   optuna:successive_halving, ...), or
                                #   {name: asha, options: {grace_period: 1, reduction_factor: 3}};
                                #   resources (grace_period...) count epochs, or steps when the
                                #   budget is in steps.
    budget:                     # required
      trials: 64                # required, an integer from 1 to 1,000,000
      epochs: 10                # per trial; exactly one of epochs (an integer from 1 to 100,000)
      # steps: 500              #   and steps (an integer from 1 to 1,000,000,000)
      time_limit: null          # null: unbounded; or seconds (a number > 0) or a string: "90s",
                                #   "30m", "2h", "1h30m"; at most a year (8784h)
    metric: val_accuracy        # required; one of the task's metric_names
                                #   (train_loss, val_loss, val_<metric>...)
    mode: max                   # required; max or min
    fusion:
      size: auto                # array size B: auto (chosen by the profiler) or an int >= 1
                                #   (auto: at most half the trials unless the searcher
                                #   is random, grid or qmc, so the searcher learns)
      device: auto              # auto (cuda if available, else cpu), cpu, cuda or cuda:N
      dtype: float32            # float32, float64 or bfloat16
      eval_every: null          # evaluate every this many steps (int >= 1); null: every epoch
    backend: local              # local (in-process) or ray (arrays on a Ray cluster)
    ray:                        # only with backend: ray
      address: null             # null: start a local Ray for the run; "auto", "host:6379" or
                                #   "ray://host:10001" to use a running cluster
      cpus_per_array: 1         # CPUs each array's actor reserves (a number > 0)
      gpus_per_array: auto      # auto: 1 when fusion.device is cuda, or auto on a cluster with
                                #   GPUs; else 0. Or a number >= 0
      max_concurrent: null      # arrays training at once; null: as many as the cluster fits
      max_failures: 3           # restarts of an array from its checkpoint after its worker died
    storage: null               # null: an Optuna journal file in the run directory; or an Optuna
                                #   RDB URL (sqlite:///study.db, postgresql+psycopg2://user@host/db
                                #   with hfsweep[postgres], ...) whose driver is installed
    output: runs/<file stem>    # the run directory, relative to the sweep file's folder
    study_name: <file stem>     # the Optuna study's name ("sweep" without a file)
    seed: 0                     # int >= 0; the searcher's seed unless searcher.seed is given

Numbers such as ``1e-4`` are read as floats (as YAML 1.2 does). A key given twice in any mapping
(here or in a search-space file) is an error naming both lines, not a silent override; merge keys
(``<<: *anchor``) may still override the keys they bring in. Validation goes as far as can be
checked without training or writing anything: unknown keys (with a did-you-mean), types, ranges,
the task's entry point imports, every config and search-space key is one the task knows, the
metric is one the task reports, the searcher and scheduler build with their options, and sampled
configs (corners of the space and 20 random draws) pass ``task.resolve``. ``epochs`` and
``max_steps`` belong to the budget, not to ``config`` or the search space.

Every problem raises :class:`ConfigError` naming the file, the YAML path (``budget.trials``,
``search_space.lr.low``), the bad value and what is valid. :func:`load_sweep` reads a file,
:func:`parse_sweep` a mapping (the Python API's route). The result, :class:`SweepConfig`, is
frozen; :meth:`SweepConfig.to_dict` is its JSON-safe resolved form, which ``parse_sweep`` reads
back to an equal config.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import importlib.util
import inspect
import logging
import math
import os
import re
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from ._entry import load_task
from ._errors import LocatedError
from .search_spaces import FixedParam, SearchSpace, SpaceError, load_space
from .training.task import Task, TaskError

if TYPE_CHECKING:
    from optuna.samplers import BaseSampler

    from .searchers import Searcher

__all__ = [
    "BACKENDS",
    "DTYPES",
    "MAX_TRIALS",
    "SEARCHER_NAMES",
    "Budget",
    "ConfigError",
    "FusionConfig",
    "RayConfig",
    "SchedulerConfig",
    "SearcherConfig",
    "SweepConfig",
    "load_sweep",
    "make_sampler",
    "make_searcher",
    "parse_sweep",
]

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
#: sampler arguments set from elsewhere (seed) or that need Python objects a YAML file cannot give
_SAMPLER_SET_BY_SWEEP = ("seed", "search_space")
_SAMPLER_PYTHON_ONLY = (
    "gamma",
    "weights",
    "constraints_func",
    "independent_sampler",
    "source_trials",
)
#: extra packages a sampler imports when it samples
_SAMPLER_NEEDS = {"cmaes": "cmaes", "gp": "scipy"}

#: Array dtypes a sweep may train in.
DTYPES = ("float32", "float64", "bfloat16")
#: Executors a sweep may run on.
BACKENDS = ("local", "ray")
_MODES = ("max", "min")
_DEVICE = re.compile(r"^(auto|cpu|cuda(:[0-9]+)?)$")
_STORAGE = re.compile(r"^(sqlite|postgresql|postgres|mysql|oracle|mssql)(\+[A-Za-z0-9_]+)?://")
_DURATION = re.compile(r"^\s*(?:[0-9]+(?:\.[0-9]*)?\s*[smh]\s*)+$")
_DURATION_PART = re.compile(r"([0-9]+(?:\.[0-9]*)?)\s*([smh])")
_UNIT_S = {"s": 1.0, "m": 60.0, "h": 3600.0}
#: keys the budget sets; config and the search space may not
_BUDGET_KEYS = {"epochs": "budget.epochs", "max_steps": "budget.steps"}
#: the config key a TaskError's message names
_TASK_KEY = re.compile(r"^config (?:key '(\w+)'|(\w+)=)")
#: random configs drawn from the space to check against task.resolve
_SAMPLES = 20
#: The largest budgets a sweep file may give: far past any sweep that could finish, they only
#: catch a typo or an exponent (``trials: 100000000000``), which would otherwise be accepted and
#: then fill the study with trials or never end (MAX_TRIALS also bounds the Tune plugin's members).
MAX_TRIALS = 1_000_000
_MAX_EPOCHS = 100_000
_MAX_STEPS = 1_000_000_000
_MAX_TIME_LIMIT_S = 366 * 24 * 3600.0

_TOP_KEYS = (
    "task",
    "config",
    "search_space",
    "searcher",
    "scheduler",
    "budget",
    "metric",
    "mode",
    "fusion",
    "backend",
    "ray",
    "storage",
    "output",
    "study_name",
    "seed",
)
_REQUIRED = ("task", "search_space", "budget", "metric", "mode")
_BUDGET = ("trials", "epochs", "steps", "time_limit")
_FUSION = ("size", "device", "dtype", "eval_every")
_RAY = ("address", "cpus_per_array", "gpus_per_array", "max_concurrent", "max_failures")
_SEARCHER = ("name", "seed", "options")
_SCHEDULER = ("name", "options")


class ConfigError(LocatedError):
    """A sweep config is not valid.

    The message is ``"<file>: <path>: <problem>"`` (the parts that are known): the sweep file,
    the YAML path of the bad entry (``budget.trials``, ``search_space.lr.low``; ``""`` for the
    file as a whole), then the bad value and what would be valid. The parts are kept as
    :attr:`file`, :attr:`path` and :attr:`problem`.
    """


# ---------------------------------------------------------------------------- the config
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
    ``device`` (``auto``, ``cpu``, ``cuda``, ``cuda:N``), ``dtype`` (one of :data:`DTYPES`) and
    ``eval_every`` (steps between evaluations; ``None``: one epoch)."""

    size: int | Literal["auto"] = "auto"
    device: str = "auto"
    dtype: str = "float32"
    eval_every: int | None = None

    def to_dict(self) -> dict[str, Any]:
        """The ``fusion:`` mapping."""
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class RayConfig:
    """Where ``backend: ray`` trains arrays: the cluster's ``address`` (``None``: a local Ray
    started for the run), the resources each array's actor reserves (``gpus_per_array`` ``None``
    means one GPU when the device may be CUDA), at most ``max_concurrent`` arrays at once
    (``None``: as many as the cluster's resources fit) and ``max_failures`` restarts of an array
    from its checkpoint when its worker dies."""

    address: str | None = None
    cpus_per_array: float = 1.0
    gpus_per_array: float | None = None
    max_concurrent: int | None = None
    max_failures: int = 3

    def to_dict(self) -> dict[str, Any]:
        """The ``ray:`` mapping (``gpus_per_array`` ``None`` written as ``"auto"``)."""
        out = dataclasses.asdict(self)
        if self.gpus_per_array is None:
            out["gpus_per_array"] = "auto"
        return out


@dataclass(frozen=True)
class SweepConfig:
    """A validated sweep: what :func:`load_sweep` and :func:`parse_sweep` return.

    ``task_ref`` is the task's reference with a file path made absolute (the resolved form the
    engine saves), ``task`` the loaded :class:`hfsweep.Task`; ``config`` the fixed values of
    every trial; ``space`` the search space; ``output`` the run directory (absolute when the
    sweep came from a file); ``source`` the sweep file, if any.
    """

    task_ref: str
    task: Task
    config: dict[str, Any]
    space: SearchSpace
    searcher: SearcherConfig
    scheduler: SchedulerConfig
    budget: Budget
    metric: str
    mode: Literal["max", "min"]
    fusion: FusionConfig
    backend: str
    storage: str | None
    output: Path
    study_name: str
    seed: int
    source: Path | None = None
    ray: RayConfig = field(default_factory=RayConfig)

    def trial_config(self, sampled: Mapping[str, Any]) -> dict[str, Any]:
        """A trial's task config: the fixed ``config``, the ``sampled`` values and the budget."""
        return {**self.config, **sampled, **self.budget.trial_config()}

    def to_dict(self) -> dict[str, Any]:
        """The resolved config as JSON-safe data, in the schema of a sweep file:
        ``parse_sweep(c.to_dict(), source=c.source)`` gives an equal config (the search space
        inline, paths absolute, every default written out)."""
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
            "storage": self.storage,
            "output": str(self.output),
            "study_name": self.study_name,
            "seed": self.seed,
        }

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
            f"task {self.task.name} ({self.task_ref})"
            if self.task_ref != self.task.name
            else f"task {self.task.name}",
            f"{b.trials} trials of {per} each, {limit}",
            f"searcher {searcher}, scheduler {self.scheduler.name}",
            f"metric {self.metric} ({self.mode})",
            f"search space: {', '.join(sampled) or '(nothing sampled)'}",
        ]
        if fixed:
            lines.append("fixed: " + ", ".join(f"{k}={v!r}" for k, v in fixed.items()))
        lines += [
            f"fusion: size {self.fusion.size}, device {self.fusion.device}, {self.fusion.dtype}",
            f"backend {self.backend}, storage {self.storage or 'journal file in the run directory'}",
            f"output {self.output} (study {self.study_name!r})",
        ]
        return "\n".join(lines)


# ---------------------------------------------------------------------------- entry points
def load_sweep(path: str | os.PathLike[str]) -> SweepConfig:
    """Read and validate the sweep file at ``path``; raises :class:`ConfigError`."""
    source = Path(path)
    file = os.fspath(path)
    try:
        text = source.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        raise ConfigError(
            f"cannot read the sweep file ({reason}); give a readable UTF-8 YAML file", file=file
        ) from None
    data = _load_yaml(text, file)
    if data is None:
        raise ConfigError(
            "the file is empty; a sweep file is a YAML mapping with at least "
            f"{', '.join(_REQUIRED)}",
            file=file,
        )
    return parse_sweep(data, source=source)


def parse_sweep(mapping: Mapping[str, Any], *, source: Path | None = None) -> SweepConfig:
    """Validate a sweep given as a mapping (the content of a sweep file).

    ``source`` is the file it came from: relative paths (a task's ``.py`` file, a space file,
    ``output``) are taken from its folder, defaults (``output``, ``study_name``) from its stem,
    and errors name it. Without a source, relative paths are taken from the working directory.
    ``task`` may also be an :class:`hfsweep.Task` and ``search_space`` a ``SearchSpace``.
    Raises :class:`ConfigError`.
    """
    return _Parser(source).parse(mapping)


def make_sampler(searcher: SearcherConfig, space: SearchSpace) -> BaseSampler:
    """The Optuna sampler ``searcher`` describes (``grid`` gets ``space.grid()``). A custom
    searcher's study gets a seeded random sampler, which never samples: the searcher's
    configs are recorded as the trials' params."""
    import optuna

    if searcher.custom:
        return optuna.samplers.RandomSampler(seed=searcher.seed)

    cls = getattr(optuna.samplers, _SAMPLERS[searcher.name])
    if searcher.name == "grid":
        cls = _ask_tell_grid_sampler()
        sampler: BaseSampler = cls(space.grid(), seed=searcher.seed, **searcher.options)
    else:
        sampler = cls(seed=searcher.seed, **searcher.options)
    return sampler


@functools.cache
def _ask_tell_grid_sampler() -> Any:
    """Optuna's GridSampler without its ``study.stop()`` once the grid is done: that call only
    works inside ``study.optimize``, and the engine (ask and tell) caps the trials at the grid
    size itself."""
    import optuna

    class GridSampler(optuna.samplers.GridSampler):
        def after_trial(self, *args: Any, **kwargs: Any) -> None:
            return None

    return GridSampler


def make_searcher(searcher: SearcherConfig) -> Searcher:
    """A new instance of the custom searcher class ``searcher.name`` names (``module:Class`` or
    ``file.py:Class``), built with ``searcher.options``. Raises ``ImportError`` when it cannot
    be imported or is not a :class:`hfsweep.Searcher` subclass."""
    from ._entry import load_object
    from .searchers import Searcher

    cls = load_object(searcher.name, "searcher")
    if not (isinstance(cls, type) and issubclass(cls, Searcher)):
        raise ImportError(
            f"searcher {searcher.name!r} is {cls!r}, not a subclass of hfsweep.Searcher"
        )
    instance: Searcher = cls(**searcher.options)
    return instance


# ---------------------------------------------------------------------------- parsing
def _load_yaml(text: str, file: str) -> Any:
    import yaml

    from .search_spaces._yaml import DuplicateKeyError, _loader_class

    try:
        return yaml.load(text, Loader=_loader_class())  # a SafeLoader subclass
    except DuplicateKeyError as exc:
        raise ConfigError(exc.problem, path=exc.path, file=file) from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = getattr(exc, "problem", None) or str(exc)
        raise ConfigError(
            f"not valid YAML{where}: {problem}; a sweep file is one YAML mapping", file=file
        ) from None


def _did_you_mean(word: object, valid: list[str] | tuple[str, ...]) -> str:
    if not isinstance(word, str):
        return ""
    close = difflib.get_close_matches(word, list(valid), n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""


def _join(prefix: str, key: object) -> str:
    return f"{prefix}.{key}" if prefix else str(key)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


class _Parser:
    def __init__(self, source: Path | None) -> None:
        self.source = source
        self.file = os.fspath(source) if source is not None else None
        self.folder = source.parent if source is not None else None

    def error(self, path: str, problem: str) -> ConfigError:
        return ConfigError(problem, path=path, file=self.file)

    def relative(self, path: str) -> Path:
        p = Path(path).expanduser()
        if p.is_absolute():
            return p
        return (self.folder / p).absolute() if self.folder is not None else p.absolute()

    # ---------------------------------------------------------------- generic checks
    def mapping(self, value: object, path: str, example: str) -> Mapping[str, Any]:
        if not isinstance(value, Mapping):
            raise self.error(
                path,
                f"{value!r} ({type(value).__name__}) is not a mapping; write e.g. {example}",
            )
        return value

    def keys(self, value: Mapping[Any, Any], valid: tuple[str, ...], path: str) -> None:
        for key in value:
            if key not in valid:
                raise self.error(
                    _join(path, key),
                    f"unknown key {key!r}{_did_you_mean(key, valid)}; valid keys"
                    f"{' here' if path else ''}: {', '.join(valid)}",
                )

    def string(self, value: object, path: str, what: str) -> str:
        if not isinstance(value, str) or not value:
            raise self.error(
                path, f"{value!r} ({type(value).__name__}) is not a non-empty string; give {what}"
            )
        return value

    def choice(self, value: object, valid: tuple[str, ...], path: str) -> str:
        if not isinstance(value, str) or value not in valid:
            raise self.error(
                path,
                f"{value!r} is not valid{_did_you_mean(value, valid)}; give one of: "
                f"{', '.join(valid)}",
            )
        return value

    def integer(
        self, value: object, path: str, low: int, high: int | None = None, unit: str = ""
    ) -> int:
        """``value`` if it is an int from ``low`` to ``high`` (``None``: no upper bound);
        ``unit`` names what it counts in the message about ``high``."""
        if not _is_int(value) or value < low:  # type: ignore[operator]
            kind = f"{value!r} ({type(value).__name__}) is not an integer"
            problem = f"{kind} >= {low}" if high is None else f"{kind} from {low} to {high:,}"
            if isinstance(value, float):
                problem += (
                    "; a number with a point or an exponent (2.5, 1e3) is a float in YAML: write "
                    "a whole number such as 64"
                )
            raise self.error(path, problem)
        assert isinstance(value, int)
        if high is not None and value > high:
            raise self.error(
                path,
                f"{value:,} is more than {high:,} {unit}, the most a sweep may give (a larger "
                f"value is a typo: no sweep would finish it); give at most {high:,}",
            )
        return value

    # ---------------------------------------------------------------- the whole sweep
    def parse(self, raw: object) -> SweepConfig:
        top = self.mapping(raw, "", "task: digits_mlp, search_space: sgd_momentum, budget: ...")
        self.keys(top, _TOP_KEYS, "")
        missing = [k for k in _REQUIRED if k not in top]
        if missing:
            raise self.error(
                missing[0],
                f"missing required key {missing[0]!r}; a sweep needs {', '.join(_REQUIRED)}",
            )
        seed = self.integer(top.get("seed", 0), "seed", 0)
        task_ref, task = self.task(top["task"])
        budget = self.budget(top["budget"])
        config = self.config(top.get("config"), task, budget)
        space = self.space(top["search_space"], task, config)
        metric = self.metric(top["metric"], task)
        mode: Literal["max", "min"] = self.choice(top["mode"], _MODES, "mode")  # type: ignore[assignment]
        self.check_samples(task, config, space, budget, seed)
        searcher = self.searcher(top.get("searcher", "tpe"), seed, space, top["search_space"])
        scheduler = self.scheduler(top.get("scheduler", "fifo"), mode, budget)
        fusion = self.fusion(top.get("fusion"))
        backend = self.choice(top.get("backend", "local"), BACKENDS, "backend")
        if backend == "ray" and importlib.util.find_spec("ray") is None:
            raise self.error("backend", "backend 'ray' needs Ray: pip install 'ray[tune]'")
        ray = self.ray(top.get("ray"), backend)
        storage = self.storage(top.get("storage"))
        stem = self.source.stem if self.source is not None else "sweep"
        study_name = top.get("study_name")
        study_name = stem if study_name is None else self.string(study_name, "study_name", "a name")
        output = top.get("output")
        output = self.string(output, "output", "a folder") if output is not None else f"runs/{stem}"
        return SweepConfig(
            task_ref=task_ref,
            task=task,
            config=config,
            space=space,
            searcher=searcher,
            scheduler=scheduler,
            budget=budget,
            metric=metric,
            mode=mode,
            fusion=fusion,
            backend=backend,
            storage=storage,
            output=self.relative(output),
            study_name=study_name,
            seed=seed,
            source=self.source,
            ray=ray,
        )

    # ---------------------------------------------------------------- sections
    def task(self, raw: object) -> tuple[str, Task]:
        from . import tasks

        if isinstance(raw, Task):
            ready = tasks.TASKS.get(raw.name) is raw
            return (raw.name if ready else f"<python object: task {raw.name!r}>"), raw
        ref = self.string(
            raw,
            "task",
            f"a ready task ({', '.join(sorted(tasks.TASKS))}), module:attribute "
            "or path/to/file.py:attribute",
        )
        where, sep, attr = ref.rpartition(":")
        if sep and where.endswith(".py"):
            ref = f"{self.relative(where)}:{attr}"
        try:
            return ref, load_task(ref)
        except TaskError as exc:
            raise self.error("task", str(exc)) from None

    def budget(self, raw: object) -> Budget:
        b = self.mapping(raw, "budget", "{trials: 64, epochs: 10}")
        self.keys(b, _BUDGET, "budget")
        if "trials" not in b:
            raise self.error("budget", "missing required key 'trials' (the number of trials)")
        trials = self.integer(b["trials"], "budget.trials", 1, MAX_TRIALS, "trials")
        given = [k for k in ("epochs", "steps") if b.get(k) is not None]
        if len(given) != 1:
            raise self.error(
                "budget",
                (
                    "both epochs and steps are given"
                    if given
                    else "neither epochs nor steps is given"
                )
                + "; give exactly one: the budget of each trial in epochs or in optimizer steps",
            )
        most = _MAX_EPOCHS if given[0] == "epochs" else _MAX_STEPS
        value = self.integer(b[given[0]], f"budget.{given[0]}", 1, most, f"{given[0]} per trial")
        limit = self.duration(b.get("time_limit"), "budget.time_limit")
        if given[0] == "epochs":
            return Budget(trials=trials, epochs=value, time_limit_s=limit)
        return Budget(trials=trials, steps=value, time_limit_s=limit)

    def duration(self, raw: object, path: str) -> float | None:
        if raw is None:
            return None
        if _is_number(raw):
            assert isinstance(raw, int | float)
            if not math.isfinite(raw) or raw <= 0:
                raise self.error(path, f"{raw!r} is not a positive number of seconds")
            return self.at_most_a_year(float(raw), raw, path)
        if isinstance(raw, str) and _DURATION.match(raw):
            seconds = sum(float(n) * _UNIT_S[u] for n, u in _DURATION_PART.findall(raw))
            if seconds > 0:
                return self.at_most_a_year(seconds, raw, path)
        raise self.error(
            path,
            f"{raw!r} is not a duration; give seconds (a number > 0) or a string such as "
            "'90s', '30m', '2h' or '1h30m'",
        )

    def at_most_a_year(self, seconds: float, raw: object, path: str) -> float:
        if seconds > _MAX_TIME_LIMIT_S:
            raise self.error(
                path,
                f"{raw!r} ({seconds:,.0f} s) is longer than a year ({_MAX_TIME_LIMIT_S:,.0f} s, "
                "8784h), the longest time limit a sweep may give; give a shorter one, or null "
                "for no time limit",
            )
        return seconds

    def known_keys(self, task: Task) -> list[str]:
        return task.known_keys

    def check_key(self, key: object, task: Task, path: str, where: str = "") -> None:
        if key in _BUDGET_KEYS:
            raise self.error(
                path,
                f"{key!r}{where} is set by the budget; use {_BUDGET_KEYS[key]} (every trial's "
                "budget) instead",
            )
        known = [k for k in self.known_keys(task) if k not in _BUDGET_KEYS]
        if key not in known:
            raise self.error(
                path,
                f"{key!r}{where} is not a config key of task {task.name!r}"
                f"{_did_you_mean(key, known)}; known keys: {', '.join(known)}",
            )

    def config(self, raw: object, task: Task, budget: Budget) -> dict[str, Any]:
        if raw is None:
            return {}
        config = self.mapping(raw, "config", "{hidden: 128, batch_size: 64}")
        for key in config:
            self.check_key(key, task, _join("config", key))
        config = dict(config)
        culprit, exc = _first_failure(task, budget.trial_config(), config)
        if exc is not None:
            path = _join("config", culprit) if culprit is not None else "config"
            raise self.error(path, f"task {task.name!r} rejects it: {exc}")
        return config

    def space(self, raw: object, task: Task, config: dict[str, Any]) -> SearchSpace:
        ref: Any = raw
        if isinstance(raw, str) and (
            raw.lower().endswith((".yaml", ".yml")) or "/" in raw or os.sep in raw
        ):
            ref = self.relative(raw)
        elif not isinstance(raw, str | Mapping | SearchSpace):
            raise self.error(
                "search_space",
                f"{raw!r} ({type(raw).__name__}) is not a search space; give a ready space "
                "(sgd_momentum, adamw, sgd_or_adamw), a path to a .yaml file, or a mapping of "
                "config keys to param specs",
            )
        try:
            space = load_space(ref, path="search_space")
        except SpaceError as exc:
            raise self.space_error(exc, raw) from None
        where = f" (in {ref})" if isinstance(ref, Path) else ""
        if isinstance(raw, str) and not where:
            where = f" (in ready space {raw!r})"
        for name in space.names:
            path = _join("search_space", name)
            self.check_key(name, task, path, where)
            if name in config:
                raise self.error(
                    path,
                    f"{name!r}{where} is both searched and fixed in config ({name}="
                    f"{config[name]!r}); set it in one place",
                )
        return space

    def space_error(self, exc: SpaceError, raw: object, prefix: str = "") -> ConfigError:
        """``exc`` at its full YAML path under ``search_space``, naming the space's file."""
        if exc.file is None:
            return self.error(exc.path or "search_space", prefix + exc.problem)
        path = exc.path
        if path and not path.startswith("search_space"):
            path = _join("search_space", path)
        is_ready = isinstance(raw, str) and not raw.lower().endswith((".yaml", ".yml"))
        where = f"ready space {raw!r}" if is_ready and "/" not in str(raw) else exc.file
        return self.error(path or "search_space", f"in {where}: {prefix}{exc.problem}")

    def metric(self, raw: object, task: Task) -> str:
        valid = tuple(task.metric_names)
        if not isinstance(raw, str) or raw not in valid:
            raise self.error(
                "metric",
                f"{raw!r} is not a metric task {task.name!r} reports{_did_you_mean(raw, valid)}; "
                f"its metrics: {', '.join(valid)}",
            )
        return raw

    def check_samples(
        self, task: Task, config: dict[str, Any], space: SearchSpace, budget: Budget, seed: int
    ) -> None:
        base = {**budget.trial_config(), **config}
        for sample in _samples(space, seed):
            culprit, exc = _first_failure(task, base, sample)
            if exc is not None:
                path = _join("search_space", culprit) if culprit is not None else "search_space"
                raise self.error(
                    path,
                    f"the sampled config {sample!r} is rejected by task {task.name!r}: {exc}; "
                    "narrow the range, fix the value, or add a when condition",
                )

    def searcher(
        self, raw: object, seed: int, space: SearchSpace, space_raw: object
    ) -> SearcherConfig:
        path = "searcher"
        options: Mapping[str, Any] = {}
        if isinstance(raw, Mapping):
            self.keys(raw, _SEARCHER, "searcher")
            if "name" not in raw:
                raise self.error("searcher", f"missing key 'name' ({', '.join(SEARCHER_NAMES)})")
            path = "searcher.name"
            seed = self.integer(raw.get("seed", seed), "searcher.seed", 0)
            if raw.get("options") is not None:
                options = self.mapping(raw["options"], "searcher.options", "{constant_liar: true}")
            raw = raw["name"]
        if isinstance(raw, str) and ":" in raw:
            return self.custom_searcher(raw, seed, options, path)
        name = self.choice(raw, SEARCHER_NAMES, path)
        import optuna

        cls = getattr(optuna.samplers, _SAMPLERS[name])
        params = inspect.signature(cls).parameters
        valid = [
            p for p in params if p not in _SAMPLER_SET_BY_SWEEP and p not in _SAMPLER_PYTHON_ONLY
        ]
        for key, value in options.items():
            opath = _join("searcher.options", key)
            if key in _SAMPLER_SET_BY_SWEEP:
                raise self.error(
                    opath,
                    f"{key!r} is set by hfsweep ("
                    + ("searcher.seed" if key == "seed" else "from the search space")
                    + f"); valid options of {cls.__name__}: {', '.join(valid) or '(none)'}",
                )
            if key in _SAMPLER_PYTHON_ONLY and key in params:
                raise self.error(
                    opath,
                    f"{cls.__name__}'s {key!r} takes a Python object, which a sweep file cannot "
                    f"give; valid options: {', '.join(valid) or '(none)'}",
                )
            if key not in params:
                raise self.error(
                    opath,
                    f"unknown option {key!r} for searcher {name!r} ({cls.__name__})"
                    f"{_did_you_mean(key, valid)}; valid options: {', '.join(valid) or '(none)'}",
                )
            default = params[key].default
            kind = _expected_kind(default)
            if kind is not None and not kind[1](value):
                raise self.error(
                    opath, f"{value!r} ({type(value).__name__}) is not {kind[0]}, as {key} takes"
                )
        grid_size = None
        if name == "grid":
            try:
                grid_size = space.grid_size()
            except SpaceError as exc:
                prefix = "searcher 'grid' cannot use this space: "
                raise self.space_error(exc, space_raw, prefix) from None
        needs = _SAMPLER_NEEDS.get(name)
        if needs is not None and importlib.util.find_spec(needs) is None:
            raise self.error(
                path, f"searcher {name!r} needs the {needs} package: pip install {needs}"
            )
        searcher = SearcherConfig(name=name, seed=seed, options=dict(options), grid_size=grid_size)
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                make_sampler(searcher, space)
        except (ValueError, TypeError) as exc:
            where = "searcher.options" if options else path
            raise self.error(
                where, f"{cls.__name__} rejects the options {dict(options)!r}: {exc}"
            ) from None
        return searcher

    def custom_searcher(
        self, ref: str, seed: int, options: Mapping[str, Any], path: str
    ) -> SearcherConfig:
        """A :class:`hfsweep.Searcher` subclass named ``module:Class`` or ``file.py:Class``,
        checked by building it with ``options``."""
        where, _, attr = ref.rpartition(":")
        if where.endswith(".py"):
            ref = f"{self.relative(where)}:{attr}"
        searcher = SearcherConfig(name=ref, seed=seed, options=dict(options))
        try:
            make_searcher(searcher)
        except ImportError as exc:
            raise self.error(path, str(exc)) from None
        except (TypeError, ValueError) as exc:
            raise self.error(
                "searcher.options" if options else path,
                f"searcher {ref!r} cannot be built with options {dict(options)!r}: {exc}",
            ) from None
        return searcher

    def scheduler(self, raw: object, mode: str, budget: Budget) -> SchedulerConfig:
        from .schedulers import SCHEDULER_NAMES, make_scheduler

        path = "scheduler"
        options: Mapping[str, Any] = {}
        if isinstance(raw, Mapping):
            self.keys(raw, _SCHEDULER, "scheduler")
            if "name" not in raw:
                raise self.error("scheduler", f"missing key 'name' ({', '.join(SCHEDULER_NAMES)})")
            path = "scheduler.name"
            if raw.get("options") is not None:
                options = self.mapping(raw["options"], "scheduler.options", "{grace_period: 1}")
            raw = raw["name"]
        name = self.choice(raw, tuple(SCHEDULER_NAMES), path)
        for key in options:
            if not isinstance(key, str):
                raise self.error("scheduler.options", f"option name {key!r} is not a string")

        def build(opts: Mapping[str, Any]) -> Exception | None:
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    make_scheduler(name, mode=mode, max_resource=budget.max_resource, **opts)
            except (ValueError, TypeError) as exc:
                return exc
            return None

        exc = build(options)
        if exc is not None:
            # the first option whose addition makes it fail is the one to blame
            where = path
            keys = list(options)
            for i, key in enumerate(keys):
                if build({k: options[k] for k in keys[: i + 1]}) is not None:
                    where = _join("scheduler.options", key)
                    break
            raise self.error(
                where,
                f"scheduler {name!r} (mode {mode}, max_resource {budget.max_resource} "
                f"{budget.resource}) rejects it: {exc}",
            )
        return SchedulerConfig(name=name, options=dict(options))

    def fusion(self, raw: object) -> FusionConfig:
        if raw is None:
            return FusionConfig()
        f = self.mapping(raw, "fusion", "{size: auto, device: auto}")
        self.keys(f, _FUSION, "fusion")
        size: int | Literal["auto"] = "auto"
        if f.get("size", "auto") != "auto":
            if not _is_int(f["size"]) or f["size"] < 1:
                raise self.error(
                    "fusion.size",
                    f"{f['size']!r} is not 'auto' or an integer >= 1 (the array size B)",
                )
            size = f["size"]
        device = f.get("device", "auto")
        if not isinstance(device, str) or not _DEVICE.match(device):
            raise self.error(
                "fusion.device", f"{device!r} is not a device; give auto, cpu, cuda or cuda:N"
            )
        dtype = self.choice(f.get("dtype", "float32"), DTYPES, "fusion.dtype")
        every = f.get("eval_every")
        if every is not None:
            every = self.integer(every, "fusion.eval_every", 1)
        return FusionConfig(size=size, device=device, dtype=dtype, eval_every=every)

    def ray(self, raw: object, backend: str) -> RayConfig:
        if raw is None:
            return RayConfig()
        r = self.mapping(raw, "ray", "{address: auto, cpus_per_array: 1}")
        if backend != "ray" and r:
            raise self.error(
                "ray", "ray settings only apply with backend: ray; set backend: ray or remove them"
            )
        self.keys(r, _RAY, "ray")
        address = r.get("address")
        if address is not None:
            address = self.string(
                address, "ray.address", 'null, "auto", "host:6379" or "ray://host:10001"'
            )
        cpus = r.get("cpus_per_array", 1.0)
        if not _is_number(cpus) or not cpus > 0:
            raise self.error(
                "ray.cpus_per_array", f"{cpus!r} is not a number > 0 (CPUs per array's actor)"
            )
        gpus = r.get("gpus_per_array", "auto")
        if gpus == "auto":
            gpus = None
        elif not _is_number(gpus) or gpus < 0:
            raise self.error(
                "ray.gpus_per_array",
                f"{gpus!r} is not 'auto' or a number >= 0 (GPUs per array's actor)",
            )
        most = r.get("max_concurrent")
        if most is not None:
            most = self.integer(most, "ray.max_concurrent", 1)
        failures = self.integer(r.get("max_failures", 3), "ray.max_failures", 0)
        return RayConfig(
            address=address,
            cpus_per_array=float(cpus),
            gpus_per_array=None if gpus is None else float(gpus),
            max_concurrent=most,
            max_failures=failures,
        )

    def storage(self, raw: object) -> str | None:
        if raw is None:
            return None
        if not isinstance(raw, str) or not _STORAGE.match(raw):
            raise self.error(
                "storage",
                f"{raw!r} is not an Optuna storage URL; give null (a journal file in the run "
                "directory) or an RDB URL such as sqlite:///study.db or "
                "postgresql://user:password@host/db",
            )
        return raw


# ---------------------------------------------------------------------------- helpers
def _seconds(seconds: float) -> str:
    """``5400 s (1h30m)``: seconds, and hours and minutes when that is easier to read."""
    text = f"{seconds:g} s"
    if seconds >= 60:
        h, rest = divmod(seconds, 3600)
        m, s = divmod(rest, 60)
        parts = [f"{h:.0f}h" if h else "", f"{m:.0f}m" if m else "", f"{s:g}s" if s else ""]
        text += f" ({''.join(parts)})"
    return text


def _expected_kind(default: object) -> tuple[str, Callable[[object], bool]] | None:
    if isinstance(default, bool):
        return "a boolean", lambda v: isinstance(v, bool)
    if isinstance(default, int):
        return "an integer", _is_int
    if isinstance(default, float):
        return "a number", _is_number
    return None


def _first_failure(
    task: Task, base: Mapping[str, Any], extra: Mapping[str, Any]
) -> tuple[str | None, TaskError | None]:
    """``(key, error)`` when ``task.resolve({**base, **extra})`` fails, else ``(None, None)``.

    The key to blame is the one the task's message names (``config key 'momentum' is not a
    hyperparameter of optimizer 'adam'``, ``config lr=-1.0 ...``) if it is in ``extra``; else
    the last key of ``extra`` whose removal alone makes it pass; else the first key whose
    addition makes it fail; ``None`` if ``base`` alone fails.
    """

    def fails(config: Mapping[str, Any]) -> bool:
        try:
            task.resolve(config)
        except TaskError:
            return True
        return False

    try:
        task.resolve({**base, **extra})
        return None, None
    except TaskError as exc:
        error = exc
    named = _TASK_KEY.match(str(error))
    if named is not None and (named[1] or named[2]) in extra:
        return named[1] or named[2], error
    keys = list(extra)
    for key in reversed(keys):
        if not fails({**base, **{k: extra[k] for k in keys if k != key}}):
            return key, error
    for i in range(len(keys) + 1):
        if fails({**base, **{k: extra[k] for k in keys[:i]}}):
            return (keys[i - 1] if i else None), error
    return None, error


class _CornerTrial:
    """A stand-in for an Optuna trial that draws the ends of every range and the
    ``index``-th choice of every categorical param."""

    def __init__(self, high: bool, index: int) -> None:
        self.high = high
        self.index = index

    def suggest_float(
        self, name: str, low: float, high: float, *, step: float | None = None, log: bool = False
    ) -> float:
        if not self.high:
            return low
        if step is None:
            return high
        return low + math.floor((high - low) / step + 1e-9) * step

    def suggest_int(
        self, name: str, low: int, high: int, *, step: int = 1, log: bool = False
    ) -> int:
        return low + (high - low) // step * step if self.high else low

    def suggest_categorical(self, name: str, choices: Any) -> Any:
        return choices[self.index % len(choices)]


def _samples(space: SearchSpace, seed: int) -> list[dict[str, Any]]:
    """Configs to check: the corners of the space (every categorical choice at both ends of
    the ranges), then random draws."""
    import optuna

    choices = [len(getattr(space[n], "choices", ())) for n in space.names]
    out = [
        space.sample(_CornerTrial(high, index))
        for index in range(max([1, *choices]))
        for high in (False, True)
    ]
    logger = logging.getLogger("optuna")
    level = logger.level
    logger.setLevel(logging.WARNING)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=seed))
            for _ in range(_SAMPLES):
                trial = study.ask()
                out.append(space.sample(trial))
                study.tell(trial, 0.0)
    finally:
        logger.setLevel(level)
    return out
