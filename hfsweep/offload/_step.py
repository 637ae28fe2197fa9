"""The optimizer step on the compute device, shard by shard (``offload_step="device"``).

With the host step (the default) a shard's parameter gradients go back to the host after its
backward and the fused optimizer of :mod:`hfsweep.optim` steps the stacked host tensors once the
whole backward is done. With the device step (:meth:`OffloadedArray.step_on_device
<hfsweep.offload.OffloadedArray.step_on_device>`) the engine steps each shard right after its
backward, while its parameters are still on the compute side: the shard's optimizer state is
fetched through the engine's transfer as its backward starts (counted in the ledger as
``"optimizer state"``), the optimizer's own group update (the very function its ``step`` runs,
multi-tensor or compiled) updates the shard's parameters and state there, and both are written
back to the host; the gradients never leave the device and the host never runs the step.

:class:`_DeviceStep` mirrors :meth:`FusedOptimizer.step <hfsweep.optim.FusedOptimizer.step>` for
one shard's parameters: inactive members (frozen ones, those isolated earlier) get their rows
back after the update, every stepped parameter's ``step`` count goes up by one, and members
whose gradients in this shard are not finite are isolated (the optimizer's own ``_isolate``:
recorded in ``nonfinite_members``, deactivated) before the shard's update. The backward reaches
the shards from the last, so a member whose loss or output is not finite is caught at the first
shard stepped, before any of its tensors moved; one whose gradients become non-finite only in an
earlier shard (finite further on) is isolated from that shard on, the shards stepped before
keeping this step's update (the host step, which sees every gradient first, leaves all of them
as they were). Clipping by a norm over all shards cannot be stepped shard by shard: the
trainer refuses it with ``offload_step="device"``; the AMP scaler, which unscales and skips by
the host gradients, is not used with the device step (see docs/offload.md).

``optimizer.step()`` is not called, so :class:`_DeviceStep` runs torch's optimizer step hooks
itself, once per step as ``step`` would: the pre hooks (the global ones of
``torch.optim.optimizer.register_optimizer_step_pre_hook``, then the optimizer's
``register_step_pre_hook`` ones) before the first shard's update, the post hooks (the
optimizer's, then the global ones) after the last shard's, all with ``(optimizer, (optimizer,),
{})``. A hook sees what ``step`` would show it, but for the gradients: those never leave the
device, so the host parameters' ``.grad`` is ``None``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from itertools import chain
from typing import TYPE_CHECKING, Any

import torch
import torch.optim.optimizer as _optim_hooks
from torch import Tensor

from ..optim import FusedOptimizer, inactive_rows
from ._shards import stacked_bytes

if TYPE_CHECKING:
    from ._resident import _Resident
    from ._view import EngineView

__all__: list[str] = []

#: the dtype a gradient's per-member sum is taken in for the non-finite check
_SUM_DTYPES = {torch.float16: torch.float32, torch.bfloat16: torch.float32}


class _DeviceStep:
    """Steps ``optimizer``'s parameters one shard at a time on ``device`` (see the module).

    The parameters are the host tensors the optimizer holds; the engine hands each shard's
    compute-side copies, their gradients and their fetched state to :meth:`step`, and writes
    back what it returns."""

    def __init__(self, optimizer: FusedOptimizer, device: torch.device) -> None:
        if not isinstance(optimizer, FusedOptimizer):
            raise TypeError(
                "the device step runs an hs.optim optimizer's update; got "
                f"{type(optimizer).__name__}"
            )
        self.optimizer = optimizer
        self.device = device
        #: id of each host parameter -> the index of its param group
        self._groups = {
            id(p): index
            for index, group in enumerate(optimizer.param_groups)
            for p in group["params"]
        }
        #: per param group, its values on the device (made once per backward)
        self._device_groups: dict[int, dict[str, Any]] = {}
        #: shards of this backward whose update has begun (their host tensors may have moved:
        #: such a step cannot be replayed)
        self.written = 0
        #: whether this backward's step ran the pre hooks (then :meth:`finish` runs the post)
        self._hooked = False

    @property
    def parts(self) -> int:
        """How many tensors of a parameter's size its state holds (the shard sizing leaves
        room for them): Adam's two moments, SGD's momentum buffer, ..."""
        return len(self.optimizer.state_keys)

    def begin(self) -> None:
        """A backward starts: the hyperparameters (an LR schedule may have moved them since the
        last step) are taken to the device again when first needed."""
        self._device_groups = {}
        self.written = 0
        self._hooked = False

    def finish(self) -> None:
        """The backward is done, every shard stepped: the optimizer's step post hooks, once,
        where its pre hooks ran (some shard was stepped)."""
        if not self._hooked:
            return
        self._hooked = False
        opt = self.optimizer
        args = (opt,)
        for hook in chain(
            opt._optimizer_step_post_hooks.values(),
            _optim_hooks._global_optimizer_post_hooks.values(),
        ):
            hook(opt, args, {})

    def _pre_hooks(self) -> None:
        """The optimizer's step pre hooks, as ``step`` runs them (a hook may return new
        arguments, which the device step, called with none, has no use for)."""
        self._hooked = True
        opt = self.optimizer
        args: tuple[Any, ...] = (opt,)
        kwargs: dict[str, Any] = {}
        for hook in chain(
            _optim_hooks._global_optimizer_pre_hooks.values(),
            opt._optimizer_step_pre_hooks.values(),
        ):
            result = hook(opt, args, kwargs)
            if result is not None:
                if not (isinstance(result, tuple) and len(result) == 2):
                    raise RuntimeError(
                        "an optimizer step pre hook must return None or a tuple of (new_args, "
                        f"new_kwargs), but got {result}"
                    )
                args, kwargs = result

    def steps(self, p: Tensor) -> bool:
        """Whether ``p`` (a host parameter) is this optimizer's to step."""
        return id(p) in self._groups

    def state_tensors(self, params: Sequence[Tensor]) -> list[Tensor]:
        """The host state tensors of ``params`` in order (``step`` first, then the state
        keys), each state made first where the optimizer has none yet, as its step would."""
        opt = self.optimizer
        out: list[Tensor] = []
        for p in params:
            group = opt.param_groups[self._groups[id(p)]]
            state = opt.state[p]
            if not state:
                opt._init_state(p, state, group)
            out.extend(_state_values(state))
        return out

    def _device_group(self, index: int) -> dict[str, Any]:
        group = self._device_groups.get(index)
        if group is None:
            host = self.optimizer.param_groups[index]
            group = {
                k: v.to(self.device) if isinstance(v, Tensor) else v
                for k, v in host.items()
                if k != "params"
            }
            self._device_groups[index] = group
        return group

    @torch.no_grad()
    def step(
        self,
        host: Sequence[Tensor],
        params: Sequence[Tensor],
        grads: Sequence[Tensor],
        state: Sequence[Tensor],
    ) -> list[Tensor]:
        """One update of every active member of the shard's parameters ``params`` (compute
        side; ``host``: the optimizer's parameters they are copies of) with ``grads`` and
        their ``state`` (:meth:`state_tensors`' order, on the compute side), in place. Returns
        the tensors to write back, in ``host`` order: each parameter, then its state."""
        opt = self.optimizer
        if not params:
            return []
        if not self._hooked:  # the step's first shard
            self._pre_hooks()
        if opt.isolate_nonfinite:
            bad = _nonfinite(grads, opt._inactive)
            if bad:
                opt._isolate(bad, "gradient")
        inactive = None if opt._inactive is None else opt._inactive.to(self.device)
        states: list[dict[str, Tensor]] = []
        at = 0
        for p in host:
            keys = list(_state_keys(opt.state[p]))
            states.append(dict(zip(keys, state[at : at + len(keys)], strict=True)))
            at += len(keys)
        by_group: dict[int, list[int]] = {}
        for i, p in enumerate(host):
            by_group.setdefault(self._groups[id(p)], []).append(i)
        for index, positions in by_group.items():
            group = self._device_group(index)
            flags = opt._flags[index]
            views: dict[Any, dict[str, Tensor]] = {}
            work_params: list[Tensor] = []
            work_states: list[dict[str, Tensor]] = []
            hps: list[dict[str, Tensor]] = []
            for i in positions:
                p = params[i]
                p.grad = grads[i]
                key = (p.dim(), p.dtype)
                hp = views.get(key)
                if hp is None:
                    hp = views[key] = opt._views_for(group, p)
                work_params.append(p)
                work_states.append(states[i])
                hps.append(hp)
            work = (work_params, work_states, hps)
            saved = inactive_rows(work_params, work_states, inactive)
            update, constants = opt._group_update(opt.param_groups[index], flags)
            try:
                if opt._compiled is None:
                    update(work, group, flags, *constants)
                else:
                    opt._compiled(update, work, group, flags, *constants)
            finally:
                for p in work_params:
                    p.grad = None
            torch._foreach_add_([s["step"] for s in work_states], 1)
            for t, rows, values in saved:
                t.index_copy_(0, rows, values)
        out: list[Tensor] = []
        for p, s in zip(params, states, strict=True):
            out.append(p)
            out.extend(s.values())
        return out


def _state_keys(state: dict[str, Any]) -> list[str]:
    """The tensor entries of one parameter's optimizer state, ``step`` first."""
    keys = [k for k, v in state.items() if isinstance(v, Tensor)]
    return sorted(keys, key=lambda k: (k != "step", keys.index(k)))


def _state_values(state: dict[str, Any]) -> list[Tensor]:
    return [state[k] for k in _state_keys(state)]


def _nonfinite(grads: Sequence[Tensor], inactive: Tensor | None) -> list[int]:
    """The members outside ``inactive`` whose ``grads`` (``[B, ...]`` each) hold an inf or
    NaN, with one read of a scalar where none does (as the optimizer's own check)."""
    sums = [
        (
            g.to(_SUM_DTYPES.get(g.dtype, g.dtype))
            if g.dim() == 1
            else g.sum(dim=tuple(range(1, g.dim())), dtype=_SUM_DTYPES.get(g.dtype, g.dtype))
        ).to(torch.float64)
        for g in grads
    ]
    if not sums:
        return []
    total = torch.stack(sums).sum(0)
    if inactive is not None:
        total = total.index_fill(0, inactive.to(total.device), 0)
    if math.isfinite(float(total.sum())):
        return []
    # x * 0 is 0 for finite x and NaN for inf and NaN
    return [int(i) for i in total.mul(0).ne(0).nonzero().flatten().tolist()]


def _step_shard(
    engine: EngineView,
    stepper: _DeviceStep,
    host: Sequence[Tensor],
    tensors: Sequence[Tensor],
    stepped: Sequence[tuple[int, Tensor]],
    state: tuple[list[Tensor], _Resident | None],
) -> None:
    """``engine``'s device step of a shard's parameters at ``stepped`` (positions within the
    shard's tensors and their gradients): update them and their ``state`` (the fetch
    :meth:`OffloadedArray._fetch_state` started) on the compute side with ``stepper``, write
    both back to the ``host`` tensors."""
    params = [host[i] for i, _ in stepped]
    fetched, resident = state
    if resident is None or [id(p) for p in fetched] != [id(p) for p in params]:
        # a first step (states made now) or a parameter without a gradient: fetch the
        # states of exactly those stepped, as the host step would make and update them
        if resident is not None:
            resident.release()
        resident = engine._fetch_tensors(stepper.state_tensors(params), "optimizer state")
    grads = [g for _, g in stepped]
    nbytes = stacked_bytes(grads)
    engine.ledger.add("gradients", nbytes)
    stepper.written += 1
    try:
        with engine.ledger.phase("step"):
            out = stepper.step(params, [tensors[i] for i, _ in stepped], grads, resident.tensors())
        back = engine.transfer.to_host(out)
        targets: list[Tensor] = []
        for p in params:
            targets.append(p)
            targets.extend(_state_values(stepper.optimizer.state[p]))
        with torch.no_grad():
            for t, b in zip(targets, back, strict=True):
                t.copy_(b)
    finally:
        engine.ledger.remove("gradients", nbytes)
        resident.release()
