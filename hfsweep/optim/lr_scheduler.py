"""LR schedulers with per-member arguments and per-member progress.

Same names and arguments as ``torch.optim.lr_scheduler``; every numeric argument may be one value
for all members or one per member (``T_max=[10, 20, 40]``). Each member has its own epoch count:
an inactive member's schedule does not advance, and ``optimizer.reset_member(i, lr=...)`` restarts
member i's schedule from its new base learning rate (every scheduler attached to the optimizer
follows). Learning rates are computed per member in Python floats from closed forms, the same
double-precision arithmetic torch uses, and written into the optimizer's ``[B]`` ``lr`` tensors.

A step reads nothing back from the device: the scheduler keeps a host copy of the values it writes
(re-read only after the optimizer's hyperparameters or active members were changed from the host,
as at a slot refill) and writes each ``[B]`` tensor with one copy, so stepping a schedule never
waits for the accelerator.

``member_state_dict(i)`` gives member i's progress in the format of the torch scheduler's
``state_dict`` (it loads into that scheduler, which then continues with the same learning rates);
``load_member_state_dict(i, sd)`` reads one back.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from ._base import FusedOptimizer
from ._lr_base import FusedLRScheduler, _per_member

__all__ = [
    "ConstantLR",
    "CosineAnnealingLR",
    "CosineAnnealingWarmRestarts",
    "ExponentialLR",
    "FusedLRScheduler",
    "LinearLR",
    "MultiStepLR",
    "OneCycleLR",
    "ReduceLROnPlateau",
    "SequentialLR",
    "StepLR",
]


class StepLR(FusedLRScheduler):
    """``lr = base * gamma ** (t // step_size)`` per member."""

    args = ("step_size", "gamma")
    step_size: list[Any]
    gamma: list[Any]
    torch_class = torch.optim.lr_scheduler.StepLR

    def __init__(self, optimizer: FusedOptimizer, step_size: Any, gamma: Any = 0.1) -> None:
        super().__init__(optimizer, step_size=step_size, gamma=gamma)

    def _validate(self) -> None:
        self._check("step_size", lambda v: int(v) == v and v >= 1, "step_size must be an int >= 1")

    def _lr(self, i: int, base: float, t: int) -> float:
        return base * self.gamma[i] ** (t // int(self.step_size[i]))


class MultiStepLR(FusedLRScheduler):
    """``lr = base * gamma ** (milestones passed)`` per member; ``milestones`` is one list for all
    members or one list per member."""

    args = ("milestones", "gamma")
    milestones: list[Any]
    gamma: list[Any]
    torch_class = torch.optim.lr_scheduler.MultiStepLR

    def __init__(self, optimizer: FusedOptimizer, milestones: Any, gamma: Any = 0.1) -> None:
        size = optimizer.size
        if milestones and not isinstance(milestones[0], list | tuple):
            milestones = [list(milestones)] * size
        super().__init__(optimizer, milestones=milestones, gamma=gamma)

    def _validate(self) -> None:
        self.milestones = [sorted(int(m) for m in ms) for ms in self.milestones]

    def _lr(self, i: int, base: float, t: int) -> float:
        return base * self.gamma[i] ** bisect.bisect_right(self.milestones[i], t)


class ExponentialLR(FusedLRScheduler):
    """``lr = base * gamma ** t`` per member."""

    args = ("gamma",)
    gamma: list[Any]
    torch_class = torch.optim.lr_scheduler.ExponentialLR

    def __init__(self, optimizer: FusedOptimizer, gamma: Any) -> None:
        super().__init__(optimizer, gamma=gamma)

    def _lr(self, i: int, base: float, t: int) -> float:
        return base * self.gamma[i] ** t


class CosineAnnealingLR(FusedLRScheduler):
    """Cosine from ``base`` to ``eta_min`` over ``T_max`` steps, per member."""

    args = ("T_max", "eta_min")
    T_max: list[Any]
    eta_min: list[Any]
    torch_class = torch.optim.lr_scheduler.CosineAnnealingLR

    def __init__(self, optimizer: FusedOptimizer, T_max: Any, eta_min: Any = 0.0) -> None:
        super().__init__(optimizer, T_max=T_max, eta_min=eta_min)

    def _validate(self) -> None:
        self._check("T_max", lambda v: v > 0, "T_max must be > 0")

    def _lr(self, i: int, base: float, t: int) -> float:
        eta_min = self.eta_min[i]
        return eta_min + (base - eta_min) * (1 + math.cos(math.pi * t / self.T_max[i])) / 2


class CosineAnnealingWarmRestarts(FusedLRScheduler):
    """Cosine annealing restarted every ``T_0 * T_mult**k`` steps, per member."""

    args = ("T_0", "T_mult", "eta_min")
    T_0: list[Any]
    T_mult: list[Any]
    eta_min: list[Any]
    torch_class = torch.optim.lr_scheduler.CosineAnnealingWarmRestarts

    def __init__(
        self, optimizer: FusedOptimizer, T_0: Any, T_mult: Any = 1, eta_min: Any = 0.0
    ) -> None:
        super().__init__(optimizer, T_0=T_0, T_mult=T_mult, eta_min=eta_min)

    def _validate(self) -> None:
        self._check("T_0", lambda v: int(v) == v and v >= 1, "T_0 must be an int >= 1")
        self._check("T_mult", lambda v: int(v) == v and v >= 1, "T_mult must be an int >= 1")

    def _cycle(self, i: int, t: int) -> tuple[int, int]:
        t_cur, t_i = t, int(self.T_0[i])
        while t_cur >= t_i:
            t_cur -= t_i
            t_i *= int(self.T_mult[i])
        return t_cur, t_i

    def _lr(self, i: int, base: float, t: int) -> float:
        t_cur, t_i = self._cycle(i, t)
        eta_min = self.eta_min[i]
        return eta_min + (base - eta_min) * (1 + math.cos(math.pi * t_cur / t_i)) / 2

    def _export_extra(self, i: int) -> dict[str, Any]:
        t_cur, t_i = self._cycle(i, self.last_epoch[i])
        return {"T_cur": t_cur, "T_i": t_i}


class LinearLR(FusedLRScheduler):
    """Linear factor from ``start_factor`` to ``end_factor`` over ``total_iters``, per member."""

    args = ("start_factor", "end_factor", "total_iters")
    start_factor: list[Any]
    end_factor: list[Any]
    total_iters: list[Any]
    torch_class = torch.optim.lr_scheduler.LinearLR

    def __init__(
        self,
        optimizer: FusedOptimizer,
        start_factor: Any = 1.0 / 3,
        end_factor: Any = 1.0,
        total_iters: Any = 5,
    ) -> None:
        super().__init__(
            optimizer, start_factor=start_factor, end_factor=end_factor, total_iters=total_iters
        )

    def _validate(self) -> None:
        self._check("start_factor", lambda v: 0 < v <= 1, "start_factor must be in (0, 1]")
        self._check("end_factor", lambda v: 0 <= v <= 1, "end_factor must be in [0, 1]")

    def _lr(self, i: int, base: float, t: int) -> float:
        start, end, total = self.start_factor[i], self.end_factor[i], self.total_iters[i]
        return base * (start + (end - start) * min(t, total) / total)


class ConstantLR(FusedLRScheduler):
    """``base * factor`` until ``total_iters``, then ``base``, per member."""

    args = ("factor", "total_iters")
    factor: list[Any]
    total_iters: list[Any]
    torch_class = torch.optim.lr_scheduler.ConstantLR

    def __init__(
        self, optimizer: FusedOptimizer, factor: Any = 1.0 / 3, total_iters: Any = 5
    ) -> None:
        super().__init__(optimizer, factor=factor, total_iters=total_iters)

    def _validate(self) -> None:
        self._check("factor", lambda v: 0 <= v <= 1, "factor must be in [0, 1]")

    def _lr(self, i: int, base: float, t: int) -> float:
        return base * self.factor[i] if t < self.total_iters[i] else base


class OneCycleLR(FusedLRScheduler):
    """The 1cycle policy per member (``max_lr``, ``pct_start``, ``div_factor``... per member);
    cycles the optimizer's ``momentum`` (SGD, RMSprop) or ``beta1`` (Adam, AdamW) too."""

    args = (
        "max_lr",
        "pct_start",
        "base_momentum",
        "max_momentum",
        "div_factor",
        "final_div_factor",
    )
    max_lr: list[Any]
    pct_start: list[Any]
    base_momentum: list[Any]
    max_momentum: list[Any]
    div_factor: list[Any]
    final_div_factor: list[Any]
    torch_class = torch.optim.lr_scheduler.OneCycleLR

    def __init__(
        self,
        optimizer: FusedOptimizer,
        max_lr: Any,
        total_steps: int | None = None,
        epochs: int | None = None,
        steps_per_epoch: int | None = None,
        pct_start: Any = 0.3,
        anneal_strategy: str = "cos",
        cycle_momentum: bool = True,
        base_momentum: Any = 0.85,
        max_momentum: Any = 0.95,
        div_factor: Any = 25.0,
        final_div_factor: Any = 1e4,
        three_phase: bool = False,
    ) -> None:
        if total_steps is None:
            if epochs is None or steps_per_epoch is None:
                raise ValueError("OneCycleLR needs total_steps, or epochs and steps_per_epoch")
            total_steps = epochs * steps_per_epoch
        if total_steps <= 0:
            raise ValueError(f"OneCycleLR: total_steps must be > 0, got {total_steps}")
        if anneal_strategy not in ("cos", "linear"):
            raise ValueError(f"anneal_strategy must be 'cos' or 'linear', got {anneal_strategy!r}")
        self.total_steps = total_steps
        self.anneal_strategy = anneal_strategy
        self.cycle_momentum = cycle_momentum
        self.three_phase = three_phase
        names = optimizer.numeric
        self._momentum_key = (
            "momentum" if "momentum" in names else "beta1" if "beta1" in names else None
        )
        if cycle_momentum and self._momentum_key is not None:
            self.writes = ("lr", self._momentum_key)
        if cycle_momentum and self._momentum_key is None:
            raise ValueError(
                f"cycle_momentum=True needs an optimizer with momentum or betas, not "
                f"{type(optimizer).__name__}; pass cycle_momentum=False"
            )
        # the 1cycle policy sets its own starting learning rate: max_lr / div_factor
        size = optimizer.size
        max_lrs = _per_member("max_lr", max_lr, size)
        divs = _per_member("div_factor", div_factor, size)
        for group in optimizer.param_groups:
            group["initial_lr"] = torch.tensor(
                [m / d for m, d in zip(max_lrs, divs, strict=True)],
                dtype=torch.float64,
                device=group["lr"].device,
            )
        super().__init__(
            optimizer,
            max_lr=max_lrs,
            pct_start=pct_start,
            base_momentum=base_momentum,
            max_momentum=max_momentum,
            div_factor=divs,
            final_div_factor=final_div_factor,
        )

    def _validate(self) -> None:
        self._check("pct_start", lambda v: 0 <= v <= 1, "pct_start must be in [0, 1]")

    def _phases(self, i: int) -> list[tuple[float, str, str]]:
        total, pct = self.total_steps, self.pct_start[i]
        if self.three_phase:
            return [
                (float(pct * total) - 1, "initial", "max"),
                (float(2 * pct * total) - 2, "max", "initial"),
                (total - 1, "initial", "min"),
            ]
        return [(float(pct * total) - 1, "initial", "max"), (total - 1, "max", "min")]

    def _anneal(self, start: float, end: float, pct: float) -> float:
        if self.anneal_strategy == "cos":
            return end + (start - end) / 2.0 * (math.cos(math.pi * pct) + 1)
        return (end - start) * pct + start

    def _value(self, i: int, t: int, values: dict[str, float]) -> float:
        if t > self.total_steps:
            raise ValueError(
                f"OneCycleLR: member {i} tried to step {t} times; total_steps is {self.total_steps}"
            )
        start_step = 0.0
        phases = self._phases(i)
        for k, (end_step, start_key, end_key) in enumerate(phases):
            if t <= end_step or k == len(phases) - 1:
                pct = (t - start_step) / (end_step - start_step)
                return self._anneal(values[start_key], values[end_key], pct)
            start_step = end_step
        raise AssertionError("unreachable")

    def _lr(self, i: int, base: float, t: int) -> float:
        initial = self.max_lr[i] / self.div_factor[i]
        lrs = {"initial": initial, "max": self.max_lr[i], "min": initial / self.final_div_factor[i]}
        return self._value(i, t, lrs)

    def _apply(self, i: int) -> None:
        super()._apply(i)
        if self.cycle_momentum and self._momentum_key is not None:
            moms = {
                "initial": self.max_momentum[i],
                "max": self.base_momentum[i],
                "min": self.max_momentum[i],
            }
            value = self._value(i, self.last_epoch[i], moms)
            for values in self._values[self._momentum_key]:
                values[i] = value

    def _after_apply(self) -> None:
        key = self._momentum_key
        if self.cycle_momentum and key is not None:
            # momentum changed: the optimizer's flag for it may too (from the host values)
            for flags, values in zip(self.optimizer._flags, self._values[key], strict=True):
                flags[f"any_{key}"] = any(v != 0 for v in values)

    def _torch_args(self, i: int) -> dict[str, Any]:
        out = super()._torch_args(i)
        out.update(
            total_steps=self.total_steps,
            anneal_strategy=self.anneal_strategy,
            cycle_momentum=self.cycle_momentum,
            three_phase=self.three_phase,
        )
        return out


class SequentialLR(FusedLRScheduler):
    """Runs ``schedulers`` one after another, switching at ``milestones`` (shared, or one list per
    member); each starts its own count at 0 at its milestone, as in torch."""

    args = ("milestones",)
    milestones: list[Any]
    torch_class = torch.optim.lr_scheduler.SequentialLR

    def __init__(
        self, optimizer: FusedOptimizer, schedulers: Sequence[FusedLRScheduler], milestones: Any
    ) -> None:
        if len(schedulers) < 1:
            raise ValueError("SequentialLR needs at least one scheduler")
        for s in schedulers:
            if s.optimizer is not optimizer:
                raise ValueError("SequentialLR: every scheduler must belong to its optimizer")
            if isinstance(s, ReduceLROnPlateau | SequentialLR):
                raise ValueError(f"SequentialLR cannot contain {type(s).__name__}")
            optimizer._schedulers.remove(s)  # this scheduler drives them from now on
        self.schedulers = list(schedulers)
        size = optimizer.size
        if not milestones or not isinstance(milestones[0], list | tuple):
            milestones = [list(milestones)] * size
        super().__init__(optimizer, milestones=milestones)

    def _validate(self) -> None:
        for i, ms in enumerate(self.milestones):
            if len(ms) != len(self.schedulers) - 1:
                raise ValueError(
                    f"SequentialLR: member {i} has {len(ms)} milestones for "
                    f"{len(self.schedulers)} schedulers; give one fewer milestone than schedulers"
                )

    def _lr(self, i: int, base: float, t: int) -> float:
        ms = self.milestones[i]
        k = bisect.bisect_right(ms, t)
        local = t - (ms[k - 1] if k > 0 else 0)
        return self.schedulers[k]._lr(i, base, local)

    def reset_member(self, i: int, **values: Any) -> None:
        for s in self.schedulers:
            for gi, group in enumerate(self.optimizer.param_groups):
                s.base_lrs[gi][i] = float(group["initial_lr"][i])
        super().reset_member(i, **values)

    def member_state_dict(self, i: int) -> dict[str, Any]:
        """torch's SequentialLR state for member ``i``, made by replaying its epochs through
        torch's own schedulers (its state nests theirs; a few microseconds per epoch)."""
        import warnings

        groups = [{"params": [nn.Parameter(torch.zeros(1))], "lr": lrs[i]} for lrs in self.base_lrs]
        dummy = torch.optim.SGD(groups, momentum=0.9)
        subs = [s.torch_class(dummy, **s._torch_args(i)) for s in self.schedulers]
        sched = torch.optim.lr_scheduler.SequentialLR(dummy, subs, self.milestones[i])
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # stepping a scheduler without an optimizer step
            for _ in range(self.last_epoch[i]):
                sched.step()
        return sched.state_dict()


class ReduceLROnPlateau(FusedLRScheduler):
    """Per-member plateau detection: ``step(metrics)`` with one metric per member (``[B]``).

    ``mode`` and ``threshold_mode`` are shared; ``factor``, ``patience``, ``threshold``,
    ``cooldown``, ``min_lr`` and ``eps`` may differ per member.
    """

    args = ("factor", "patience", "threshold", "cooldown", "min_lr", "eps")
    factor: list[Any]
    patience: list[Any]
    threshold: list[Any]
    cooldown: list[Any]
    min_lr: list[Any]
    eps: list[Any]
    torch_class = torch.optim.lr_scheduler.ReduceLROnPlateau

    def __init__(
        self,
        optimizer: FusedOptimizer,
        mode: str = "min",
        factor: Any = 0.1,
        patience: Any = 10,
        threshold: Any = 1e-4,
        threshold_mode: str = "rel",
        cooldown: Any = 0,
        min_lr: Any = 0.0,
        eps: Any = 1e-8,
    ) -> None:
        if mode not in ("min", "max"):
            raise ValueError(f"ReduceLROnPlateau: mode must be 'min' or 'max', got {mode!r}")
        if threshold_mode not in ("rel", "abs"):
            raise ValueError(f"threshold_mode must be 'rel' or 'abs', got {threshold_mode!r}")
        self.mode = mode
        self.threshold_mode = threshold_mode
        self.best: list[float] = []
        self.num_bad_epochs: list[int] = []
        self.cooldown_counter: list[int] = []
        super().__init__(
            optimizer,
            factor=factor,
            patience=patience,
            threshold=threshold,
            cooldown=cooldown,
            min_lr=min_lr,
            eps=eps,
        )

    def _validate(self) -> None:
        self._check("factor", lambda v: v < 1.0, "factor must be < 1")

    def _start(self, i: int) -> None:
        worse = math.inf if self.mode == "min" else -math.inf
        while len(self.best) < self.size:
            self.best.append(worse)
            self.num_bad_epochs.append(0)
            self.cooldown_counter.append(0)
        self.best[i], self.num_bad_epochs[i], self.cooldown_counter[i] = worse, 0, 0

    def _apply(self, i: int) -> None:
        pass  # the learning rate changes only on a plateau

    def _better(self, i: int, a: float, best: float) -> bool:
        th = self.threshold[i]
        if self.mode == "min":
            return a < best * (1.0 - th) if self.threshold_mode == "rel" else a < best - th
        return a > best * (th + 1.0) if self.threshold_mode == "rel" else a > best + th

    def step(self, metrics: Any) -> None:  # type: ignore[override]
        """Record each member's metric (``[B]``) and reduce the learning rate of members whose
        metric has not improved for more than ``patience`` epochs."""
        values = _per_member("metrics", metrics, self.size)
        active = self.optimizer._active_host
        lrs = self._host_values()["lr"]
        changed = False
        for i in range(self.size):
            if not active[i]:
                continue
            current = float(values[i])
            self.last_epoch[i] += 1
            if self._better(i, current, self.best[i]):
                self.best[i] = current
                self.num_bad_epochs[i] = 0
            else:
                self.num_bad_epochs[i] += 1
            if self.cooldown_counter[i] > 0:
                self.cooldown_counter[i] -= 1
                self.num_bad_epochs[i] = 0
            if self.num_bad_epochs[i] > self.patience[i]:
                for group_lrs in lrs:
                    old = group_lrs[i]
                    new = max(old * self.factor[i], self.min_lr[i])
                    if old - new > self.eps[i]:
                        group_lrs[i] = new
                        changed = True
                self.cooldown_counter[i] = self.cooldown[i]
                self.num_bad_epochs[i] = 0
        if changed:
            self._write()

    def reset_member(self, i: int, **values: Any) -> None:
        super().reset_member(i, **values)
        for group, lrs in zip(self.optimizer.param_groups, self._host_values()["lr"], strict=True):
            lrs[i] = float(group["initial_lr"][i])
        self._write()

    def member_state_dict(self, i: int) -> dict[str, Any]:
        sched = self._torch_scheduler(i)
        state = sched.state_dict()
        state.update(
            last_epoch=self.last_epoch[i],
            best=self.best[i],
            num_bad_epochs=self.num_bad_epochs[i],
            cooldown_counter=self.cooldown_counter[i],
            _last_lr=[lrs[i] for lrs in self._host_values()["lr"]],
        )
        return state

    def load_member_state_dict(self, i: int, state: dict[str, Any]) -> None:
        for name in ("factor", "patience", "threshold", "cooldown", "eps"):
            getattr(self, name)[i] = state[name]
        self.min_lr[i] = state["min_lrs"][0]
        self.last_epoch[i] = int(state["last_epoch"])
        self.best[i] = float(state["best"])
        self.num_bad_epochs[i] = int(state["num_bad_epochs"])
        self.cooldown_counter[i] = int(state["cooldown_counter"])
        for lrs, lr in zip(self._host_values()["lr"], state["_last_lr"], strict=True):
            lrs[i] = float(lr)
        self._write()

    def _torch_args(self, i: int) -> dict[str, Any]:
        out = super()._torch_args(i)
        out.update(mode=self.mode, threshold_mode=self.threshold_mode)
        return out
