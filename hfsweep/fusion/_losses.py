"""Per-member losses from ``[B, N, ...]`` outputs.

Training an array minimises the sum of the members' losses: member i's parameters only receive
gradient from member i's term, so ``member_losses(out, y).sum().backward()`` gives every member
exactly the gradient of its own mean loss, as if it trained alone.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch.nn.functional as F
from torch import Tensor
from torch.func import vmap

from .._errors import FusionError

__all__ = ["member_losses"]

# Losses whose "mean" reduction is the plain mean of their "none" output.
_ELEMENTWISE_MEAN: frozenset[Callable[..., Tensor]] = frozenset(
    {
        F.mse_loss,
        F.l1_loss,
        F.smooth_l1_loss,
        F.huber_loss,
        F.binary_cross_entropy_with_logits,
        F.soft_margin_loss,
    }
)


def member_losses(
    outputs: Tensor,
    target: Tensor,
    loss_fn: Callable[..., Tensor] = F.cross_entropy,
    *,
    shared_target: bool = True,
    **loss_kwargs: Any,
) -> Tensor:
    """Loss of each member, shape ``[B]``, as ``loss_fn`` with its ``"mean"`` reduction gives it.

    ``outputs`` is what a fused array returned (``[B, N, ...]``). ``target`` is one target shared
    by all members (shaped as for a single model), or with ``shared_target=False`` one target per
    member (``[B, ...]``). ``loss_fn`` is any ``(input, target, **loss_kwargs) -> scalar`` loss
    (``F.cross_entropy``, ``F.mse_loss``, an ``nn.Module`` loss...): cross-entropy with class
    indices and the elementwise torch losses take a fast path, anything else runs per member
    under ``torch.func.vmap``. Both give the per-member value of the "mean" reduction, including
    cross-entropy's ``ignore_index`` rule (the mean is over the targets that are not ignored).
    """
    if outputs.dim() < 2:
        raise FusionError(
            f"outputs must be [B, N, ...] with the member dimension first; got shape "
            f"{tuple(outputs.shape)}"
        )
    size = outputs.shape[0]
    if not shared_target and (target.dim() == 0 or target.shape[0] != size):
        raise FusionError(
            f"with shared_target=False the target needs {size} members in dimension 0; got shape "
            f"{tuple(target.shape)}"
        )
    if size == 1:
        # one member: its loss as it trains alone, on views of the output (squeeze's backward
        # is a view) and with the loss's own mean reduction, which is what every path below
        # computes per member; outputs[0] would give the output's gradient through
        # select_backward, a zero-filled tensor and a copy into it
        one = loss_fn(
            outputs.squeeze(0), target if shared_target else target.squeeze(0), **loss_kwargs
        )
        return one.unsqueeze(0)
    tgt = target.expand(size, *target.shape) if shared_target else target
    if (
        loss_fn is F.cross_entropy
        and not tgt.is_floating_point()
        and loss_kwargs.get("weight") is None
    ):
        ignore = loss_kwargs.get("ignore_index", -100)
        none = F.cross_entropy(
            outputs.flatten(0, 1), tgt.flatten(0, 1), reduction="none", **loss_kwargs
        )
        kept = target != ignore
        counted = kept.sum() if shared_target else kept.reshape(size, -1).sum(1)
        return none.view(size, -1).sum(1) / counted
    if loss_fn in _ELEMENTWISE_MEAN and tgt.shape == outputs.shape and "weight" not in loss_kwargs:
        none = loss_fn(outputs, tgt, reduction="none", **loss_kwargs)
        return none.reshape(size, -1).mean(1)
    return vmap(lambda o, t: loss_fn(o, t, **loss_kwargs), in_dims=(0, 0), randomness="different")(
        outputs, tgt
    )
