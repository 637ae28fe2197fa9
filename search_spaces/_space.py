"""``SearchSpace``: the params of a sweep, validated as a whole, drawn through Optuna."""

from __future__ import annotations

import copy
import heapq
import math
import os
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any

from hfsweep._checks import is_int

from ._errors import SpaceError
from ._params import FixedParam, FloatParam, Param, join_path, same_value
from ._parse_param import parse_param
from ._yaml import load_yaml, read_yaml_file

if TYPE_CHECKING:
    from optuna.distributions import BaseDistribution
    from optuna.trial import BaseTrial

__all__ = ["SearchSpace"]

_EXAMPLE = "lr: {type: float, low: 1.0e-4, high: 1.0, log: true}"


class SearchSpace:
    """How each config key of a sweep is drawn.

    Built from a mapping of config keys (the flat names ``hs.Task`` configs use: ``lr``,
    ``momentum``, ``optimizer``, ``batch_size``, a task's own keys...) to param specs::

        lr: {type: float, low: 1.0e-4, high: 1.0, log: true}
        momentum: {type: float, low: 0.0, high: 0.99, step: 0.01}
        hidden: {type: int, low: 32, high: 256, log: true}
        optimizer: {type: categorical, choices: [sgd, adamw]}
        batch_size: 64                          # a plain value: fixed
        epochs: {type: fixed, value: 10}
        beta1: {type: float, low: 0.8, high: 0.99, when: {optimizer: adamw}}

    ``when`` makes a param conditional: it is drawn only when every key it names has one of the
    listed values (a key that was not drawn does not hold). Conditions may chain but not form a
    cycle. Everything is checked when the space is built; a problem raises :class:`SpaceError`
    naming the YAML path under ``path`` (``""``: no prefix) and ``source`` (a file, if any).

    The space is read-only. ``names`` lists the params in a deterministic order in which every
    param comes after the params its condition names (otherwise in the order given);
    ``space[name]`` is the parsed param (:class:`FloatParam`, :class:`IntParam`,
    :class:`CategoricalParam` or :class:`FixedParam`).
    """

    def __init__(
        self, spec: Mapping[str, Any], *, path: str = "search_space", source: str | None = None
    ) -> None:
        self._path = path
        self._source = source
        try:
            self._params = _parse_params(spec, path)
            self._names = _order(self._params, path)
            _check_reachable(self._params, self._names, path)
        except SpaceError as exc:
            if source is None or exc.file is not None:
                raise
            raise SpaceError(exc.problem, path=exc.path, file=source) from None

    # ------------------------------------------------------------------ building
    @classmethod
    def from_dict(cls, d: Mapping[str, Any], *, path: str = "search_space") -> SearchSpace:
        """The space ``d`` describes (a mapping of config keys to specs); errors name YAML
        paths under ``path``."""
        return cls(d, path=path)

    @classmethod
    def from_yaml(cls, path: str | os.PathLike[str]) -> SearchSpace:
        """The space in a YAML file whose top level is the mapping of config keys to specs.

        Numbers such as ``1e-4`` are read as floats (as YAML 1.2 does). Errors name the file
        and the key path inside it (``lr.low``).
        """
        file = os.fspath(path)
        text = read_yaml_file(file, error=SpaceError, what="search-space file")
        data = load_yaml(text, file)
        if data is None:
            raise SpaceError(
                f"the file is empty; a search space maps config keys to specs, e.g. {_EXAMPLE}",
                file=file,
            )
        return cls(data, path="", source=file)

    # ------------------------------------------------------------------ reading
    @property
    def names(self) -> list[str]:
        """Every param's name; each comes after the params its ``when`` names."""
        return list(self._names)

    @property
    def fixed(self) -> dict[str, Any]:
        """The unconditional fixed values (conditional ones appear in :meth:`sample` when their
        condition holds)."""
        return {
            n: copy.deepcopy(p.value)
            for n, p in self._items()
            if isinstance(p, FixedParam) and not p.when
        }

    @property
    def path(self) -> str:
        """The YAML path errors about this space start with."""
        return self._path

    def __len__(self) -> int:
        return len(self._params)

    def __iter__(self) -> Iterator[str]:
        return iter(self._names)

    def __contains__(self, name: object) -> bool:
        return name in self._params

    def __getitem__(self, name: str) -> Param:
        try:
            return self._params[name]
        except KeyError:
            raise KeyError(f"{name!r} is not a param of the space; params: {self._names}") from None

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, SearchSpace):
            return NotImplemented
        return list(self._params.items()) == list(other._params.items())

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        inner = ", ".join(f"{n}={p}" for n, p in self._params.items())
        return f"SearchSpace({inner})"

    def to_dict(self) -> dict[str, Any]:
        """The spec mapping, in the order the params were given; ``SearchSpace.from_dict`` of it
        gives an equal space. Defaults are left out (no ``log: false``) and unconditional fixed
        scalars are written as plain values."""
        return {n: p.to_spec() for n, p in self._params.items()}

    # ------------------------------------------------------------------ Optuna
    def sample(self, trial: BaseTrial) -> dict[str, Any]:
        """Draw one config from ``trial`` (define-by-run).

        Params are suggested in :attr:`names` order with ``trial.suggest_float``,
        ``suggest_int`` or ``suggest_categorical``; a param whose ``when`` does not hold is
        skipped (absent from the config), and fixed values are included without being
        suggested (so they are not in ``trial.params``). Works with any Optuna trial, e.g.
        ``optuna.trial.FixedTrial(params)`` to replay a config.
        """
        config: dict[str, Any] = {}
        for name in self._names:
            param = self._params[name]
            if param.is_active(config):
                config[name] = param.suggest(trial)
        return config

    def distributions(self) -> dict[str, BaseDistribution]:
        """The Optuna distributions of the unconditional, non-fixed params.

        This is the static search space samplers such as ``optuna.samplers.QMCSampler`` or
        ``study.enqueue_trial``/``study.add_trial`` need. Conditional params are *not* included
        (they exist only in some trials), nor are fixed values (they are not sampled).
        """
        return {
            n: p.distribution()
            for n, p in self._items()
            if not isinstance(p, FixedParam) and not p.when
        }

    def grid(self, max_points: int | None = None) -> dict[str, list[Any]]:
        """The search space for ``optuna.samplers.GridSampler``: every value of each sampled
        param (categorical choices, int ranges with their step, float ranges with their step).

        Fixed values are left out (``sample`` adds them). :class:`SpaceError` for a float param
        without ``step``, for conditional params (GridSampler needs every param in every trial),
        and when the grid has more than ``max_points`` points.
        """
        counts = self._grid_counts()
        if max_points is not None:
            if not is_int(max_points) or max_points < 1:
                raise ValueError(f"max_points must be a positive int or None, got {max_points!r}")
            size = math.prod(counts.values())
            if size > max_points:
                parts = " x ".join(f"{n}: {c}" for n, c in counts.items())
                raise SpaceError(
                    f"the grid has {size} points ({parts}), more than max_points={max_points}; "
                    "use a coarser step or fewer choices, or another sampler (random, TPE)",
                    path=self._path,
                    file=self._source,
                )
        return {n: self._params[n].grid_values(self._param_path(n)) for n in counts}

    def grid_size(self) -> int:
        """The number of points in :meth:`grid` (1 for a space of fixed values only); raises as
        :meth:`grid` does."""
        return math.prod(self._grid_counts().values())

    # ------------------------------------------------------------------ internals
    def _items(self) -> Iterator[tuple[str, Param]]:
        return ((n, self._params[n]) for n in self._names)

    def _param_path(self, name: str) -> str:
        return join_path(self._path, name)

    def _grid_counts(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for name, param in self._items():
            if isinstance(param, FixedParam):
                continue
            if param.when:
                raise SpaceError(
                    f"{name!r} is conditional ({param}); optuna's GridSampler needs every param "
                    "in every trial, so a grid cannot have conditional params; remove when, or "
                    "use another sampler (random, TPE)",
                    path=join_path(self._param_path(name), "when"),
                    file=self._source,
                )
            try:
                counts[name] = param.grid_count(self._param_path(name))
            except SpaceError as exc:
                raise SpaceError(exc.problem, path=exc.path, file=self._source) from None
        return counts


# ---------------------------------------------------------------------------- validation
def _parse_params(spec: Mapping[str, Any], path: str) -> dict[str, Param]:
    if not isinstance(spec, Mapping):
        raise SpaceError(
            f"{spec!r} ({type(spec).__name__}) is not a mapping; a search space maps config "
            f"keys to param specs, e.g. {_EXAMPLE}",
            path=path,
        )
    if not spec:
        raise SpaceError(
            f"the search space is empty; give at least one param, e.g. {_EXAMPLE}", path=path
        )
    params: dict[str, Param] = {}
    for name, raw in spec.items():
        if not isinstance(name, str) or not name:
            raise SpaceError(
                f"key {name!r} ({type(name).__name__}) is not a param name; param names are "
                "non-empty strings, the config keys of the task (lr, momentum, optimizer, ...)",
                path=path,
            )
        params[name] = parse_param(name, raw, join_path(path, name))
    for name, param in params.items():
        for key, values in param.when.items():
            key_path = join_path(join_path(join_path(path, name), "when"), key)
            if key == name:
                raise SpaceError(
                    f"{name!r} is conditional on itself; when names other params", path=key_path
                )
            if key not in params:
                others = [n for n in params if n != name]
                raise SpaceError(
                    f"{key!r} is not a param of the space; when may name: {', '.join(others)}",
                    path=key_path,
                )
            target = params[key]
            if isinstance(target, FloatParam):
                raise SpaceError(
                    f"{key!r} is a float param; conditions test params with a finite set of "
                    "values: categorical, int or fixed ones",
                    path=key_path,
                )
            for value in values:
                if not target.takes(value):
                    raise SpaceError(
                        f"{value!r} is not a value {key!r} can take; {key!r} takes "
                        f"{_domain(target)}",
                        path=key_path,
                    )
    return params


def _domain(param: Param) -> str:
    if isinstance(param, FixedParam):
        return f"only its fixed value {param.value!r}"
    choices = getattr(param, "choices", None)
    if choices is not None:
        return f"one of {list(choices)!r}"
    return str(param).split(" when ")[0]


def _order(params: dict[str, Param], path: str) -> list[str]:
    """Params in the given order, except that each comes after those its condition names:
    each step places the first param (in the given order) whose condition names only placed
    ones. Kahn's algorithm with a heap of ready params by position: O(n log n + conditions),
    so a large space is ordered in about linear time (rescanning the remaining params at each
    step would be quadratic)."""
    names = list(params)
    position = {name: i for i, name in enumerate(names)}
    waiting = {name: len(params[name].when) for name in names}
    waiters: dict[str, list[str]] = {}
    for name in names:
        for key in params[name].when:  # _parse_params checked that every key is a param
            waiters.setdefault(key, []).append(name)
    ready = [position[name] for name in names if not waiting[name]]
    heapq.heapify(ready)
    placed: list[str] = []
    done: set[str] = set()
    while ready:
        name = names[heapq.heappop(ready)]
        placed.append(name)
        done.add(name)
        for waiter in waiters.get(name, ()):
            waiting[waiter] -= 1
            if not waiting[waiter]:
                heapq.heappush(ready, position[waiter])
    if len(placed) < len(names):  # every remaining param waits on another: a cycle among them
        first = next(name for name in names if name not in done)
        cycle = _find_cycle(params, first, done)
        arrows = " -> ".join([*cycle, cycle[0]])
        raise SpaceError(
            f"conditions form a cycle ({arrows}: each is drawn only when the next one is); "
            "remove one of these conditions",
            path=join_path(join_path(join_path(path, cycle[0]), "when"), cycle[1]),
        )
    return placed


def _find_cycle(params: dict[str, Param], start: str, done: set[str]) -> list[str]:
    trail: list[str] = []
    name = start
    while name not in trail:
        trail.append(name)
        name = next(k for k in params[name].when if k not in done)
    return trail[trail.index(name) :]


def _check_reachable(params: dict[str, Param], names: list[str], path: str) -> None:
    """Every conditional param can be drawn: the conditions it implies, through the params its
    condition names, on any one key can hold at once. Each (key, param whose when says so)
    rule is kept once per param however many paths lead to it, so conditions that branch and
    join again do not multiply the rules."""
    # name -> key -> {whose when says so: values allowed}
    needs: dict[str, dict[str, dict[str, tuple[Any, ...]]]] = {}
    for name in names:
        mine: dict[str, dict[str, tuple[Any, ...]]] = {}
        for key, values in params[name].when.items():
            mine.setdefault(key, {})[name] = values
            for inner_key, rules in needs[key].items():
                mine.setdefault(inner_key, {}).update(rules)
        for key, rules in mine.items():
            if len(rules) < 2:
                continue  # one rule's values are not empty (_parse_when): it can hold
            sets = iter(rules.values())
            allowed = list(next(sets))
            for values in sets:
                allowed = [v for v in allowed if any(same_value(v, w) for w in values)]
            if not allowed:
                said = "; ".join(
                    f"{who}.when needs {key} in {list(v)!r}" for who, v in rules.items()
                )
                raise SpaceError(
                    f"{name!r} can never be drawn: its conditions, followed through the params "
                    f"they name, need {key!r} to take values that exclude each other ({said})",
                    path=join_path(join_path(path, name), "when"),
                )
        needs[name] = mine
