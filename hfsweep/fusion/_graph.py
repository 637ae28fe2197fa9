"""Cleanup of a traced array forward before it is replayed on every call.

A trace of ``vmap`` carries bookkeeping that costs time on every replay, forward and backward:
identity ``permute``s from moving the member dimension to where it already is, and ``detach``es
whose results nothing reads. For small models those nodes are a large share of the step. This pass
removes them and calls the remaining ops through torch's public functions, which dispatch faster
than ``torch.ops.aten`` overload objects. The arithmetic is untouched.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import fx

__all__ = ["simplify"]

_aten = torch.ops.aten


def _is_identity_permute(node: fx.Node) -> bool:
    if node.target is not _aten.permute.default:
        return False
    dims = node.args[1]
    return isinstance(dims, list | tuple) and list(dims) == list(range(len(dims)))


def _is_same_shape_view(node: fx.Node) -> bool:
    if node.target not in (_aten.view.default, _aten.expand.default, _aten.reshape.default):
        return False
    src = node.args[0]
    out, inp = node.meta.get("val"), getattr(src, "meta", {}).get("val")
    return (
        isinstance(out, torch.Tensor) and isinstance(inp, torch.Tensor) and out.shape == inp.shape
    )


def _removable(node: fx.Node) -> bool:
    """A call whose result is unused and that has no effect besides its result."""
    target = node.target
    if node.op != "call_function" or node.users or not isinstance(target, torch._ops.OpOverload):
        return False
    schema = target._schema
    return not schema.is_mutable and torch.Tag.nondeterministic_seeded not in target.tags


def _public_function(target: Any) -> Callable[..., Any] | None:
    """``torch.<name>`` or ``Tensor.<name>`` for an aten overload called positionally."""
    if not isinstance(target, torch._ops.OpOverload):
        return None
    name = target.overloadpacket.__name__
    if name.startswith("_"):
        return None
    fn = getattr(torch, name, None)
    if fn is None or not callable(fn) or isinstance(fn, type):
        fn = getattr(torch.Tensor, name, None)
    return fn if callable(fn) else None


# Overloads whose public function picks the same kernel for the same positional arguments.
_SAFE_OVERLOADS = frozenset({"default", "Tensor", "Scalar", "int", "dim", "dim_IntList", "self"})


def simplify(gm: fx.GraphModule) -> fx.GraphModule:
    """Remove no-op and dead nodes of a traced forward and retarget calls to public functions."""
    graph = gm.graph
    for node in list(graph.nodes):
        if _is_identity_permute(node) or _is_same_shape_view(node):
            node.replace_all_uses_with(node.args[0])
            graph.erase_node(node)
    changed = True
    while changed:
        changed = False
        for node in reversed(list(graph.nodes)):
            if _removable(node):
                graph.erase_node(node)
                changed = True
    for node in graph.nodes:
        if node.op == "call_function" and not node.kwargs:
            fn = _public_function(node.target)
            if fn is not None and node.target._overloadname in _SAFE_OVERLOADS:
                node.target = fn
    graph.lint()
    gm.recompile()
    return gm
