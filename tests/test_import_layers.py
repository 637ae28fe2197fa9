"""Imports between hfsweep's packages run one way, without cycles.

The units are the packages under ``hfsweep/`` (``fusion``, ``core``, ``training``...), each
top-level module on its own (``hfsweep/cli.py``...), the trial schedulers (``schedulers/``) and
the Ray Tune plugin (``schedulers/tune.py`` and ``schedulers/_tune_*.py``: a front door over the
sweep core, like the CLI, that lives beside the schedulers it adapts). ``hfsweep/__init__.py``
is the facade that re-exports the public names, not a unit: every unit may be imported through
it. Imports inside functions count too: a lazy import is still a dependency.

Every module of the package is also held to two rules:

**Private names.** A name that starts with one underscore (``_Run``, or a module ``_threads``)
is private to the *package* that holds it, and only modules of that package may import it. A
package here is a direct subpackage of hfsweep (``hfsweep.training``, ``hfsweep.parallel``,
``hfsweep.schedulers``, ``hfsweep.search_spaces``...) with everything under it; each top-level
module (``hfsweep/cli.py``, ``hfsweep/_retrain.py``) is a package of its own. A private
top-level module (``hfsweep/_io.py``, ``hfsweep/_errors.py``) belongs to hfsweep as a whole,
so every package may import its public names, and only it its private ones. The Ray Tune
plugin (``schedulers/tune.py``, ``schedulers/_tune_*.py``) is part of ``hfsweep.schedulers``
here. Every import statement counts: at module level, inside ``if TYPE_CHECKING:`` and inside
functions, in the ``import a.b._c`` and the ``from a.b import _c`` forms. Another package's
shared piece is reached through a public name: its ``__init__``'s ``__all__`` or a public
module (``hfsweep.training.run.ArrayRun``). Dunder names (``__version__``) are not private.

**File circles.** No two modules (files) import each other, directly or through others, by
any import statement: module level, ``if TYPE_CHECKING:`` and inside functions. A circle
hidden behind a lazy import or a type-checking import still means neither file can be read,
tested or moved without the other; the shared piece goes into a module of its own (or the
one that only needs the other's type sees it through a protocol). ``from pkg import name``
is an import of the module ``pkg.name`` where that is a module, else of ``pkg/__init__.py``.
"""

from __future__ import annotations

import ast
import functools
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
#: package name -> folder
PACKAGES = {
    "hfsweep": ROOT / "hfsweep",
    "hfsweep.schedulers": ROOT / "schedulers",
    "hfsweep.search_spaces": ROOT / "search_spaces",
}


@functools.cache
def _parsed(path: Path) -> ast.Module:
    """The syntax tree of ``path``, parsed once for all the checks here."""
    return ast.parse(path.read_text())


def _module(path: Path) -> tuple[str, bool]:
    """The dotted name of the module in ``path``, and whether it is a package's __init__."""
    for name, folder in sorted(PACKAGES.items(), key=lambda kv: -len(str(kv[1]))):
        if path.is_relative_to(folder):
            parts = [name, *path.relative_to(folder).with_suffix("").parts]
            if parts[-1] == "__init__":
                return ".".join(parts[:-1]), True
            return ".".join(parts), False
    raise AssertionError(path)


def _unit(module: str) -> str | None:
    """The unit ``module`` belongs to (None for the facade ``hfsweep``)."""
    parts = module.split(".")
    if parts[:2] == ["hfsweep", "schedulers"]:
        tune = len(parts) > 2 and (parts[2] == "tune" or parts[2].startswith("_tune"))
        return "hfsweep.schedulers.tune" if tune else "hfsweep.schedulers"
    if len(parts) == 1:
        return None
    return ".".join(parts[:2])


def _from_target(node: ast.ImportFrom, module: str, is_package: bool) -> str:
    """The dotted name ``from X import ...`` in ``module`` takes names from (X resolved)."""
    if not node.level:
        return node.module or ""
    base = module.split(".")
    if not is_package:
        base = base[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _imported(node: ast.ImportFrom | ast.Import, module: str, is_package: bool) -> list[str]:
    """The hfsweep modules an import statement names."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    target = _from_target(node, module, is_package)
    if node.module is None or target in PACKAGES or target == "hfsweep":
        # `from .. import optim`: the names are modules of that package
        return [f"{target}.{a.name}" for a in node.names]
    return [target]


def _edges() -> dict[str, dict[str, str]]:
    """unit -> {unit it imports: one place that does, for messages}."""
    edges: dict[str, dict[str, str]] = defaultdict(dict)
    for folder in PACKAGES.values():
        for path in sorted(folder.rglob("*.py")):
            module, is_package = _module(path)
            source = _unit(module)
            if source is None:
                continue
            for node in ast.walk(_parsed(path)):
                if not isinstance(node, ast.Import | ast.ImportFrom):
                    continue
                for target in _imported(node, module, is_package):
                    if not target.startswith("hfsweep"):
                        continue
                    unit = _unit(target)
                    if unit is not None and unit != source:
                        where = f"{path.relative_to(ROOT)}:{node.lineno}"
                        edges[source].setdefault(unit, where)
    return edges


def _cycles(edges: dict[str, dict[str, str]]) -> list[list[str]]:
    """The strongly connected components of more than one unit (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in edges.get(v, {}):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in list(edges):
        if v not in index:
            visit(v)
    return found


def test_the_checker_finds_a_cycle() -> None:
    assert _cycles({"a": {"b": "x"}, "b": {"c": "y"}, "c": {"a": "z"}, "d": {"a": "w"}}) == [
        ["a", "b", "c"]
    ]


def test_imports_between_packages_have_no_cycle() -> None:
    edges = _edges()
    assert {"hfsweep.training", "hfsweep.config"} <= set(edges["hfsweep.core"])  # it reads them
    problems = [
        "; ".join(
            f"{a} -> {b} ({edges[a][b]})" for a in component for b in edges[a] if b in component
        )
        for component in _cycles(edges)
    ]
    assert problems == []


def test_the_fusion_core_imports_nothing_above_it() -> None:
    """fusion/, nn/ and optim/ are the lowest floors: the sweep machinery builds on them."""
    edges = _edges()
    above = {"hfsweep.core", "hfsweep.config", "hfsweep.executors", "hfsweep.training"}
    for low in ("hfsweep.fusion", "hfsweep.nn", "hfsweep.optim"):
        assert not above & set(edges.get(low, {})), (low, edges.get(low))


# ---------------------------------------------------------------- private names, file circles

#: (importing module, imported dotted name) pairs allowed (none: add one only with the reason
#: beside it, for an import a change in progress removes)
_PRIVATE_ALLOWED: set[tuple[str, str]] = set()

#: file circles allowed, as the sorted list of their modules (none)
_CIRCLES_ALLOWED: list[list[str]] = []


def _is_private(part: str) -> bool:
    return part.startswith("_") and not (part.startswith("__") and part.endswith("__"))


def _private_owner(importer: str, name: str) -> str | None:
    """The package a private part of the dotted ``name`` is private to, where ``importer``
    (a module) is outside that package; ``None`` when ``importer`` may import ``name``."""
    parts = name.split(".")
    for i in range(1, len(parts)):
        if not _is_private(parts[i]):
            continue
        parent = parts[:i]
        owner = "hfsweep" if len(parent) == 1 else ".".join(parent[:2])
        if owner != "hfsweep" and importer != owner and not importer.startswith(owner + "."):
            return owner
    return None


def _modules() -> dict[str, tuple[Path, bool]]:
    """Every module of the package: dotted name -> (file, whether it is an __init__)."""
    found = {}
    for folder in PACKAGES.values():
        for path in sorted(folder.rglob("*.py")):
            module, is_package = _module(path)
            found[module] = (path, is_package)
    return found


def _imports() -> list[tuple[str, str, str, str | None]]:
    """Every import of an hfsweep name in the package: (importing module, where (file:line),
    the full dotted name imported, the module file it loads or None)."""
    modules = _modules()
    found = []
    for module, (path, is_package) in modules.items():
        for node in ast.walk(_parsed(path)):
            if isinstance(node, ast.Import):
                names = [(a.name, a.name) for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                target = _from_target(node, module, is_package)
                names = []
                for alias in node.names:
                    full = f"{target}.{alias.name}"
                    names.append((full, full if full in modules else target))
            else:
                continue
            for full, loaded in names:
                if full.split(".")[0] != "hfsweep":
                    continue
                where = f"{path.relative_to(ROOT)}:{node.lineno}"
                found.append((module, where, full, loaded if loaded in modules else None))
    return found


def test_the_private_rule() -> None:
    """The rule in the docstring above, on names the package has or had."""
    assert _private_owner("hfsweep.parallel._run", "hfsweep.training.run._Run") == (
        "hfsweep.training"
    )
    assert _private_owner("hfsweep.core.loop", "hfsweep.tracking._dispatch.Tracking") == (
        "hfsweep.tracking"
    )
    assert _private_owner("hfsweep.cli", "hfsweep.search_spaces._yaml._loader_class") == (
        "hfsweep.search_spaces"
    )
    assert _private_owner("hfsweep.core.ledger", "hfsweep.schedulers._base.encode_float") == (
        "hfsweep.schedulers"
    )
    assert _private_owner("hfsweep.training.run", "hfsweep.training.live._Live") is None
    assert _private_owner("hfsweep.schedulers._tune_sweep", "hfsweep.schedulers._base.x") is None
    assert _private_owner("hfsweep.core.loop", "hfsweep._io.atomic_save") is None
    assert _private_owner("hfsweep.core.loop", "hfsweep._io._atomic") == "hfsweep._io"
    assert _private_owner("hfsweep.core.loop", "hfsweep.cli._main") == "hfsweep.cli"
    assert _private_owner("hfsweep.sizing.cache", "hfsweep.__version__") is None


def test_no_module_imports_a_private_name_of_another_package() -> None:
    imports = _imports()
    assert len(imports) > 500  # the walk sees the package's imports
    found = set()
    problems = []
    for module, where, name, _ in imports:
        owner = _private_owner(module, name)
        if owner is None:
            continue
        if (module, name) in _PRIVATE_ALLOWED:
            found.add((module, name))
            continue
        problems.append(f"{where}: {module} imports {name}, private to {owner}")
    assert not problems, "\n".join(problems)
    # an entry whose import is gone goes too, so the list says what is left
    assert found == _PRIVATE_ALLOWED


def test_the_checker_finds_a_file_circle_through_a_lazy_import(tmp_path: Path) -> None:
    """A circle closed only by an import inside a function still counts."""
    folder = tmp_path / "hfsweep"
    folder.mkdir()
    (folder / "__init__.py").write_text("")
    (folder / "a.py").write_text("from .b import x\n")
    (folder / "b.py").write_text("x = 1\n\ndef f():\n    from . import a\n")
    edges: dict[str, dict[str, str]] = defaultdict(dict)
    for path in sorted(folder.glob("*.py")):
        module = "hfsweep." + path.stem if path.stem != "__init__" else "hfsweep"
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                for target in _imported(node, module, path.stem == "__init__"):
                    edges[module][target] = f"{path.name}:{node.lineno}"
    assert _cycles(edges) == [["hfsweep.a", "hfsweep.b"]]


def test_no_two_files_import_each_other() -> None:
    edges: dict[str, dict[str, str]] = defaultdict(dict)
    for module, where, _, loaded in _imports():
        if loaded is not None and loaded != module:
            edges[module].setdefault(loaded, where)
    assert "hfsweep.training.run" in edges["hfsweep.training.trainer"]  # the walk sees them
    circles = _cycles(edges)
    problems = [
        "; ".join(f"{a} -> {b} ({edges[a][b]})" for a in circle for b in edges[a] if b in circle)
        for circle in circles
        if circle not in _CIRCLES_ALLOWED
    ]
    assert not problems, "\n".join(problems)
    assert [c for c in _CIRCLES_ALLOWED if c not in circles] == []  # stale entries go
