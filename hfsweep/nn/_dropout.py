"""Dropout with one probability per member.

Under ``vmap`` a Python float ``p`` is the same for every member, so HFTA could not sweep it. Here
``p`` lives in a ``[B]`` buffer (``member_p``) and the mask is drawn independently per member.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

__all__ = ["FusedDropoutMixin", "feature_dims"]

#: how many trailing dimensions share one mask value, by dropout class name
feature_dims: dict[str, int] = {"Dropout": 0, "Dropout1d": 1, "Dropout2d": 2, "Dropout3d": 3}


class FusedDropoutMixin(nn.Module):
    """Forward of ``nn.Dropout``/``Dropout1d/2d/3d`` with the probability read from ``member_p``."""

    member_p: Tensor
    inplace: bool
    _hfsweep_feature_dims: int = 0

    def forward(self, input: Tensor) -> Tensor:
        if not self.training:
            return input
        k = self._hfsweep_feature_dims
        shape = input.shape if k == 0 else (*input.shape[: input.dim() - k], *([1] * k))
        p = self.member_p.to(input.dtype)
        keep = torch.rand(shape, dtype=input.dtype, device=input.device) >= p
        scale = torch.where(p < 1, 1 / (1 - p), torch.zeros_like(p))
        return input * (keep * scale)
