"""Ready search spaces shipped as YAML files next to this module, and ``load_space``."""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from importlib import resources
from typing import TYPE_CHECKING, Any

from ._errors import SpaceError
from ._space import SearchSpace

if TYPE_CHECKING:
    if sys.version_info >= (3, 11):
        from importlib.resources.abc import Traversable
    else:
        from importlib.abc import Traversable

__all__ = ["load_space", "ready_spaces"]

_SUFFIXES = (".yaml", ".yml")


def _package() -> Traversable:
    return resources.files(__package__ or "hfsweep.search_spaces")


def ready_spaces() -> list[str]:
    """The names of the ready spaces shipped with hfsweep (``sgd_momentum``, ``adamw``...),
    sorted."""
    return sorted(
        entry.name.rsplit(".", 1)[0]
        for entry in _package().iterdir()
        if entry.is_file() and entry.name.endswith(".yaml")
    )


def load_space(
    ref: str | os.PathLike[str] | Mapping[str, Any] | SearchSpace, *, path: str = "search_space"
) -> SearchSpace:
    """A search space from ``ref``: a mapping of config keys to specs (inline), a path to a
    ``.yaml``/``.yml`` file, the name of a ready space (see :func:`ready_spaces`), or a
    :class:`SearchSpace` (returned as it is).

    A string ending in ``.yaml``/``.yml`` or containing a path separator is a file; any other
    string is a ready space's name. ``path`` is the YAML path errors about an inline mapping or
    a bad ``ref`` start with (where the reference sits in a sweep file).
    """
    if isinstance(ref, SearchSpace):
        return ref
    if isinstance(ref, Mapping):
        return SearchSpace.from_dict(ref, path=path)
    if isinstance(ref, os.PathLike):
        return SearchSpace.from_yaml(ref)
    if not isinstance(ref, str):
        raise SpaceError(
            f"{ref!r} ({type(ref).__name__}) is not a search space; give a mapping of config "
            f"keys to specs, a path to a .yaml file, or a ready space: {', '.join(ready_spaces())}",
            path=path,
        )
    if ref.lower().endswith(_SUFFIXES) or "/" in ref or os.sep in ref:
        return SearchSpace.from_yaml(ref)
    names = ready_spaces()
    if ref not in names:
        raise SpaceError(
            f"{ref!r} is not a ready search space; ready spaces: {', '.join(names)} (or give a "
            "path to a .yaml file, or the space itself as a mapping)",
            path=path,
        )
    with resources.as_file(_package() / f"{ref}.yaml") as file:
        return SearchSpace.from_yaml(file)
