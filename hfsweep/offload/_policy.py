"""``offload: none | host | auto``: checking the value and deciding what ``auto`` means.

The rule for ``auto`` is one comparison: offload when the array's estimated training state does
not fit the device's memory budget, else keep it on the device. The estimate is the stacked
parameters four times over (the parameters, their gradients, and two optimizer moments: Adam's
and AdamW's, the largest state the fused optimizers keep) plus the buffers. The budget is the
``device_memory`` given; without one, a CUDA device's free memory (``torch.cuda.mem_get_info``),
and on the CPU none at all: there the host and the device are one memory, so moving state from
one to the other cannot make room, and ``auto`` stays ``none``.

What is not measured (yet): the issue asks ``auto`` to compare the throughput of an offloaded
array with that of splitting it into smaller arrays on the device, from the profiler's
measurements. That needs a device to measure on; this rule only decides by memory.
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["OFFLOAD_MODES", "check_offload", "choose_offload", "state_bytes"]

#: the values ``offload`` takes
OFFLOAD_MODES = ("none", "host", "auto")


def check_offload(value: object, where: str = "offload") -> str:
    """``value`` if it is one of :data:`OFFLOAD_MODES`, else ``ValueError`` naming ``where``."""
    if not isinstance(value, str) or value not in OFFLOAD_MODES:
        raise ValueError(
            f"{where} must be one of {', '.join(map(repr, OFFLOAD_MODES))}, got {value!r}"
        )
    return value


def state_bytes(module: nn.Module) -> int:
    """Estimated bytes of ``module``'s training state: its parameters four times (weights,
    gradients, two optimizer moments) and its buffers once."""
    params = sum(p.numel() * p.element_size() for p in module.parameters())
    buffers = sum(b.numel() * b.element_size() for b in module.buffers())
    return 4 * params + buffers


def choose_offload(
    mode: str,
    *,
    state: int,
    device: torch.device | str,
    device_memory: int | None = None,
) -> tuple[str, str]:
    """``("none" | "host", reason)`` for an array of ``state`` estimated bytes (:func:`state_bytes`)
    trained on ``device`` with ``device_memory`` bytes for it (``None``: see the module's rule)."""
    mode = check_offload(mode)
    if mode != "auto":
        return mode, f"offload: {mode} was asked for"
    device = torch.device(device)
    budget = device_memory
    if budget is None:
        if device.type != "cuda":
            return "none", (
                f"offload: auto keeps the array on {device}: host and device are one memory there "
                "and no device_memory limit was given"
            )
        free, _ = torch.cuda.mem_get_info(device)
        budget = int(free)
    if state > budget:
        return "host", (
            f"offload: auto spills the array to the host: its estimated state of {state} bytes "
            f"exceeds the {budget} bytes of device memory"
        )
    return "none", (
        f"offload: auto keeps the array on {device}: its estimated state of {state} bytes fits "
        f"the {budget} bytes of device memory"
    )
