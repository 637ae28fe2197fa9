"""A fused array's stacked tensors and where they live: :class:`StackedSlot` (one stacked tensor and
every place in the template that refers to it), and the maps from a model's parameters and buffers
to the modules that hold them, which a member's ``state_dict`` and ``load_member`` go through."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from torch import Tensor, nn


@dataclass
class StackedSlot:
    """One stacked tensor and every place in the template that refers to it (tied weights)."""

    name: str
    is_param: bool
    places: list[tuple[dict[str, Any], str]]
    setting: bool = False  # a per-member setting of hfsweep's (dropout p), not model state
    #: one unstacked tensor for all members (identical in every member, not trained; see
    #: ``_shared``); it lives in its modules' ``_buffers`` even when it was a parameter
    shared: bool = False
    #: (submodule path, attribute) of every place holding the tensor, for a shared slot: where
    #: it goes back to, as a stacked parameter or buffer, when a member needs its own copy
    owners: list[tuple[str, str]] | None = None


def _owners(model: nn.Module) -> dict[str, list[tuple[nn.Module, str]]]:
    """Every (module, attribute) holding each parameter/buffer, keyed by the tensor's first name.

    A tensor tied into several modules (shared embedding and output weights) appears once, with
    all the places that hold it.
    """
    first: dict[int, str] = {}
    out: dict[str, list[tuple[nn.Module, str]]] = {}
    for path, module in model.named_modules(remove_duplicate=False):
        for store in (module._parameters, module._buffers):
            for name, t in store.items():
                if t is None:
                    continue
                full = f"{path}.{name}" if path else name
                key = first.setdefault(id(t), full)
                out.setdefault(key, []).append((module, name))
    return out


def _plan_state_dict(
    prototype: nn.Module, slots: list[StackedSlot]
) -> tuple[list[tuple[str, int]], Any] | None:
    """Which stacked tensor each entry of a member's ``state_dict`` is, from the prototype's
    ``state_dict`` on the meta device; ``None`` if some entry is not one of them (extra state,
    a hook that makes new values) or the prototype's ``state_dict`` fails on meta tensors."""
    owners = _owners(prototype)
    index: dict[int, int] = {}
    for position, slot in enumerate(slots):
        if slot.setting:
            continue
        for module, name in owners.get(slot.name, []):
            index[id(getattr(module, name))] = position
    try:
        entries = prototype.state_dict(keep_vars=True)
    except Exception:  # a state_dict hook that cannot run on meta tensors
        return None
    keys: list[tuple[str, int]] = []
    for key, value in entries.items():
        j: int | None = index.get(id(value)) if isinstance(value, Tensor) else None
        if j is None:
            return None
        keys.append((key, j))
    return keys, getattr(entries, "_metadata", None)


def _with_metadata(values: dict[str, Any], like: Any) -> dict[str, Any]:
    """``values`` as an ordered state dict carrying ``like``'s ``_metadata``."""
    out = OrderedDict(values)
    out._metadata = getattr(like, "_metadata", None)  # type: ignore[attr-defined]
    return out


def _places(model: nn.Module) -> dict[str, list[tuple[dict[str, Any], str]]]:
    """Like :func:`_owners`, with the module's parameter or buffer dict in place of the module."""
    return {
        key: [(m._parameters if name in m._parameters else m._buffers, name) for m, name in owners]
        for key, owners in _owners(model).items()
    }
