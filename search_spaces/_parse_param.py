"""Parsing one search-space parameter from its YAML spec into a :class:`~._params.Param`.

Every check of one param's spec lives here (its type, bounds, step, choices, ``when``), with
errors that name the YAML path and what would be valid; :mod:`._params` holds the param kinds.
"""

from __future__ import annotations

import copy
import difflib
import math
import numbers
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

from hfsweep._checks import is_finite, is_int, is_number

from ._errors import SpaceError
from ._params import (
    PARAM_TYPES,
    CategoricalParam,
    Condition,
    FixedParam,
    FloatParam,
    IntParam,
    Param,
    _dec,
    join_path,
    same_value,
)

__all__ = ["parse_param"]

_N = TypeVar("_N", int, float)

# names other tools use for these types, with what to write instead
_TYPE_HINTS = {
    "uniform": "type: float",
    "loguniform": "type: float with log: true",
    "quniform": "type: float with step",
    "discrete_uniform": "type: float with step",
    "randint": "type: int",
    "choice": "type: categorical",
    "categories": "type: categorical",
    "const": "type: fixed",
    "constant": "type: fixed",
}


def _scalar(value: Any) -> tuple[bool, Any]:
    """``(ok, value)``: whether ``value`` is a valid choice (str, int, float, bool or None, not
    NaN), with NumPy-like numbers turned into Python's own."""
    if value is None or isinstance(value, (bool, str)):
        return True, str(value) if isinstance(value, str) else value
    if isinstance(value, numbers.Integral):
        return True, int(value)
    if isinstance(value, numbers.Real):
        f = float(value)
        return (not math.isnan(f)), f
    return False, value


def _type_name(value: Any) -> str:
    if isinstance(value, Mapping):
        return "mapping"
    if isinstance(value, (list, tuple)):
        return "list"
    return type(value).__name__


def _suggest(word: str, options: Sequence[str]) -> str:
    close = difflib.get_close_matches(word, options, n=2)
    return f" (did you mean {' or '.join(map(repr, close))}?)" if close else ""


def parse_param(name: str, raw: Any, path: str) -> Param:
    """Parse the spec ``raw`` of the param ``name`` found at YAML path ``path``.

    A plain scalar (str, number, bool, null) is a fixed value; a mapping is a spec with a
    ``type``. Only this param is checked; conditions are checked against the others later.
    """
    if not isinstance(raw, Mapping):
        if isinstance(raw, (list, tuple)):
            raise SpaceError(
                f"{list(raw)!r} is a list, not a param spec; write "
                "{type: categorical, choices: [...]} to choose among values, or "
                "{type: fixed, value: [...]} for a fixed list",
                path=path,
            )
        ok, value = _scalar(raw)
        if not ok:
            raise SpaceError(
                f"{raw!r} ({_type_name(raw)}) is neither a param spec (a mapping with a type) nor "
                "a fixed value (str, int, float, bool or null)",
                path=path,
            )
        return FixedParam(name, value=value)

    for key in raw:
        if not isinstance(key, str):
            raise SpaceError(
                f"key {key!r} ({_type_name(key)}) is not a spec key; valid keys are strings: "
                f"type, {', '.join(sorted({k for ks in PARAM_TYPES.values() for k in ks} - {'type'}))}",
                path=path,
            )
    if "type" not in raw:
        raise SpaceError(
            f"the spec {dict(raw)!r} has no type; add type: one of {list(PARAM_TYPES)}"
            f"{_guess_type(raw)}",
            path=path,
        )
    kind = raw["type"]
    if not isinstance(kind, str) or kind not in PARAM_TYPES:
        hint = ""
        if isinstance(kind, str):
            hint = (
                f" (for {kind!r} write {_TYPE_HINTS[kind.lower()]})"
                if kind.lower() in _TYPE_HINTS
                else _suggest(kind, list(PARAM_TYPES))
            )
        raise SpaceError(
            f"{kind!r} is not a param type; valid types: {', '.join(PARAM_TYPES)}{hint}",
            path=join_path(path, "type"),
        )
    valid = PARAM_TYPES[kind]
    for key in raw:
        if key not in valid:
            raise SpaceError(
                f"{key!r} is not a key of a {kind} param; valid keys: {', '.join(valid)}"
                f"{_suggest(key, valid)}",
                path=join_path(path, key),
            )
    when = _parse_when(raw["when"], join_path(path, "when")) if "when" in raw else {}
    if kind == "float":
        return _parse_float(name, raw, path, when)
    if kind == "int":
        return _parse_int(name, raw, path, when)
    if kind == "categorical":
        return _parse_categorical(name, raw, path, when)
    if "value" not in raw:
        raise SpaceError("a fixed param needs value: the value every config gets", path=path)
    return FixedParam(name, value=copy.deepcopy(raw["value"]), when=when)


def _guess_type(raw: Mapping[str, Any]) -> str:
    if "choices" in raw:
        return " (with choices: type: categorical)"
    if "value" in raw:
        return " (with value: type: fixed)"
    if "low" in raw or "high" in raw:
        return " (with low and high: type: float or type: int)"
    return ""


def _required(raw: Mapping[str, Any], key: str, path: str, kind: str) -> Any:
    if key not in raw:
        raise SpaceError(f"a {kind} param needs low and high; {key} is missing", path=path)
    return raw[key]


def _number(value: Any, path: str, what: str) -> float:
    if not is_number(value):
        hint = ""
        if isinstance(value, str):
            try:
                float(value)
                hint = " (YAML 1.1 reads a number such as 1e-4 as a string: write 1.0e-4)"
            except ValueError:
                pass
        raise SpaceError(
            f"{value!r} ({_type_name(value)}) is not a number; {what}{hint}", path=path
        )
    if not is_finite(value):
        raise SpaceError(f"{value!r} is not finite; {what}", path=path)
    return float(value)


def _integer(value: Any, path: str, what: str) -> int:
    if is_int(value):
        return int(value)
    number = _number(value, path, what)  # a clear message for strings, bools, None
    raise SpaceError(
        f"{value!r} is not an integer; {what}"
        + (f" (write {int(number)})" if number.is_integer() else " (or use type: float)"),
        path=path,
    )


def _flag(raw: Mapping[str, Any], path: str) -> bool:
    value = raw.get("log", False)
    if not isinstance(value, bool):
        raise SpaceError(f"{value!r} is not true or false; log takes a bool", path=path)
    return value


def _bounds(
    raw: Mapping[str, Any],
    path: str,
    kind: str,
    convert: Callable[[Any, str, str], _N],
    what: str,
) -> tuple[_N, _N]:
    """A float or int param's ``(low, high)``, each converted and checked, with high > low."""
    article = "an" if kind[0] in "aeiou" else "a"
    low, high = (
        convert(
            _required(raw, key, path, kind),
            join_path(path, key),
            f"{article} {kind} param's {key} is {what}",
        )
        for key in ("low", "high")
    )
    if high <= low:
        raise SpaceError(
            f"{raw['high']!r} is not greater than low ({raw['low']!r}); high must be > low "
            "(for a single value write {type: fixed, value: ...})",
            path=join_path(path, "high"),
        )
    return low, high


def _parse_float(name: str, raw: Mapping[str, Any], path: str, when: Condition) -> FloatParam:
    low, high = _bounds(raw, path, "float", _number, "a finite number")
    log = _flag(raw, join_path(path, "log"))
    if log and low <= 0:
        raise SpaceError(
            f"{raw['low']!r} is not > 0; a log scale needs low > 0 (e.g. 1.0e-6), or drop log",
            path=join_path(path, "low"),
        )
    step: float | None = None
    if raw.get("step") is not None:
        step_path = join_path(path, "step")
        step = _number(raw["step"], step_path, "step is a positive number")
        if step <= 0:
            raise SpaceError(
                f"{raw['step']!r} is not > 0; step is a positive number", path=step_path
            )
        if log:
            raise SpaceError(
                f"step {raw['step']!r} cannot be combined with log: true for a float param "
                "(Optuna forbids it); drop step or log",
                path=step_path,
            )
        span = _dec(high) - _dec(low)
        if span % _dec(step) != 0:
            below = float(_dec(low) + (span // _dec(step)) * _dec(step))
            above = float(_dec(below) + _dec(step))
            raise SpaceError(
                f"{raw['step']!r} does not divide high - low = {high!r} - {low!r}; Optuna needs "
                f"(high - low) to be a multiple of step (it would silently lower high to "
                f"{below!r}); set high to {below!r} or {above!r}, or pick a step that divides "
                f"{float(span)!r}",
                path=step_path,
            )
    return FloatParam(name, low=low, high=high, step=step, log=log, when=when)


def _parse_int(name: str, raw: Mapping[str, Any], path: str, when: Condition) -> IntParam:
    low, high = _bounds(raw, path, "int", _integer, "an integer")
    log = _flag(raw, join_path(path, "log"))
    if log and low < 1:
        raise SpaceError(
            f"{raw['low']!r} is not >= 1; an int param on a log scale needs low >= 1, or drop log",
            path=join_path(path, "low"),
        )
    step = 1
    if raw.get("step") is not None:
        step_path = join_path(path, "step")
        step = _integer(raw["step"], step_path, "an int param's step is a positive integer")
        if step <= 0:
            raise SpaceError(
                f"{raw['step']!r} is not > 0; an int param's step is a positive integer",
                path=step_path,
            )
        if log and step != 1:
            raise SpaceError(
                f"step {raw['step']!r} cannot be combined with log: true (Optuna allows only "
                "step 1 on a log scale); drop step or log",
                path=step_path,
            )
        if (high - low) % step:
            below = low + (high - low) // step * step
            raise SpaceError(
                f"{step!r} does not divide high - low = {high - low}; Optuna would silently lower "
                f"high to {below}; set high to {below} or {below + step}, or pick a step that "
                f"divides {high - low}",
                path=step_path,
            )
    return IntParam(name, low=low, high=high, step=step, log=log, when=when)


def _parse_categorical(
    name: str, raw: Mapping[str, Any], path: str, when: Condition
) -> CategoricalParam:
    choices_path = join_path(path, "choices")
    if "choices" not in raw:
        raise SpaceError("a categorical param needs choices: a list of values", path=path)
    raw_choices = raw["choices"]
    if not isinstance(raw_choices, (list, tuple)):
        raise SpaceError(
            f"{raw_choices!r} ({_type_name(raw_choices)}) is not a list; choices is a list of "
            "values, e.g. [sgd, adamw]",
            path=choices_path,
        )
    if not raw_choices:
        raise SpaceError(
            "[] is empty; choices needs at least one value (two or more to choose from)",
            path=choices_path,
        )
    choices: list[Any] = []
    first: dict[Any, int] = {}  # choice -> its index; scalars hash as they compare (1 == 1.0)
    for i, item in enumerate(raw_choices):
        item_path = f"{choices_path}[{i}]"
        ok, value = _scalar(item)
        if not ok:
            raise SpaceError(
                f"{item!r} ({_type_name(item)}) is not a valid choice; choices are str, int, "
                "float (not NaN), bool or null",
                path=item_path,
            )
        j = first.setdefault(value, i)
        if j != i:
            earlier = choices[j]
            why = (
                ""
                if same_value(value, earlier) and type(value) is type(earlier)
                else " in Python, so Optuna cannot tell them apart"
            )
            raise SpaceError(
                f"{item!r} equals choices[{j}] ({earlier!r}){why}; choices must be distinct",
                path=item_path,
            )
        choices.append(value)
    return CategoricalParam(name, choices=tuple(choices), when=when)


def _parse_when(raw: Any, path: str) -> dict[str, tuple[Any, ...]]:
    example = "e.g. {optimizer: adamw} or {optimizer: [sgd, adam]}"
    if not isinstance(raw, Mapping) or not raw:
        raise SpaceError(
            f"{raw!r} is not a non-empty mapping; when maps other params to the value(s) they "
            f"must take, {example}",
            path=path,
        )
    when: dict[str, tuple[Any, ...]] = {}
    for key, value in raw.items():
        if not isinstance(key, str):
            raise SpaceError(
                f"key {key!r} ({_type_name(key)}) is not a param name; when maps param names to "
                f"values, {example}",
                path=path,
            )
        key_path = join_path(path, key)
        items = list(value) if isinstance(value, (list, tuple)) else [value]
        if not items:
            raise SpaceError(
                "[] lists no value; give one value or a non-empty list of values", path=key_path
            )
        values: list[Any] = []
        for i, item in enumerate(items):
            ok, item_value = _scalar(item)
            if not ok:
                where = f"{key_path}[{i}]" if isinstance(value, (list, tuple)) else key_path
                raise SpaceError(
                    f"{item!r} ({_type_name(item)}) is not a value a param can be tested for; "
                    "use str, int, float, bool or null (or a list of them)",
                    path=where,
                )
            if not any(same_value(item_value, v) for v in values):
                values.append(item_value)
        when[key] = tuple(values)
    return when
