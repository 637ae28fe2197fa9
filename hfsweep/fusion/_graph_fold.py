"""A traced graph's convolutions and BatchNorms, reading the stacked state without a view per call.

The batching rules of ``hfsweep/nn/_conv.py`` and ``_batchnorm.py`` fold the members into the
channels: a convolution's stacked weight ``[B, C_out, C_in, k, ...]`` is read as
``[B * C_out, C_in, k, ...]``, a BatchNorm's weight, bias and running statistics ``[B, C]`` as
``[B * C]``. In a traced graph each is a ``view`` of a graph input (a stacked tensor of the
array), dispatched on every call: per BatchNorm layer four views forward, per convolution one
(a view launches no kernel on a GPU, but is an operator of the step all the same).

:func:`fold_state_views` replaces such a call by :func:`folded_convolution` or
:func:`folded_batch_norm`, autograd functions that take the stacked tensors themselves and read
them through views made once per tensor and kept (:func:`_alias`). A view of a tensor's memory
reads what the tensor holds as long as the tensor keeps that memory, which the optimizers update
in place; a tensor given new memory (``.data = ...``, ``.to()``, offload's moves) gets a new view,
checked on every call by identity, data pointer, shape, strides and dtype, none of which
dispatches anything. The views share the tensor's version counter, so autograd's checks of
saved tensors written in place still apply. The trade-off: a kept view holds the memory it was
made of until its tensor goes or is read again with new memory; a fused array's ``.to()`` and
the like drop the views of its state first (:func:`forget_views`), so moving an array leaves
no copy of its old memory behind.

Forward and backward call the kernels autograd would call (``convolution`` and
``convolution_backward``, ``native_batch_norm`` and ``native_batch_norm_backward``) on the same
memory with the same arguments: the values are identical. Each parameter's gradient is returned
viewed as the parameter, one view per parameter in the backward; the forward dispatches no
view. With ``create_graph`` the backward reads the parameters through differentiable views
instead, so second derivatives still reach them.
"""

from __future__ import annotations

import operator
import weakref
from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch import Tensor, fx

__all__ = ["fold_state_views", "folded_batch_norm", "folded_convolution", "forget_views"]

_aten = torch.ops.aten

Shape = tuple[int, ...]


class _Views:
    """The views made of one tensor's memory (see :func:`_alias`)."""

    __slots__ = ("dtype", "ptr", "ref", "shape", "stride", "views")

    def __init__(self, t: Tensor) -> None:
        self.ref = weakref.ref(t, _forget(id(t)))
        self.ptr, self.shape, self.stride, self.dtype = t.data_ptr(), t.shape, t.stride(), t.dtype
        self.views: dict[Shape, Tensor] = {}

    def valid_for(self, t: Tensor) -> bool:
        """Whether these views still read ``t``'s memory, in its layout (nothing dispatched)."""
        return (
            self.ref() is t
            and self.ptr == t.data_ptr()
            and self.shape == t.shape
            and self.stride == t.stride()
            and self.dtype == t.dtype
        )


#: id of a tensor -> the views of its memory
_ALIASES: dict[int, _Views] = {}


def _forget(key: int) -> Any:
    """A weak reference's callback: drop the views of a tensor that no longer exists."""
    return lambda _ref: _ALIASES.pop(key, None)


def _alias(t: Tensor, shape: Shape) -> Tensor:
    """``t.detach().view(shape)``, made once for ``t``'s current memory and kept."""
    entry = _ALIASES.get(id(t))
    if entry is None or not entry.valid_for(t):
        entry = _ALIASES[id(t)] = _Views(t)
    alias = entry.views.get(shape)
    if alias is None:
        with torch.no_grad():
            alias = entry.views[shape] = t.detach().view(shape)
    return alias


def forget_views(tensors: Iterable[Tensor]) -> None:
    """Drop the kept views of ``tensors``: before their memory is replaced (``.to()`` of an
    array swaps its parameters' ``.data``), so that the old memory is not held by a view that
    no call would read again."""
    for t in tensors:
        _ALIASES.pop(id(t), None)


def _read(t: Tensor | None, shape: Shape | None, differentiable: bool) -> Tensor | None:
    """``t`` as the kernel reads it: as given (``shape`` None), else viewed as ``shape``."""
    if t is None or shape is None:
        return t
    return t.view(shape) if differentiable else _alias(t, shape)


def _as(grad: Tensor | None, t: Tensor | None, shape: Shape | None) -> Tensor | None:
    """A gradient computed in the kernel's layout, in ``t``'s (``shape``: how it was read)."""
    if grad is None or t is None or shape is None:
        return grad
    return grad.view(t.shape)


class _FoldedConvolution(torch.autograd.Function):
    """``torch.convolution`` of kept views of ``w`` (and ``bias``); the backward is autograd's
    ``convolution_backward`` call, each parameter's gradient viewed as the parameter."""

    @staticmethod
    def forward(
        ctx: Any,
        x: Tensor,
        w: Tensor,
        w_shape: Shape | None,
        bias: Tensor | None,
        bias_shape: Shape | None,
        *settings: Any,
    ) -> Tensor:
        ctx.save_for_backward(x, w, bias)
        ctx.shapes, ctx.settings = (w_shape, bias_shape), settings
        wf, bf = _alias(w, w_shape) if w_shape else w, _read(bias, bias_shape, False)
        return torch.convolution(x, wf, bf, *settings)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        x, w, bias = ctx.saved_tensors
        w_shape, bias_shape = ctx.shapes
        need_x, need_w, _, need_b, _ = ctx.needs_input_grad[:5]
        wf = _read(w, w_shape, torch.is_grad_enabled())
        assert wf is not None
        sizes = None if bias is None else list(bias_shape or bias.shape)
        gx, gw, gb = _aten.convolution_backward(
            grad, x, wf, sizes, *ctx.settings, [need_x, need_w, need_b and bias is not None]
        )
        return (gx, _as(gw, w, w_shape), None, _as(gb, bias, bias_shape), None) + (None,) * len(
            ctx.settings
        )


def folded_convolution(
    x: Tensor,
    w: Tensor,
    w_shape: Sequence[int] | None,
    bias: Tensor | None,
    bias_shape: Sequence[int] | None,
    *settings: Any,
) -> Tensor:
    """``torch.convolution(x, w.view(w_shape), bias.view(bias_shape), *settings)`` (a shape
    ``None``: the tensor as it is) with the views made once per tensor (see the module)."""
    return _FoldedConvolution.apply(x, w, _shape(w_shape), bias, _shape(bias_shape), *settings)


class _FoldedBatchNorm(torch.autograd.Function):
    """``torch.native_batch_norm`` of kept views of the weight, bias and running statistics;
    the backward is autograd's ``native_batch_norm_backward`` call."""

    @staticmethod
    def forward(
        ctx: Any,
        x: Tensor,
        training: bool,
        momentum: float,
        eps: float,
        shapes: tuple[Shape | None, ...],
        *state: Tensor | None,
    ) -> Tensor:
        w, b, mean, var = (_read(t, s, False) for t, s in zip(state, shapes, strict=True))
        out, save_mean, save_invstd = torch.native_batch_norm(
            x, w, b, mean, var, training, momentum, eps
        )
        ctx.save_for_backward(x, save_mean, save_invstd, *state)
        ctx.shapes, ctx.training, ctx.eps = shapes, training, eps
        return out

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        x, save_mean, save_invstd, *state = ctx.saved_tensors
        shapes = ctx.shapes
        differentiable = torch.is_grad_enabled()
        w, _, mean, var = (_read(t, s, differentiable) for t, s in zip(state, shapes, strict=True))
        needs: tuple[bool, ...] = ctx.needs_input_grad
        need_x, need_w, need_b = needs[0], needs[5], needs[6]
        gx, gw, gb = _aten.native_batch_norm_backward(
            grad,
            x,
            w,
            mean,
            var,
            save_mean,
            save_invstd,
            ctx.training,
            ctx.eps,
            [need_x, need_w, need_b],
        )
        return (
            gx,
            None,
            None,
            None,
            None,
            _as(gw, state[0], shapes[0]),
            _as(gb, state[1], shapes[1]),
            None,
            None,
        )


def folded_batch_norm(
    x: Tensor,
    training: bool,
    momentum: float,
    eps: float,
    shapes: Sequence[Sequence[int] | None],
    weight: Tensor | None,
    bias: Tensor | None,
    running_mean: Tensor | None,
    running_var: Tensor | None,
) -> Tensor:
    """``torch.native_batch_norm(x, ...)[0]`` with weight, bias and running statistics each
    viewed as its entry of ``shapes`` (``None``: as it is), the views made once per tensor.
    The running statistics are updated in place, as the native call updates them."""
    return _FoldedBatchNorm.apply(
        x,
        training,
        momentum,
        eps,
        tuple(_shape(s) for s in shapes),
        weight,
        bias,
        running_mean,
        running_var,
    )


def _shape(shape: Sequence[int] | None) -> Shape | None:
    """A graph's shape argument (a list) as a hashable tuple."""
    return None if shape is None else tuple(int(n) for n in shape)


def _state_view(node: Any) -> tuple[Any, Shape | None]:
    """``(t, shape)`` where ``node`` is ``view(t, shape)`` of a graph input ``t`` with a
    recorded contiguous value (``shape`` with ``-1`` resolved), else ``(node, None)``."""
    if not isinstance(node, fx.Node) or node.target is not _aten.view.default:
        return node, None
    src = node.args[0]
    if not isinstance(src, fx.Node) or src.op != "placeholder":
        return node, None
    val, out = src.meta.get("val"), node.meta.get("val")
    if not isinstance(val, Tensor) or not isinstance(out, Tensor) or val.layout != torch.strided:
        return node, None
    if not val.is_contiguous():
        return node, None
    return src, tuple(out.shape)


def _drop_dead(graph: fx.Graph, nodes: Sequence[Any]) -> None:
    """Erase those of ``nodes`` that nothing reads any more."""
    for n in nodes:
        if isinstance(n, fx.Node) and not n.users:
            graph.erase_node(n)


def _fold_convolution(graph: fx.Graph, node: fx.Node) -> bool:
    """Replace ``node`` (a ``convolution``) by :func:`folded_convolution` where its weight or
    bias is a view of a graph input."""
    x, w_arg, b_arg, *settings = node.args
    w, w_shape = _state_view(w_arg)
    b, b_shape = _state_view(b_arg)
    if w_shape is None and b_shape is None:
        return False
    with graph.inserting_before(node):
        new = graph.call_function(
            folded_convolution,
            (
                x,
                w,
                None if w_shape is None else list(w_shape),
                b,
                None if b_shape is None else list(b_shape),
                *settings,
            ),
        )
    new.meta.update(node.meta)
    node.replace_all_uses_with(new)
    graph.erase_node(node)
    _drop_dead(graph, (w_arg, b_arg))
    return True


def _fold_batch_norm(graph: fx.Graph, node: fx.Node) -> bool:
    """Replace ``node`` (a ``native_batch_norm`` of which only the output is read) by
    :func:`folded_batch_norm` where one of its tensors is a view of a graph input."""
    x, *state_args = node.args[:5]
    training, momentum, eps = node.args[5:8]
    # only the output is read (the saved statistics are the backward's, kept inside)
    getitems = list(node.users)
    if any(u.target is not operator.getitem or u.args[1] != 0 for u in getitems if u.users):
        return False
    folded = [_state_view(a) for a in state_args]
    if all(s is None for _, s in folded):
        return False
    shapes = [None if s is None else list(s) for _, s in folded]
    with graph.inserting_before(node):
        new = graph.call_function(
            folded_batch_norm,
            (x, training, momentum, eps, shapes, *(t for t, _ in folded)),
        )
    new.meta["val"] = node.meta["val"][0] if "val" in node.meta else None
    for u in getitems:
        if u.users:
            u.replace_all_uses_with(new)
        graph.erase_node(u)
    graph.erase_node(node)
    _drop_dead(graph, state_args)
    return True


def fold_state_views(graph: fx.Graph) -> None:
    """Replace each ``convolution`` (without keyword arguments) whose weight or bias, and each
    ``native_batch_norm`` whose weight, bias or running statistics, is a view of a graph
    input by :func:`folded_convolution` / :func:`folded_batch_norm` (see the module)."""
    for node in list(graph.nodes):
        if node.op != "call_function" or node.kwargs:
            continue
        if node.target is _aten.convolution.default and len(node.args) == 9:
            _fold_convolution(graph, node)
        elif node.target is _aten.native_batch_norm.default and len(node.args) == 8:
            _fold_batch_norm(graph, node)
