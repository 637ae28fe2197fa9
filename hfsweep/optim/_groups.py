"""Param groups and per-member hyperparameters for :class:`~._base.FusedOptimizer`: the groups
built from what a user passes (a fused array, its parameters, or groups), a hyperparameter given
once or per member as its ``[B]`` float64 values, and the range check that names the first
member out of range."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any, cast

import torch
from torch import Tensor

from .._checks import is_number
from ..fusion import FusedArray

__all__ = ["HyperParameter", "ParamsT", "check_range", "member_values", "param_groups"]

#: a hyperparameter as given: one number for all members, or one per member
HyperParameter = float | int | Sequence[float] | Tensor
#: what a fused optimizer takes: a fused array, its parameters, or param groups of either
ParamsT = FusedArray | Iterable[Tensor] | Iterable[dict[str, Any]]


def member_values(name: str, value: Any, size: int, device: torch.device, group: int) -> Tensor:
    """``value`` (one number, or one per member: a sequence or a tensor) as a ``[size]``
    float64 tensor on ``device``; ``ValueError`` naming ``name`` and its param group when it is
    neither, has another count, or holds NaN."""
    where = f"{name} (param group {group})"
    if isinstance(value, Tensor):
        values = value.detach().to(torch.float64).flatten()
        if value.dim() == 0:
            values = values.expand(size)
    elif is_number(value):
        values = torch.full((size,), float(value), dtype=torch.float64)
    else:
        try:
            values = torch.tensor([float(v) for v in value], dtype=torch.float64)
        except (TypeError, ValueError) as exc:
            raise ValueError(
                f"{where} must be a number or one number per member, got {value!r}"
            ) from exc
    if values.numel() != size:
        raise ValueError(f"{where} has {values.numel()} values for {size} members")
    if torch.isnan(values).any():
        bad = int(torch.isnan(values).nonzero()[0])
        raise ValueError(f"{where}[{bad}] is NaN; give a number")
    return values.to(device).clone()


def param_groups(params: ParamsT) -> tuple[list[dict[str, Any]], int]:
    """The param groups of ``params`` (a fused array, its parameters, or groups of either) and
    their member count; ``ValueError`` for an empty list, a 0-d tensor, or parameters of arrays
    of different sizes."""
    if isinstance(params, FusedArray):
        groups: list[dict[str, Any]] = [
            {"params": [p for p in params.parameters() if p.requires_grad]}
        ]
    else:
        items = list(params)
        if not items:
            raise ValueError("optimizer got an empty parameter list")
        if all(isinstance(x, dict) for x in items):
            groups = [dict(cast(dict[str, Any], x)) for x in items]
            for g in groups:
                g["params"] = list(
                    g["params"].parameters() if isinstance(g["params"], FusedArray) else g["params"]
                )
        else:
            groups = [{"params": items}]
    sizes = {int(p.shape[0]) for g in groups for p in g["params"] if p.dim() > 0}
    if any(p.dim() == 0 for g in groups for p in g["params"]):
        raise ValueError("fused optimizers need stacked [B, ...] parameters; got a 0-d tensor")
    if len(sizes) != 1:
        raise ValueError(
            f"parameters disagree on the member count (dimension 0): {sorted(sizes)}; pass the "
            "parameters of one fused array"
        )
    return groups, sizes.pop()


def check_range(
    group: dict[str, Any],
    name: str,
    index: int,
    low: float,
    high: float | None = None,
    low_open: bool = False,
    high_open: bool = False,
) -> None:
    """Raise ``ValueError`` naming the first member whose value is outside the range."""
    values = group[name]
    bad = values < low if not low_open else values <= low
    if high is not None:
        bad = bad | (values >= high if high_open else values > high)
    if bool(bad.any()):
        i = int(bad.nonzero()[0])
        lo = "(" if low_open else "["
        hi = ")" if high_open else "]"
        bounds = f"{lo}{low}, {high if high is not None else 'inf'}{hi}"
        raise ValueError(
            f"{name}[{i}] = {float(values[i])} (param group {index}) is outside {bounds}"
        )
