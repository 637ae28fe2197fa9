"""Linear layer whose batching rule is one ``baddbmm`` per call.

``torch.func.vmap`` batches ``F.linear`` by decomposing ``addmm`` into ``bmm``, ``mul`` and ``add``:
three kernels and two extra passes over the output. Registering ``linear`` as a custom op with its
own vmap rule gives the HFTA kernel (one batched matrix product with the bias folded in).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = ["fused_linear"]


@torch.library.custom_op("hfsweep::linear", mutates_args=())
def _linear_op(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    return F.linear(x, weight, bias)


@_linear_op.register_fake
def _linear_fake(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


def _linear_backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
    x, weight = ctx.saved_tensors
    need_x, need_w, need_b = ctx.needs_input_grad
    # a frozen weight (an array's shared backbone) gets no gradient: under vmap it would be a
    # [B, out, in] product per call, thrown away
    grad_x = grad @ weight if need_x else None
    grad_w = grad.reshape(-1, grad.shape[-1]).t() @ x.reshape(-1, x.shape[-1]) if need_w else None
    grad_b = grad.reshape(-1, grad.shape[-1]).sum(0) if ctx.has_bias and need_b else None
    return grad_x, grad_w, grad_b


def _linear_setup_context(ctx: Any, inputs: tuple[Any, ...], output: Tensor) -> None:
    x, weight, bias = inputs
    ctx.save_for_backward(x, weight)
    ctx.has_bias = bias is not None


_linear_op.register_autograd(_linear_backward, setup_context=_linear_setup_context)


def _linear_vmap(
    info: Any, in_dims: tuple[int | None, ...], x: Tensor, weight: Tensor, bias: Tensor | None
) -> tuple[Tensor, int]:
    x_dim, w_dim, b_dim = in_dims
    size = info.batch_size
    if w_dim is None and x_dim is not None:
        # one weight for all members (shared frozen state): one product over every member's
        # rows, without B copies of the weight
        xb = x.movedim(x_dim, 0) if x_dim != 0 else x
        if b_dim is None:
            return F.linear(xb, weight, bias), 0
        assert bias is not None
        b = bias.movedim(b_dim, 0) if b_dim != 0 else bias
        out = F.linear(xb, weight)
        return out + b.view(size, *([1] * (out.dim() - 2)), b.shape[-1]), 0
    if w_dim is None:
        w = weight.expand(size, *weight.shape)
    else:
        w = weight.movedim(w_dim, 0) if w_dim != 0 else weight
    if x_dim is None:
        lead = x.shape[:-1]
        x3 = x.reshape(1, -1, x.shape[-1]).expand(size, -1, -1)
    else:
        xb = x.movedim(x_dim, 0) if x_dim != 0 else x
        lead = xb.shape[1:-1]
        x3 = xb if xb.dim() == 3 else xb.reshape(size, -1, xb.shape[-1])
    wt = w.transpose(1, 2)
    if bias is None:
        out = torch.bmm(x3, wt)
    else:
        if b_dim is None:
            b = bias.expand(size, *bias.shape)
        else:
            b = bias.movedim(b_dim, 0) if b_dim != 0 else bias
        out = torch.baddbmm(b.unsqueeze(1), x3, wt)
    return (out if len(lead) == 1 else out.view(size, *lead, w.shape[1])), 0


_linear_op.register_vmap(_linear_vmap)


def fused_linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """``F.linear`` with a one-kernel batching rule under ``vmap`` (same result, fewer passes)."""
    return _linear_op(x, weight, bias)


class FusedLinearMixin(nn.Module):
    """Forward of ``nn.Linear`` through :func:`fused_linear`; mixed into an array's template."""

    weight: Tensor
    bias: Tensor | None

    def forward(self, input: Tensor) -> Tensor:
        return fused_linear(input, self.weight, self.bias)
