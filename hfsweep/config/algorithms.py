"""The ``searcher:`` and ``scheduler:`` sections of a sweep file: a name (or a mapping with a
name and options), checked by building what they name with their options, so that a bad option
is an error naming it before anything trains."""

from __future__ import annotations

import importlib.util
import inspect
import warnings
from collections.abc import Callable, Mapping
from typing import Any

from .._checks import is_int, is_number
from ..search_spaces import SearchSpace, SpaceError
from .build import make_sampler, make_searcher
from .fields import _did_you_mean, _Fields, _join
from .schema import _SAMPLERS, SEARCHER_NAMES, Budget, SchedulerConfig, SearcherConfig

_SEARCHER = ("name", "seed", "options")
_SCHEDULER = ("name", "options")
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


def _named(
    f: _Fields, raw: object, section: str, valid: tuple[str, ...], names: tuple[str, ...]
) -> tuple[object, str]:
    """``(name, path of the name)`` of a section given as a name (one of ``names``) or as a
    mapping ``{name, ...}`` whose keys are ``valid``."""
    if not isinstance(raw, Mapping):
        return raw, section
    f.keys(raw, valid, section)
    if "name" not in raw:
        raise f.error(section, f"missing key 'name' ({', '.join(names)})")
    return raw["name"], f"{section}.name"


def _options(f: _Fields, raw: object, section: str, example: str) -> Mapping[str, Any]:
    """The ``options`` mapping of a section given as a mapping; ``{}`` when absent."""
    if not isinstance(raw, Mapping) or raw.get("options") is None:
        return {}
    return f.mapping(raw["options"], f"{section}.options", example)


def _searcher(
    f: _Fields, raw: object, seed: int, space: SearchSpace, space_raw: object
) -> SearcherConfig:
    """The ``searcher:`` section; ``seed`` is the sweep's, ``space_raw`` the ``search_space:``
    value as given (for errors about a grid)."""
    given, path = _named(f, raw, "searcher", _SEARCHER, SEARCHER_NAMES)
    if isinstance(raw, Mapping):
        seed = f.integer(raw.get("seed", seed), "searcher.seed", 0)
    options = _options(f, raw, "searcher", "{constant_liar: true}")
    if isinstance(given, str) and ":" in given:  # built with the task (_check_custom_searcher)
        where, _, attr = given.rpartition(":")
        ref = f"{f.relative(where)}:{attr}" if where.endswith(".py") else given
        return SearcherConfig(name=ref, seed=seed, options=dict(options))
    name = f.choice(given, SEARCHER_NAMES, path)
    import optuna

    cls = getattr(optuna.samplers, _SAMPLERS[name])
    _check_sampler_options(f, cls, name, options)
    grid_size = None
    if name == "grid":
        try:
            grid_size = space.grid_size()
        except SpaceError as exc:
            prefix = "searcher 'grid' cannot use this space: "
            raise f.space_error(exc, space_raw, prefix) from None
    needs = _SAMPLER_NEEDS.get(name)
    if needs is not None and importlib.util.find_spec(needs) is None:
        raise f.error(path, f"searcher {name!r} needs the {needs} package: pip install {needs}")
    searcher = SearcherConfig(name=name, seed=seed, options=dict(options), grid_size=grid_size)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            make_sampler(searcher, space)
    except (ValueError, TypeError) as exc:
        where = "searcher.options" if options else path
        raise f.error(
            where, f"{cls.__name__} rejects the options {dict(options)!r}: {exc}"
        ) from None
    return searcher


def _check_sampler_options(f: _Fields, cls: type, name: str, options: Mapping[str, Any]) -> None:
    """Every option is an argument of the sampler ``cls`` that a sweep file may give, of the
    kind its default is."""
    params = inspect.signature(cls).parameters
    valid = [p for p in params if p not in _SAMPLER_SET_BY_SWEEP and p not in _SAMPLER_PYTHON_ONLY]
    for key, value in options.items():
        opath = _join("searcher.options", key)
        if key in _SAMPLER_SET_BY_SWEEP:
            raise f.error(
                opath,
                f"{key!r} is set by hfsweep ("
                + ("searcher.seed" if key == "seed" else "from the search space")
                + f"); valid options of {cls.__name__}: {', '.join(valid) or '(none)'}",
            )
        if key in _SAMPLER_PYTHON_ONLY and key in params:
            raise f.error(
                opath,
                f"{cls.__name__}'s {key!r} takes a Python object, which a sweep file cannot "
                f"give; valid options: {', '.join(valid) or '(none)'}",
            )
        if key not in params:
            raise f.error(
                opath,
                f"unknown option {key!r} for searcher {name!r} ({cls.__name__})"
                f"{_did_you_mean(key, valid)}; valid options: {', '.join(valid) or '(none)'}",
            )
        kind = _expected_kind(params[key].default)
        if kind is not None and not kind[1](value):
            raise f.error(
                opath, f"{value!r} ({type(value).__name__}) is not {kind[0]}, as {key} takes"
            )


def _expected_kind(default: object) -> tuple[str, Callable[[object], bool]] | None:
    if isinstance(default, bool):
        return "a boolean", lambda v: isinstance(v, bool)
    if isinstance(default, int):
        return "an integer", is_int
    if isinstance(default, float):
        return "a number", is_number
    return None


def _check_custom_searcher(f: _Fields, searcher: SearcherConfig, raw: object) -> None:
    """A searcher of your own (``searcher.name`` ``module:Class`` or ``file.py:Class``, from
    ``raw``, the ``searcher:`` section as given) is a :class:`hfsweep.Searcher` subclass that
    builds with its options: checked with the task, since importing it runs its code."""
    path = "searcher.name" if isinstance(raw, Mapping) else "searcher"
    options = searcher.options
    try:
        make_searcher(searcher)
    except ImportError as exc:
        raise f.error(path, str(exc)) from None
    except (TypeError, ValueError) as exc:
        raise f.error(
            "searcher.options" if options else path,
            f"searcher {searcher.name!r} cannot be built with options {dict(options)!r}: {exc}",
        ) from None


def _scheduler(f: _Fields, raw: object, mode: str, budget: Budget) -> SchedulerConfig:
    """The ``scheduler:`` section, for a sweep in ``mode`` with ``budget``."""
    from ..schedulers import SCHEDULER_NAMES, make_scheduler

    names = tuple(SCHEDULER_NAMES)
    given, path = _named(f, raw, "scheduler", _SCHEDULER, names)
    options = _options(f, raw, "scheduler", "{grace_period: 1}")
    name = f.choice(given, names, path)
    for key in options:
        if not isinstance(key, str):
            raise f.error("scheduler.options", f"option name {key!r} is not a string")

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
        raise f.error(
            where,
            f"scheduler {name!r} (mode {mode}, max_resource {budget.max_resource} "
            f"{budget.resource}) rejects it: {exc}",
        )
    return SchedulerConfig(name=name, options=dict(options))
