"""What the traced graph's rewrites ask of a node: one predicate shared by the passes."""

from __future__ import annotations

import torch
from torch import fx

from .._compat import OpOverload

__all__ = ["pointwise"]


def pointwise(node: fx.Node) -> bool:
    """An elementwise ATen op without keyword arguments, deterministic and with no effect
    besides its result: the same values whatever the layout of its operands, so a rewrite may
    move a permute or a transpose across it."""
    target = node.target
    if node.op != "call_function" or not isinstance(target, OpOverload) or node.kwargs:
        return False
    if torch.Tag.pointwise not in target.tags or target._schema.is_mutable:
        return False
    return torch.Tag.nondeterministic_seeded not in target.tags
