"""Shared frozen state: tensors every member holds identically and no member trains, kept once.

A fine-tuning array (a frozen pretrained backbone and a trainable head or adapter per member) would
otherwise hold B copies of the backbone. :func:`shareable` decides, tensor by tensor, whether one
copy serves all members: a buffer, or a parameter with ``requires_grad=False``, whose values are
equal in every member (``torch.equal``, checked, not assumed). Such a tensor lives unstacked in the
template as a buffer (a frozen parameter too, so ``array.parameters()`` and the optimizers never
see it), and the vmapped forward takes it with ``in_dims=None``.

Buffers that a forward writes per member cannot be shared: BatchNorm running statistics (and a
spectral norm's power-iteration vectors) in training mode. They are shared only while their module
is in eval mode; :func:`writes_buffers` tells the array when a module has been switched to
training, and the array then gives each member its own copy again (:meth:`FusedArray._unshare`).
Other buffers are shared only when they are non-persistent (constants the model builds itself):
a persistent buffer may be a running average that forward updates from each member's data.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor, nn
from torch.nn.utils.parametrizations import _SpectralNorm

from ._state import StackedSlot

__all__ = ["same_values", "shareable", "unshare_slot", "writes_buffers"]


#: modules whose buffers are known and written only in training mode
_WRITERS = (nn.modules.batchnorm._BatchNorm, _SpectralNorm)


def writes_buffers(module: nn.Module) -> bool:
    """Whether ``module``'s forward updates its buffers from its input (so per member): a
    BatchNorm tracking running statistics in training mode, a spectral norm in training mode."""
    if isinstance(module, nn.modules.batchnorm._BatchNorm):
        return module.training and module.track_running_stats
    return isinstance(module, _SpectralNorm) and module.training


def shareable(
    tensors: Sequence[Tensor], is_param: bool, owners: Sequence[tuple[nn.Module, str]]
) -> bool:
    """Whether one copy of ``tensors`` (one per member, one stacked slot) can serve every member.

    ``owners`` are member 0's ``(module, attribute)`` places of the tensor (several when it is
    tied). A parameter that requires grad is trained, so it is never shared. A buffer is shared
    only where it is known not to be written per member: BatchNorm statistics (and a spectral
    norm's vectors) while their module is in eval mode, and non-persistent buffers (constants a
    model builds itself, such as position ids, causal masks, rotary frequencies). A persistent
    buffer of another module may be a running average its forward updates, so it stays per
    member. What passes is shared when all members' values are equal.
    """
    first = tensors[0]
    if is_param and first.requires_grad:
        return False
    if not is_param:
        for module, name in owners:
            if isinstance(module, _WRITERS):
                if writes_buffers(module):
                    return False
            elif name not in module._non_persistent_buffers_set:
                return False
    # a NaN anywhere makes torch.equal False: such a tensor stays per member (safe)
    return all(torch.equal(first, t) for t in tensors[1:])


def same_values(shared: Tensor, value: Any) -> bool:
    """Whether ``value`` (a member's tensor, any device or dtype) equals a shared tensor as the
    array would store it."""
    if not isinstance(value, Tensor) or value.shape != shared.shape:
        return False
    return bool(torch.equal(shared, value.to(device=shared.device, dtype=shared.dtype)))


def unshare_slot(slot: StackedSlot, template: nn.Module, prototype: nn.Module, size: int) -> None:
    """Stack ``slot``'s shared tensor ``size`` times and store it in ``template`` as it would be
    without sharing: a parameter (``requires_grad=False``) back in its module's parameters, in
    the module's order, or a stacked buffer. ``slot`` then describes the stacked tensor."""
    assert slot.shared and slot.owners is not None
    owner, name = slot.places[0]
    value = owner[name]
    with torch.no_grad():
        stacked: Tensor = value.unsqueeze(0).expand(size, *value.shape).clone()
    if slot.is_param:
        stacked = nn.Parameter(stacked, requires_grad=False)
    places: list[tuple[dict[str, Any], str]] = []
    for path, attr in slot.owners:
        module = template.get_submodule(path)
        if not slot.is_param:
            module._buffers[attr] = stacked
            places.append((module._buffers, attr))
            continue
        del module._buffers[attr]
        params: dict[str, Any] = dict(module._parameters)
        params[attr] = stacked
        order = list(prototype.get_submodule(path)._parameters)
        rank = {k: r for r, k in enumerate(order)}
        module._parameters.clear()  # the same dict (places refer to it), in the model's order
        for k in sorted(params, key=lambda k: rank.get(k, len(order))):
            module._parameters[k] = params[k]
        places.append((module._parameters, attr))
    slot.places[:] = places
    slot.shared = False
