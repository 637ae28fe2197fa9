"""The checks every section of a sweep file uses: a mapping with known keys, a string, one of a
few names, an integer in a range, a duration; each failure a :class:`ConfigError` naming the
sweep file, the YAML path, the bad value and what would be valid."""

from __future__ import annotations

import difflib
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from .._checks import in_range, is_finite, is_int, is_number
from ..search_spaces import SpaceError
from .schema import _MAX_TIME_LIMIT_S, ConfigError

_DURATION = re.compile(r"^\s*(?:[0-9]+(?:\.[0-9]*)?\s*[smh]\s*)+$")
_DURATION_PART = re.compile(r"([0-9]+(?:\.[0-9]*)?)\s*([smh])")
_UNIT_S = {"s": 1.0, "m": 60.0, "h": 3600.0}


def _did_you_mean(word: object, valid: list[str] | tuple[str, ...]) -> str:
    if not isinstance(word, str):
        return ""
    close = difflib.get_close_matches(word, list(valid), n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""


def _join(prefix: str, key: object) -> str:
    return f"{prefix}.{key}" if prefix else str(key)


class _Fields:
    """Reads the fields of one sweep (from the file ``source``, or a mapping when ``None``):
    relative paths are taken from the file's folder and every error names the file."""

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
        if not is_int(value) or value < low:
            kind = f"{value!r} ({type(value).__name__}) is not an integer"
            problem = f"{kind} >= {low}" if high is None else f"{kind} from {low} to {high:,}"
            if isinstance(value, float):
                problem += (
                    "; a number with a point or an exponent (2.5, 1e3) is a float in YAML: write "
                    "a whole number such as 64"
                )
            raise self.error(path, problem)
        if high is not None and value > high:
            raise self.error(
                path,
                f"{value:,} is more than {high:,} {unit}, the most a sweep may give (a larger "
                f"value is a typo: no sweep would finish it); give at most {high:,}",
            )
        return int(value)

    def number(self, value: object, path: str, low: float, *, low_open: bool, what: str) -> float:
        """``value`` as a float if it is a number from ``low`` up (``low`` itself excluded with
        ``low_open``); else an error saying it is not ``what``."""
        if not is_number(value) or not in_range(value, low, low_open=low_open):
            raise self.error(path, f"{value!r} is not {what}")
        return float(value)

    def duration(self, raw: object, path: str) -> float | None:
        if raw is None:
            return None
        if is_number(raw):
            if not is_finite(raw) or raw <= 0:
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
