"""Reading search-space YAML: PyYAML's safe loader, with numbers read as YAML 1.2 reads them."""

from __future__ import annotations

import re
from typing import Any

from ._errors import SpaceError

__all__ = ["load_yaml"]

# YAML 1.1 (PyYAML) needs a dot in a float, so it reads `1e-4` as the string "1e-4"; YAML 1.2
# and every user read it as 0.0001. This pattern is the part of YAML 1.2's float syntax that
# PyYAML's own resolver misses: an exponent without a dot.
_EXPONENT_FLOAT = re.compile(r"^[-+]?[0-9][0-9_]*[eE][-+]?[0-9]+$")

_loader: type | None = None


def _loader_class() -> type:
    global _loader
    if _loader is None:
        import yaml

        # PyYAML has no type hints: build the subclass dynamically so strict mypy accepts it
        loader: Any = type("Loader", (yaml.SafeLoader,), {"__doc__": "Reads 1e-4 as a float."})
        loader.add_implicit_resolver(
            "tag:yaml.org,2002:float", _EXPONENT_FLOAT, list("-+0123456789")
        )
        _loader = loader
    return _loader


def load_yaml(text: str, source: str) -> Any:
    """Parse one YAML document; a syntax error becomes a :class:`SpaceError` naming ``source``
    and the line."""
    import yaml

    try:
        return yaml.load(text, Loader=_loader_class())  # a SafeLoader subclass
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = getattr(exc, "problem", None) or str(exc)
        raise SpaceError(
            f"not valid YAML{where}: {problem}; a search space is a YAML mapping of config keys "
            "to param specs",
            file=source,
        ) from None
