"""Reading YAML (sweep files and search-space files): PyYAML's safe loader, with numbers read as
YAML 1.2 reads them and every duplicate mapping key refused."""

from __future__ import annotations

import re
from typing import Any

from hfsweep._errors import LocatedError

from ._errors import SpaceError

__all__ = ["DuplicateKeyError", "load_yaml"]

# YAML 1.1 (PyYAML) needs a dot and a signed exponent in a float, so it reads `1e-4` and `1.0e3`
# as strings; YAML 1.2 and every user read them as numbers. This pattern is the part of YAML
# 1.2's float syntax that PyYAML's own resolver misses: an exponent without a dot or a sign.
_EXPONENT_FLOAT = re.compile(r"^[-+]?(?:[0-9][0-9_]*(?:\.[0-9_]*)?|\.[0-9_]+)[eE][-+]?[0-9]+$")
_MERGE_TAG = "tag:yaml.org,2002:merge"

_loader: type | None = None


class DuplicateKeyError(Exception):
    """A YAML mapping holds one key twice.

    PyYAML keeps the later value without a word, so ``mode: max`` followed by ``mode: min``
    would quietly minimise. :attr:`key` is the key, :attr:`path` its YAML path from the
    document's root (``mode``, ``search_space.lr.low``), :attr:`lines` the two 1-based lines.
    Keys that a merge key (``<<: *base``) brings in may be overridden; they are not duplicates.
    """

    def __init__(self, key: object, path: str, lines: tuple[int, int]) -> None:
        self.key = key
        self.path = path
        self.lines = lines
        first, second = lines
        where = f"both on line {first}" if first == second else f"on lines {first} and {second}"
        super().__init__(
            f"key {key!r} is given twice ({where}); YAML would silently keep the later value, "
            "so give each key once"
        )

    @property
    def problem(self) -> str:
        """The message without the location (for errors that add the file and path)."""
        return str(self)


def _yaml_path(prefix: str, key: object) -> str:
    return f"{prefix}.{key}" if prefix else str(key)


def _check_duplicates(loader: Any, root: Any) -> None:
    """Raise :class:`DuplicateKeyError` for the first mapping under ``root`` (a composed node,
    before construction) that holds a key twice. Walked before construction because PyYAML's
    ``flatten_mapping`` rewrites merged mappings in place and ``construct_mapping`` does not
    know where in the document it is."""
    import yaml

    seen_nodes: set[int] = set()
    todo: list[tuple[Any, str]] = [(root, "")]
    while todo:
        node, path = todo.pop()
        if id(node) in seen_nodes:  # an alias of a node already walked (or a recursive one)
            continue
        seen_nodes.add(id(node))
        if isinstance(node, yaml.SequenceNode):
            todo += [(item, f"{path}[{i}]") for i, item in reversed(list(enumerate(node.value)))]
        elif isinstance(node, yaml.MappingNode):
            lines: dict[Any, int] = {}
            children: list[tuple[Any, str]] = []
            for key_node, value_node in node.value:
                if key_node.tag == _MERGE_TAG:
                    children.append((value_node, path))
                    continue
                key = loader.construct_object(key_node, deep=True)
                child = _yaml_path(path, key)
                line = key_node.start_mark.line + 1
                try:
                    first = lines.get(key)
                except TypeError:  # an unhashable key: construct_mapping refuses it itself
                    first = None
                else:
                    lines.setdefault(key, line)
                if first is not None:
                    raise DuplicateKeyError(key, child, (first, line))
                children.append((value_node, child))
            todo += reversed(children)


def _construct_document(self: Any, node: Any) -> Any:
    _check_duplicates(self, node)
    import yaml

    return yaml.SafeLoader.construct_document(self, node)


def _loader_class() -> type:
    global _loader
    if _loader is None:
        import yaml

        # PyYAML has no type hints: build the subclass dynamically so strict mypy accepts it
        loader: Any = type(
            "Loader",
            (yaml.SafeLoader,),
            {
                "__doc__": "Reads 1e-4 as a float; refuses a mapping key given twice.",
                "construct_document": _construct_document,
            },
        )
        loader.add_implicit_resolver(
            "tag:yaml.org,2002:float", _EXPONENT_FLOAT, list("-+0123456789.")
        )
        _loader = loader
    return _loader


def load_yaml(
    text: str,
    source: str,
    *,
    error: type[LocatedError] = SpaceError,
    expected: str = "a search space is a YAML mapping of config keys to param specs",
) -> Any:
    """Parse one YAML document; a syntax error or a duplicate key becomes an ``error`` (a
    :class:`SpaceError` unless told) naming ``source``, the YAML path and the lines; a syntax
    error's message ends by saying what the document should be (``expected``)."""
    import yaml

    try:
        return yaml.load(text, Loader=_loader_class())  # a SafeLoader subclass
    except DuplicateKeyError as exc:
        raise error(exc.problem, path=exc.path, file=source) from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = getattr(exc, "problem", None) or str(exc)
        raise error(f"not valid YAML{where}: {problem}; {expected}", file=source) from None
