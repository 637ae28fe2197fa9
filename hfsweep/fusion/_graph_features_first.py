"""Runs of stacked Linears computed features-first: native autograd, weight gradients in layout.

:func:`~hfsweep.fusion._graph_linear.use_stacked_linear` makes each fused ``Linear`` of a traced
graph one call of a Python ``autograd.Function``, whose backward computes the weight's gradient
as ``grad^T @ x`` in the stacked weight's ``[B, out, in]`` layout. Its Python costs, forward and
backward, on every layer of every step.

For a run of such Linears (``Linear -> relu -> Linear -> ... -> Linear``, starting at an input
of the graph: an MLP) this pass computes every layer with its activations transposed,
``[B, features, N]``::

    h_next^T = baddbmm(b.unsqueeze(-1), w, h^T)

Autograd's own derivative of that product gives the weight's gradient as ``grad @ h`` (with
``h = (h^T)^T``): ``[B, out, in]`` and contiguous, the stacked weight's layout, so the gradient
accumulator keeps it without a copy; the input's gradient ``w^T @ grad`` is contiguous too. No
Python runs in the backward. The elementwise ops between the layers (``relu``, ``tanh``, ...;
deterministic, one tensor in, one reader) work on either layout and are kept as they are. The
run's input is transposed once (a view of the shared batch) and its output transposed back into
a contiguous tensor once (``transpose_copy``: one copy of the last layer's ``[B, N, out]``
output, one operator; its backward a transposed view), so whatever reads
it (the loss, a ``LayerNorm``, a residual add, a dropout that draws its mask in the tensor's
memory order) sees the tensor it saw before.

Operators: the run's first layer dispatches as many as with the ``autograd.Function`` (its
weight's transpose moves from the forward to the backward), every later one one more (autograd's
bias gradient is a sum over the rows and a ``squeeze``: a view, no kernel on a GPU), and the
run's output two (the copy and its backward's transpose): an MLP of three Linears 4 more per
step. The tiny MLP's step is faster for it, the medium MLP's the same within the measuring
machine's noise (no Python in the backward; ``benchmarks/results/linear_layout_cpu_issue21_linear*``). A Linear alone (between a ``LayerNorm`` and an attention, or after a
pool) keeps the ``autograd.Function``: transposes at both of its ends would cost more operators
for no transpose saved. The products sum in another order than ``x @ w^T``: the same values
within float rounding.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, fx

from ._graph_linear import stacked_linear
from ._graph_ops import pointwise

__all__ = ["features_first_runs"]

_aten = torch.ops.aten

#: off: every Linear keeps the ``autograd.Function`` (read when a forward is traced). Only for
#: ``benchmarks/linear_layout.py``, which times both ways side by side in one process
_ENABLED = True

#: the fewest Linears a run must have to be rewritten (one alone gains no product and costs
#: the transposes at both ends)
_MIN_RUN = 2


def _eligible(node: fx.Node) -> bool:
    """A :func:`stacked_linear` call with a ``[B, out]`` bias or none, on 3-d values."""
    if node.op != "call_function" or node.target is not stacked_linear or node.kwargs:
        return False
    _x, _w, bias, vector = node.args
    val = node.meta.get("val")
    if not isinstance(val, Tensor) or val.dim() != 3 or val.layout != torch.strided:
        return False
    return bias is None or bool(vector)


def _elementwise(node: fx.Node, src: fx.Node) -> bool:
    """A deterministic elementwise op of ``src`` alone (other arguments plain values), with no
    effect besides its result: it computes the same values in either layout."""
    if not pointwise(node):
        return False
    if not node.args or node.args[0] is not src:
        return False
    return not any(isinstance(a, fx.Node) for a in node.args[1:])


def _next_layer(node: fx.Node) -> tuple[fx.Node, list[fx.Node]] | None:
    """The eligible Linear that alone reads ``node``'s output, through elementwise ops each read
    only by the next, and those ops; ``None`` where the output goes anywhere else."""
    between: list[fx.Node] = []
    cur = node
    while len(cur.users) == 1:
        (user,) = cur.users
        if _eligible(user) and user.args[0] is cur:
            return user, between
        if not _elementwise(user, cur):
            return None
        between.append(user)
        cur = user
    return None


def _from_graph_input(x: Any) -> bool:
    """Whether ``x`` is an input of the graph, or views of one (the shared batch, expanded to
    the members): no gradient flows back through the run's first transpose."""
    while isinstance(x, fx.Node) and x.op == "call_function":
        if x.target not in (_aten.view.default, _aten.expand.default, _aten.reshape.default):
            return False
        x = x.args[0]
    return isinstance(x, fx.Node) and x.op == "placeholder"


def _meta(shape: tuple[int, ...], like: Tensor) -> Tensor:
    return torch.empty(shape, dtype=like.dtype, device="meta")


def _transposed(val: Tensor) -> Tensor:
    """A contiguous meta tensor of ``val``'s shape with the last two dimensions swapped."""
    b, n, f = val.shape
    return _meta((b, f, n), val)


def _runs(graph: fx.Graph) -> list[list[tuple[fx.Node, list[fx.Node]]]]:
    """Each run: its Linears in order, each with the elementwise ops that follow it up to the
    next Linear of the run (none after the last)."""
    follows: dict[fx.Node, tuple[fx.Node, list[fx.Node]]] = {}
    for node in graph.nodes:
        if _eligible(node):
            nxt = _next_layer(node)
            if nxt is not None:
                follows[node] = nxt
    heads = set(follows) - {nxt for nxt, _ in follows.values()}
    runs = []
    for node in graph.nodes:
        if node not in heads or not _from_graph_input(node.args[0]):
            continue
        run: list[tuple[fx.Node, list[fx.Node]]] = []
        cur: fx.Node | None = node
        while cur is not None:
            nxt = follows.get(cur)
            run.append((cur, [] if nxt is None else nxt[1]))
            cur = None if nxt is None else nxt[0]
        if len(run) >= _MIN_RUN:
            runs.append(run)
    return runs


def _shared_rows(x: fx.Node) -> fx.Node | None:
    """``p`` where ``x`` is ``p.view(1, N, in).expand(B, -1, -1)`` of a 2-d ``p`` (the shared
    batch as ``vmap`` hands it to every member), the views read by nothing else."""
    if x.target is not _aten.expand.default or len(x.users) != 1:
        return None
    view = x.args[0]
    if not isinstance(view, fx.Node) or view.target is not _aten.view.default:
        return None
    p = view.args[0]
    val = p.meta.get("val") if isinstance(p, fx.Node) else None
    if len(view.users) != 1 or not isinstance(val, Tensor) or val.dim() != 2:
        return None
    return p  # type: ignore[return-value]


def _input_transposed(graph: fx.Graph, first: fx.Node) -> fx.Node:
    """``x^T`` (``[B, in, N]``) of the run's first input ``x`` (``[B, N, in]``): of the shared
    batch ``p`` (``[N, in]``), ``p.t().expand(B, in, N)``, as many operators as ``vmap``'s."""
    x = first.args[0]
    assert isinstance(x, fx.Node)
    val = x.meta["val"]
    rows = _shared_rows(x)
    if rows is not None:
        rows_val = rows.meta["val"]
        n, f = rows_val.shape
        with graph.inserting_before(first):
            t = graph.call_function(_aten.t.default, (rows,))
            node = graph.call_function(_aten.expand.default, (t, [val.shape[0], f, n]))
        s0, s1 = rows_val.stride()
        t.meta["val"] = torch.empty_strided((f, n), (s1, s0), dtype=val.dtype, device="meta")
        node.meta["val"] = torch.empty_strided(
            (val.shape[0], f, n), (0, s1, s0), dtype=val.dtype, device="meta"
        )
        return node
    with graph.inserting_before(first):
        node = graph.call_function(_aten.transpose.int, (x, 1, 2))
    node.meta["val"] = torch.empty_strided(
        (val.shape[0], val.shape[2], val.shape[1]),
        (val.stride(0), val.stride(2), val.stride(1)),
        dtype=val.dtype,
        device="meta",
    )
    return node


def _rewrite(graph: fx.Graph, run: list[tuple[fx.Node, list[fx.Node]]]) -> None:
    h = _input_transposed(graph, run[0][0])
    for i, (layer, between) in enumerate(run):
        _x, w, bias, _vector = layer.args
        val = layer.meta["val"]
        with graph.inserting_before(layer):
            if bias is None:
                new = graph.call_function(_aten.bmm.default, (w, h))
            else:
                column = graph.call_function(_aten.unsqueeze.default, (bias, 2))
                column.meta["val"] = _meta((*bias.meta["val"].shape, 1), val)  # type: ignore[union-attr]
                new = graph.call_function(_aten.baddbmm.default, (column, w, h))
        new.meta["val"] = _transposed(val)
        if i == len(run) - 1:  # back to [B, N, out], contiguous: one operator
            with graph.inserting_after(new):
                out = graph.call_function(torch.transpose_copy, (new, 1, 2))
            out.meta["val"] = _meta(tuple(val.shape), val)
            layer.replace_all_uses_with(out)
        else:
            layer.replace_all_uses_with(new)
            for op in between:  # the same op, now on [B, features, N]
                op.meta["val"] = _transposed(op.meta["val"])
            h = between[-1] if between else new
        graph.erase_node(layer)


def _drop_dead(graph: fx.Graph) -> None:
    """The views that led to a rewritten run's old input, now read by nothing."""
    for node in reversed(list(graph.nodes)):
        if (
            node.op == "call_function"
            and not node.users
            and node.target in (_aten.view.default, _aten.expand.default, _aten.reshape.default)
        ):
            graph.erase_node(node)


def features_first_runs(graph: fx.Graph) -> None:
    """Compute each run of at least two :func:`stacked_linear` calls that starts at an input of
    ``graph`` features-first with native products (see the module docstring)."""
    if not _ENABLED:
        return
    runs = _runs(graph)
    for run in runs:
        _rewrite(graph, run)
    if runs:
        _drop_dead(graph)
