"""RReLU, which ``vmap`` does not support (``aten::rrelu`` has no batching rule)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = ["FusedRReLUMixin"]


class FusedRReLUMixin(nn.Module):
    """Forward of ``nn.RReLU``: random negative slopes in ``[lower, upper]`` while training, drawn
    independently per member and element (``torch.rand``, which a fused array draws from each
    member's own stream); the mean slope in eval mode, as torch does."""

    lower: float
    upper: float
    inplace: bool

    def forward(self, input: Tensor) -> Tensor:
        if not self.training:
            return F.leaky_relu(input, (self.lower + self.upper) / 2)
        slope = torch.rand(input.shape, dtype=input.dtype, device=input.device)
        slope = slope * (self.upper - self.lower) + self.lower
        return torch.where(input >= 0, input, input * slope)
