"""The base of the per-member LR schedulers (``hfsweep.optim.lr_scheduler``): base learning
rates, per-member epoch counts, and the host copies a step writes from (see that module's
docstring)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, ClassVar

import torch
from torch import nn

from ._base import FusedOptimizer

__all__ = ["FusedLRScheduler"]


def _per_member(name: str, value: Any, size: int) -> list[Any]:
    """One value per member from a scalar, a sequence or a tensor; names the bad argument."""
    if isinstance(value, torch.Tensor):
        value = value.tolist()
    if isinstance(value, list | tuple):
        if len(value) != size:
            raise ValueError(f"{name} has {len(value)} values for {size} members")
        return list(value)
    return [value] * size


class FusedLRScheduler:
    """Base of the per-member schedulers: holds base learning rates and epoch counts.

    Subclasses list their per-member arguments in ``args`` and implement :meth:`_lr`, member i's
    learning rate at its epoch ``t`` from its base learning rate.
    """

    args: ClassVar[tuple[str, ...]] = ()
    torch_class: ClassVar[type]
    #: the optimizer's ``[B]`` values this scheduler writes (one host copy per param group each)
    writes: tuple[str, ...] = ("lr",)

    def __init__(self, optimizer: FusedOptimizer, **values: Any) -> None:
        if not isinstance(optimizer, FusedOptimizer):
            raise TypeError(
                f"{type(self).__name__} needs an hs.optim optimizer, got {type(optimizer).__name__}"
            )
        self.optimizer = optimizer
        self.size = optimizer.size
        for name in self.args:
            setattr(self, name, _per_member(name, values[name], self.size))
        for group in optimizer.param_groups:
            if "initial_lr" not in group:
                group["initial_lr"] = group["lr"].clone()
        self.base_lrs: list[list[float]] = [
            g["initial_lr"].tolist() for g in optimizer.param_groups
        ]
        self.last_epoch: list[int] = [0] * self.size
        self._values: dict[str, list[list[float]]] = {}
        self._generation = -1
        self._validate()
        optimizer._schedulers.append(self)
        for i in range(self.size):
            self._start(i)
        self._apply_members(range(self.size))

    # ------------------------------------------------------------------ subclass hooks
    def _validate(self) -> None:
        """Check the per-member arguments; raise ``ValueError`` naming the member."""

    def _start(self, i: int) -> None:
        """Reset member i's internal state (epoch 0)."""

    def _lr(self, i: int, base: float, t: int) -> float:
        raise NotImplementedError

    # ------------------------------------------------------------------ public
    def step(self) -> None:
        """Advance every active member's schedule by one epoch (or step)."""
        active = self.optimizer._active_host
        members = [i for i in range(self.size) if active[i]]
        for i in members:
            self.last_epoch[i] += 1
        self._apply_members(members)

    def get_last_lr(self) -> list[torch.Tensor]:
        """The current ``[B]`` learning rates of each param group."""
        return [g["lr"].clone() for g in self.optimizer.param_groups]

    def reset_member(self, i: int, **values: Any) -> None:
        """Restart member ``i``'s schedule at epoch 0 from the optimizer's base learning rate for
        it, optionally with new arguments (``T_max=...``)."""
        unknown = sorted(set(values) - set(self.args))
        if unknown:
            raise ValueError(
                f"{type(self).__name__} has no per-member argument {unknown[0]!r}; valid names "
                f"are {list(self.args)}"
            )
        for name, value in values.items():
            getattr(self, name)[i] = value
        self._validate()
        for gi, group in enumerate(self.optimizer.param_groups):
            self.base_lrs[gi][i] = float(group["initial_lr"][i])
        self.last_epoch[i] = 0
        self._start(i)
        self._apply_members([i])

    def member_state_dict(self, i: int) -> dict[str, Any]:
        """Member ``i``'s schedule as the matching torch scheduler's ``state_dict``."""
        sched = self._torch_scheduler(i)
        state = sched.state_dict()
        t = self.last_epoch[i]
        state.update(
            last_epoch=t,
            _step_count=t + 1,
            base_lrs=[lrs[i] for lrs in self.base_lrs],
            _last_lr=[lrs[i] for lrs in self._host_values()["lr"]],
        )
        state.update(self._export_extra(i))
        return state

    def load_member_state_dict(self, i: int, state: dict[str, Any]) -> None:
        """Read member ``i``'s progress (epoch, base learning rates, internal state) from a torch
        scheduler's ``state_dict``."""
        for name in self.args:
            if name in state:
                getattr(self, name)[i] = state[name]
        self.last_epoch[i] = int(state["last_epoch"])
        for gi, base in enumerate(state.get("base_lrs", [])):
            self.base_lrs[gi][i] = float(base)
        self._import_extra(i, state)
        self._apply_members([i])

    # ------------------------------------------------------------------ helpers
    def _apply_members(self, members: Iterable[int]) -> None:
        """Write the scheduled values of ``members``, then let the optimizer catch up once."""
        self._host_values()
        for i in members:
            self._apply(i)
        self._write()
        self._after_apply()

    def _host_values(self) -> dict[str, list[list[float]]]:
        """The host copy of the values this scheduler writes (``{name: [group][member]}``),
        taken again from the optimizer's host copy when that changed since."""
        opt = self.optimizer
        if self._generation != opt._generation:
            self._values = {name: [list(v) for v in opt._host_values[name]] for name in self.writes}
            self._generation = opt._generation
        return self._values

    def _write(self) -> None:
        """Copy the host values into the optimizer's ``[B]`` tensors, one copy per tensor."""
        for name, groups in self._values.items():
            for group, values in zip(self.optimizer.param_groups, groups, strict=True):
                target = group[name]
                source = torch.tensor(values, dtype=target.dtype)
                target.copy_(source, non_blocking=target.device.type != "cpu")

    def _after_apply(self) -> None:
        """Called once after a batch of :meth:`_apply` calls."""

    def _apply(self, i: int) -> None:
        for gi, lrs in enumerate(self._values["lr"]):
            lrs[i] = self._lr(i, self.base_lrs[gi][i], self.last_epoch[i])

    def _torch_scheduler(self, i: int) -> Any:
        groups = [{"params": [nn.Parameter(torch.zeros(1))], "lr": lrs[i]} for lrs in self.base_lrs]
        dummy = torch.optim.SGD(groups, momentum=0.9)
        return self.torch_class(dummy, **self._torch_args(i))

    def _torch_args(self, i: int) -> dict[str, Any]:
        return {name: getattr(self, name)[i] for name in self.args}

    def _export_extra(self, i: int) -> dict[str, Any]:
        return {}

    def _import_extra(self, i: int, state: dict[str, Any]) -> None:
        pass

    def _check(self, name: str, ok: Any, what: str) -> None:
        for i, v in enumerate(getattr(self, name)):
            if not ok(v):
                raise ValueError(f"{type(self).__name__}: {name}[{i}] = {v!r}; {what}")
