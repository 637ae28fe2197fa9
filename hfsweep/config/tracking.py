"""``tracking:``, the experiment trackers of a sweep: a list whose entries are a tracker's name
(``- mlflow``) or a one-key mapping of its name to its options (``- wandb: {mode: offline}``).

Every entry is checked against :data:`hfsweep.tracking._registry.TRACKERS`: a known name, known
options of the right kind, and the tracker's library installed (a missing one is named with the
extra that installs it). Errors name the entry's YAML path, ``tracking[0].mlflow.tracking_uri``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..tracking import TRACKERS, Option, import_problem, missing
from .fields import _did_you_mean, _Fields
from .schema import ConfigError, SweepConfig, TrackerConfig

_EXAMPLE = "[mlflow, {tensorboard: {log_dir: tb}}, {wandb: {mode: offline}}]"


def _tracking(fields: _Fields, raw: object) -> tuple[TrackerConfig, ...]:
    """The trackers ``raw`` (the value of ``tracking:``) names, validated."""
    if raw is None:
        return ()
    if not isinstance(raw, list | tuple):
        raise fields.error(
            "tracking",
            f"{raw!r} ({type(raw).__name__}) is not a list of trackers; write e.g. {_EXAMPLE}",
        )
    return tuple(_entry(fields, entry, f"tracking[{i}]") for i, entry in enumerate(raw))


def _entry(fields: _Fields, entry: object, path: str) -> TrackerConfig:
    if isinstance(entry, str):
        name, options = entry, None
    elif isinstance(entry, Mapping) and len(entry) == 1:
        name, options = next(iter(entry.items()))
    else:
        raise fields.error(
            path,
            f"{entry!r} is not a tracker; give its name ({', '.join(TRACKERS)}) or a mapping "
            "of one name to its options, e.g. {mlflow: {tracking_uri: http://host:5000}}",
        )
    if name not in TRACKERS:
        raise fields.error(
            path,
            f"unknown tracker {name!r}{_did_you_mean(name, tuple(TRACKERS))}; valid: "
            f"{', '.join(TRACKERS)}",
        )
    here = f"{path}.{name}"
    spec = TRACKERS[name]
    values: dict[str, Any] = {}
    if options is not None:
        given = fields.mapping(options, here, f"{{{name}: {{{next(iter(spec.options))}: ...}}}}")
        fields.keys(given, tuple(spec.options), here)
        for key, value in given.items():
            if value is not None:
                values[key] = _option(fields, spec.options[key], value, f"{here}.{key}")
    problem = missing(name)
    if problem is not None:
        raise fields.error(here, problem)
    return TrackerConfig(name, values)


def _option(fields: _Fields, option: Option, value: object, path: str) -> Any:
    """``value`` checked against ``option``'s kind (see :class:`Option`)."""
    if option.kind == "choice":
        return fields.choice(value, option.choices, path)
    if option.kind == "path":
        return str(fields.relative(fields.string(value, path, option.help)))
    if option.kind == "strings":
        if not isinstance(value, list | tuple) or not all(isinstance(v, str) and v for v in value):
            raise fields.error(path, f"{value!r} is not a list of strings; give {option.help}")
        return list(value)
    if option.kind == "tags":
        if not isinstance(value, Mapping) or not all(
            isinstance(k, str) and isinstance(v, str | int | float | bool) for k, v in value.items()
        ):
            raise fields.error(
                path, f"{value!r} is not a mapping of names to values; give {option.help}"
            )
        return {k: str(v) for k, v in value.items()}
    return fields.string(value, path, option.help)


def check_trackers(sc: SweepConfig) -> None:
    """Each tracker's library imports (a broken install fails here, before anything trains,
    not at the first trial): raises :class:`ConfigError` naming the ``tracking:`` entry."""
    for i, tracker in enumerate(sc.tracking):
        problem = import_problem(tracker.name)
        if problem is not None:
            file = str(sc.source) if sc.source is not None else None
            raise ConfigError(problem, path=f"tracking[{i}].{tracker.name}", file=file)
