"""A gradient scaler for mixed precision with one loss scale per member.

torch's ``GradScaler`` keeps one scale for the whole model: in an array, one member's overflow
would skip every member's step and shrink everyone's scale. Here member i has its own scale and
growth tracker, and an overflow in member i skips only member i's step and backs off only its
scale, exactly as ``torch.amp.GradScaler`` does for ``array.member(i)`` alone.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from ._base import FusedOptimizer
from ._clip import _member_views

__all__ = ["GradScaler"]


class GradScaler:
    """Per-member ``torch.amp.GradScaler``: ``scale`` losses, ``step`` the optimizer, ``update``.

    Usage (``losses`` is the ``[B]`` output of ``hs.member_losses``)::

        scaler = hs.optim.GradScaler(array.size)
        scaler.scale(losses).sum().backward()
        scaler.step(opt)      # unscales; members whose gradients overflowed skip this step
        scaler.update()       # per member: back off after an overflow, grow after a quiet run
    """

    def __init__(
        self,
        size: int,
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
        enabled: bool = True,
        device: str | torch.device = "cpu",
    ) -> None:
        if growth_factor <= 1.0 or not 0.0 < backoff_factor < 1.0 or growth_interval < 1:
            raise ValueError(
                "GradScaler needs growth_factor > 1, 0 < backoff_factor < 1 and "
                f"growth_interval >= 1; got {growth_factor}, {backoff_factor}, {growth_interval}"
            )
        self.size = size
        self.enabled = enabled
        self.growth_factor = growth_factor
        self.backoff_factor = backoff_factor
        self.growth_interval = growth_interval
        self._init_scale = init_scale
        self._scale = torch.full((size,), init_scale, dtype=torch.float32, device=device)
        self._growth_tracker = torch.zeros(size, dtype=torch.int32, device=device)
        self._found_inf: Tensor | None = None

    def get_scale(self) -> Tensor:
        """The current ``[B]`` loss scales."""
        return self._scale.clone()

    def scale(self, losses: Tensor) -> Tensor:
        """Multiply member i's loss (``losses[i]``, or ``losses[i, ...]``) by its scale."""
        if not self.enabled:
            return losses
        if losses.dim() == 0 or losses.shape[0] != self.size:
            raise ValueError(
                f"scale() takes per-member losses with {self.size} members in dimension 0, got "
                f"shape {tuple(losses.shape)}; sum after scaling"
            )
        self._scale = self._scale.to(losses.device)
        self._growth_tracker = self._growth_tracker.to(losses.device)
        view = self._scale.view(self.size, *([1] * (losses.dim() - 1)))
        return losses * view.to(losses.dtype)

    def unscale_(self, optimizer: FusedOptimizer) -> None:
        """Divide member i's gradients by its scale and note which members overflowed (an inf
        or NaN in their gradients, seen in one sum per parameter as the optimizer's check)."""
        if not self.enabled or self._found_inf is not None:
            return
        inv = self._scale.double().reciprocal().float()
        grads = [p.grad for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
        if grads:
            torch._foreach_mul_(grads, _member_views(inv, grads))
        # x * 0 is 0 for finite x and NaN for inf and NaN; a member's sums hold them if its
        # gradients do (the optimizer's check, one reduction per parameter)
        total = optimizer._nonfinite_total().to(self._scale.device)
        self._found_inf = total.mul(0).ne(0)

    def step(self, optimizer: FusedOptimizer, *args: Any, **kwargs: Any) -> Any:
        """Unscale (if not done yet) and step every member whose gradients are finite."""
        if not self.enabled:
            return optimizer.step(*args, **kwargs)
        self.unscale_(optimizer)
        assert self._found_inf is not None
        return optimizer.step(*args, skip=self._found_inf, **kwargs)

    def update(self) -> None:
        """Per member: after an overflow multiply the scale by ``backoff_factor`` and restart the
        growth count; after ``growth_interval`` overflow-free steps multiply by ``growth_factor``."""
        if not self.enabled:
            return
        if self._found_inf is None:
            raise RuntimeError("update() needs a step() (or unscale_()) since the last update()")
        found = self._found_inf
        tracker = torch.where(found, 0, self._growth_tracker + 1)
        grow = tracker >= self.growth_interval
        scale = torch.where(found, self._scale * self.backoff_factor, self._scale)
        self._scale = torch.where(grow, scale * self.growth_factor, scale)
        self._growth_tracker = torch.where(grow, 0, tracker).to(torch.int32)
        self._found_inf = None

    def reset_member(self, i: int) -> None:
        """A new trial in slot ``i`` starts from the initial scale."""
        self._scale[i] = self._init_scale
        self._growth_tracker[i] = 0

    def state_dict(self) -> dict[str, Any]:
        """The per-member scales, growth trackers and growth settings, for a checkpoint."""
        return {
            "scale": self._scale.clone(),
            "growth_tracker": self._growth_tracker.clone(),
            "growth_factor": self.growth_factor,
            "backoff_factor": self.backoff_factor,
            "growth_interval": self.growth_interval,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned."""
        self._scale = state["scale"].clone()
        self._growth_tracker = state["growth_tracker"].clone()
        self.growth_factor = state["growth_factor"]
        self.backoff_factor = state["backoff_factor"]
        self.growth_interval = state["growth_interval"]
