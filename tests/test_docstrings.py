"""Every public name has a docstring: the modules users import, the names in their ``__all__``,
and the public methods and properties of the public classes."""

from __future__ import annotations

import importlib
import inspect
import pkgutil
import sys
from collections.abc import Iterator
from types import ModuleType
from typing import Any

import hfsweep

#: the packages whose modules users import, under the names they are installed as (the
#: schedulers/ and search_spaces/ folders are installed as subpackages of hfsweep; imported as
#: top-level packages too, their classes would exist twice in this process)
_ROOTS = ("hfsweep", "hfsweep.schedulers", "hfsweep.search_spaces")


def _public_modules() -> Iterator[ModuleType]:
    for root in _ROOTS:
        package = importlib.import_module(root)
        yield package
        for info in pkgutil.walk_packages(package.__path__, prefix=f"{root}."):
            if any(part.startswith("_") for part in info.name.split(".")):
                continue
            try:
                module = importlib.import_module(info.name)
            except ImportError:  # an optional extra (ray[tune]) that is not installed
                continue
            yield module


def _own(obj: Any) -> bool:
    module = getattr(obj, "__module__", "") or ""
    return module.split(".")[0] == "hfsweep"


def _undocumented() -> list[str]:
    missing: list[str] = []
    seen: set[int] = set()
    for module in _public_modules():
        if not inspect.getdoc(module):
            missing.append(module.__name__)
        for name in getattr(module, "__all__", ()):
            obj = getattr(module, name)
            if id(obj) in seen or not (inspect.isclass(obj) or inspect.isfunction(obj)):
                continue
            seen.add(id(obj))
            if not _own(obj):
                continue
            where = f"{obj.__module__}.{obj.__qualname__}"
            if not (obj.__doc__ or "").strip():
                missing.append(where)
            if inspect.isclass(obj):
                missing += _undocumented_members(obj, where)
    return missing


def _undocumented_members(cls: type, where: str) -> list[str]:
    missing = []
    for name, member in vars(cls).items():
        if name.startswith("_"):
            continue
        if isinstance(member, (staticmethod, classmethod)):
            member = member.__func__
        if isinstance(member, property):
            member = member.fget
        if not callable(member):
            continue
        if not (getattr(member, "__doc__", None) or "").strip() and not _inherits_doc(cls, name):
            missing.append(f"{where}.{name}")
    return missing


def _inherits_doc(cls: type, name: str) -> bool:
    """An override of a documented base method (``Module.forward``, ``Optimizer.step``)."""
    return any(
        (getattr(getattr(base, name, None), "__doc__", None) or "").strip()
        for base in cls.__mro__[1:]
    )


def test_every_public_name_has_a_docstring() -> None:
    assert hfsweep.__doc__
    assert _undocumented() == []


def test_the_subpackages_are_imported_under_their_installed_names_only() -> None:
    """Walking the packages imports every public module, and none as a top-level package."""
    names = {module.__name__ for module in _public_modules()}
    assert {"hfsweep.schedulers.tune", "hfsweep.search_spaces"} <= names
    assert "schedulers" not in sys.modules and "search_spaces" not in sys.modules
