"""Reading YAML (sweep files and search-space files): PyYAML's safe loader, with numbers read as
YAML 1.2 reads them, every duplicate mapping key refused, and the document's size bounded.

The bounds keep a hostile or mistaken file from hanging hfsweep: a file larger than
:data:`MAX_FILE_BYTES` is not read, a document nested deeper than :data:`MAX_DEPTH` levels is
refused while it is composed (PyYAML composes recursively), and aliases (``*name``) may bring in
at most :data:`MAX_ALIAS_NODES` nodes in all. PyYAML builds an alias as a reference to one
shared object, so a "billion laughs" document (anchors of ten aliases of the anchor before) loads
in microseconds into a structure that anything walking it (printing it, comparing it, writing it
as JSON) would take for ever on. Each limit is far beyond a file a person writes; a search space
generated larger than that can be given to ``hs.sweep`` as a Python mapping, which has no limit.
"""

from __future__ import annotations

import os
import re
from typing import Any

from hfsweep._errors import LocatedError

from ._errors import SpaceError

__all__ = [
    "MAX_ALIAS_NODES",
    "MAX_DEPTH",
    "MAX_FILE_BYTES",
    "DuplicateKeyError",
    "YamlLimitError",
    "load_yaml",
    "read_yaml_file",
    "yaml_loader",
]

#: the largest sweep or search-space file read, in bytes (8 MiB)
MAX_FILE_BYTES = 8 * 2**20
#: the deepest nesting of mappings and sequences a document may have (aliases expanded)
MAX_DEPTH = 100
#: the most nodes the aliases of one document may bring in, each alias counting every node
#: under the anchor it names
MAX_ALIAS_NODES = 100_000

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


class YamlLimitError(Exception):
    """A YAML document passes one of the bounds above; the message names the bound, the line
    and what to do instead (the caller adds the file)."""


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


def _compose_node(self: Any, parent: Any, index: Any) -> Any:
    """PyYAML's ``compose_node``, bounding the depth and what the aliases bring in.

    Each composed node's size (its nodes, aliases expanded) and height are recorded as it is
    finished, so an alias's share is known in constant time: the whole check is linear in the
    document's text however far its aliases would expand."""
    import yaml

    sizes: dict[int, tuple[int, int]] = self._hfsweep_sizes
    if self.check_event(yaml.AliasEvent):
        event = self.peek_event()
        target = self.anchors.get(event.anchor)
        if target is not None:  # an undefined alias: PyYAML's own error below
            line = event.start_mark.line + 1
            known = sizes.get(id(target))
            if known is None:
                raise YamlLimitError(
                    f"the alias *{event.anchor} on line {line} refers to a node that contains "
                    "it, a structure without end; write the values out instead"
                )
            size, height = known
            self._hfsweep_alias_nodes += size
            if self._hfsweep_alias_nodes > MAX_ALIAS_NODES:
                raise YamlLimitError(
                    f"its aliases (*name) bring in more than {MAX_ALIAS_NODES:,} nodes (by the "
                    f"alias *{event.anchor} on line {line}), the most hfsweep expands: a file "
                    "that small cannot mean that much data (an alias bomb?); write the values "
                    "out, or give a generated sweep to hs.sweep as a Python mapping"
                )
            if self._hfsweep_depth + height > MAX_DEPTH:
                raise _too_deep(event.start_mark)
        return yaml.SafeLoader.compose_node(self, parent, index)
    self._hfsweep_depth += 1
    if self._hfsweep_depth > MAX_DEPTH:
        raise _too_deep(self.peek_event().start_mark)
    try:
        node = yaml.SafeLoader.compose_node(self, parent, index)
    finally:
        self._hfsweep_depth -= 1
    size, height = 1, 1
    if isinstance(node, yaml.SequenceNode):
        children = node.value
    elif isinstance(node, yaml.MappingNode):
        children = [child for pair in node.value for child in pair]
    else:
        children = []
    for child in children:
        child_size, child_height = sizes[id(child)]
        size += child_size
        height = max(height, child_height + 1)
    sizes[id(node)] = (size, height)
    return node


def _too_deep(mark: Any) -> YamlLimitError:
    return YamlLimitError(
        f"it nests mappings and lists deeper than {MAX_DEPTH} levels (at line {mark.line + 1}, "
        "counting what aliases bring in), the deepest hfsweep reads; a sweep file needs a few"
    )


def _compose_document(self: Any) -> Any:
    import yaml

    self._hfsweep_depth = 0
    self._hfsweep_alias_nodes = 0
    self._hfsweep_sizes = {}
    try:
        return yaml.SafeLoader.compose_document(self)
    finally:
        self._hfsweep_sizes = {}  # ids of nodes that are gone must not be looked up again


def yaml_loader() -> type:
    """The PyYAML loader every YAML file and value of hfsweep is read with: a ``SafeLoader``
    that reads ``1e-4`` as a float and refuses a key given twice, a document nested too deep
    and aliases that expand too far (the command line's ``--set`` values use it too)."""
    global _loader
    if _loader is None:
        import yaml

        # PyYAML has no type hints: build the subclass dynamically so strict mypy accepts it
        loader: Any = type(
            "Loader",
            (yaml.SafeLoader,),
            {
                "__doc__": "Reads 1e-4 as a float; refuses a mapping key given twice and a "
                "document too deep or whose aliases expand too far.",
                "construct_document": _construct_document,
                "compose_document": _compose_document,
                "compose_node": _compose_node,
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
        return yaml.load(text, Loader=yaml_loader())  # a SafeLoader subclass
    except DuplicateKeyError as exc:
        raise error(exc.problem, path=exc.path, file=source) from None
    except YamlLimitError as exc:
        raise error(f"not read: {exc}", file=source) from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = getattr(exc, "problem", None) or str(exc)
        raise error(f"not valid YAML{where}: {problem}; {expected}", file=source) from None


def read_yaml_file(file: str, *, error: type[LocatedError], what: str) -> str:
    """The text of the YAML file ``file``; an ``error`` naming it when it cannot be read as
    UTF-8 or is larger than :data:`MAX_FILE_BYTES` (read no further than that). ``what`` names
    the file's role in the messages (``sweep file``, ``search-space file``)."""
    try:
        with open(file, "rb") as f:
            data = f.read(MAX_FILE_BYTES + 1)
            if len(data) > MAX_FILE_BYTES:
                size = os.fstat(f.fileno()).st_size
                raise error(
                    f"the file is {size:,} bytes, more than {MAX_FILE_BYTES:,} "
                    f"({MAX_FILE_BYTES // 2**20} MiB), the largest {what} hfsweep reads; a "
                    "space that large is generated: give the sweep to hs.sweep as a Python "
                    "mapping (not read as YAML, no limit)",
                    file=file,
                )
        return data.decode("utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        raise error(
            f"cannot read the {what} ({reason}); give a readable UTF-8 YAML file", file=file
        ) from None
