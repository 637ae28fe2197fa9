"""Reading a sweep: :func:`load_sweep` (a file) and :func:`parse_sweep` (a mapping) check every
section in turn and return a :class:`SweepConfig`.

Where a setting goes: a new top-level key is named in ``_TOP_KEYS`` and read in
:meth:`_Parser.parse` (by a method of its own when it is a section); a new ``ray:`` key is named
in ``_RAY`` and read in :meth:`_Parser.ray`, a new ``fusion:`` key likewise in ``_FUSION`` and
:meth:`_Parser.fusion`; its field and default live in :mod:`hfsweep.config.schema`, and the
schema's reference in the package's docstring. The generic checks are in
:mod:`hfsweep.config.fields`, the searcher and scheduler in :mod:`hfsweep.config.algorithms`,
the checks against the task in :mod:`hfsweep.config.validate`.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import re
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from .._checks import is_int
from .._names import READY_TASKS
from ..search_spaces import SearchSpace, SpaceError, load_space, load_yaml, read_yaml_file
from ..settings import ARRAY_KEYS, YAML, SettingsError, array_settings
from ..storage.db_url import mask
from ..storage.journal_url import is_journal, resolve
from .algorithms import _check_custom_searcher, _scheduler, _searcher
from .elastic import _elastic
from .fields import _did_you_mean, _Fields, _join
from .schema import (
    _MAX_EPOCHS,
    _MAX_STEPS,
    BACKENDS,
    MAX_TRIALS,
    Budget,
    ConfigError,
    FusionConfig,
    RayConfig,
    SweepConfig,
    SweepFile,
)
from .tracking import _tracking
from .validate import _check_budget_key, _check_config, _check_key, _check_samples

if TYPE_CHECKING:
    from ..training.task import Task

_MODES = ("max", "min")
_STORAGE = re.compile(
    r"^(\$\{|journal://|(sqlite|postgresql|postgres|mysql|oracle|mssql)(\+[A-Za-z0-9_]+)?://)"
)

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
    "storage_retry",
    "output",
    "study_name",
    "seed",
    "tracking",
)
_REQUIRED = ("task", "search_space", "budget", "metric", "mode")
_BUDGET = ("trials", "epochs", "steps", "time_limit")
#: ``size`` (the packer's) and every array setting (:class:`~hfsweep.settings.ArraySettings`)
_FUSION = ("size", *ARRAY_KEYS)
_RAY = (
    "address",
    "cpus_per_array",
    "gpus_per_array",
    "max_concurrent",
    "max_failures",
    "connect_timeout_s",
    "elastic",
)


def load_sweep(path: str | os.PathLike[str]) -> SweepConfig:
    """Read and validate the sweep file at ``path``; raises :class:`ConfigError`.

    The file's own checks (every key, type and section: :func:`check_sweep_file`) come first;
    only then is the task imported and the file checked against it."""
    source, data = _read(path)
    return parse_sweep(data, source=source)


def check_sweep_file(path: str | os.PathLike[str]) -> SweepFile:
    """Read the sweep file at ``path`` and check it on its own, without importing its task
    (nor torch): every key with a did-you-mean, types, ranges, the search space, the searcher
    and scheduler with their options (see :class:`SweepFile` for what is left to the task).
    Raises :class:`ConfigError`. ``hfsweep validate --file-only`` runs this."""
    source, data = _read(path)
    return _Parser(source).check_file(data)


def _read(path: str | os.PathLike[str]) -> tuple[Path, Any]:
    file = os.fspath(path)
    text = read_yaml_file(file, error=ConfigError, what="sweep file")
    data = load_yaml(text, file, error=ConfigError, expected="a sweep file is one YAML mapping")
    if data is None:
        raise ConfigError(
            "the file is empty; a sweep file is a YAML mapping with at least "
            f"{', '.join(_REQUIRED)}",
            file=file,
        )
    return Path(path), data


def parse_sweep(mapping: Mapping[str, Any], *, source: Path | None = None) -> SweepConfig:
    """Validate a sweep given as a mapping (the content of a sweep file).

    ``source`` is the file it came from: relative paths (a task's ``.py`` file, a space file,
    ``output``) are taken from its folder, defaults (``output``, ``study_name``) from its stem,
    and errors name it. Without a source, relative paths are taken from the working directory.
    ``task`` may also be an :class:`hfsweep.Task` and ``search_space`` a ``SearchSpace``.
    Raises :class:`ConfigError`.
    """
    return _Parser(source).parse(mapping)


class _Parser(_Fields):
    """Reads one sweep, a section a method: first the file on its own (:meth:`check_file`), then
    against its task (:meth:`parse`)."""

    def parse(self, raw: object) -> SweepConfig:
        checked = self.check_file(raw)
        top: Mapping[str, Any] = raw  # type: ignore[assignment]  # a mapping: check_file() said so
        task = self.task(top["task"], checked.task_ref)
        config = self.config_keys(checked.config, task, checked.budget)
        self.space_keys(checked.space, top["search_space"], task)
        metric = self.metric(checked.metric, task)
        _check_samples(self, task, config, checked.space, checked.budget, checked.seed)
        if checked.searcher.custom:  # a searcher of your own is code, as the task is
            _check_custom_searcher(self, checked.searcher, top["searcher"])
        values = {f.name: getattr(checked, f.name) for f in dataclasses.fields(checked)}
        return SweepConfig(**{**values, "config": config, "metric": metric}, task=task)

    def check_file(self, raw: object) -> SweepFile:
        """Every check of the sweep that needs neither its task nor this machine."""
        top = self.mapping(raw, "", "task: digits_mlp, search_space: sgd_momentum, budget: ...")
        self.keys(top, _TOP_KEYS, "")
        missing = [k for k in _REQUIRED if k not in top]
        if missing:
            raise self.error(
                missing[0],
                f"missing required key {missing[0]!r}; a sweep needs {', '.join(_REQUIRED)}",
            )
        seed = self.integer(top.get("seed", 0), "seed", 0)
        task_ref = self.task_ref(top["task"])
        budget = self.budget(top["budget"])
        config = self.config(top.get("config"), budget)
        space = self.space(top["search_space"], config)
        metric = self.string(top["metric"], "metric", "the name of a metric the task reports")
        mode: Literal["max", "min"] = self.choice(top["mode"], _MODES, "mode")  # type: ignore[assignment]
        searcher = _searcher(self, top.get("searcher", "tpe"), seed, space, top["search_space"])
        scheduler = _scheduler(self, top.get("scheduler", "fifo"), mode, budget)
        fusion = self.fusion(top.get("fusion"))
        backend = self.choice(top.get("backend", "local"), BACKENDS, "backend")
        if backend == "ray" and importlib.util.find_spec("ray") is None:
            raise self.error("backend", "backend 'ray' needs Ray: pip install 'ray[tune]'")
        ray = self.ray(top.get("ray"), backend)
        if backend == "ray" and ray.elastic.enabled and fusion.offload != "none":
            raise self.error(
                "fusion.offload",
                f"{fusion.offload!r} is not supported with ray.elastic yet (a data-parallel "
                "array's workers train it on their devices); set offload: none or turn "
                "ray.elastic off",
            )
        storage = self.storage(top.get("storage"))
        stem = self.source.stem if self.source is not None else "sweep"
        study_name = top.get("study_name")
        study_name = stem if study_name is None else self.string(study_name, "study_name", "a name")
        output = top.get("output")
        output = self.string(output, "output", "a folder") if output is not None else f"runs/{stem}"
        return SweepFile(
            task_ref=task_ref,
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
            storage_retry_s=self.duration(top.get("storage_retry", 120.0), "storage_retry"),
            tracking=_tracking(self, top.get("tracking")),
        )

    def task_ref(self, raw: object) -> str:
        """The ``task:`` reference as the engine saves it (a file path made absolute), checked
        without importing anything: a ready task's name, or ``module:attribute`` or
        ``path/to/file.py:attribute`` whose file exists."""
        task_module = sys.modules.get("hfsweep.training.task")  # not imported for a file
        if task_module is not None and isinstance(raw, task_module.Task):  # the Python API's
            from .. import tasks

            ready = tasks.TASKS.get(raw.name) is raw
            return raw.name if ready else f"<python object: task {raw.name!r}>"
        valid = (
            f"a ready task ({', '.join(READY_TASKS)}), module:attribute or "
            "path/to/file.py:attribute"
        )
        ref = self.string(raw, "task", valid)
        where, sep, attr = ref.rpartition(":")
        if not sep:
            if ref not in READY_TASKS:
                raise self.error(
                    "task",
                    f"task {ref!r} is not a ready task{_did_you_mean(ref, READY_TASKS)} "
                    f"({', '.join(READY_TASKS)}) nor an entry point; write module:attribute or "
                    "path/to/file.py:attribute",
                )
            return ref
        if not where or not attr:
            raise self.error("task", f"task {ref!r}: write {valid}")
        if where.endswith(".py"):
            path = self.relative(where)
            if not path.is_file():
                raise self.error("task", f"task {ref!r}: file {os.fspath(path)!r} does not exist")
            return f"{path}:{attr}"
        return ref

    def task(self, raw: object, ref: str) -> Task:
        """The task ``ref`` names, imported (``raw`` when it is a task object already)."""
        from ..training.task import Task, TaskError
        from .entry import load_task

        if isinstance(raw, Task):
            return raw
        try:
            return load_task(ref)
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

    def config(self, raw: object, budget: Budget) -> dict[str, Any]:
        if raw is None:
            return {}
        config = self.mapping(raw, "config", "{hidden: 128, batch_size: 64}")
        for key in config:
            _check_budget_key(self, key, _join("config", key))
        return dict(config)

    def config_keys(self, config: dict[str, Any], task: Task, budget: Budget) -> dict[str, Any]:
        """``config`` checked against ``task``: keys it knows, values it resolves."""
        for key in config:
            _check_key(self, key, task, _join("config", key))
        _check_config(self, task, budget, config)
        return config

    def space(self, raw: object, config: dict[str, Any]) -> SearchSpace:
        ref: Any = raw
        if isinstance(raw, str) and _is_space_file(raw):
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
        where = _space_where(raw, ref)
        for name in space.names:
            path = _join("search_space", name)
            _check_budget_key(self, name, path, where)
            if name in config:
                raise self.error(
                    path,
                    f"{name!r}{where} is both searched and fixed in config ({name}="
                    f"{config[name]!r}); set it in one place",
                )
        return space

    def space_keys(self, space: SearchSpace, raw: object, task: Task) -> None:
        """Every key of ``space`` (given as ``raw``) is one ``task`` knows."""
        ref = self.relative(raw) if isinstance(raw, str) and _is_space_file(raw) else raw
        where = _space_where(raw, ref)
        for name in space.names:
            _check_key(self, name, task, _join("search_space", name), where)

    def metric(self, raw: str, task: Task) -> str:
        valid = tuple(task.metric_names)
        if raw not in valid:
            raise self.error(
                "metric",
                f"{raw!r} is not a metric task {task.name!r} reports{_did_you_mean(raw, valid)}; "
                f"its metrics: {', '.join(valid)}",
            )
        return raw

    def fusion(self, raw: object) -> FusionConfig:
        if raw is None:
            return FusionConfig()
        f = self.mapping(raw, "fusion", "{size: auto, device: auto}")
        self.keys(f, _FUSION, "fusion")
        size: int | Literal["auto"] = "auto"
        if f.get("size", "auto") != "auto":
            if not is_int(f["size"]) or f["size"] < 1:
                raise self.error(
                    "fusion.size",
                    f"{f['size']!r} is not 'auto' or an integer >= 1 (the array size B)",
                )
            size = int(f["size"])
        values = {k: f[k] for k in ARRAY_KEYS if k in f}
        try:
            arrays = array_settings(values, YAML)
        except SettingsError as exc:
            raise self.error(f"fusion.{exc.key}", exc.problem) from None
        return FusionConfig(size=size, **arrays.to_dict())

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
        cpus = self.number(
            r.get("cpus_per_array", 1.0),
            "ray.cpus_per_array",
            0,
            low_open=True,
            what="a number > 0 (CPUs per array's actor)",
        )
        gpus = r.get("gpus_per_array", "auto")
        if gpus != "auto":
            gpus = self.number(
                gpus,
                "ray.gpus_per_array",
                0,
                low_open=False,
                what="'auto' or a number >= 0 (GPUs per array's actor)",
            )
        most = r.get("max_concurrent")
        if most is not None:
            most = self.integer(most, "ray.max_concurrent", 1)
        failures = self.integer(r.get("max_failures", 3), "ray.max_failures", 0)
        wait = self.number(
            r.get("connect_timeout_s", 30.0),
            "ray.connect_timeout_s",
            0,
            low_open=True,
            what="a number of seconds > 0",
        )
        return RayConfig(
            address=address,
            cpus_per_array=cpus,
            gpus_per_array=None if gpus == "auto" else gpus,
            max_concurrent=most,
            max_failures=failures,
            connect_timeout_s=wait,
            elastic=_elastic(self, r.get("elastic")),
        )

    def storage(self, raw: object) -> str | None:
        if raw is None:
            return None
        if not isinstance(raw, str) or not _STORAGE.match(raw):
            raise self.error(
                "storage",
                f"{mask(raw) if isinstance(raw, str) else raw!r} is not an Optuna storage URL; "
                "give null (a journal file in the run directory), a journal file to share "
                "(journal:///abs/path/study.log, or journal://path relative to the sweep "
                "file) or an RDB URL such as sqlite:///study.db or "
                "postgresql://user:password@host/db",
            )
        if is_journal(raw):
            base = self.source.parent if self.source is not None else Path.cwd()
            return resolve(raw, base.resolve())
        return raw


def _is_space_file(raw: str) -> bool:
    """Whether ``search_space: raw`` names a file (else a ready space)."""
    return raw.lower().endswith((".yaml", ".yml")) or "/" in raw or os.sep in raw


def _space_where(raw: object, ref: object) -> str:
    """Which space a key came from, for messages: `` (in FILE)``, `` (in ready space NAME)``,
    or nothing for an inline one."""
    if isinstance(ref, Path):
        return f" (in {ref})"
    return f" (in ready space {raw!r})" if isinstance(raw, str) else ""
