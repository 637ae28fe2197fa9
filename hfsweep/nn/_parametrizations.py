"""The parametrizations of ``torch.nn.utils.parametrizations`` that ``vmap`` cannot batch as torch
writes them, rewritten per member with the same arithmetic.

``weight_norm`` calls ``torch._weight_norm`` (and its norm, ``torch.norm_except_dim``), which have
no batching rule (``vmap`` would loop over the members). ``spectral_norm``'s power iteration, in training mode, writes its singular vector
estimates into the ``_u``/``_v`` buffers through ``out=`` arguments, which ``vmap`` cannot batch,
under ``no_grad`` (a grad-mode switch keeps a forward from being traced).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = ["FusedSpectralNormMixin", "FusedWeightNormMixin"]


class FusedWeightNormMixin(nn.Module):
    """``weight_norm``'s ``v * (g / ||v||)``, the norm over every dim but ``dim`` (over all of
    them for ``dim=-1``, which is what ``weight_norm(dim=None)`` stores), in batched ops."""

    dim: int

    def forward(self, weight_g: Tensor, weight_v: Tensor) -> Tensor:
        if self.dim == -1:
            norm = torch.linalg.vector_norm(weight_v)
        else:
            dim = self.dim % weight_v.dim()  # other negative dims count from the end
            others = [d for d in range(weight_v.dim()) if d != dim]
            norm = torch.linalg.vector_norm(weight_v, dim=others, keepdim=True)
        return weight_v * (weight_g / norm)


class FusedSpectralNormMixin(nn.Module):
    """``spectral_norm``'s power iteration, writing the estimates with ``copy_``: the values of
    torch's ``out=`` writes, per member."""

    _u: Tensor
    _v: Tensor
    eps: float

    def _power_method(self, weight_mat: Tensor, n_power_iterations: int) -> None:
        weight_mat = weight_mat.detach()  # the estimates take no gradient, as under no_grad
        for _ in range(n_power_iterations):
            self._u.copy_(F.normalize(torch.mv(weight_mat, self._v), dim=0, eps=self.eps))
            self._v.copy_(F.normalize(torch.mv(weight_mat.H, self._u), dim=0, eps=self.eps))
