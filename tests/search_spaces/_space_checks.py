"""An oracle for sampled configs, written from the raw spec, independently of the parser."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any


def same(a: Any, b: Any) -> bool:
    return a == b and isinstance(a, bool) == isinstance(b, bool)


def _spec(spec: Mapping[str, Any], name: str) -> Mapping[str, Any]:
    raw = spec[name]
    return raw if isinstance(raw, Mapping) else {"type": "fixed", "value": raw}


def should_be_drawn(spec: Mapping[str, Any], config: Mapping[str, Any], name: str) -> bool:
    """Whether ``name``'s condition holds, following chains through the raw spec."""
    for key, wanted in _spec(spec, name).get("when", {}).items():
        values = wanted if isinstance(wanted, list) else [wanted]
        if not should_be_drawn(spec, config, key) or key not in config:
            return False
        if not any(same(config[key], v) for v in values):
            return False
    return True


def check_config(spec: Mapping[str, Any], config: Mapping[str, Any]) -> None:
    """Assert that ``config`` is a config the raw ``spec`` allows, with exactly the right keys."""
    expected = {n for n in spec if should_be_drawn(spec, config, n)}
    assert set(config) == expected, (config, expected)
    for name, value in config.items():
        s = _spec(spec, name)
        kind = s["type"]
        if kind == "fixed":
            assert value == s["value"], (name, value)
        elif kind == "categorical":
            assert any(same(value, c) and type(value) is type(c) for c in s["choices"]), (
                name,
                value,
            )
        elif kind == "int":
            assert type(value) is int, (name, value)
            assert s["low"] <= value <= s["high"], (name, value)
            assert (value - s["low"]) % s.get("step", 1) == 0, (name, value)
        else:
            assert kind == "float"
            assert type(value) is float and math.isfinite(value), (name, value)
            assert s["low"] <= value <= s["high"], (name, value)
            if s.get("step") is not None:
                k = (value - s["low"]) / s["step"]
                assert abs(k - round(k)) < 1e-6, (name, value)
