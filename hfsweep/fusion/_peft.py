"""peft's LoRA in a fused array: ``lora_alpha`` and ``lora_dropout`` per member.

A LoRA layer computes ``base(x) + lora_B(lora_A(dropout(x))) * scaling[adapter]``, with
``scaling = lora_alpha / r`` a Python float in a dict. A float cannot vary under ``vmap``, so the
array keeps each member's scaling in a ``[B]`` setting buffer (``hfsweep_scaling_<adapter>``)
and, for the duration of a call, puts the member's value into the layer's ``scaling`` dict (a
second place of that slot, see :class:`~hfsweep.fusion._state.StackedSlot`). ``lora_dropout`` is an
``nn.Dropout`` per adapter, which the array already gives a per-member probability.

So members may differ in ``lora_alpha`` and ``lora_dropout`` (their configs are compared without
those two fields); rank, target modules and everything else are the compatibility key.
``member(i)`` writes member ``i``'s ``lora_alpha``, ``scaling`` and ``lora_dropout`` back into
its layers and its ``peft_config``, so its ``save_pretrained`` writes that member's adapter.
peft is imported only when a model already uses it.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any, cast

import torch
from torch import nn

from ._state import StackedSlot

__all__ = [
    "PER_MEMBER_CONFIG_FIELDS",
    "configs_agree",
    "is_lora_layer",
    "is_peft_configs",
    "load_member_lora",
    "lora_slots",
    "set_member_lora",
]

#: fields of a peft config that may differ between members of one array
PER_MEMBER_CONFIG_FIELDS = frozenset({"lora_alpha", "lora_dropout"})
_SCALING = "hfsweep_scaling_"
_ALPHA = "hfsweep_lora_alpha_"


def _lora_layer_class() -> type | None:
    if "peft" not in sys.modules:  # a model that uses peft has imported it
        return None
    try:
        from peft.tuners.lora import LoraLayer
    except ImportError:  # pragma: no cover - a peft without LoRA
        return None
    return LoraLayer


def is_lora_layer(module: nn.Module) -> bool:
    """Whether ``module`` is one of peft's LoRA layers (its ``scaling`` may differ per member)."""
    cls = _lora_layer_class()
    return cls is not None and isinstance(module, cls)


def is_peft_configs(value: Any) -> bool:
    """A peft config, or a dict of them (``model.peft_config``)."""
    if "peft" not in sys.modules:
        return False
    from peft import PeftConfig

    if isinstance(value, dict):
        return bool(value) and all(isinstance(v, PeftConfig) for v in value.values())
    return isinstance(value, PeftConfig)


def configs_agree(a: Any, b: Any) -> bool:
    """Two peft configs (or dicts of them) equal apart from the per-member fields."""

    def fields(config: Any) -> dict[str, Any]:
        return {k: v for k, v in config.to_dict().items() if k not in PER_MEMBER_CONFIG_FIELDS}

    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(configs_agree(a[k], b[k]) for k in a)
    if type(a) is not type(b):
        return False
    return fields(a) == fields(b)


def lora_slots(
    template: nn.Module, models: Sequence[nn.Module], device: torch.device
) -> list[StackedSlot]:
    """Per-member ``scaling`` and ``lora_alpha`` of every LoRA layer of ``template`` as setting
    buffers; the ``scaling`` buffer's slot also names the layer's ``scaling`` dict entry, so a
    call puts the member's value there."""
    slots: list[StackedSlot] = []
    for path, module in template.named_modules():
        if not is_lora_layer(module):
            continue
        layers: list[Any] = [m.get_submodule(path) for m in models]
        lora: Any = module
        for adapter in list(lora.scaling):
            scaling = torch.tensor(
                [float(m.scaling[adapter]) for m in layers], dtype=torch.float64, device=device
            )
            alpha = torch.tensor(
                [float(m.lora_alpha[adapter]) for m in layers], dtype=torch.float64, device=device
            )
            module.register_buffer(_SCALING + adapter, scaling)
            module.register_buffer(_ALPHA + adapter, alpha)
            prefix = f"{path}." if path else ""
            slots.append(
                StackedSlot(
                    f"{prefix}{_SCALING}{adapter}",
                    False,
                    [(module._buffers, _SCALING + adapter), (lora.scaling, adapter)],
                    setting=True,
                )
            )
            slots.append(
                StackedSlot(
                    f"{prefix}{_ALPHA}{adapter}",
                    False,
                    [(module._buffers, _ALPHA + adapter)],
                    setting=True,
                )
            )
    return slots


def set_member_lora(template: nn.Module, i: int, model: nn.Module) -> None:
    """Write member ``i``'s ``scaling``/``lora_alpha`` (from ``template``'s buffers) into the
    LoRA layers of ``model`` (``member(i)``), and its ``lora_alpha``/``lora_dropout`` into
    ``model``'s peft configs, so that ``save_pretrained`` writes member ``i``'s adapter."""
    alphas: dict[str, Any] = {}
    dropouts: dict[str, float] = {}
    for path, module in template.named_modules():
        if not is_lora_layer(module):
            continue
        layer: Any = model.get_submodule(path)
        for adapter in list(cast(Any, module).scaling):
            layer.scaling[adapter] = float(module.get_buffer(_SCALING + adapter)[i])
            alpha = float(module.get_buffer(_ALPHA + adapter)[i])
            layer.lora_alpha[adapter] = int(alpha) if alpha.is_integer() else alpha
            alphas.setdefault(adapter, layer.lora_alpha[adapter])
            dropout = layer.lora_dropout[adapter]
            dropouts.setdefault(adapter, float(getattr(dropout, "p", 0.0)))
    for module in model.modules():
        configs = getattr(module, "peft_config", None)
        if not is_peft_configs(configs) or not isinstance(configs, dict):
            continue
        for adapter, config in configs.items():
            if adapter in alphas and hasattr(config, "lora_alpha"):
                config.lora_alpha = alphas[adapter]
                config.lora_dropout = dropouts[adapter]


def load_member_lora(template: nn.Module, i: int, model: nn.Module) -> None:
    """Slot ``i``'s ``scaling``/``lora_alpha`` from the LoRA layers of ``model`` (a refill)."""
    for path, module in template.named_modules():
        if not is_lora_layer(module):
            continue
        layer: Any = model.get_submodule(path)
        for adapter in list(cast(Any, module).scaling):
            module.get_buffer(_SCALING + adapter)[i] = float(layer.scaling[adapter])
            module.get_buffer(_ALPHA + adapter)[i] = float(layer.lora_alpha[adapter])
