"""``offload: none | host | auto``: checking the value and deciding what ``auto`` means.

``auto`` first compares the array's estimated training state with the device's memory budget.
The estimate is the stacked parameters four times over (the parameters, their gradients, and two
optimizer moments: Adam's and AdamW's, the largest state the fused optimizers keep) plus the
buffers. Where the array keeps frozen tensors once (``share_frozen``), the frozen parameters and
the constants a model builds itself (non-persistent buffers) count once for the array
(:func:`frozen_bytes`), not per member. The budget is the ``device_memory`` given; without one, a CUDA device's free memory
(``torch.cuda.mem_get_info``, rounded down to whole 256 MiB: :func:`offload_budget`), and on
the CPU none at all: there the host and the device are one memory, so moving state from one to
the other cannot make room, and ``auto`` stays ``none``.

- Not even one member's estimated state fits: offload (``host``) is the only way to train it,
  nothing is measured.
- Otherwise the estimate leaves out the activations, so what fits is measured: the peak memory
  of arrays on the device, activations included. The whole array fits: it stays on the device
  (``none``). Not one member fits: ``host``. Otherwise B' = the most members that fit
  (1 <= B' < B), and the choice is by throughput (:func:`choose_by_rate`): the profiler
  measures the member-samples/s of the array offloaded at B and of an array of B' on the
  device, and ``auto`` keeps the faster: ``host``, or ``split`` (the B members train as
  ceil(B / B') arrays of at most B', one after another).
  The measuring is :func:`hfsweep.sizing.offloading.profile_offload`'s; this module only decides.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import nn

from .._names import OFFLOAD_MODES, OFFLOAD_STEPS

__all__ = [
    "OFFLOAD_MODES",
    "OFFLOAD_STEPS",
    "OffloadChoice",
    "check_offload",
    "check_offload_step",
    "choose_by_rate",
    "choose_offload",
    "choose_step",
    "fit_size",
    "frozen_bytes",
    "offload_budget",
    "state_bytes",
]


def check_offload(value: object, where: str = "offload") -> str:
    """``value`` if it is one of :data:`OFFLOAD_MODES`, else ``ValueError`` naming ``where``."""
    if not isinstance(value, str) or value not in OFFLOAD_MODES:
        raise ValueError(
            f"{where} must be one of {', '.join(map(repr, OFFLOAD_MODES))}, got {value!r}"
        )
    return value


def check_offload_step(value: object, where: str = "offload_step") -> str:
    """``value`` if it is one of :data:`OFFLOAD_STEPS`, else ``ValueError`` naming ``where``."""
    if not isinstance(value, str) or value not in OFFLOAD_STEPS:
        raise ValueError(
            f"{where} must be one of {', '.join(map(repr, OFFLOAD_STEPS))}, got {value!r}"
        )
    return value


def choose_step(host_seconds: float, device_seconds: float, steps: int) -> tuple[str, str]:
    """``("host" | "device", reason)``: where ``offload_step: auto`` steps an array whose
    training steps took ``host_seconds`` with the host step and ``device_seconds`` with the
    device step (each the fastest of ``steps`` measured steps); a tie goes to the host (the
    default, no optimizer state on the device)."""
    mode = "device" if device_seconds < host_seconds else "host"
    where = "on the device, shard by shard" if mode == "device" else "on the host"
    return mode, (
        f"offload_step: auto steps the optimizer {where}: a training step took "
        f"{host_seconds * 1e3:.2f} ms with the host step and {device_seconds * 1e3:.2f} ms with "
        f"the device step (the fastest of {steps} each, after one of each to warm up)"
    )


def _kept_once(module: nn.Module) -> set[int]:
    """Ids of the tensors an array with ``share_frozen`` keeps once where every member holds
    them identically: frozen parameters and non-persistent buffers."""
    found = {id(p) for p in module.parameters() if not p.requires_grad}
    for m in module.modules():
        found.update(id(b) for n, b in m._buffers.items() if n in m._non_persistent_buffers_set)
    return found


def frozen_bytes(module: nn.Module) -> int:
    """Bytes of the tensors of ``module`` (one member's model) that an array fused with
    ``share_frozen`` keeps once for all members, where the members hold them identically (a
    pretrained backbone): its frozen parameters and its non-persistent buffers."""
    once = _kept_once(module)
    tensors = {id(t): t for t in [*module.parameters(), *module.buffers()] if id(t) in once}
    return sum(t.numel() * t.element_size() for t in tensors.values())


def state_bytes(module: nn.Module, *, share_frozen: bool = False) -> int:
    """Estimated bytes of ``module``'s training state: its parameters four times (weights,
    gradients, two optimizer moments) and its buffers once. With ``share_frozen``, one
    member's part only: the tensors an array keeps once (:func:`frozen_bytes`) are left out."""
    once = _kept_once(module) if share_frozen else set()
    params = sum(p.numel() * p.element_size() for p in module.parameters() if id(p) not in once)
    buffers = sum(b.numel() * b.element_size() for b in module.buffers() if id(b) not in once)
    return 4 * params + buffers


#: a CUDA device's free memory is rounded down to a multiple of this many bytes (256 MiB)
_BUDGET_STEP = 1 << 28


def offload_budget(device: torch.device | str, device_memory: int | None = None) -> int | None:
    """The bytes ``auto`` compares an array's state with on ``device``: ``device_memory`` when
    given, else a CUDA device's free memory rounded down to a multiple of 256 MiB,
    else ``None`` (the CPU: one memory with the host).

    Free memory moves by a few MiB from one run to the next (the CUDA context, another
    process's allocations); rounded down, a resumed or repeated run asks with the same budget,
    so it finds the choice the profile cache keeps under that budget instead of measuring again,
    and the rounding only ever leaves memory unused, never claims more than is free."""
    if device_memory is not None:
        return device_memory
    device = torch.device(device)
    if device.type != "cuda":
        return None
    free, _ = torch.cuda.mem_get_info(device)
    return int(free) - int(free) % _BUDGET_STEP


def choose_offload(
    mode: str,
    *,
    state: int,
    device: torch.device | str,
    device_memory: int | None = None,
) -> tuple[str, str]:
    """``("none" | "host", reason)`` by memory alone, for an array of ``state`` estimated bytes
    (:func:`state_bytes`) trained on ``device`` with ``device_memory`` bytes for it (``None``:
    see the module's rule). The trainer asks this only where no throughput comparison is
    possible (the array fits, or not one member does); :func:`choose_by_rate` decides the rest."""
    mode = check_offload(mode)
    if mode != "auto":
        return mode, f"offload: {mode} was asked for"
    device = torch.device(device)
    budget = offload_budget(device, device_memory)
    if budget is None:
        return "none", (
            f"offload: auto keeps the array on {device}: host and device are one memory there "
            "and no device_memory limit was given"
        )
    if state > budget:
        return "host", (
            f"offload: auto spills the array to the host: its estimated state of {state} bytes "
            f"exceeds the {budget} bytes of device memory"
        )
    return "none", (
        f"offload: auto keeps the array on {device}: its estimated state of {state} bytes fits "
        f"the {budget} bytes of device memory"
    )


@dataclass(frozen=True)
class OffloadChoice:
    """What ``offload: auto`` trains an array of ``size`` members as, and why.

    ``mode`` is ``"none"`` (it fits: on the device as it is), ``"host"`` (offloaded at ``size``)
    or ``"split"`` (arrays of at most ``fit_size`` members on the device, one after another).
    ``fit_size`` is B', the most members whose estimated state fits ``budget_bytes`` (0: not
    one). ``offloaded_rate`` and ``split_rate`` are the measured member-samples/s of the array
    offloaded at ``size`` and of an array of ``fit_size`` on the device; ``None`` where nothing
    was measured (the array fits, or offload is the only way). ``reason``: one sentence for
    the log, with both figures where they were measured."""

    size: int
    fit_size: int
    budget_bytes: int | None
    mode: str
    reason: str
    offloaded_rate: float | None = None
    split_rate: float | None = None

    def __post_init__(self) -> None:
        if self.mode not in ("none", "host", "split"):
            raise ValueError(
                f"OffloadChoice.mode must be 'none', 'host' or 'split', got {self.mode!r}"
            )

    @property
    def arrays(self) -> int:
        """How many arrays the ``size`` members train as: ceil(size / fit_size) for a split,
        else 1."""
        return math.ceil(self.size / self.fit_size) if self.mode == "split" else 1

    def to_dict(self) -> dict[str, Any]:
        """Plain numbers and strings, as the profile cache stores them."""
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> OffloadChoice:
        """The choice :meth:`to_dict` wrote."""
        return cls(**d)


def fit_size(member_state: int, budget: int, shared: int = 0) -> int:
    """B': the most members of ``member_state`` estimated bytes each that fit ``budget`` bytes
    beside the ``shared`` bytes the array keeps once for all of them (:func:`frozen_bytes`)."""
    if member_state < 1:
        raise ValueError(f"member_state must be a number of bytes >= 1, got {member_state!r}")
    return max(budget - shared, 0) // member_state


def choose_by_rate(
    size: int, fit: int, budget: int, offloaded_rate: float, split_rate: float
) -> OffloadChoice:
    """``host`` when the array offloaded at ``size`` trains more member-samples/s
    (``offloaded_rate``) than arrays of ``fit`` members on the device (``split_rate``), else
    ``split``; a tie goes to the split (no transfers, the known path). ``1 <= fit < size``."""
    if not 1 <= fit < size:
        raise ValueError(f"choose_by_rate needs 1 <= fit < size, got fit={fit}, size={size}")
    arrays = math.ceil(size / fit)
    figures = (
        f"measured {offloaded_rate:,.1f} member-samples/s offloaded at B={size} against "
        f"{split_rate:,.1f} for arrays of B'={fit} that fit the {budget} bytes of device memory"
    )
    if offloaded_rate > split_rate:
        mode = "host"
        reason = f"offload: auto spills the array of {size} to the host: {figures}"
    else:
        mode = "split"
        reason = (
            f"offload: auto splits the array of {size} into {arrays} arrays of at most {fit} "
            f"on the device, one after another: {figures}"
        )
    return OffloadChoice(size, fit, budget, mode, reason, offloaded_rate, split_rate)
