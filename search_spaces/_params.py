"""One search-space parameter: how a single config key is drawn.

Four kinds, one dataclass each: :class:`FloatParam`, :class:`IntParam`, :class:`CategoricalParam`
and :class:`FixedParam`. Each knows how to suggest itself to an Optuna trial, its Optuna
distribution, its grid of values and its spec (the inverse of parsing). Parsing and checking one
param's YAML spec lives in :mod:`._parse_param`; checks across params (conditions, cycles) in
:mod:`._space`.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from dataclasses import dataclass, field
from decimal import Decimal
from typing import TYPE_CHECKING, Any, ClassVar

from hfsweep._checks import is_int

from ._errors import SpaceError

if TYPE_CHECKING:
    from optuna.distributions import BaseDistribution
    from optuna.trial import BaseTrial

__all__ = [
    "PARAM_TYPES",
    "CategoricalParam",
    "FixedParam",
    "FloatParam",
    "IntParam",
    "Param",
    "join_path",
    "same_value",
]

#: the values a condition maps a key to: the param must take one of them
Condition = Mapping[str, tuple[Any, ...]]

#: the spec keys each param type takes
PARAM_TYPES: dict[str, tuple[str, ...]] = {
    "float": ("type", "low", "high", "step", "log", "when"),
    "int": ("type", "low", "high", "step", "log", "when"),
    "categorical": ("type", "choices", "when"),
    "fixed": ("type", "value", "when"),
}


def join_path(prefix: str, key: object) -> str:
    """``prefix.key``, or ``key`` alone where there is no prefix."""
    return f"{prefix}.{key}" if prefix else str(key)


def same_value(a: Any, b: Any) -> bool:
    """Whether two scalar values are the same choice: equal, and both or neither a bool.

    ``0 == 0.0`` (YAML may spell a float choice as an int), but ``True`` is not ``1``.
    """
    return bool(a == b) and isinstance(a, bool) == isinstance(b, bool)


@dataclass(frozen=True)
class Param:
    """One config key of a search space and how it is drawn.

    ``when`` maps other keys of the space to the values they must take for this one to be drawn
    (all keys must hold; a key holds when its value is any of those listed). An empty ``when``
    means the param is always drawn.
    """

    #: the spec's ``type``
    kind: ClassVar[str] = ""

    name: str
    when: Condition = field(default_factory=dict, kw_only=True, hash=False)

    def is_active(self, config: Mapping[str, Any]) -> bool:
        """Whether this param is drawn, given the values drawn so far."""
        return all(
            key in config and any(same_value(config[key], v) for v in values)
            for key, values in self.when.items()
        )

    def suggest(self, trial: BaseTrial) -> Any:
        """Draw this param's value from ``trial`` (define-by-run)."""
        raise NotImplementedError

    def distribution(self) -> BaseDistribution:
        """The Optuna distribution this param is drawn from."""
        raise NotImplementedError

    def takes(self, value: Any) -> bool:
        """Whether the param can take ``value`` (used to check conditions on it)."""
        raise NotImplementedError

    def grid_values(self, path: str) -> list[Any]:
        """Every value, in order, for a grid search; :class:`SpaceError` where there is no finite
        grid."""
        raise NotImplementedError

    def grid_count(self, path: str) -> int:
        """``len(self.grid_values(path))`` without building the list."""
        return len(self.grid_values(path))

    def to_spec(self) -> Any:
        """The YAML spec of this param (parsing it gives this param back)."""
        raise NotImplementedError

    def _when_spec(self) -> dict[str, Any]:
        if not self.when:
            return {}
        return {
            "when": {
                key: list(values) if len(values) > 1 else values[0]
                for key, values in self.when.items()
            }
        }

    def _when_text(self) -> str:
        if not self.when:
            return ""
        parts = [f"{key} in {list(values)!r}" for key, values in self.when.items()]
        return " when " + " and ".join(parts)


@dataclass(frozen=True)
class FloatParam(Param):
    """A float drawn from ``[low, high]``: uniformly, on a log scale (``log``), or on the grid
    ``low, low + step, ..., high`` (``step``; ``high - low`` is a multiple of it)."""

    kind: ClassVar[str] = "float"

    low: float
    high: float
    step: float | None = None
    log: bool = False

    def suggest(self, trial: BaseTrial) -> float:
        return trial.suggest_float(self.name, self.low, self.high, step=self.step, log=self.log)

    def distribution(self) -> BaseDistribution:
        from optuna.distributions import FloatDistribution

        return FloatDistribution(self.low, self.high, log=self.log, step=self.step)

    def takes(self, value: Any) -> bool:
        return False  # conditions on a continuous param are rejected before this is asked

    def grid_count(self, path: str) -> int:
        if self.step is None:
            how = "drop log and add step" if self.log else "add step"
            raise SpaceError(
                f"float param {self.name!r} has no step, so it has no finite grid of values; "
                f"{how} (e.g. step: {_example_step(self)}), make it categorical, or use "
                "another sampler (random, TPE)",
                path=path,
            )
        return int((_dec(self.high) - _dec(self.low)) / _dec(self.step)) + 1

    def grid_values(self, path: str) -> list[Any]:
        n = self.grid_count(path)
        assert self.step is not None
        low, step = _dec(self.low), _dec(self.step)
        return [float(low + i * step) for i in range(n)]

    def to_spec(self) -> dict[str, Any]:
        spec: dict[str, Any] = {"type": "float", "low": self.low, "high": self.high}
        if self.step is not None:
            spec["step"] = self.step
        if self.log:
            spec["log"] = True
        return spec | self._when_spec()

    def __str__(self) -> str:
        extra = ", log" if self.log else f", step {self.step}" if self.step is not None else ""
        return f"float[{self.low}, {self.high}{extra}]{self._when_text()}"


@dataclass(frozen=True)
class IntParam(Param):
    """An int drawn from ``low, low + step, ..., high`` (``step`` defaults to 1), uniformly or
    on a log scale (``log``, only with step 1)."""

    kind: ClassVar[str] = "int"

    low: int
    high: int
    step: int = 1
    log: bool = False

    def suggest(self, trial: BaseTrial) -> int:
        return trial.suggest_int(self.name, self.low, self.high, step=self.step, log=self.log)

    def distribution(self) -> BaseDistribution:
        from optuna.distributions import IntDistribution

        return IntDistribution(self.low, self.high, log=self.log, step=self.step)

    def takes(self, value: Any) -> bool:
        return (
            is_int(value)
            and self.low <= int(value) <= self.high
            and (int(value) - self.low) % self.step == 0
        )

    def grid_count(self, path: str) -> int:
        return (self.high - self.low) // self.step + 1

    def grid_values(self, path: str) -> list[Any]:
        return list(range(self.low, self.high + 1, self.step))

    def to_spec(self) -> dict[str, Any]:
        spec: dict[str, Any] = {"type": "int", "low": self.low, "high": self.high}
        if self.step != 1:
            spec["step"] = self.step
        if self.log:
            spec["log"] = True
        return spec | self._when_spec()

    def __str__(self) -> str:
        extra = ", log" if self.log else f", step {self.step}" if self.step != 1 else ""
        return f"int[{self.low}, {self.high}{extra}]{self._when_text()}"


@dataclass(frozen=True)
class CategoricalParam(Param):
    """One of ``choices`` (str, int, float, bool or None), drawn as a category."""

    kind: ClassVar[str] = "categorical"

    choices: tuple[Any, ...]

    def suggest(self, trial: BaseTrial) -> Any:
        return trial.suggest_categorical(self.name, self.choices)

    def distribution(self) -> BaseDistribution:
        from optuna.distributions import CategoricalDistribution

        return CategoricalDistribution(self.choices)

    def takes(self, value: Any) -> bool:
        return any(same_value(value, c) for c in self.choices)

    def grid_values(self, path: str) -> list[Any]:
        return list(self.choices)

    def to_spec(self) -> dict[str, Any]:
        return {"type": "categorical", "choices": list(self.choices)} | self._when_spec()

    def __str__(self) -> str:
        return f"categorical{list(self.choices)!r}{self._when_text()}"


@dataclass(frozen=True)
class FixedParam(Param):
    """A value every drawn config gets as it is (no suggestion to the sampler)."""

    kind: ClassVar[str] = "fixed"

    value: Any = field(hash=False)

    def suggest(self, trial: BaseTrial) -> Any:
        return copy.deepcopy(self.value)

    def distribution(self) -> BaseDistribution:
        raise TypeError(f"fixed param {self.name!r} has no distribution: it is not sampled")

    def takes(self, value: Any) -> bool:
        return same_value(value, self.value)

    def grid_values(self, path: str) -> list[Any]:
        return [copy.deepcopy(self.value)]

    def to_spec(self) -> Any:
        plain = not self.when and not isinstance(self.value, (Mapping, list, tuple))
        if plain:
            return copy.deepcopy(self.value)
        return {"type": "fixed", "value": copy.deepcopy(self.value)} | self._when_spec()

    def __str__(self) -> str:
        return f"fixed {self.value!r}{self._when_text()}"


def _dec(x: float) -> Decimal:
    # Optuna checks and builds stepped float ranges in decimal arithmetic on str(x)
    return Decimal(str(x))


def _example_step(p: FloatParam) -> float:
    return float((_dec(p.high) - _dec(p.low)) / 10)
