"""Assembling a fused array from B models (:func:`build_array`, behind :func:`hfsweep.fuse`):
check them, stack their state into a template of fused layers, and give each member its dropout
streams."""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from ._array import FusedArray
from ._check import check_compatible
from ._peft import lora_slots
from ._plan import dropout_feature_dims, stream_attribute, unsupported_reason
from ._random import FunctionalStream, StreamFloat
from ._shared import shareable
from ._state import StackedSlot, _owners, _places
from ._streams import (
    _ATTENTION_SALTS,
    _STREAM_LIMIT,
    _peeked_seeds,
    _stream_probability,
    _update_attention_masks,
)


def build_array(
    models: Sequence[nn.Module],
    dropout: Sequence[float] | Mapping[str, Sequence[float]] | None,
    trace: bool,
    share_frozen: bool = True,
) -> FusedArray:
    """Check ``models``, stack their state and assemble the array (see :func:`hfsweep.fuse`)."""
    from ._plan import fused_class
    from ._random import draws_functionally

    models = list(models)
    check_compatible(models, unsupported_reason)
    ref = models[0]
    size = len(models)

    # Copies of member 0's tree whose tensors are meta placeholders: no data is duplicated.
    def meta_copy() -> nn.Module:
        memo: dict[int, Any] = {}
        for t in [*ref.parameters(), *ref.buffers()]:
            empty = torch.empty_like(t, device="meta")
            memo[id(t)] = (
                nn.Parameter(empty, requires_grad=t.requires_grad)
                if isinstance(t, nn.Parameter)
                else empty
            )
        return copy.deepcopy(ref, memo)

    prototype = meta_copy()
    template = meta_copy()
    dropout_paths: list[str] = []
    stream_attributes: list[str] = []
    for path, module in template.named_modules():
        dims = dropout_feature_dims(module)
        attr = stream_attribute(module)
        cls = fused_class(module, size)
        if cls is not None:
            module.__class__ = cls
        if attr is not None:
            module._hfsweep_feature_dims = dims or 0
            # the layer's own stream within a member: its index among the dropout layers, or
            # among the attention layers in a range of their own (so adding attention streams
            # left the dropout layers' masks as they were)
            offset = _ATTENTION_SALTS if attr == "dropout" else 0
            module._hfsweep_salt = stream_attributes.count(attr) + offset
            dropout_paths.append(path)
            stream_attributes.append(attr)

    member_places = [_places(m) for m in models]
    template_places = _places(template)
    template_owners = _owners(template)
    member0_owners = _owners(ref)
    template_paths = {id(m): path for path, m in template.named_modules(remove_duplicate=False)}
    slots: list[StackedSlot] = []
    with torch.no_grad():
        for name, places in template_places.items():
            owner0, attr0 = member_places[0][name][0]
            first = owner0[attr0]
            tensors = [mp[name][0][0][mp[name][0][1]].detach() for mp in member_places]
            is_param = isinstance(first, nn.Parameter)
            if share_frozen and shareable([first, *tensors[1:]], is_param, member0_owners[name]):
                # one copy for every member, as a buffer of the template (see _shared)
                value: Tensor = tensors[0].clone()
                owners = template_owners[name]
                for module, attr in owners:
                    module._parameters.pop(attr, None)
                    module._buffers[attr] = value
                slots.append(
                    StackedSlot(
                        name=name,
                        is_param=is_param,
                        places=[(m._buffers, attr) for m, attr in owners],
                        shared=True,
                        owners=[(template_paths[id(m)], attr) for m, attr in owners],
                    )
                )
                continue
            stacked = torch.stack(tensors)
            value = (
                nn.Parameter(stacked, requires_grad=first.requires_grad) if is_param else stacked
            )
            for owner, attr in places:
                owner[attr] = value
            slots.append(StackedSlot(name=name, is_param=is_param, places=places))

    device = slots[0].places[0][0][slots[0].places[0][1]].device if slots else torch.device("cpu")
    # One default dropout seed per member from torch's global generator (on the CPU, so the
    # same torch.manual_seed gives the same streams on every device); drawn only when needed,
    # so arrays without dropout (attention layers whose dropout is 0 included) leave the
    # generator alone.
    probabilities = {
        path: [_stream_probability(m.get_submodule(path), attr, path) for m in models]
        for path, attr in zip(dropout_paths, stream_attributes, strict=True)
    }
    draws = any(
        attr == "p" or any(p > 0 for p in probabilities[path])
        for path, attr in zip(dropout_paths, stream_attributes, strict=True)
    )
    functional = draws_functionally(ref)
    seeds = (
        torch.randint(0, _STREAM_LIMIT - 1, (size,))
        if draws
        else _peeked_seeds(size)
        if functional
        else torch.zeros(size, dtype=torch.int64)
    )
    for path, attr in zip(dropout_paths, stream_attributes, strict=True):
        module = template.get_submodule(path)
        ps = probabilities[path]
        settings = {
            "member_p": torch.tensor(ps, dtype=torch.float32, device=device),
            "member_seed": seeds.to(device, copy=True),  # one tensor per layer, never shared
            "member_calls": torch.zeros(size, dtype=torch.int64, device=device),
        }
        for name, value in settings.items():
            module.register_buffer(name, value)
            slots.append(
                StackedSlot(f"{path}.{name}", False, [(module._buffers, name)], setting=True)
            )
        if attr == "dropout":
            _update_attention_masks(module)
        else:  # forward code reading the layer's p for a functional dropout gets its stream
            module.__dict__["p"] = StreamFloat(ps[0], module)
    slots.extend(lora_slots(template, models, device))  # peft: per-member lora_alpha
    stream = None
    if functional:
        stream = FunctionalStream(seeds.to(device, copy=True))
        for name in ("member_seed", "member_calls"):
            slots.append(
                StackedSlot(f"<functional>.{name}", False, [(stream._buffers, name)], setting=True)
            )
    array = FusedArray(template, prototype, size, slots, trace, stream)
    if dropout is not None:
        array.set_dropout(dropout)
    return array
