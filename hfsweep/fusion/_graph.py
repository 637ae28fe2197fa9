"""Cleanup of a traced array forward before it is replayed on every call.

A trace of ``vmap`` carries bookkeeping that costs time on every replay, forward and backward:
identity ``permute``s from moving the member dimension to where it already is, and ``detach``es
whose results nothing reads. For small models those nodes are a large share of the step. This pass
removes them, merges chains of views (``vmap`` splits the member dimension out of a fused
convolution's or BatchNorm's channels and the next such layer folds it back in: two views that
cancel, each with a view in the backward too), and calls the common remaining ops through torch's C bindings, which dispatch faster
than ``torch.ops.aten`` overload objects (:data:`PUBLIC_FUNCTIONS`). The arithmetic is untouched.
"""

from __future__ import annotations

import types
from collections.abc import Callable
from typing import Any, cast

import torch
from torch import fx

from .._compat import TORCH_BINDING_OWNERS, OpOverload
from ._graph_features_first import features_first_runs
from ._graph_fold import fold_state_views
from ._graph_linear import use_stacked_linear
from ._graph_ops import pointwise
from ._graph_pool import drop_contiguous_copy, pool_members_with_channels

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


def _layout(node: Any) -> torch.Tensor | None:
    """A meta tensor with ``node``'s recorded shape, strides and dtype (``None``: unknown)."""
    val = node.meta.get("val") if isinstance(node, fx.Node) else None
    if not isinstance(val, torch.Tensor) or val.layout != torch.strided:
        return None
    return torch.empty_strided(val.shape, val.stride(), dtype=val.dtype, device="meta")


def _same_layout(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.stride() == b.stride() and a.dtype == b.dtype


def _view_of(base: torch.Tensor, out: torch.Tensor) -> bool:
    """Whether ``base.view(out.shape)`` is valid and has ``out``'s strides."""
    try:
        return _same_layout(base.view(out.shape), out)
    except RuntimeError:
        return False


def _merge_views(graph: fx.Graph, node: fx.Node) -> bool:
    """``view(view(x, s1), s2)`` -> ``view(x, s2)``, or ``x`` itself where ``s2`` is ``x``'s
    shape: the same tensor (shape and strides checked on the recorded values)."""
    if node.target is not _aten.view.default:
        return False
    src = node.args[0]
    if not isinstance(src, fx.Node) or src.target is not _aten.view.default:
        return False
    base, out = src.args[0], _layout(node)
    base_val = _layout(base)
    if out is None or base_val is None or not _view_of(base_val, out):
        return False
    assert isinstance(base, fx.Node)
    if _same_layout(base_val, out):
        node.replace_all_uses_with(base)
        graph.erase_node(node)
    else:
        node.args = (base, list(out.shape))
    return True


def _unary_pointwise(node: fx.Node) -> bool:
    """An elementwise op of one tensor that has no effect besides its result (``relu``)."""
    return pointwise(node) and not any(isinstance(a, fx.Node) for a in node.args[1:])


def _hoist_pointwise(graph: fx.Graph, node: fx.Node) -> bool:
    """``view(f(view(x, s1)), s0)`` -> ``f(x)`` for an elementwise ``f`` of a contiguous ``x``
    of shape ``s0``: ``f(view(x))`` becomes ``view(f(x))`` (the same values, elementwise), whose
    views then merge. Done only where a user views the result back to ``x``'s shape."""
    src = node.args[0] if node.args else None
    if not _unary_pointwise(node) or not isinstance(src, fx.Node):
        return False
    if src.target is not _aten.view.default:
        return False
    base = src.args[0]
    base_val, val = _layout(base), _layout(node)
    if base_val is None or val is None or not base_val.is_contiguous() or not val.is_contiguous():
        return False
    if base_val.dtype != val.dtype:
        return False
    if not any(
        u.target is _aten.view.default and tuple(_layout(u).shape) == tuple(base_val.shape)  # type: ignore[union-attr]
        for u in node.users
        if _layout(u) is not None
    ):
        return False
    with graph.inserting_before(node):
        whole = graph.call_function(node.target, (base, *node.args[1:]))  # type: ignore[arg-type]
        whole.meta["val"] = torch.empty_strided(
            base_val.shape, base_val.stride(), dtype=val.dtype, device="meta"
        )
        viewed = graph.call_function(_aten.view.default, (whole, list(val.shape)))
        viewed.meta["val"] = val
    node.replace_all_uses_with(viewed)
    graph.erase_node(node)
    return True


def _pointwise_of_permutes(graph: fx.Graph, node: fx.Node) -> bool:
    """``f(permute(a, p), permute(b, p))`` -> ``permute(f(a, b), p)`` for an elementwise ``f``
    of contiguous same-shaped ``a, b`` whose permutes nothing else reads: ``vmap`` moves the
    member dimension to the front for an elementwise op of two tensors that hold it elsewhere
    (a residual connection between convolutions) and the next convolution moves it back. The
    permutes then meet their inverses and cancel (:func:`_merge_permutes`)."""
    if not pointwise(node):
        return False
    inputs = [a for a in node.args if isinstance(a, fx.Node)]
    if not inputs or any(
        a.target is not _aten.permute.default or len(a.users) != 1 for a in inputs
    ):
        return False
    dims = list(inputs[0].args[1])  # type: ignore[arg-type]
    bases = [a.args[0] for a in inputs]
    vals = [_layout(b) for b in bases]
    val = _layout(node)
    if val is None or any(v is None or not v.is_contiguous() for v in vals):
        return False
    shape = vals[0].shape  # type: ignore[union-attr]
    if any(list(a.args[1]) != dims or v.shape != shape for a, v in zip(inputs, vals, strict=True)):  # type: ignore[arg-type, union-attr]
        return False
    whole_val = torch.empty(shape, dtype=val.dtype, device="meta")
    if not _same_layout(whole_val.permute(dims), val):
        return False
    with graph.inserting_before(node):
        args = tuple(a.args[0] if isinstance(a, fx.Node) else a for a in node.args)
        whole = graph.call_function(cast(OpOverload, node.target), args)
        whole.meta["val"] = whole_val
        permuted = graph.call_function(_aten.permute.default, (whole, dims))
        permuted.meta["val"] = val
    node.replace_all_uses_with(permuted)
    graph.erase_node(node)
    for a in dict.fromkeys(inputs):  # x + x reads one permute twice
        graph.erase_node(a)
    return True


def _pointwise_of_views(graph: fx.Graph, node: fx.Node) -> bool:
    """``f(view(a, s), view(b, s))`` -> ``view(f(a, b), s)`` for an elementwise ``f`` of
    contiguous same-shaped ``a, b``: ``vmap`` splits the members
    out of the channels of two ``[N, B * C, ...]`` tensors (a BatchNorm's output and a residual
    connection) to add them, and the next convolution folds them back in. One view is left,
    which then meets the next layer's and cancels (:func:`_hoist_pointwise`, :func:`_merge_views`);
    the backward loses the views' too."""
    if not pointwise(node):
        return False
    inputs = [a for a in node.args if isinstance(a, fx.Node)]
    if len(inputs) < 2 or any(a.target is not _aten.view.default for a in inputs):
        return False
    bases = [a.args[0] for a in inputs]
    vals = [_layout(b) for b in bases]
    views = [_layout(a) for a in inputs]
    val = _layout(node)
    if val is None or any(v is None or not v.is_contiguous() for v in (*vals, *views)):
        return False
    shape, view_shape = vals[0].shape, views[0].shape  # type: ignore[union-attr]
    if any(v.shape != shape for v in vals) or any(v.shape != view_shape for v in views):  # type: ignore[union-attr]
        return False
    if not val.is_contiguous() or val.shape != view_shape:
        return False
    with graph.inserting_before(node):
        args = tuple(a.args[0] if isinstance(a, fx.Node) else a for a in node.args)
        whole = graph.call_function(node.target, args)  # type: ignore[arg-type]
        whole.meta["val"] = torch.empty(shape, dtype=val.dtype, device="meta")
        viewed = graph.call_function(_aten.view.default, (whole, list(view_shape)))
        viewed.meta["val"] = val
    node.replace_all_uses_with(viewed)
    graph.erase_node(node)
    for a in dict.fromkeys(inputs):
        if not a.users:  # a view read elsewhere too stays for that reader
            graph.erase_node(a)
    return True


def _merge_permutes(graph: fx.Graph, node: fx.Node) -> bool:
    """``permute(permute(x, p), q)`` -> ``x`` where ``q`` undoes ``p``."""
    if node.target is not _aten.permute.default:
        return False
    src = node.args[0]
    if not isinstance(src, fx.Node) or src.target is not _aten.permute.default:
        return False
    p, q = list(src.args[1]), list(node.args[1])  # type: ignore[arg-type]
    if len(p) != len(q) or [p[i] for i in q] != list(range(len(p))):
        return False
    base = src.args[0]
    if not isinstance(base, fx.Node):
        return False
    node.replace_all_uses_with(base)
    graph.erase_node(node)
    return True


def _fold_views(graph: fx.Graph) -> None:
    """Merge chains of views and of permutes, moving elementwise ops out from between them
    (see above), and drop copies of what those merges left contiguous."""
    changed = True
    while changed:
        changed = False
        for node in list(graph.nodes):
            if node._erased:  # erased by an earlier rewrite of this sweep
                continue
            if (
                _hoist_pointwise(graph, node)
                or _merge_views(graph, node)
                or _pointwise_of_permutes(graph, node)
                or _pointwise_of_views(graph, node)
                or _merge_permutes(graph, node)
                or drop_contiguous_copy(graph, node)
            ):
                changed = True


def simplify(gm: fx.GraphModule, fold_state: bool = True) -> fx.GraphModule:
    """Remove no-op and dead nodes of a traced forward, pool with the members next to the
    channels (:func:`pool_members_with_channels`), merge chains of views, compute stacked
    weights' gradients in their layout (:func:`use_stacked_linear`, and for runs of Linears from
    an input features-first with native products, :func:`features_first_runs`), read the stacked state of
    convolutions and BatchNorms through views made once (:func:`fold_state_views`; not with
    ``fold_state=False``: a graph ``torch.compile`` traces, whose inductor does its own) and
    retarget calls to public functions."""
    graph = gm.graph
    for node in list(graph.nodes):
        if _is_identity_permute(node) or _is_same_shape_view(node):
            node.replace_all_uses_with(node.args[0])
            graph.erase_node(node)
    pool_members_with_channels(graph)
    _fold_views(graph)
    changed = True
    while changed:
        changed = False
        for node in reversed(list(graph.nodes)):
            if _removable(node):
                graph.erase_node(node)
                changed = True
    use_stacked_linear(graph)
    features_first_runs(graph)
    if fold_state:
        fold_state_views(graph)
    for node in graph.nodes:
        if node.op == "call_function" and not node.kwargs:
            fn = PUBLIC_FUNCTIONS.get(node.target)
            if fn is not None:
                node.target = fn
    graph.lint()
    gm.recompile()
    return gm
