"""SGD, Adam, AdamW, RMSprop and Adagrad over stacked ``[B, ...]`` parameters.

Each ``_update`` follows the arithmetic of torch's single-tensor implementation of the same
optimizer, with every hyperparameter a ``[B, 1, ...]`` tensor, so member i of a fused optimizer
takes exactly the step ``torch.optim`` takes for ``array.member(i)``. Where torch branches on a
hyperparameter's value (``momentum == 0``, a member's first step), the branch is taken per member
with ``torch.where``.
"""

from __future__ import annotations

from typing import Any, cast

import torch
from torch import Tensor

from ._base import (
    Flags,
    FusedOptimizer,
    Group,
    GroupUpdate,
    HyperParameter,
    ParamsT,
    State,
    Views,
    Work,
    each_parameter,
    view_key,
)
from ._groups import check_range

__all__ = ["SGD", "Adagrad", "Adam", "AdamW", "RMSprop"]

#: what torch's ``_foreach_*`` operators take and return
_Tensors = tuple[Tensor, ...] | list[Tensor]


def _as_member_view(values: Tensor, like: Tensor) -> Tensor:
    """``[B]`` values as ``[B, 1, ...]`` for broadcasting against ``like`` (in its dtype)."""
    return values.to(like.dtype).view(values.shape[0], *([1] * (like.dim() - 1)))


def _gradient(
    p: Tensor, grad: Tensor, hp: Views, group: Group, flags: Flags, *, l2: bool = True
) -> Tensor:
    """The gradient an update follows, as torch's optimizers form it: negated with
    ``maximize``, plus ``weight_decay * p`` (L2 decay) where any member decays and ``l2`` (AdamW
    decays the parameters instead). ``grad`` itself is never changed."""
    g = grad.neg() if group["maximize"] else grad
    if l2 and flags["any_weight_decay"]:
        g = torch.addcmul(g, p, hp["weight_decay"])
    return g


def _gradients(work: Work, group: Group, flags: Flags, *, l2: bool = True) -> _Tensors:
    """:func:`_gradient` of every parameter of ``work`` with ``torch._foreach_*`` operations."""
    params, _, hps = work
    grads = [cast(Tensor, p.grad) for p in params]
    g = torch._foreach_neg(grads) if group["maximize"] else grads
    if l2 and flags["any_weight_decay"]:
        g = torch._foreach_addcmul(g, params, [hp["weight_decay"] for hp in hps])
    return g


def _sgd_one(p: Tensor, grad: Tensor, state: State, hp: Views, group: Group, flags: Flags) -> None:
    """One parameter's SGD step (torch's single-tensor arithmetic, per member)."""
    g = _gradient(p, grad, hp, group, flags)
    if flags["any_momentum"]:
        buf = state["momentum_buffer"]
        if flags["first_step_rule"]:
            # per member: keep the buffer at 0 and take the gradient whole on a first step
            # or without momentum (torch has no buffer then), else buf*m + (1-d)*g
            plain = (state["step"] == 0) | (group["momentum"] == 0)
            keep = torch.where(plain, 0.0, group["momentum"])
            take = torch.where(plain, 1.0, 1 - group["dampening"])
            buf.mul_(_as_member_view(keep, p)).addcmul_(g, _as_member_view(take, p))
        else:
            buf.mul_(hp["momentum"]).add_(g)
        g = torch.addcmul(g, buf, hp["momentum"]) if group["nesterov"] else buf
    p.addcmul_(g, hp["neg_lr"])


def _sgd_group(work: Work, group: Group, flags: Flags) -> None:
    """:func:`_sgd_one` on all parameters at once with ``torch._foreach_*`` operations (the
    same op per tensor, hyperparameters broadcast per tensor). The per-member first-step
    rule needs each parameter's step counts, so it keeps the per-parameter path."""
    if flags["any_momentum"] and flags["first_step_rule"]:
        each_parameter(_sgd_one, work, group, flags)
        return
    params, states, hps = work
    g: _Tensors = _gradients(work, group, flags)
    if flags["any_momentum"]:
        momentum = [hp["momentum"] for hp in hps]
        bufs = [state["momentum_buffer"] for state in states]
        torch._foreach_mul_(bufs, momentum)
        torch._foreach_add_(bufs, g)
        g = torch._foreach_addcmul(g, bufs, momentum) if group["nesterov"] else bufs
    torch._foreach_addcmul_(params, g, [hp["neg_lr"] for hp in hps])


class SGD(FusedOptimizer):
    """``torch.optim.SGD`` with per-member ``lr``, ``momentum``, ``dampening``, ``weight_decay``."""

    numeric = ("lr", "momentum", "dampening", "weight_decay")
    options = ("nesterov", "maximize")
    state_keys = ("momentum_buffer",)
    torch_class = torch.optim.SGD

    def __init__(
        self,
        params: ParamsT,
        lr: HyperParameter = 1e-3,
        momentum: HyperParameter = 0.0,
        dampening: HyperParameter = 0.0,
        weight_decay: HyperParameter = 0.0,
        nesterov: bool = False,
        *,
        maximize: bool = False,
    ) -> None:
        super().__init__(params, self._defaults(locals()))

    def _validate(self, group: dict[str, Any], index: int) -> None:
        check_range(group, "lr", index, 0.0)
        check_range(group, "momentum", index, 0.0)
        check_range(group, "weight_decay", index, 0.0)
        if group["nesterov"] and bool(((group["momentum"] <= 0) | (group["dampening"] != 0)).any()):
            raise ValueError(
                f"nesterov=True (param group {index}) needs momentum > 0 and dampening = 0 for "
                "every member"
            )

    def _group_flags(self, group: dict[str, Any]) -> dict[str, bool]:
        flags = super()._group_flags(group)
        # torch's first momentum step copies the gradient; with zero-initialised buffers and
        # no dampening, buf*m + g gives exactly that, and g for members without momentum
        flags["first_step_rule"] = flags["any_dampening"]
        return flags

    def _group_update(self, group: Group, flags: Flags) -> tuple[GroupUpdate, tuple[Any, ...]]:
        return _sgd_group, ()

    def _has_state(self, st: dict[str, Any], i: int, group: dict[str, Any]) -> bool:
        return float(st["step"][i]) > 0 and float(group["momentum"][i]) != 0

    def _export_state(self, st: dict[str, Any], i: int, group: dict[str, Any]) -> dict[str, Any]:
        # torch keeps no step for SGD, and no state at all without momentum
        return {"momentum_buffer": st["momentum_buffer"][i].clone()}

    def _import_state(
        self, st: dict[str, Any], i: int, src: dict[str, Any], group: dict[str, Any]
    ) -> None:
        buf = src.get("momentum_buffer")
        if buf is not None:
            st["momentum_buffer"][i].copy_(buf)
            st["step"][i] = 1  # the buffer exists: the next step is not a first step
        else:
            st["step"][i] = 0


def _adam_one(
    p: Tensor,
    grad: Tensor,
    state: State,
    hp: Views,
    group: Group,
    flags: Flags,
    decoupled: bool,
    beta2: float | None,
) -> None:
    """One parameter's Adam (``decoupled``: AdamW) step; ``beta2`` is the members' one value
    where they share it (a host float: no read of the device), else ``None``."""
    if flags["any_weight_decay"] and decoupled:
        p.mul_(1 - hp["lr"] * hp["weight_decay"])
    g = _gradient(p, grad, hp, group, flags, l2=not decoupled)
    exp_avg, exp_avg_sq = state["exp_avg"], state["exp_avg_sq"]
    exp_avg.lerp_(g, 1 - hp["beta1"])
    if beta2 is not None:
        exp_avg_sq.mul_(beta2).addcmul_(g, g, value=1 - beta2)
    else:
        exp_avg_sq.mul_(hp["beta2"]).addcmul_(g, g * (1 - hp["beta2"]))
    step = state["step"].to(torch.float64) + 1
    step_size = group["lr"] / (1 - group["beta1"] ** step)
    bias2_sqrt = (1 - group["beta2"] ** step).sqrt()
    if group["amsgrad"]:
        torch.maximum(state["max_exp_avg_sq"], exp_avg_sq, out=state["max_exp_avg_sq"])
        denom = state["max_exp_avg_sq"].sqrt()
    else:
        denom = exp_avg_sq.sqrt()
    # torch: p -= step_size * m / (sqrt(v) / bias2_sqrt + eps). With step_size folded into the
    # denominator this is one addcdiv_; a member with lr 0 gets an infinite denominator.
    moving = step_size > 0
    inv = torch.where(moving, 1 / (bias2_sqrt * step_size), 0.0)
    eps = torch.where(moving, group["eps"] / step_size, torch.inf)
    denom.mul_(_as_member_view(inv, p)).add_(_as_member_view(eps, p))
    p.addcdiv_(exp_avg, denom, value=-1)


def _adam_group(
    work: Work, group: Group, flags: Flags, decoupled: bool, beta2: float | None
) -> None:
    """:func:`_adam_one` on all parameters at once: the same arithmetic, each elementwise
    step one ``torch._foreach_*`` operator for every parameter, and the per-member bias
    corrections computed once for all parameters (``[P, B]``) instead of per parameter.
    Parameters of several dtypes keep the per-parameter path."""
    params, states, hps = work
    if len({p.dtype for p in params}) != 1:
        each_parameter(_adam_one, work, group, flags, decoupled, beta2)
        return
    pairs = list(zip(params, hps, strict=True))
    if flags["any_weight_decay"] and decoupled:
        decay = {view_key(p): 1 - hp["lr"] * hp["weight_decay"] for p, hp in pairs}
        torch._foreach_mul_(params, [decay[view_key(p)] for p in params])
    g = _gradients(work, group, flags, l2=not decoupled)
    exp_avgs = [st["exp_avg"] for st in states]
    exp_avg_sqs = [st["exp_avg_sq"] for st in states]
    one_minus = {view_key(p): (1 - hp["beta1"], 1 - hp["beta2"]) for p, hp in pairs}
    torch._foreach_lerp_(exp_avgs, g, [one_minus[view_key(p)][0] for p in params])
    if beta2 is not None:
        torch._foreach_mul_(exp_avg_sqs, beta2)
        torch._foreach_addcmul_(exp_avg_sqs, g, g, value=1 - beta2)
    else:
        torch._foreach_mul_(exp_avg_sqs, [hp["beta2"] for hp in hps])
        scaled = torch._foreach_mul(g, [one_minus[view_key(p)][1] for p in params])
        torch._foreach_addcmul_(exp_avg_sqs, g, scaled)
    # the per-member scalars of every parameter at once, [P, B] in float64 as _update has them
    step = torch.stack([st["step"] for st in states]).to(torch.float64) + 1
    step_size = group["lr"] / (1 - group["beta1"] ** step)
    bias2_sqrt = (1 - group["beta2"] ** step).sqrt()
    if group["amsgrad"]:
        max_sqs = [st["max_exp_avg_sq"] for st in states]
        torch._foreach_maximum_(max_sqs, exp_avg_sqs)
        denom = torch._foreach_sqrt(max_sqs)
    else:
        denom = torch._foreach_sqrt(exp_avg_sqs)
    moving = step_size > 0
    inv = torch.where(moving, 1 / (bias2_sqrt * step_size), 0.0).to(params[0].dtype)
    eps = torch.where(moving, group["eps"] / step_size, torch.inf).to(params[0].dtype)
    shapes = [(p.shape[0], *([1] * (p.dim() - 1))) for p in params]
    invs = [v.view(shape) for v, shape in zip(inv.unbind(0), shapes, strict=True)]
    epss = [v.view(shape) for v, shape in zip(eps.unbind(0), shapes, strict=True)]
    torch._foreach_mul_(denom, invs)
    torch._foreach_add_(denom, epss)
    torch._foreach_addcdiv_(params, exp_avgs, denom, value=-1)


class _AdamBase(FusedOptimizer):
    numeric = ("lr", "beta1", "beta2", "eps", "weight_decay")
    options = ("amsgrad", "maximize")
    decoupled: bool = False

    def __init__(
        self,
        params: ParamsT,
        lr: HyperParameter = 1e-3,
        betas: tuple[HyperParameter, HyperParameter] = (0.9, 0.999),
        eps: HyperParameter = 1e-8,
        weight_decay: HyperParameter = 0.0,
        amsgrad: bool = False,
        *,
        maximize: bool = False,
    ) -> None:
        beta1, beta2 = betas
        super().__init__(params, self._defaults(locals()))

    @property
    def state_keys(self) -> tuple[str, ...]:  # type: ignore[override]
        amsgrad = any(g["amsgrad"] for g in self.param_groups)
        return ("exp_avg", "exp_avg_sq", "max_exp_avg_sq") if amsgrad else ("exp_avg", "exp_avg_sq")

    def _validate(self, group: dict[str, Any], index: int) -> None:
        check_range(group, "lr", index, 0.0)
        check_range(group, "eps", index, 0.0)
        check_range(group, "beta1", index, 0.0, 1.0, high_open=True)
        check_range(group, "beta2", index, 0.0, 1.0, high_open=True)
        check_range(group, "weight_decay", index, 0.0)

    def _group_update(self, group: Group, flags: Flags) -> tuple[GroupUpdate, tuple[Any, ...]]:
        # the members' shared beta2 from the host copy: no read of the device
        beta2 = self._host(group, "beta2")[0] if flags["shared_beta2"] else None
        return _adam_group, (self.decoupled, beta2)

    def _group_flags(self, group: dict[str, Any]) -> dict[str, bool]:
        flags = super()._group_flags(group)
        flags["shared_beta2"] = len(set(self._host(group, "beta2"))) == 1
        return flags

    def _torch_kwargs(self, group: dict[str, Any], i: int) -> dict[str, Any]:
        out = super()._torch_kwargs(group, i)
        out["betas"] = (out.pop("beta1"), out.pop("beta2"))
        return out

    def _from_torch_group(self, group: dict[str, Any]) -> dict[str, float]:
        b1, b2 = group["betas"]
        return {
            "lr": group["lr"],
            "beta1": b1,
            "beta2": b2,
            "eps": group["eps"],
            "weight_decay": group["weight_decay"],
        }


class Adam(_AdamBase):
    """``torch.optim.Adam`` (L2 weight decay added to the gradient, optional AMSGrad) with
    per-member ``lr``, ``betas``, ``eps`` and ``weight_decay``."""

    torch_class = torch.optim.Adam


class AdamW(_AdamBase):
    """``torch.optim.AdamW`` (decoupled weight decay) with per-member ``lr``, ``betas``, ``eps``
    and ``weight_decay`` (default 0.01, as in torch)."""

    torch_class = torch.optim.AdamW
    decoupled = True

    def __init__(
        self,
        params: ParamsT,
        lr: HyperParameter = 1e-3,
        betas: tuple[HyperParameter, HyperParameter] = (0.9, 0.999),
        eps: HyperParameter = 1e-8,
        weight_decay: HyperParameter = 1e-2,
        amsgrad: bool = False,
        *,
        maximize: bool = False,
    ) -> None:
        super().__init__(params, lr, betas, eps, weight_decay, amsgrad, maximize=maximize)


def _rmsprop_one(
    p: Tensor, grad: Tensor, state: State, hp: Views, group: Group, flags: Flags
) -> None:
    """One parameter's RMSprop step (torch's single-tensor arithmetic, per member)."""
    g = _gradient(p, grad, hp, group, flags)
    square_avg = state["square_avg"]
    square_avg.mul_(hp["alpha"]).addcmul_(g, g * (1 - hp["alpha"]))
    if group["centered"]:
        grad_avg = state["grad_avg"]
        grad_avg.lerp_(g, 1 - hp["alpha"])
        avg = torch.addcmul(square_avg, grad_avg, grad_avg, value=-1).sqrt_()
    else:
        avg = square_avg.sqrt()
    avg.add_(hp["eps"])
    if flags["any_momentum"]:
        # members without momentum: buf*0 + g/avg is the plain update, exactly
        buf = state["momentum_buffer"]
        buf.mul_(hp["momentum"]).addcdiv_(g, avg)
        p.addcmul_(buf, hp["neg_lr"])
    else:
        p.addcmul_(g.div(avg), hp["neg_lr"])


def _rmsprop_group(work: Work, group: Group, flags: Flags) -> None:
    """:func:`_rmsprop_one` on every parameter of ``work``."""
    each_parameter(_rmsprop_one, work, group, flags)


class RMSprop(FusedOptimizer):
    """``torch.optim.RMSprop`` with per-member ``lr``, ``alpha``, ``eps``, ``weight_decay`` and
    ``momentum``; ``centered`` is shared."""

    numeric = ("lr", "alpha", "eps", "weight_decay", "momentum")
    options = ("centered", "maximize")
    torch_class = torch.optim.RMSprop

    def __init__(
        self,
        params: ParamsT,
        lr: HyperParameter = 1e-2,
        alpha: HyperParameter = 0.99,
        eps: HyperParameter = 1e-8,
        weight_decay: HyperParameter = 0.0,
        momentum: HyperParameter = 0.0,
        centered: bool = False,
        *,
        maximize: bool = False,
    ) -> None:
        super().__init__(params, self._defaults(locals()))

    @property
    def state_keys(self) -> tuple[str, ...]:  # type: ignore[override]
        keys = ["square_avg", "momentum_buffer"]  # the buffer stays 0 for members without momentum
        if any(g["centered"] for g in self.param_groups):
            keys.append("grad_avg")
        return tuple(keys)

    def _validate(self, group: dict[str, Any], index: int) -> None:
        for name in ("lr", "eps", "weight_decay", "momentum", "alpha"):
            check_range(group, name, index, 0.0)

    def _group_update(self, group: Group, flags: Flags) -> tuple[GroupUpdate, tuple[Any, ...]]:
        return _rmsprop_group, ()

    def _export_state(self, st: dict[str, Any], i: int, group: dict[str, Any]) -> dict[str, Any]:
        out = super()._export_state(st, i, group)
        if float(group["momentum"][i]) <= 0:
            out.pop("momentum_buffer")  # torch keeps no buffer without momentum
        return out


def _adagrad_one(
    p: Tensor, grad: Tensor, state: State, hp: Views, group: Group, flags: Flags
) -> None:
    """One parameter's Adagrad step (torch's single-tensor arithmetic, per member)."""
    g = _gradient(p, grad, hp, group, flags)
    step = state["step"].to(torch.float64) + 1
    clr = _as_member_view(group["lr"] / (1 + (step - 1) * group["lr_decay"]), p)
    state["sum"].addcmul_(g, g)
    std = state["sum"].sqrt().add_(hp["eps"])
    p.addcmul_(g.div(std), clr.neg())


def _adagrad_group(work: Work, group: Group, flags: Flags) -> None:
    """:func:`_adagrad_one` on every parameter of ``work``."""
    each_parameter(_adagrad_one, work, group, flags)


class Adagrad(FusedOptimizer):
    """``torch.optim.Adagrad`` with per-member ``lr``, ``lr_decay``, ``weight_decay``,
    ``initial_accumulator_value`` and ``eps``."""

    numeric = ("lr", "lr_decay", "weight_decay", "initial_accumulator_value", "eps")
    options = ("maximize",)
    state_keys = ("sum",)
    torch_class = torch.optim.Adagrad

    def __init__(
        self,
        params: ParamsT,
        lr: HyperParameter = 1e-2,
        lr_decay: HyperParameter = 0.0,
        weight_decay: HyperParameter = 0.0,
        initial_accumulator_value: HyperParameter = 0.0,
        eps: HyperParameter = 1e-10,
        *,
        maximize: bool = False,
    ) -> None:
        super().__init__(params, self._defaults(locals()))
        # torch creates the accumulators eagerly, filled with the initial value
        for group in self.param_groups:
            for p in group["params"]:
                self._init_state(p, self.state[p], group)

    def _validate(self, group: dict[str, Any], index: int) -> None:
        for name in ("lr", "lr_decay", "weight_decay", "initial_accumulator_value", "eps"):
            check_range(group, name, index, 0.0)

    def _init_state(self, p: Tensor, state: dict[str, Any], group: dict[str, Any]) -> None:
        state["step"] = torch.zeros(self.size, dtype=torch.float32, device=p.device)
        init = _as_member_view(group["initial_accumulator_value"], p)
        state["sum"] = (torch.zeros_like(p) + init).contiguous()

    def _reset_state(self, state: dict[str, Any], i: int, group: dict[str, Any]) -> None:
        state["step"][i] = 0
        state["sum"][i].fill_(float(group["initial_accumulator_value"][i]))

    def _has_state(self, st: dict[str, Any], i: int, group: dict[str, Any]) -> bool:
        return True  # torch creates Adagrad's state with the optimizer

    def _group_update(self, group: Group, flags: Flags) -> tuple[GroupUpdate, tuple[Any, ...]]:
        return _adagrad_group, ()
