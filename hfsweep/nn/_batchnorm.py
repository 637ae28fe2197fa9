"""BatchNorm whose running statistics are updated per member, ``momentum=None`` included.

Under ``vmap`` torch's ``batch_norm`` with per-member weights decomposes into views, permutes,
products and sums (about 40 operators per layer, forward and backward) and per-member running
statistics. Here a batching rule folds the members into the channels instead: member ``b``'s
channel ``c`` becomes channel ``b * C + c`` of one ``[N, B * C, ...]`` input, so the whole array
is one native ``batch_norm`` (one backward operator), which updates each member's running
statistics in place exactly as torch's ``BatchNorm`` updates one model's: a channel's statistics
are taken over the same values either way.

``momentum=None`` (a cumulative average) needs a per-member averaging factor, which one native
call cannot take: there the factor is a tensor (each member keeps its own count, so a slot
refilled with a fresh trial restarts its cumulative average at 1) and the statistics are updated
by hand.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .._compat import is_batched_tensor

__all__ = ["FusedBatchNormMixin"]

_is_batched = is_batched_tensor


@torch.library.custom_op("hfsweep::batch_norm", mutates_args=("running_mean", "running_var"))
def _batch_norm_op(
    x: Tensor,
    weight: Tensor | None,
    bias: Tensor | None,
    running_mean: Tensor | None,
    running_var: Tensor | None,
    training: bool,
    momentum: float,
    eps: float,
) -> Tensor:
    # only called under vmap (see FusedBatchNormMixin), where the batching rule runs instead
    return F.batch_norm(x, running_mean, running_var, weight, bias, training, momentum, eps)


def _member_channels(t: Tensor | None, dim: int | None, size: int) -> Tensor | None:
    """A per-channel tensor as ``[B * C]`` (member-major), expanded where it is shared."""
    if t is None:
        return None
    if dim is None:
        return t.expand(size, *t.shape).reshape(-1)
    return (t.movedim(dim, 0) if dim != 0 else t).reshape(-1)


def _statistics(t: Tensor | None, dim: int | None, size: int, training: bool) -> Tensor | None:
    """A running statistic as ``[B * C]``; in training a view of the stacked buffer itself,
    which the native kernel updates in place."""
    if t is None:
        return None
    if not training:
        return _member_channels(t, dim, size)
    if dim != 0 or not t.is_contiguous():
        # unshared in training (FusedArray._unshare_written) and stacked contiguous: never here
        raise RuntimeError("a BatchNorm's running statistics must be stacked in training mode")
    return t.view(-1)


def _batch_norm_vmap(
    info: Any,
    in_dims: tuple[int | None, ...],
    x: Tensor,
    weight: Tensor | None,
    bias: Tensor | None,
    running_mean: Tensor | None,
    running_var: Tensor | None,
    training: bool,
    momentum: float,
    eps: float,
) -> tuple[Tensor, int]:
    size = info.batch_size
    x_dim, w_dim, b_dim, m_dim, v_dim = in_dims[:5]
    if x_dim is None:
        x = x.unsqueeze(1).expand(x.shape[0], size, *x.shape[1:])
    elif x_dim != 1:
        x = x.movedim(x_dim, 1)
    # [N, B, C, ...] -> [N, B * C, ...]: a view where the members already sit next to the
    # channels (the output of a fused convolution, of this rule), else one copy
    folded = x.flatten(1, 2)
    out = torch.batch_norm(
        folded,
        _member_channels(weight, w_dim, size),
        _member_channels(bias, b_dim, size),
        _statistics(running_mean, m_dim, size, training),
        _statistics(running_var, v_dim, size, training),
        training,
        momentum,
        eps,
        torch.backends.cudnn.enabled,
    )
    return out.view(x.shape), 1


_batch_norm_op.register_vmap(_batch_norm_vmap)


class FusedBatchNormMixin(nn.Module):
    """Forward of ``nn.BatchNorm{1,2,3}d`` that is exact per member under ``vmap``."""

    weight: Tensor | None
    bias: Tensor | None
    running_mean: Tensor | None
    running_var: Tensor | None
    num_batches_tracked: Tensor | None
    momentum: float | None
    eps: float
    track_running_stats: bool
    _check_input_dim: Callable[[Tensor], None]  # from the torch class

    def forward(self, input: Tensor) -> Tensor:
        self._check_input_dim(input)
        use_batch_stats = self.training or self.running_mean is None
        updates = self.training and self.track_running_stats and self.running_mean is not None
        if updates and self.momentum is None:
            out = F.batch_norm(input, None, None, self.weight, self.bias, True, 0.0, self.eps)
            self._update_running_stats(input.detach())
            return out
        if updates:
            assert self.num_batches_tracked is not None
            self.num_batches_tracked.add_(1)
        running = not use_batch_stats or updates
        mean = self.running_mean if running else None
        var = self.running_var if running else None
        momentum = 0.0 if self.momentum is None else self.momentum
        if any(t is not None and _is_batched(t) for t in (input, self.weight, mean)):
            return _batch_norm_op(
                input, self.weight, self.bias, mean, var, use_batch_stats, momentum, self.eps
            )
        # one member (an array of size 1 runs without vmap): torch's own call
        return F.batch_norm(
            input, mean, var, self.weight, self.bias, use_batch_stats, momentum, self.eps
        )

    def _update_running_stats(self, x: Tensor) -> None:
        """``momentum=None``: the cumulative average, with each member's own count."""
        assert self.running_mean is not None and self.running_var is not None
        assert self.num_batches_tracked is not None
        dims = [0, *range(2, x.dim())]
        mean = x.mean(dims)
        var = x.var(dims, correction=1)
        self.num_batches_tracked.add_(1)
        factor = self.num_batches_tracked.to(mean.dtype).reciprocal()
        # x is detached, so these in-place updates stay out of autograd (no grad-mode switch,
        # which would keep a traced array from replaying).
        self.running_mean.mul_(1 - factor).add_(mean * factor)
        self.running_var.mul_(1 - factor).add_(var * factor)
