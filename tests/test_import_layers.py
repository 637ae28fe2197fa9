"""Imports between hfsweep's packages run one way, without cycles.

The units are the packages under ``hfsweep/`` (``fusion``, ``core``, ``training``...), each
top-level module on its own (``hfsweep/cli.py``...), the trial schedulers (``schedulers/``) and
the Ray Tune plugin (``schedulers/tune.py`` and ``schedulers/_tune_*.py``: a front door over the
sweep core, like the CLI, that lives beside the schedulers it adapts). ``hfsweep/__init__.py``
is the facade that re-exports the public names, not a unit: every unit may be imported through
it. Imports inside functions count too: a lazy import is still a dependency.
"""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
#: package name -> folder
PACKAGES = {
    "hfsweep": ROOT / "hfsweep",
    "hfsweep.schedulers": ROOT / "schedulers",
    "hfsweep.search_spaces": ROOT / "search_spaces",
}


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


def _imported(node: ast.ImportFrom | ast.Import, module: str, is_package: bool) -> list[str]:
    """The hfsweep modules an import statement names."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    if node.level:
        base = module.split(".")
        if not is_package:
            base = base[:-1]
        base = base[: len(base) - (node.level - 1)]
        target = ".".join(base + ([node.module] if node.module else []))
    else:
        target = node.module or ""
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
            for node in ast.walk(ast.parse(path.read_text())):
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
