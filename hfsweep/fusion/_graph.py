"""Cleanup of a traced array forward before it is replayed on every call.

A trace of ``vmap`` carries bookkeeping that costs time on every replay, forward and backward:
identity ``permute``s from moving the member dimension to where it already is, and ``detach``es
whose results nothing reads. For small models those nodes are a large share of the step. This pass
removes them and calls the common remaining ops through torch's C bindings, which dispatch faster
than ``torch.ops.aten`` overload objects (:data:`PUBLIC_FUNCTIONS`). The arithmetic is untouched.
"""

from __future__ import annotations

import types
from collections.abc import Callable
from typing import Any, cast

import torch
from torch import fx

from .._compat import TORCH_BINDING_OWNERS, OpOverload

__all__ = ["PUBLIC_FUNCTIONS", "simplify"]

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
    if node.op != "call_function" or node.users or not isinstance(target, OpOverload):
        return False
    schema = target._schema
    return not schema.is_mutable and torch.Tag.nondeterministic_seeded not in target.tags


# Ops a replayed graph calls through torch's C binding of the same name instead of the aten
# overload object: the binding parses its arguments into the same native function, so for the
# positional arguments a trace records it runs the same kernel, with less dispatch overhead. Only
# generated C bindings qualify: Python functions of the same name on ``torch`` or ``Tensor`` are
# other functions (``Tensor.index`` is first-class dims' indexing, not ``aten.index``;
# ``torch.split`` and ``torch.stft`` are Python wrappers with their own argument lists). Every
# entry is checked against its overload on random inputs in tests/fusion/test_graph.py.
_PUBLIC_NAMES = (
    "abs.default",
    "add.Tensor",
    "add_.Tensor",
    "addmm.default",
    "all.dim",
    "baddbmm.default",
    "bitwise_and.Tensor",
    "bmm.default",
    "cat.default",
    "clone.default",
    "convolution.default",
    "cos.default",
    "detach.default",
    "div.Tensor",
    "embedding.default",
    "eq.Scalar",
    "exp.default",
    "expand.default",
    "gather.default",
    "ge.Scalar",
    "ge.Tensor",
    "gt.Scalar",
    "le.Tensor",
    "log.default",
    "lt.Scalar",
    "masked_fill.Scalar",
    "maximum.default",
    "mean.dim",
    "minimum.default",
    "mm.default",
    "mul.Scalar",
    "mul.Tensor",
    "mul_.Tensor",
    "native_batch_norm.default",
    "native_layer_norm.default",
    "neg.default",
    "permute.default",
    "pow.Tensor_Scalar",
    "relu.default",
    "rsqrt.default",
    "rsub.Scalar",
    "select.int",
    "sigmoid.default",
    "sin.default",
    "split.Tensor",
    "sqrt.default",
    "squeeze.dim",
    "stack.default",
    "sub.Tensor",
    "sum.dim_IntList",
    "t.default",
    "tanh.default",
    "transpose.int",
    "tril.default",
    "triu.default",
    "unbind.int",
    "unsqueeze.default",
    "view.default",
    "where.self",
)


_BUILTINS = (types.BuiltinFunctionType, types.MethodDescriptorType)


def _binding(name: str) -> Callable[..., Any] | None:
    """torch's generated C binding ``name``: a function of ``torch`` or a method of tensors."""
    for owner in TORCH_BINDING_OWNERS:
        fn = getattr(owner, name, None)
        if isinstance(fn, _BUILTINS):
            return cast(Callable[..., Any], fn)
    return None


def _public_table() -> dict[OpOverload, Callable[..., Any]]:
    table: dict[OpOverload, Callable[..., Any]] = {}
    for entry in _PUBLIC_NAMES:
        packet, overload = entry.split(".")
        op = getattr(getattr(_aten, packet, None), overload, None)
        fn = _binding(packet)
        if isinstance(op, OpOverload) and fn is not None:  # absent in this torch: skip
            table[op] = fn
    return table


#: aten overload -> the C binding a replayed graph calls instead (positional arguments only)
PUBLIC_FUNCTIONS = _public_table()


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
            fn = PUBLIC_FUNCTIONS.get(node.target)
            if fn is not None:
                node.target = fn
    graph.lint()
    gm.recompile()
    return gm
