"""Pooling with the members next to the channels, instead of moved to the front and copied.

``vmap`` batches ``F.max_pool2d`` (and ``avg_pool2d``) by moving the member dimension to the
front and reshaping the ``[B, N, C, H, W]`` input to ``[B * N, C, H, W]``. A fused convolution
(``hfsweep/nn/_conv.py``) leaves its output as ``[N, B * C, H, W]`` with the members next to the
channels, seen by ``vmap`` as ``[N, B, C, H, W]``: the reshape is then a ``permute`` and a copy
(``clone`` + ``_unsafe_view``), and the pooled result goes through another before the next
convolution folds the members back into its channels, forward and backward.

Pooling works on each ``[H, W]`` plane alone, whatever order the planes are in, so pooling
``[N, B * C, H, W]`` (a view of the same memory) gives the same values, and the same indices
(they count within a plane). :func:`pool_members_with_channels` rewrites a traced graph to do
that and hands the result on as it is where the next layer moves the members back next to the
channels (a convolution, BatchNorm), where :func:`drop_contiguous_copy` then removes ``vmap``'s
copy of what is now already contiguous; any other reader gets the members-first layout ``vmap``
traced, copied once (the copy before the pool is saved either way). Anything that does not match exactly (another layout, a
pooled tensor read other than through ``vmap``'s ``[B, N, ...]`` view, an input written in place)
keeps the path ``vmap`` traced.
"""

from __future__ import annotations

import operator
from typing import Any

import torch
from torch import Tensor, fx

from .._compat import OpOverload

__all__ = ["drop_contiguous_copy", "pool_members_with_channels"]

_aten = torch.ops.aten

#: pooling ops that work plane by plane on a 4-d ``[N, C, H, W]`` input (their first argument)
_POOLS: tuple[Any, ...] = (
    _aten.max_pool2d_with_indices.default,
    _aten.max_pool2d.default,
    _aten.avg_pool2d.default,
)

#: ops whose result shares its input's memory (their first argument)
_VIEWS: tuple[Any, ...] = (
    _aten.view.default,
    _aten._unsafe_view.default,
    _aten.reshape.default,
    _aten.permute.default,
    _aten.transpose.int,
    _aten.t.default,
    _aten.expand.default,
    _aten.unsqueeze.default,
    _aten.squeeze.dim,
    _aten.squeeze.default,
    _aten.select.int,
    _aten.slice.Tensor,
    _aten.alias.default,
    _aten.as_strided.default,
    _aten.unflatten.int,
    _aten.flatten.using_ints,
)


def _val(node: Any) -> Tensor | None:
    val = node.meta.get("val") if isinstance(node, fx.Node) else None
    return val if isinstance(val, Tensor) and val.layout == torch.strided else None


def _meta(val: Tensor) -> Tensor:
    """A meta tensor with ``val``'s shape, strides and dtype."""
    return torch.empty_strided(val.shape, val.stride(), dtype=val.dtype, device="meta")


def _written(graph: fx.Graph) -> set[fx.Node]:
    """The nodes that an op of ``graph`` writes in place (``relu_``'s input, BatchNorm's
    running statistics)."""
    out: set[fx.Node] = set()
    for node in graph.nodes:
        target = node.target
        if node.op != "call_function" or not isinstance(target, OpOverload):
            continue
        if not target._schema.is_mutable:
            continue
        for i, arg in enumerate(target._schema.arguments):
            if arg.alias_info is None or not arg.alias_info.is_write:
                continue
            value = node.args[i] if i < len(node.args) else node.kwargs.get(arg.name)
            if isinstance(value, fx.Node):
                out.add(value)
    return out


def _written_alias(node: fx.Node, written: set[fx.Node]) -> bool:
    """Whether a tensor sharing ``node``'s memory (through views) is written in place."""
    base = node
    while base.target in _VIEWS and isinstance(base.args[0], fx.Node):
        base = base.args[0]
    todo, seen = [base], {base}
    while todo:
        current = todo.pop()
        if current in written:
            return True
        for user in current.users:
            if user.target in _VIEWS and user.args[0] is current and user not in seen:
                seen.add(user)
                todo.append(user)
    return False


def _member_front_copy(node: Any) -> tuple[fx.Node, int, int] | None:
    """``(src, B, N)`` where ``node`` is ``_unsafe_view(clone(permute(src, [1, 0, 2, 3, 4])),
    [B * N, C, H, W])`` of a contiguous ``src`` of shape ``[N, B, C, H, W]``, each read once:
    ``vmap``'s reshape of a member-next-to-channels tensor to members first."""
    if not isinstance(node, fx.Node) or node.target is not _aten._unsafe_view.default:
        return None
    clone = node.args[0]
    if not isinstance(clone, fx.Node) or clone.target is not _aten.clone.default:
        return None
    permute = clone.args[0]
    if not isinstance(permute, fx.Node) or permute.target is not _aten.permute.default:
        return None
    if list(permute.args[1]) != [1, 0, 2, 3, 4]:  # type: ignore[arg-type]
        return None
    if len(node.users) != 1 or len(clone.users) != 1 or len(permute.users) != 1:
        return None
    src, out = permute.args[0], _val(node)
    src_val = _val(src)
    if src_val is None or out is None or src_val.dim() != 5 or not src_val.is_contiguous():
        return None
    n, b = src_val.shape[:2]
    if list(out.shape) != [b * n, *src_val.shape[2:]]:
        return None
    assert isinstance(src, fx.Node)
    return src, b, n


def _outputs(node: fx.Node) -> list[fx.Node] | None:
    """The nodes holding ``node``'s pooled tensors (its ``getitem``s for a tuple result)."""
    if node.target is not _aten.max_pool2d_with_indices.default:
        return [node]
    outs = list(node.users)
    if any(u.target is not operator.getitem for u in outs):
        return None
    return outs


def _member_views(out: fx.Node, b: int, n: int) -> bool:
    """Whether every reader of ``out`` is ``vmap``'s view of it as ``[B, N, ...]``."""
    for user in out.users:
        val = _val(user)
        if user.target is not _aten.view.default or user.args[0] is not out or val is None:
            return False
        if val.dim() < 2 or list(val.shape[:2]) != [b, n]:
            return False
    return True


def _rewrite(graph: fx.Graph, node: fx.Node, written: set[fx.Node]) -> bool:
    if node.op != "call_function" or node.target not in _POOLS or not node.args:
        return False
    found = _member_front_copy(node.args[0])
    if found is None:
        return False
    src, b, n = found
    outs = _outputs(node)
    if outs is None or not all(_member_views(o, b, n) for o in outs):
        return False
    if _written_alias(src, written):
        return False  # the pool would save a tensor that is written later for its backward
    src_val = _val(src)
    assert src_val is not None
    folded_shape = [n, b * src_val.shape[2], *src_val.shape[3:]]
    copy, target = node.args[0], node.target
    assert isinstance(copy, fx.Node) and callable(target)
    with graph.inserting_before(node):
        folded = graph.call_function(_aten.view.default, (src, folded_shape))
        folded.meta["val"] = _meta(src_val).view(folded_shape)
        pooled = graph.call_function(target, (folded, *node.args[1:]), dict(node.kwargs))
        pooled.meta["val"] = target(folded.meta["val"], *node.args[1:], **node.kwargs)
        for old in outs:
            if old is node:
                new, new_val = pooled, pooled.meta["val"]
            else:
                k = old.args[1]
                new = graph.call_function(operator.getitem, (pooled, k))
                new_val = pooled.meta["val"][k]
                new.meta["val"] = new_val
            for view in list(old.users):
                rest = list(view.meta["val"].shape[2:])
                unflat = graph.call_function(_aten.view.default, (new, [n, b, *rest]))
                unflat.meta["val"] = new_val.view(n, b, *rest)
                dims = [1, 0, *range(2, 2 + len(rest))]
                for user in list(view.users):
                    if user.target is _aten.permute.default and user.args[1] in (dims, tuple(dims)):
                        # moved back next to the channels (the next convolution): as pooled
                        user.replace_all_uses_with(unflat)
                        graph.erase_node(user)
                if view.users:
                    # read members first: the layout vmap traced them on, copied once
                    members_first = graph.call_function(_aten.permute.default, (unflat, dims))
                    members_first.meta["val"] = unflat.meta["val"].permute(dims)
                    copied = graph.call_function(
                        _aten.clone.default,
                        (members_first,),
                        {"memory_format": torch.contiguous_format},
                    )
                    copied.meta["val"] = members_first.meta["val"].contiguous()
                    view.replace_all_uses_with(copied)
                graph.erase_node(view)
    for old in outs:
        if old is not node:
            graph.erase_node(old)
    graph.erase_node(node)
    clone = copy.args[0]
    assert isinstance(clone, fx.Node)
    permute = clone.args[0]
    assert isinstance(permute, fx.Node)
    for dead in (copy, clone, permute):
        graph.erase_node(dead)
    return True


def pool_members_with_channels(graph: fx.Graph) -> None:
    """Pool a member-next-to-channels ``[N, B, C, H, W]`` tensor as ``[N, B * C, H, W]`` where
    ``vmap`` moved the members to the front and copied (see the module docstring)."""
    written = _written(graph)
    for node in list(graph.nodes):
        if not node._erased:
            _rewrite(graph, node, written)


def drop_contiguous_copy(graph: fx.Graph, node: fx.Node) -> bool:
    """``_unsafe_view(clone(x), s)`` -> ``view(x, s)`` where ``x`` is already contiguous, the
    clone is read only there, and no tensor sharing the memory of ``x`` or of the result is
    written in place: the same values without the copy (``vmap``'s reshape of a tensor that a
    rewrite above made contiguous)."""
    if node.target is not _aten._unsafe_view.default:
        return False
    clone = node.args[0]
    if not isinstance(clone, fx.Node) or clone.target is not _aten.clone.default:
        return False
    if len(clone.users) != 1 or clone.kwargs.get("memory_format") not in (
        None,
        torch.contiguous_format,
    ):
        return False
    src = clone.args[0]
    src_val, val = _val(src), _val(node)
    if src_val is None or val is None or not src_val.is_contiguous():
        return False
    assert isinstance(src, fx.Node)
    written = _written(graph)
    if _written_alias(src, written) or _written_alias(node, written):
        return False
    with graph.inserting_before(node):
        view = graph.call_function(_aten.view.default, (src, list(val.shape)))
    view.meta["val"] = _meta(src_val).view(list(val.shape))
    node.replace_all_uses_with(view)
    graph.erase_node(node)
    graph.erase_node(clone)
    return True
