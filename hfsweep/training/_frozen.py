"""New members' models share their frozen tensors' storage as soon as each is built.

A fine-tuning array's members are built one by one from the task's ``model(config)``; each
builds its own copy of the pretrained backbone. The fused array keeps one copy of a frozen
tensor that every member holds identically (``fusion.share_frozen``), but until the models are
fused every member's backbone would be alive at once: B backbones at the array's build, the
very memory that sharing saves while training. :func:`share_frozen_storage` lets each new model
point its frozen tensors at the first model's storage when their values are equal (checked with
``torch.equal``, as the fusion checks them), so its own copy is freed right away and the build
holds one backbone plus B trainable parts. Only storage is shared, never the tensor objects: the
models stay separate modules (their own ``Parameter`` objects, which fusion maps one by one), and
nothing writes a member model's frozen tensors before it is fused (fusion copies what it stacks).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

__all__: list[str] = []


def _frozen(model: nn.Module) -> dict[str, Tensor]:
    """``model``'s parameters that do not require grad and its buffers, by name."""
    tensors: dict[str, Tensor] = {
        n: p for n, p in model.named_parameters(remove_duplicate=False) if not p.requires_grad
    }
    tensors.update(model.named_buffers(remove_duplicate=False))
    return tensors


def share_frozen_storage(model: nn.Module, reference: nn.Module) -> int:
    """Point each frozen tensor of ``model`` (a parameter that does not require grad, or a
    buffer) at the storage of ``reference``'s tensor of the same name when the two are equal in
    shape, dtype, device and values; the bytes of ``model``'s own copies now unreferenced by
    it. Tensors that differ, or that only one of the models has, are left as they are."""
    theirs = _frozen(reference)
    saved = 0
    for name, mine in _frozen(model).items():
        other = theirs.get(name)
        if (
            other is None
            or mine is other
            or mine.shape != other.shape
            or mine.dtype != other.dtype
            or mine.device != other.device
            or mine.untyped_storage().data_ptr() == other.untyped_storage().data_ptr()
            or not torch.equal(mine, other)
        ):
            continue
        saved += mine.numel() * mine.element_size()
        mine.data = other.data
    return saved
