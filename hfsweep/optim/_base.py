"""``FusedOptimizer``: a ``torch.optim.Optimizer`` whose hyperparameters are ``[B]`` tensors.

Every numeric hyperparameter (``lr``, ``weight_decay``, ``momentum``, betas, ``eps``...) is given as
one value for all members or one value per member, and is stored as a ``[B]`` float64 tensor in its
param group. A step updates all members of every stacked ``[B, ...]`` parameter with a few batched
tensor operations; hyperparameters broadcast as ``[B, 1, ...]``.

Members can be inactive: their parameters, optimizer state and step count do not change.
:meth:`FusedOptimizer.reset_member` clears one member's state and sets its new hyperparameters (slot
refill), and :meth:`member_state_dict` / :meth:`load_member_state_dict` convert one member's state
to and from the ``state_dict`` that the matching ``torch.optim`` optimizer would have for
``array.member(i)``.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Mapping
from typing import Any, ClassVar, cast

import torch
from torch import Tensor, nn

from .._checks import is_int
from ._compiled import CompiledUpdate
from ._compiled import GroupUpdate as GroupUpdate
from ._groups import HyperParameter as HyperParameter
from ._groups import ParamsT as ParamsT
from ._groups import member_values, param_groups
from ._observed import observed_step

__all__ = ["FusedOptimizer", "HyperParameter", "inactive_rows"]

_log = logging.getLogger("hfsweep.optim")

#: the dtype gradients are summed in for the non-finite check (at least float32)
_SUM_DTYPES = {torch.float16: torch.float32, torch.bfloat16: torch.float32}
#: gradient dtypes the multi-tensor check (:meth:`FusedOptimizer._any_nonfinite`) takes
_CHECK_DTYPES = frozenset({torch.float16, torch.bfloat16, torch.float32, torch.float64})


#: one parameter's optimizer state (``step`` and the state tensors), by name
State = dict[str, Any]
#: one parameter's hyperparameters as ``[B, 1, ...]`` tensors in its dtype (and ``neg_lr``)
Views = dict[str, Tensor]
#: a param group (``[B]`` float64 hyperparameters, shared options, ``params``)
Group = dict[str, Any]
#: which optional terms any member of a group needs (``any_weight_decay``...)
Flags = dict[str, bool]
#: a group's parameters that have gradients, with their states and hyperparameter views
Work = tuple[list[Tensor], list[State], list[Views]]


def view_key(p: Tensor) -> tuple[int, torch.dtype]:
    """The key of the hyperparameter views ``p`` shares with its kind (values derived from views
    are made once per key; a key, not an id, so ``torch.compile`` guards on no object's id)."""
    return (p.dim(), p.dtype)


def each_parameter(
    one: Callable[..., None], work: Work, group: Group, flags: Flags, *consts: Any
) -> None:
    """``one(p, grad, state, views, group, flags, *consts)``, one parameter's update, on every
    parameter of ``work`` in turn (where the multi-tensor form does not apply)."""
    for p, state, hp in zip(*work, strict=True):
        one(p, cast(Tensor, p.grad), state, hp, group, flags, *consts)


class FusedOptimizer(torch.optim.Optimizer):
    """Base class of the ``hs.optim`` optimizers (see the module docstring).

    Subclasses name their per-member numeric hyperparameters in ``numeric``, their shared
    options (booleans) in ``options``, the state tensors they keep per parameter in
    ``state_keys``, and implement :meth:`_update` with batched tensor operations.
    """

    numeric: ClassVar[tuple[str, ...]] = ()
    options: ClassVar[tuple[str, ...]] = ()
    state_keys: ClassVar[tuple[str, ...]] = ()
    torch_class: ClassVar[type[torch.optim.Optimizer]]

    @classmethod
    def _defaults(cls, arguments: Mapping[str, Any]) -> dict[str, Any]:
        """A subclass constructor's defaults from its ``arguments`` (``locals()``): the value of
        each hyperparameter in ``numeric`` and each option in ``options``, by that name."""
        return {name: arguments[name] for name in (*cls.numeric, *cls.options)}

    def __init__(self, params: ParamsT, defaults: dict[str, Any]) -> None:
        groups, size = param_groups(params)
        self.size = size
        super().__init__(groups, defaults)
        device = self.param_groups[0]["params"][0].device
        #: ``[B]`` bool, which members step; read it, change it with :meth:`set_active` (the
        #: step keeps the idle members' indices from the last change)
        self.active = torch.ones(size, dtype=torch.bool, device=device)
        self._flags: list[dict[str, bool]] = []
        self._inactive: Tensor | None = None
        #: host copies of ``active`` and of the numeric hyperparameters (``{name: [group]
        #: [member]}``), and a count of the host-side changes: all renewed by :meth:`_refresh`,
        #: so that LR schedulers step without reading the device (they take the host copies
        #: again only when the count has moved)
        self._active_host: list[bool] = [True] * size
        self._host_values: dict[str, list[list[float]]] = {}
        self._generation = 0
        #: check gradients for inf/NaN at every step and deactivate the members that have them
        #: (one multi-tensor reduction over all gradients, which it leaves unwritten, and one
        #: scalar read into Python per step, per-member sums only when a value is non-finite;
        #: off, a step reads nothing back from the device)
        self.isolate_nonfinite = True
        #: members deactivated because their loss or gradients were not finite, in order
        self.nonfinite_members: list[int] = []
        self._schedulers: list[Any] = []  # hs.optim.lr_scheduler objects attached to this
        #: per param group: (the hyperparameters' identity and version, their [B, 1, ...] views)
        self._view_cache: dict[int, tuple[tuple[Any, ...], dict[Any, dict[str, Tensor]]]] = {}
        #: per param group: one ``[P, B]`` tensor whose rows are its parameters' ``step``
        #: counts (the states hold the row views), so a step counts with one ``add_``
        self._step_blocks: dict[int, tuple[Tensor, list[Tensor]]] = {}
        #: the group updates compiled (:meth:`compile`), or ``None``: eager
        self._compiled: CompiledUpdate | None = None
        self._refresh()

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """torch's ``add_param_group``, with the group's values turned into ``[B]`` tensors."""
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        index = len(self.param_groups) - 1
        sizes = {int(p.shape[0]) for p in group["params"] if p.dim() > 0}
        if sizes != {self.size} or any(p.dim() == 0 for p in group["params"]):
            raise ValueError(
                f"param group {index} has parameters with member counts {sorted(sizes)}; this "
                f"optimizer has {self.size} members"
            )
        device = group["params"][0].device
        for name in self.numeric:
            group[name] = member_values(name, group[name], self.size, device, index)
        for name in self.options:
            if not isinstance(group[name], bool):
                raise ValueError(
                    f"{name}={group[name]!r} (param group {index}) must be a bool shared by "
                    "all members"
                )
        self._validate(group, index)
        if hasattr(self, "active"):  # added after construction
            self._refresh()

    # ------------------------------------------------------------------ subclass hooks
    def _validate(self, group: dict[str, Any], index: int) -> None:
        """Check the group's values (``[B]`` tensors); raise ``ValueError`` naming the member."""

    def _init_state(self, p: Tensor, state: dict[str, Any], group: dict[str, Any]) -> None:
        state["step"] = torch.zeros(self.size, dtype=torch.float32, device=p.device)
        for key in self.state_keys:
            state[key] = torch.zeros_like(p, memory_format=torch.preserve_format)

    def _update(
        self, p: Tensor, grad: Tensor, state: State, hp: Views, group: Group, flags: Flags
    ) -> None:
        """Update ``p`` and its state in place, for all members.

        ``hp`` holds the numeric hyperparameters as ``[B, 1, ...]`` in ``p``'s dtype (and
        ``neg_lr``); ``group`` holds them as ``[B]`` float64 (for per-member scalars such as bias
        corrections) and the shared options; ``flags`` says which optional terms any member
        needs. ``state["step"]`` is each member's step count before this update.
        """
        raise NotImplementedError

    def _reset_state(self, state: dict[str, Any], i: int, group: dict[str, Any]) -> None:
        state["step"][i] = 0
        for key in self.state_keys:
            state[key][i].zero_()

    # ------------------------------------------------------------------ stepping
    @observed_step
    @torch.no_grad()
    def step(
        self, closure: Callable[[], float] | None = None, *, skip: Tensor | None = None
    ) -> float | None:
        """One update of every active member.

        ``skip`` (a ``[B]`` bool tensor) leaves some members out of this step only (the AMP
        scaler's overflowed members). With ``isolate_nonfinite`` on (the default), a member whose
        gradients hold inf or NaN is deactivated before the update, recorded in
        ``nonfinite_members`` and logged; the others step exactly as if it were not there.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._follow_device()
        if skip is None:
            if self.isolate_nonfinite:
                bad = self._nonfinite_members(self._inactive)
                if bad:
                    self._isolate(bad, "gradient")
            inactive = self._inactive
        else:
            left_out = ~self.active | skip.to(self.active.device)
            if self.isolate_nonfinite:
                # one read of both masks: the members left out, and the others' non-finite ones
                found = self._nonfinite_total().mul(0).ne(0) & ~left_out
                out, bad = torch.stack([left_out, found]).tolist()
                self._isolate([i for i, b in enumerate(bad) if b], "gradient")
                idle = [i for i, (o, b) in enumerate(zip(out, bad, strict=True)) if o or b]
                inactive = (
                    torch.tensor(idle, dtype=torch.long, device=self.active.device)
                    if idle
                    else None
                )
            else:
                rows = left_out.nonzero().flatten()
                inactive = rows if rows.numel() else None
        for index, group in enumerate(self.param_groups):
            work = self._group_work(index, group)
            params, states, _ = work
            if not params:
                continue
            # The update runs in place for all members; inactive members get their slices
            # back afterwards (their gradients may even be non-finite).
            # the block of step counts first: the rows kept for inactive members must be the
            # step tensors the count then adds to
            steps = [state["step"] for state in states]
            block = self._step_block(index, states, steps)
            saved = inactive_rows(params, states, inactive)
            update, constants = self._group_update(group, self._flags[index])
            if self._compiled is None:
                update(work, group, self._flags[index], *constants)
            else:
                self._compiled(update, work, group, self._flags[index], *constants)
            if block is None:  # some parameters had no gradient: only theirs count
                torch._foreach_add_([state["step"] for state in states], 1)
            else:
                block.add_(1)
            for t, rows, values in saved:
                t.index_copy_(0, rows, values)
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        """torch's ``zero_grad``; with ``set_to_none`` (the default) a plain loop that drops
        every gradient, without the profiler range (``Optimizer.zero_grad#...``) torch opens
        around it, whose cost is fixed and outweighs the loop on a small model's fused step."""
        if not set_to_none:
            super().zero_grad(set_to_none=False)
            return
        for group in self.param_groups:
            for p in group["params"]:
                p.grad = None

    def _step_block(self, index: int, states: list[State], steps: list[Tensor]) -> Tensor | None:
        """The ``[P, B]`` block of group ``index``'s step counts when ``steps`` are its rows, in
        order; made here (the counts copied, the states given its row views) when every
        parameter of the group is in ``states``; else ``None``. A state whose ``step`` was
        replaced (``load_state_dict``, a move to another device) no longer matches, and the
        block is made again from the new counts."""
        cached = self._step_blocks.get(index)
        if cached is not None:
            block, rows = cached
            if len(rows) == len(steps) and all(a is b for a, b in zip(rows, steps, strict=True)):
                return block
        if len(steps) != len(self.param_groups[index]["params"]):
            return None
        if len({(t.device, t.dtype, t.shape) for t in steps}) != 1:
            return None
        block = torch.stack(steps)
        rows = list(block.unbind(0))
        for state, row in zip(states, rows, strict=True):
            state["step"] = row
        self._step_blocks[index] = (block, rows)
        return block

    def _group_work(self, index: int, group: Group) -> Work:
        """The group's parameters that have gradients, their (initialised) states and their
        hyperparameter views."""
        views = self._member_views(index, group)
        params: list[Tensor] = []
        states: list[dict[str, Any]] = []
        hps: list[dict[str, Tensor]] = []
        for p in group["params"]:
            if p.grad is None:
                continue
            if p.grad.is_sparse:
                raise RuntimeError(f"{type(self).__name__} does not support sparse gradients")
            state = self.state[p]
            if not state:
                self._init_state(p, state, group)
            key = view_key(p)
            hp = views.get(key)
            if hp is None:
                hp = views[key] = self._views_for(group, p)
            params.append(p)
            states.append(state)
            hps.append(hp)
        return params, states, hps

    def compile(self, mode: str | None = None) -> None:
        """Compile every later step's update arithmetic with ``torch.compile`` (``mode``:
        inductor's default when ``None``), exactly the eager update's results within float
        rounding. The non-finite check, the idle members' rows and the step counts stay eager
        (they read the device into Python); graphs are shared by all optimizers of the same
        class, shapes and options. A call dynamo refuses runs uncompiled from then on, with one
        ``hfsweep.fusion.CompileFallbackWarning`` (see ``hfsweep.optim._compiled``)."""
        self._compiled = CompiledUpdate(type(self).__name__, mode)

    def _group_update(self, group: Group, flags: Flags) -> tuple[GroupUpdate, tuple[Any, ...]]:
        """The function updating one group, ``update(work, group, flags, *constants)``, and its
        constants: the subclasses' are plain functions of their arguments, what
        :meth:`compile` compiles; by default :meth:`_update_group` (this optimizer's)."""
        return self._update_group, ()

    def _update_group(self, work: Work, group: Group, flags: Flags) -> None:
        """Update every parameter of a group (see :meth:`_update`); subclasses may do it with
        multi-tensor operations, which run the same kernel on each tensor with less overhead."""
        each_parameter(self._update, work, group, flags)

    def _member_views(
        self, index: int, group: dict[str, Any]
    ) -> dict[tuple[int, torch.dtype], dict[str, Tensor]]:
        """The group's hyperparameters as ``[B, 1, ...]`` tensors by (dims, dtype), kept across
        steps while the ``[B]`` values are unchanged (same tensors, same in-place version: a
        schedule that writes new learning rates invalidates them)."""
        stamp = tuple((group[n], group[n]._version) for n in self.numeric)
        cached = self._view_cache.get(index)
        if cached is not None and _same_stamp(cached[0], stamp):
            return cached[1]
        views: dict[tuple[int, torch.dtype], dict[str, Tensor]] = {}
        self._view_cache[index] = (stamp, views)
        return views

    def _views_for(self, group: dict[str, Any], p: Tensor) -> dict[str, Tensor]:
        """``group``'s hyperparameters shaped and typed to broadcast against ``p``."""
        shape = (self.size, *([1] * (p.dim() - 1)))
        hp = {n: group[n].to(p.dtype).view(shape) for n in self.numeric}
        hp["neg_lr"] = -hp["lr"]
        return hp

    def _follow_device(self) -> None:
        """Keep the per-member tensors where the parameters are (``array.to(...)`` after the
        optimizer was made moves the parameters, not these)."""
        device = self.param_groups[0]["params"][0].device
        if self.active.device == device:
            return
        self.active = self.active.to(device)
        for group in self.param_groups:
            for name in (*self.numeric, "initial_lr"):
                if name in group:
                    group[name] = group[name].to(device)
        for state in self.state.values():
            if "step" in state:
                state["step"] = state["step"].to(device)
        self._refresh()

    def _nonfinite_total(self) -> Tensor:
        """``[B]``: the sum of each member's gradients, inf or NaN where one of them is. One
        reduction per parameter: inf and NaN survive a sum (accumulated in at least float32, so
        half-precision gradients cannot overflow it); a finite sum that overflowed would need
        gradients near 1e38."""
        sums = [
            g.to(_SUM_DTYPES.get(g.dtype, g.dtype))  # one value per member already (a copy
            if g.dim() == 1  # only for half precision: callers must not write into it)
            else g.sum(dim=tuple(range(1, g.dim())), dtype=_SUM_DTYPES.get(g.dtype, g.dtype))
            for group in self.param_groups
            for p in group["params"]
            if (g := p.grad) is not None
        ]
        if not sums:
            return torch.zeros(self.size, dtype=torch.float32, device=self.active.device)
        return sums[0] if len(sums) == 1 else torch.stack(sums).sum(0)

    def _any_nonfinite(self) -> bool:
        """Whether any gradient holds an inf or NaN, reading the gradients and writing nothing:
        one multi-tensor reduction per device and dtype (``torch._foreach_norm``: each
        gradient's 2-norm, inf or NaN where one of its values is), the norms' sum and one read
        of that scalar, instead of one reduction per parameter. A finite gradient whose norm
        overflows (values near 1e19 in float32; half precision is reduced in float32) passes
        for a non-finite one here, and the per-member sums that follow find no member: it
        costs that step a second pass, never a member. Gradients of other dtypes than the
        floating ones it takes are checked one by one (``isfinite``)."""
        groups: dict[tuple[torch.device, torch.dtype], list[Tensor]] = {}
        rest: list[Tensor] = []
        for group in self.param_groups:
            for p in group["params"]:
                g = p.grad
                if g is None or g.is_sparse:  # sparse: the step raises after the check
                    continue
                if g.dtype in _CHECK_DTYPES and g.layout == torch.strided:
                    groups.setdefault((g.device, g.dtype), []).append(g)
                else:
                    rest.append(g)
        if not groups and not rest:
            return False
        here = self.active.device
        norms: list[Tensor] = []
        for (_, dtype), grads in groups.items():
            found = torch._foreach_norm(grads, 2.0, dtype=_SUM_DTYPES.get(dtype))
            norms.extend(n.to(here) for n in found)
        for g in rest:
            norms.append(torch.where(torch.isfinite(g).all(), 0.0, math.inf).to(here))
        total = norms[0] if len(norms) == 1 else torch.stack(norms).sum()
        return not math.isfinite(cast(float, total.item()))

    def _nonfinite_members(self, inactive: Tensor | None) -> list[int]:
        """The members outside ``inactive`` whose gradients hold an inf or NaN, with one read
        of a scalar on the host per step: their sums' total is finite in the usual case, and
        only otherwise is each member looked at (inactive members' values are left out: a
        deactivated member's gradients may stay non-finite)."""
        if inactive is None:
            # all members active (the usual case): one operator over every gradient says
            # whether any value is non-finite; the per-member sums only when one is
            if not self._any_nonfinite():
                return []
            total = self._nonfinite_total()
        else:
            total = self._nonfinite_total().index_fill(0, inactive, 0)
            if math.isfinite(float(total.sum())):
                return []
        # x * 0 is 0 for finite x and NaN for inf and NaN
        return cast(list[int], total.mul(0).ne(0).nonzero().flatten().tolist())

    def _isolate(self, members: list[int], what: str) -> list[int]:
        """Deactivate ``members`` (host indices), record them and log why."""
        for i in members:
            self.active[i] = False
            self.nonfinite_members.append(i)
            _log.info("member %d has a non-finite %s: deactivated, the others go on", i, what)
        if members:
            self._refresh()
        return members

    def deactivate_nonfinite(self, losses: Tensor) -> list[int]:
        """Deactivate the active members whose entry of ``losses`` (``[B]``) is inf or NaN; return
        their indices. Call it with the per-member losses before ``backward``/``step``."""
        if losses.shape != (self.size,):
            raise ValueError(f"losses must have shape ({self.size},), got {tuple(losses.shape)}")
        bad = ~torch.isfinite(losses.detach()).to(self.active.device) & self.active
        return self._isolate(bad.nonzero().flatten().tolist(), "loss")

    def _refresh(self) -> None:
        """Recompute host-side facts about the hyperparameters and the active members after a
        change made from the host (the steps themselves then read nothing back from the device)."""
        self._host_values = {
            name: [g[name].tolist() for g in self.param_groups] for name in self.numeric
        }
        self._flags = [self._group_flags(g) for g in self.param_groups]
        active = self.active.tolist()
        self._active_host = active
        idle = [i for i, a in enumerate(active) if not a]
        self._inactive = (
            torch.tensor(idle, dtype=torch.long, device=self.active.device) if idle else None
        )
        self._generation += 1

    def _group_flags(self, group: dict[str, Any]) -> dict[str, bool]:
        """Which optional parts of the update any member of ``group`` needs (from the host
        copies :meth:`_refresh` has just taken)."""
        return {f"any_{n}": any(v != 0 for v in self._host(group, n)) for n in self.numeric}

    def _host(self, group: dict[str, Any], name: str) -> list[float]:
        """The host copy of ``group``'s ``[B]`` values of ``name``, as of the last refresh."""
        index = next(k for k, g in enumerate(self.param_groups) if g is group)
        return self._host_values[name][index]

    # ------------------------------------------------------------------ members
    def set_active(self, i: int, active: bool) -> None:
        """Freeze (``False``) or unfreeze member ``i``: an inactive member's parameters, state and
        step count do not change when the optimizer steps."""
        self.active[self._index(i)] = active
        self._refresh()

    def hyperparameters(self, i: int, group: int = 0) -> dict[str, float]:
        """Member ``i``'s numeric hyperparameters in param group ``group``."""
        i = self._index(i)
        g = self.param_groups[group]
        return {name: float(g[name][i]) for name in self.numeric}

    def set_hyperparameters(self, i: int, *, group: int | None = None, **values: float) -> None:
        """Set member ``i``'s hyperparameters (in every param group unless ``group`` is given)."""
        self._set_values(self._index(i), values, group)

    def _set_values(self, i: int, values: dict[str, float], group: int | None) -> None:
        unknown = sorted(set(values) - set(self.numeric))
        if unknown:
            raise ValueError(
                f"{type(self).__name__} has no per-member hyperparameter {unknown[0]!r}; valid "
                f"names are {list(self.numeric)}"
            )
        targets = self.param_groups if group is None else [self.param_groups[group]]
        for index, g in enumerate(targets):
            for name, value in values.items():
                g[name][i] = float(value)
            self._validate(g, index)
        self._refresh()

    def reset_member(self, i: int, **hyperparameters: float) -> None:
        """Clear member ``i``'s optimizer state (a new trial in a refilled slot) and set its
        hyperparameters; the member becomes active. LR schedulers attached to this optimizer
        restart member ``i``'s schedule from its (new) learning rate."""
        i = self._index(i)
        if hyperparameters:
            self._set_values(i, hyperparameters, None)
        for group in self.param_groups:
            if "lr" in hyperparameters and "initial_lr" in group:
                group["initial_lr"][i] = float(hyperparameters["lr"])
            for p in group["params"]:
                state = self.state[p]
                if state:
                    self._reset_state(state, i, group)
        self.set_active(i, True)
        for scheduler in self._schedulers:
            scheduler.reset_member(i)

    def member_state_dict(self, i: int) -> dict[str, Any]:
        """Member ``i``'s state as ``torch_class(array.member(i).parameters(), ...).state_dict()``
        would hold it after the same steps."""
        i = self._index(i)
        params = [p for g in self.param_groups for p in g["params"]]
        dummies = iter([nn.Parameter(torch.empty(0)) for _ in params])
        groups = []
        for g in self.param_groups:
            kwargs = self._torch_kwargs(g, i)
            groups.append({"params": [next(dummies) for _ in g["params"]], **kwargs})
        template = cast(Any, self.torch_class)(groups).state_dict()
        state: dict[int, dict[str, Any]] = {}
        for k, p in enumerate(params):
            st = self.state.get(p)
            if st and self._has_state(st, i, self._group_of(p)):
                state[k] = self._export_state(st, i, self._group_of(p))
        return {"state": state, "param_groups": template["param_groups"]}

    def load_member_state_dict(self, i: int, state_dict: dict[str, Any]) -> None:
        """Load a ``torch.optim`` state dict (of the matching class, for one member's parameters)
        into slot ``i``: hyperparameters and state."""
        i = self._index(i)
        if len(state_dict["param_groups"]) != len(self.param_groups):
            raise ValueError(
                f"state dict has {len(state_dict['param_groups'])} param groups, this optimizer "
                f"{len(self.param_groups)}"
            )
        for g, sg in zip(self.param_groups, state_dict["param_groups"], strict=True):
            for name, value in self._from_torch_group(sg).items():
                g[name][i] = value
        self._refresh()
        params = [p for g in self.param_groups for p in g["params"]]
        for k, p in enumerate(params):
            group = self._group_of(p)
            st = self.state[p]
            if not st:
                self._init_state(p, st, group)
            self._reset_state(st, i, group)
            if k in state_dict["state"]:
                self._import_state(st, i, state_dict["state"][k], group)

    # ------------------------------------------------------------------ whole optimizer
    def state_dict(self) -> dict[str, Any]:
        """torch's optimizer state dict, plus which members are active."""
        out = super().state_dict()
        out["hfsweep_active"] = self.active.clone()
        return out

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state dict saved by :meth:`state_dict` (of an optimizer of the same array shape)."""
        active = state_dict.get("hfsweep_active")
        super().load_state_dict({k: v for k, v in state_dict.items() if k != "hfsweep_active"})
        device = self.active.device
        for group in self.param_groups:  # own copies, on the parameters' device
            for name in self.numeric:
                group[name] = torch.as_tensor(group[name], dtype=torch.float64).to(device).clone()
        if active is not None:
            self.active.copy_(active)
        self._refresh()

    # ------------------------------------------------------------------ torch format
    def _torch_kwargs(self, group: dict[str, Any], i: int) -> dict[str, Any]:
        out: dict[str, Any] = {name: float(group[name][i]) for name in self.numeric}
        out.update({name: group[name] for name in self.options})
        return out

    def _from_torch_group(self, group: dict[str, Any]) -> dict[str, float]:
        return {name: float(group[name]) for name in self.numeric}

    def _has_state(self, st: dict[str, Any], i: int, group: dict[str, Any]) -> bool:
        """Whether torch would hold state for this parameter (it creates it at the first step)."""
        return float(st["step"][i]) > 0

    def _export_state(self, st: dict[str, Any], i: int, group: dict[str, Any]) -> dict[str, Any]:
        out: dict[str, Any] = {"step": torch.tensor(float(st["step"][i]))}
        for key in self.state_keys:
            out[key] = st[key][i].clone()
        return out

    def _import_state(
        self, st: dict[str, Any], i: int, src: dict[str, Any], group: dict[str, Any]
    ) -> None:
        if "step" in src:
            st["step"][i] = float(src["step"])
        for key in self.state_keys:
            if src.get(key) is not None:
                st[key][i].copy_(src[key])

    # ------------------------------------------------------------------ helpers
    def _group_of(self, p: Tensor) -> dict[str, Any]:
        for g in self.param_groups:
            if any(q is p for q in g["params"]):
                return g
        raise KeyError("parameter not in this optimizer")

    def _index(self, i: int) -> int:
        if not is_int(i) or not -self.size <= i < self.size:
            raise IndexError(f"member index {i!r} is out of range for {self.size} members")
        return int(i) % self.size

    def __repr__(self) -> str:
        lines = [f"{type(self).__name__} (B={self.size}, active={int(self.active.sum())})"]
        for index, g in enumerate(self.param_groups):
            values = ", ".join(f"{n}={_fmt(g[n])}" for n in (*self.numeric, *self.options))
            lines.append(f"  group {index}: {len(g['params'])} params, {values}")
        return "\n".join(lines)


def _fmt(value: Any) -> str:
    if isinstance(value, Tensor):
        vals = value.tolist()
        if all(v == vals[0] for v in vals):
            return f"{vals[0]:g}"
        return "[" + ", ".join(f"{v:g}" for v in vals) + "]"
    return repr(value)


def inactive_rows(
    params: list[Tensor], states: list[dict[str, Any]], inactive: Tensor | None
) -> list[tuple[Tensor, Tensor, Tensor]]:
    """``(tensor, rows, their values)`` of the inactive members in every parameter and state
    tensor, to write back after an update of all members; empty when all are active."""
    if inactive is None:
        return []
    return [
        (t, inactive, t.index_select(0, inactive))
        for p, state in zip(params, states, strict=True)
        for t in (p, *_tensors(state))
    ]


def _same_stamp(a: tuple[Any, ...], b: tuple[Any, ...]) -> bool:
    """Whether two ``(tensor, version)`` stamps name the same tensors at the same versions."""
    return len(a) == len(b) and all(
        x is y and vx == vy for (x, vx), (y, vy) in zip(a, b, strict=True)
    )


def _tensors(state: dict[str, Any]) -> list[Tensor]:
    return [v for v in state.values() if isinstance(v, Tensor)]
