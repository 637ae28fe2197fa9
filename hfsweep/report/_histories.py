"""Reading the learning curves of ``histories/trial-<number>.csv``, leaving out what cannot be
drawn (unreadable files, missing columns, empty or non-finite cells) with a logged reason."""

from __future__ import annotations

import csv
import logging
import math
import re
from dataclasses import dataclass
from pathlib import Path

__all__: list[str] = []

_log = logging.getLogger("hfsweep.report")

_HISTORY_FILE = re.compile(r"^trial-(\d+)\.csv$")


def _float(text: object) -> float | None:
    """A CSV cell as a finite float, or None (empty, not a number, nan or inf)."""
    if not isinstance(text, str) or not text.strip():
        return None
    try:
        value = float(text)
    except ValueError:
        return None
    return value if math.isfinite(value) else None


@dataclass(frozen=True)
class _Curve:
    """One trial's learning curve from ``histories/trial-<number>.csv``."""

    number: int
    xs: list[float]
    ys: list[float]


def _read_history(path: Path, number: int, x: str, metric: str) -> _Curve | None:
    """The ``(x, metric)`` points of one history file, or None (logged) when it has none.

    Rows whose cells are empty or not finite (an evaluation that did not report the metric, a
    diverged trial) are left out rather than drawn as gaps or spikes.
    """
    try:
        with path.open(newline="", encoding="utf-8") as f:
            reader = csv.DictReader(f)
            columns = list(reader.fieldnames or [])
            if x not in columns or metric not in columns:
                _log.warning(
                    "%s: skipped in curves.png; expected columns %r and %r, found %s",
                    path,
                    x,
                    metric,
                    columns,
                )
                return None
            xs: list[float] = []
            ys: list[float] = []
            for row in reader:
                xv, yv = _float(row.get(x)), _float(row.get(metric))
                if xv is not None and yv is not None:
                    xs.append(xv)
                    ys.append(yv)
    except (OSError, UnicodeDecodeError, csv.Error) as exc:
        _log.warning("%s: skipped in curves.png; cannot be read (%s)", path, exc)
        return None
    if not xs:
        _log.info("%s: no finite %s values; skipped in curves.png", path, metric)
        return None
    return _Curve(number, xs, ys)


def _read_histories(run: Path, x: str, metric: str) -> list[_Curve]:
    """Every readable ``histories/trial-<number>.csv``, by trial number."""
    folder = run / "histories"
    if not folder.is_dir():
        return []
    found = sorted(
        (int(m.group(1)), p)
        for p in folder.iterdir()
        if (m := _HISTORY_FILE.match(p.name)) is not None and p.is_file()
    )
    curves = [_read_history(path, number, x, metric) for number, path in found]
    return [c for c in curves if c is not None]
