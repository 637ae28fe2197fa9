"""Embedding whose ``padding_idx`` holds per member when each member has its own indices.

torch's batching rule for ``embedding`` with batched weights and batched indices offsets each
member's indices into one flattened table, but keeps ``padding_idx`` as a single row: the padding
rows of members 1..B-1 then receive gradient. Here the lookup runs without ``padding_idx`` and the
gradient is cut at padding positions, which is the documented meaning of ``padding_idx``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = ["FusedEmbeddingMixin"]


class FusedEmbeddingMixin(nn.Module):
    """Forward of ``nn.Embedding`` (``max_norm`` and ``sparse`` are refused at fuse time)."""

    weight: Tensor
    padding_idx: int | None
    scale_grad_by_freq: bool

    def forward(self, input: Tensor) -> Tensor:
        out = F.embedding(input, self.weight, scale_grad_by_freq=self.scale_grad_by_freq)
        if self.padding_idx is None:
            return out
        at_padding = (input == self.padding_idx).unsqueeze(-1)
        return torch.where(at_padding, out.detach(), out)
