"""Batched products against a stacked weight, with the weight's gradient in the weight's layout.

The fused ``Linear`` (``hfsweep/nn/_linear.py``) runs as ``baddbmm(bias, x, w.transpose(1, 2))``
on the stacked ``[B, out, in]`` weight. Autograd's derivative of that product gives the gradient
of ``w.transpose(1, 2)`` as a contiguous ``[B, in, out]`` tensor, and the transpose's backward
hands it to the weight as a transposed view, whose strides differ from the weight's: the
weight's gradient accumulator then copies it into the weight's layout (``new_empty_strided`` and
``copy_``, per weight and step), after a transpose and a ``squeeze`` of the bias's gradient.

This pass replaces such a product of a traced graph, where the transposed tensor is a graph
input (a parameter or buffer of the array), by :class:`_StackedLinear`, whose backward computes
the weight's gradient as ``grad^T @ x`` directly in ``[B, out, in]`` (as ``torch``'s own
``F.linear`` backward does for one weight: ``grad^T @ x``) and the bias's as one sum. The forward
dispatches the same operators as the product it replaces; the backward four per layer where
autograd's takes ten. A run of
such products from the graph's input (an MLP) is then computed features-first with autograd's
own products instead, no Python left in its step (:mod:`._graph_features_first`); a Linear
alone keeps this one.

The product is an ``autograd.Function`` of the classic form (``forward(ctx, ...)``): its ``apply``
costs about 7 us, where the ``setup_context`` form binds its arguments through
``inspect.signature`` on every call (about 30 us more, forward and backward of three layers:
a tenth of a small MLP's fused step on a CPU). The classic form has no rule for ``torch.func``
transforms, so a call made under one (``vmap``, ``grad``) takes the ``setup_context`` form, whose
rule is generated (:func:`stacked_linear` decides per call).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, fx

from .._compat import functorch_transforms_active

__all__ = ["stacked_linear", "use_stacked_linear"]

_aten = torch.ops.aten


def _product(x: Tensor, w: Tensor, bias: Tensor | None, vector: bool) -> Tensor:
    wt = w.transpose(1, 2)
    if bias is None:
        return torch.bmm(x, wt)
    return torch.baddbmm(bias.unsqueeze(1) if vector else bias, x, wt)


def _gradients(
    grad: Tensor,
    x: Tensor,
    w: Tensor,
    needs: tuple[bool, ...],
    vector: bool,
    bias_shape: torch.Size | None,
) -> tuple[Tensor | None, ...]:
    need_x, need_w, need_b, _ = needs
    grad_x = torch.bmm(grad, w) if need_x else None
    grad_w = torch.bmm(grad.transpose(1, 2), x) if need_w else None
    grad_b = None
    if need_b:
        grad_b = grad.sum(1) if vector else grad.sum_to_size(bias_shape)  # type: ignore[arg-type]
    return grad_x, grad_w, grad_b, None


class _StackedLinear(torch.autograd.Function):
    """``x @ w.transpose(1, 2) (+ bias)`` for ``x: [B, N, in]``, ``w: [B, out, in]`` and a bias
    of ``[B, out]`` (``vector``: broadcast over the rows) or one that broadcasts to the output.
    The classic form: cheap to call, no rule for ``torch.func`` transforms."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, w: Tensor, bias: Tensor | None, vector: bool) -> Tensor:
        ctx.save_for_backward(x, w)
        ctx.bias_shape = None if bias is None else bias.shape
        ctx.vector = vector
        return _product(x, w, bias, vector)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        x, w = ctx.saved_tensors
        return _gradients(grad, x, w, ctx.needs_input_grad, ctx.vector, ctx.bias_shape)


class _StackedLinearTransformable(torch.autograd.Function):
    """The same product in the ``setup_context`` form, whose ``vmap`` rule torch generates: for
    calls under a ``torch.func`` transform."""

    generate_vmap_rule = True

    @staticmethod
    def forward(x: Tensor, w: Tensor, bias: Tensor | None, vector: bool) -> Tensor:
        return _product(x, w, bias, vector)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Tensor) -> None:
        x, w, bias, vector = inputs
        ctx.save_for_backward(x, w)
        ctx.bias_shape = None if bias is None else bias.shape
        ctx.vector = vector

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        x, w = ctx.saved_tensors
        return _gradients(grad, x, w, ctx.needs_input_grad, ctx.vector, ctx.bias_shape)


def stacked_linear(
    x: Tensor, w: Tensor, bias: Tensor | None = None, vector: bool = False
) -> Tensor:
    """``torch.baddbmm(bias, x, w.transpose(1, 2))`` (``torch.bmm`` without a bias; a ``vector``
    bias is ``[B, out]``, unsqueezed) with ``w``'s gradient computed in ``w``'s layout."""
    if functorch_transforms_active():
        return _StackedLinearTransformable.apply(x, w, bias, vector)
    return _StackedLinear.apply(x, w, bias, vector)


def _transposed_input(node: Any) -> fx.Node | None:
    """The graph input ``w`` where ``node`` is ``w.transpose(1, 2)`` of a 3-d ``w``."""
    if not isinstance(node, fx.Node) or node.target is not _aten.transpose.int:
        return None
    w, *dims = node.args
    if not isinstance(w, fx.Node) or w.op != "placeholder":
        return None
    val = w.meta.get("val")
    if not isinstance(val, Tensor) or val.dim() != 3 or val.layout != torch.strided:
        return None
    return w if sorted(d % 3 for d in dims) == [1, 2] else None  # type: ignore[operator]


def _vector_bias(node: Any) -> fx.Node | None:
    """``b`` where ``node`` is ``b.unsqueeze(1)`` of a 2-d ``b`` that nothing else reads."""
    if not isinstance(node, fx.Node) or node.target is not _aten.unsqueeze.default:
        return None
    b, dim = node.args
    val = b.meta.get("val") if isinstance(b, fx.Node) else None
    if not isinstance(val, Tensor) or val.dim() != 2 or dim != 1 or len(node.users) != 1:
        return None
    return b  # type: ignore[return-value]


def use_stacked_linear(graph: fx.Graph) -> None:
    """Replace ``bmm(x, w.transpose(1, 2))`` and ``baddbmm(bias, x, w.transpose(1, 2))`` (no
    ``beta``/``alpha``) of a graph input ``w`` by :func:`stacked_linear` (see the module
    docstring); transposes and unsqueezes nothing else reads go with them."""
    for node in list(graph.nodes):
        if node.op != "call_function" or node.kwargs:
            continue
        if node.target is _aten.bmm.default and len(node.args) == 2:
            x, t = node.args
            bias: Any = None
        elif node.target is _aten.baddbmm.default and len(node.args) == 3:
            bias, x, t = node.args
        else:
            continue
        w = _transposed_input(t)
        if w is None:
            continue
        vector_bias = _vector_bias(bias)
        args = (x, w, bias, False) if vector_bias is None else (x, w, vector_bias, True)
        with graph.inserting_before(node):
            new = graph.call_function(stacked_linear, args)
        new.meta.update(node.meta)
        node.replace_all_uses_with(new)
        graph.erase_node(node)
        for dead in (bias if vector_bias is not None else None, t):
            if isinstance(dead, fx.Node) and not dead.users:
                graph.erase_node(dead)
