"""Per-member gradient clipping: each member's gradients are clipped by its own total norm."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch
from torch import Tensor

from ..fusion import FusedArray

__all__ = ["clip_grad_norm_", "clip_grad_value_"]


def _grads(parameters: FusedArray | Iterable[Tensor]) -> list[Tensor]:
    params = parameters.parameters() if isinstance(parameters, FusedArray) else parameters
    return [p.grad for p in params if p.grad is not None]


def _per_member(
    value: float | Sequence[float] | Tensor, size: int, like: Tensor, name: str
) -> Tensor:
    t = torch.as_tensor(value, dtype=torch.float64).flatten()
    if t.numel() == 1:
        t = t.expand(size)
    if t.numel() != size:
        raise ValueError(f"{name} has {t.numel()} values for {size} members")
    return t.to(device=like.device)


def clip_grad_norm_(
    parameters: FusedArray | Iterable[Tensor],
    max_norm: float | Sequence[float] | Tensor,
    norm_type: float = 2.0,
    error_if_nonfinite: bool = False,
) -> Tensor:
    """``torch.nn.utils.clip_grad_norm_`` for each member: returns the ``[B]`` total norms.

    Member i's gradients (slice i of every stacked gradient) are scaled by
    ``min(max_norm[i] / (norm_i + 1e-6), 1)``, where ``norm_i`` is the ``norm_type`` norm of the
    per-parameter norms, as torch computes it for ``array.member(i)``. ``max_norm`` is one value for
    all members or one per member. A member with a non-finite norm is left for the optimizer to
    isolate, unless ``error_if_nonfinite`` asks for an error.
    """
    grads = _grads(parameters)
    if not grads:
        return torch.zeros(0)
    size = grads[0].shape[0]
    norm_type = float(norm_type)
    norms = torch.stack(
        [torch.linalg.vector_norm(g.reshape(len(g), -1), norm_type, dim=1) for g in grads]
    )  # [P, B]
    total = torch.linalg.vector_norm(norms, norm_type, dim=0)  # [B]
    if error_if_nonfinite and not bool(torch.isfinite(total).all()):
        bad = (~torch.isfinite(total)).nonzero().flatten().tolist()
        raise RuntimeError(f"the total gradient norm of members {bad} is not finite")
    limit = _per_member(max_norm, size, total, "max_norm").to(total.dtype)
    coef = torch.clamp(limit / (total + 1e-6), max=1.0)
    torch._foreach_mul_(grads, _member_views(coef, grads))
    return total


def _member_views(values: Tensor, like: list[Tensor]) -> list[Tensor]:
    """``[B]`` values as ``[B, 1, ...]`` in each tensor's dtype, one view per (dims, dtype)."""
    views: dict[tuple[int, torch.dtype], Tensor] = {}
    out = []
    for g in like:
        key = (g.dim(), g.dtype)
        view = views.get(key)
        if view is None:
            view = views[key] = values.to(g.dtype).view(len(values), *([1] * (g.dim() - 1)))
        out.append(view)
    return out


def clip_grad_value_(
    parameters: FusedArray | Iterable[Tensor], clip_value: float | Sequence[float] | Tensor
) -> None:
    """``torch.nn.utils.clip_grad_value_`` with one ``clip_value`` per member (or one for all)."""
    grads = _grads(parameters)
    if not grads:
        return
    size = grads[0].shape[0]
    limit = _per_member(clip_value, size, grads[0], "clip_value")
    for g in grads:
        bound = limit.to(g.dtype).view(size, *([1] * (g.dim() - 1)))
        torch.clamp(g, min=-bound, max=bound, out=g)
