"""``ray.elastic:``, the elastic-array settings of a sweep on ``backend: ray``.

Elastic arrays train on several workers and are resized while they run by the allocator
(:mod:`hfsweep.elastic.allocator`, carried out by :mod:`hfsweep.elastic.policy`). The settings are
validated here like every other section. :data:`WIRED` says whether ``backend: ray`` runs
elastic arrays; while it is False (it was, before the allocator was connected), ``enabled:
true`` is refused with a :class:`~hfsweep.config.ConfigError` at ``ray.elastic.enabled``
(``hfsweep validate`` and ``hfsweep run`` exit with status 2) instead of being silently ignored.
"""

from __future__ import annotations

from typing import Any

from .fields import _Fields
from .schema import ElasticConfig

#: Whether ``backend: ray`` runs elastic arrays yet; while False, ``enabled: true`` is an error.
WIRED = True

_KEYS = (
    "enabled",
    "min_workers_per_array",
    "max_workers_per_array",
    "resize_every_s",
    "resize_cost_s",
    "max_wait_s",
    "scaling",
)
#: ``ray.elastic.scaling``: the scaling profiles the allocator decides with
SCALING = ("model", "perfect")
_EXAMPLE = "{enabled: false, max_workers_per_array: 8, resize_every_s: 60}"


def _elastic(fields: _Fields, raw: object) -> ElasticConfig:
    """The ``ray.elastic`` mapping ``raw``, validated (``None``: the defaults, off)."""
    if raw is None:
        return ElasticConfig()
    e = fields.mapping(raw, "ray.elastic", _EXAMPLE)
    fields.keys(e, _KEYS, "ray.elastic")
    enabled = e.get("enabled", False)
    if not isinstance(enabled, bool):
        raise fields.error(
            "ray.elastic.enabled", f"{enabled!r} ({type(enabled).__name__}) is not true or false"
        )
    low = fields.integer(e.get("min_workers_per_array", 1), "ray.elastic.min_workers_per_array", 1)
    high: Any = e.get("max_workers_per_array")
    if high is not None:
        high = fields.integer(high, "ray.elastic.max_workers_per_array", 1)
        if high < low:
            raise fields.error(
                "ray.elastic.max_workers_per_array",
                f"{high} is less than min_workers_per_array ({low}); give an integer >= {low} "
                "or null (as many as the cluster has)",
            )
    every = _seconds(fields, e.get("resize_every_s", 60.0), "ray.elastic.resize_every_s")
    cost = _seconds(fields, e.get("resize_cost_s", 0.0), "ray.elastic.resize_cost_s")
    wait = _seconds(fields, e.get("max_wait_s", 600.0), "ray.elastic.max_wait_s")
    scaling = e.get("scaling", "model")
    if scaling not in SCALING:
        raise fields.error(
            "ray.elastic.scaling",
            f"{scaling!r} is not one of {', '.join(SCALING)} (model: each key's profile modelled "
            "from a measured one-worker step and all-reduce; perfect: k workers assumed k times "
            "one)",
        )
    if enabled and not WIRED:
        raise fields.error(
            "ray.elastic.enabled",
            "true is not supported yet: the elastic allocator (hfsweep.elastic.allocator) is not "
            "connected to backend: ray in this version, so every array would still get one "
            "worker; set enabled: false (or remove ray.elastic). See docs/elastic-allocator.md",
        )
    return ElasticConfig(
        enabled=enabled,
        min_workers_per_array=low,
        max_workers_per_array=high,
        resize_every_s=every,
        resize_cost_s=cost,
        max_wait_s=wait,
        scaling=str(scaling),
    )


def _seconds(fields: _Fields, raw: object, path: str) -> float:
    """A number of seconds >= 0, or a duration string ('90s', '5m')."""
    if isinstance(raw, int | float) and not isinstance(raw, bool) and raw == 0:
        return 0.0
    seconds = fields.duration(raw, path)
    if seconds is None:
        raise fields.error(path, "null is not a duration; give seconds (a number >= 0) or '5m'")
    return seconds
