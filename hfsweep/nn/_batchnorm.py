"""BatchNorm whose running statistics are updated per member, ``momentum=None`` included.

Under ``vmap`` torch's own BatchNorm cannot use ``momentum=None`` (its cumulative average reads
``num_batches_tracked`` as a Python number). Here the averaging factor is a tensor, so each member
keeps its own count: a slot refilled with a fresh trial restarts its cumulative average at 1.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch.nn.functional as F
from torch import Tensor, nn

__all__ = ["FusedBatchNormMixin"]


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
        if not use_batch_stats:
            return F.batch_norm(
                input,
                self.running_mean,
                self.running_var,
                self.weight,
                self.bias,
                False,
                0.0,
                self.eps,
            )
        out = F.batch_norm(input, None, None, self.weight, self.bias, True, 0.0, self.eps)
        if self.training and self.track_running_stats and self.running_mean is not None:
            self._update_running_stats(input.detach())
        return out

    def _update_running_stats(self, x: Tensor) -> None:
        assert self.running_mean is not None and self.running_var is not None
        assert self.num_batches_tracked is not None
        dims = [0, *range(2, x.dim())]
        mean = x.mean(dims)
        var = x.var(dims, correction=1)
        self.num_batches_tracked.add_(1)
        factor: Any
        if self.momentum is None:
            factor = self.num_batches_tracked.to(mean.dtype).reciprocal()
        else:
            factor = self.momentum
        # x is detached, so these in-place updates stay out of autograd (no grad-mode switch,
        # which would keep a traced array from replaying).
        self.running_mean.mul_(1 - factor).add_(mean * factor)
        self.running_var.mul_(1 - factor).add_(var * factor)
