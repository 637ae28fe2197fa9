"""Convolution whose batching rule is one grouped convolution with the bias folded in.

``torch.func.vmap`` already batches a convolution with per-member weights as one grouped
convolution over the members folded into the channels, but adds the bias afterwards: the output
is permuted to put the member first, and the bias is reshaped, broadcast and added, forward and
backward (about 10 operators per layer). Here the bias goes into the convolution itself
(``[B * C_out]``, member-major like the output channels) and the output keeps the members next
to the channels, where the next convolution, BatchNorm or elementwise op reads them as they are.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .._compat import is_batched_tensor

__all__ = ["FusedConvMixin"]

_is_batched = is_batched_tensor


@torch.library.custom_op("hfsweep::convolution", mutates_args=())
def _conv_op(
    x: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    stride: list[int],
    padding: list[int],
    dilation: list[int],
    groups: int,
) -> Tensor:
    # only called under vmap (see FusedConvMixin), where the batching rule runs instead
    zeros = [0] * len(stride)
    return torch.convolution(x, weight, bias, stride, padding, dilation, False, zeros, groups)


def _conv_vmap(
    info: Any,
    in_dims: tuple[int | None, ...],
    x: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    stride: list[int],
    padding: list[int],
    dilation: list[int],
    groups: int,
) -> tuple[Tensor, int]:
    size = info.batch_size
    x_dim, w_dim, b_dim = in_dims[:3]
    zeros = [0] * len(stride)
    if b_dim is not None and bias is not None and b_dim != 0:
        bias = bias.movedim(b_dim, 0)
    if w_dim is None:
        # one weight for all members (shared frozen state): the members go into the batch
        xm = x if x_dim is None or x_dim == 0 else x.movedim(x_dim, 0)
        xb = xm if x_dim is None else xm.flatten(0, 1)
        shared_bias = bias if b_dim is None else None
        out = torch.convolution(
            xb, weight, shared_bias, stride, padding, dilation, False, zeros, groups
        )
        if x_dim is None:
            out = out.expand(size, *out.shape)
        else:
            out = out.view(size, xm.shape[1], *out.shape[1:])
        if b_dim is not None and bias is not None:
            out = out + bias.view(size, 1, -1, *([1] * (out.dim() - 3)))
        return out, 0
    w = weight.movedim(w_dim, 0) if w_dim != 0 else weight
    if x_dim is None and groups == 1:
        # one input for all members: every member's filters read all of its channels
        folded, total_groups = x, 1
    else:
        if x_dim is None:
            xb = x.unsqueeze(1).expand(x.shape[0], size, *x.shape[1:])
        else:
            xb = x.movedim(x_dim, 1) if x_dim != 1 else x
        # [N, B, C_in, ...] -> [N, B * C_in, ...]: a view where the members already sit next to
        # the channels (the output of this rule, of BatchNorm's), else one copy
        folded, total_groups = xb.flatten(1, 2), groups * size
    if bias is not None and b_dim is None:
        bias = bias.expand(size, *bias.shape)
    out = torch.convolution(
        folded,
        w.flatten(0, 1),
        None if bias is None else bias.reshape(-1),
        stride,
        padding,
        dilation,
        False,
        zeros,
        total_groups,
    )
    return out.view(out.shape[0], size, w.shape[1], *out.shape[2:]), 1


_conv_op.register_vmap(_conv_vmap)


class FusedConvMixin(nn.Module):
    """``_conv_forward`` of ``nn.Conv{1,2,3}d`` through one grouped convolution under ``vmap``;
    torch's own where that does not apply (an unbatched sample, ``padding="same"``)."""

    stride: tuple[int, ...]
    padding: str | tuple[int, ...]
    dilation: tuple[int, ...]
    groups: int
    padding_mode: str
    _reversed_padding_repeated_twice: list[int]

    def _conv_forward(self, input: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
        padding = self.padding
        batched = _is_batched(input) or _is_batched(weight)
        if not batched or input.dim() != weight.dim() or padding == "same":
            return super()._conv_forward(input, weight, bias)  # type: ignore[misc]
        if self.padding_mode != "zeros":
            input = F.pad(input, self._reversed_padding_repeated_twice, mode=self.padding_mode)
            padding = (0,) * len(self.stride)
        elif padding == "valid":
            padding = (0,) * len(self.stride)
        assert not isinstance(padding, str)
        return _conv_op(
            input, weight, bias, list(self.stride), list(padding), list(self.dilation), self.groups
        )
