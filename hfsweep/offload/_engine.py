"""The offload engine: a fused array kept in host storage and run on the compute side shard by
shard (:class:`OffloadedArray`).

One training step, for shards ``0..n-1``:

- forward (no autograd graph): shard k's parameters and buffers are on the compute side, shard
  k+1's are being copied in (prefetch), shard k computes; its buffers (BatchNorm statistics,
  dropout call counters) are written back to the host, its state is released, its output kept as
  the next shard's input (a *boundary activation*). The last shard's state stays for backward.
- backward, shards ``n-1..0``: shard k-1 is prefetched while shard k recomputes its forward from
  its saved boundary input (with autograd, its buffers as they were before the forward, so the
  recomputation is the forward's exact twin: same dropout masks, same batch statistics) and runs
  its backward; its parameter gradients go back to the host and are added to the host
  parameters' ``.grad`` as autograd would; the gradient of its input goes on to shard k-1.
- the optimizer steps on the host parameters (the fused optimizers of :mod:`hfsweep.optim` work
  on the stacked host tensors; nothing of it is on the compute side).

Why not PyTorch's own. ``torch.utils.checkpoint`` recomputes a segment with the parameters it ran
with, which here have left the compute side by then, and it would run each forward's buffer
updates twice; the engine recomputes itself, with the shard fetched again and its buffers put
back. FSDP2's ``CPUOffloadPolicy`` (``fully_shard(..., offload_policy=CPUOffloadPolicy())``)
keeps parameters on the host and runs the optimizer there, but it turns parameters into
``DTensor``\\ s sharded over a process group and unshards them per module with its own hooks:
the fused array's stacked tensors are swapped in and out of one module tree under ``vmap`` and
replayed from traces, which FSDP's parameter management does not see. What the engine does use
from PyTorch: pinned memory, ``non_blocking`` copies on a side stream with events
(:class:`~hfsweep.offload.CudaTransfer`), ``torch.fx`` to find where a model can be cut, and
autograd (``torch.autograd.Function``, ``torch.autograd.backward``) for the shard-wise backward.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from ..fusion import FusedArray
from ._errors import OffloadError
from ._ledger import ResidentLedger
from ._shards import Shard, plan_shards, stacked_bytes
from ._transfer import Fetch, Transfer, default_transfer

__all__ = ["OffloadedArray"]


class _Resident:
    """A shard's tensors on the compute side, counted in the ledger until released."""

    def __init__(self, fetch: Fetch, nbytes: int, ledger: ResidentLedger, kind: str) -> None:
        self._fetch = fetch
        self._tensors: list[Tensor] | None = None
        self.nbytes = nbytes
        self._ledger = ledger
        self._kind = kind
        ledger.add(kind, nbytes)  # counted from the moment the copy is started

    def tensors(self) -> list[Tensor]:
        if self._tensors is None:
            self._tensors = self._fetch.wait()
        return self._tensors

    def release(self) -> None:
        if self.nbytes >= 0:
            if self._tensors is None:
                self._fetch.wait()  # a copy still under way finishes before it is dropped
            self._ledger.remove(self._kind, self.nbytes)
            self.nbytes = -1
            self._tensors = None


class _Held:
    """A boundary activation kept on the compute side, counted in the ledger."""

    def __init__(self, value: Tensor, ledger: ResidentLedger) -> None:
        self.value: Tensor | None = value
        self.nbytes = stacked_bytes([value])
        self._ledger = ledger
        ledger.add("boundary activations", self.nbytes)

    def release(self) -> None:
        if self.value is not None:
            self._ledger.remove("boundary activations", self.nbytes)
            self.value = None


class _Sharded(torch.autograd.Function):
    """Autograd's view of one offloaded forward: its backward runs the engine's backward."""

    @staticmethod
    def forward(ctx: Any, engine: OffloadedArray, x: Tensor, anchor: Tensor) -> Tensor:
        ctx.engine = engine
        out = engine._forward(x, keep=True)
        ctx.generation = engine._generation
        return out

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[None, Tensor | None, None]:
        return None, ctx.engine._backward(grad, ctx.generation), None


class OffloadedArray:
    """``array`` (a :class:`~hfsweep.fusion.FusedArray`) kept in host storage and run on
    ``device`` shard by shard; call it like the array (``engine(x)``, one shared input tensor).

    The array's stacked tensors stay where the optimizer, checkpoints and ``member(i)`` expect
    them, in host memory (pinned on CUDA); on the compute side the engine holds at most the
    shard computing, the next one being prefetched, the computing shard's gradients and the
    boundary activations, all counted in :attr:`ledger` against ``budget_bytes``. Shards hold at
    most a quarter of the budget each (the other quarter is for the boundary activations);
    without a budget (``None``: no limit, only recorded) they hold at most a quarter of the
    array's stacked state, so the model still runs as four shards or more where it can be cut.

    ``transfer`` moves tensors (default: :func:`~hfsweep.offload.default_transfer` for
    ``device``); ``prefetch=False`` fetches each shard only when it is needed (no overlap; the
    benchmark's baseline). ``shard_bytes`` sets the shard limit itself (a hard limit when a
    budget is given). Exactly the array's results: same outputs, gradients and buffer
    updates, within float rounding.
    """

    def __init__(
        self,
        array: FusedArray,
        *,
        device: str | torch.device = "cpu",
        budget_bytes: int | None = None,
        transfer: Transfer | None = None,
        prefetch: bool = True,
        shard_bytes: int | None = None,
    ) -> None:
        if not isinstance(array, FusedArray):
            raise OffloadError(f"offload needs a FusedArray (hs.fuse), got {type(array).__name__}")
        self.device = torch.device(device)
        self.transfer = transfer if transfer is not None else default_transfer(self.device)
        if self.transfer.device.type != self.device.type:
            raise OffloadError(
                f"transfer moves to {self.transfer.device}, the engine computes on {self.device}"
            )
        self.array = array
        self.prefetch = bool(prefetch)
        self.ledger = ResidentLedger(budget_bytes)
        self._to_host_storage()
        total = stacked_bytes(array._state())
        if shard_bytes is not None:
            if isinstance(shard_bytes, bool) or not isinstance(shard_bytes, int) or shard_bytes < 1:
                raise OffloadError(f"shard_bytes must be an int >= 1, got {shard_bytes!r}")
            limit = shard_bytes
        elif budget_bytes is not None:
            limit = budget_bytes // 4
        else:
            limit = max(math.ceil(total / 4), 1)
        #: the shards, in forward order
        self.shards: list[Shard] = plan_shards(array, limit, strict=budget_bytes is not None)
        self._anchor = torch.zeros((), requires_grad=True)
        self._input: Tensor | None = None
        self._saved: list[_Held] = []
        self._before: list[list[Tensor]] = []
        self._last: _Resident | None = None
        #: every shard fetched since the last release (released ones included)
        self._outstanding: list[_Resident] = []
        #: counts the forwards kept for backward: a backward must be the latest one's
        self._generation = 0

    # ------------------------------------------------------------------ public
    def __call__(self, x: Tensor) -> Tensor:
        """Every member's output on the shared input ``x`` (``[B, N, ...]``), as ``array(x)``.
        With autograd on, ``backward`` through the result runs the engine's backward."""
        if not isinstance(x, Tensor):
            raise OffloadError(f"an offloaded array takes one tensor input, got {type(x).__name__}")
        if torch.is_grad_enabled():
            out: Tensor = _Sharded.apply(self, x, self._anchor)
            return out
        return self._forward(x, keep=False)

    def close(self) -> None:
        """Drop what is held on the compute side and stop the transfer's threads or streams."""
        self._release()
        self.transfer.close()

    # ------------------------------------------------------------------ internals
    def _to_host_storage(self) -> None:
        """Every stacked tensor on the CPU, in the transfer's host storage (pinned on CUDA)."""
        with torch.no_grad():
            for slot in self.array._slots:
                d, name = slot.places[0]
                t = d[name]
                host = self.transfer.host_storage(t.detach().to("cpu"))
                if host.data_ptr() == t.data_ptr() and t.device == host.device:
                    continue  # already host storage
                if isinstance(t, torch.nn.Parameter):
                    t.data = host  # the optimizer's references stay valid
                else:
                    for place, key in slot.places:
                        place[key] = host

    def _host(self, shard: Shard) -> list[Tensor]:
        return [
            self.array._slots[j].places[0][0][self.array._slots[j].places[0][1]]
            for j in shard.slots
        ]

    def _buffers(self, shard: Shard) -> list[int]:
        """Positions, within the shard's tensors, of its buffers (what a forward may write)."""
        return [i for i, j in enumerate(shard.slots) if not self.array._slots[j].is_param]

    def _fetch(self, k: int, buffers: Sequence[Tensor] | None = None) -> _Resident:
        """Start copying shard ``k``'s tensors in, its buffers from ``buffers`` when given."""
        shard = self.shards[k]
        host = self._host(shard)
        if buffers is not None:
            for i, value in zip(self._buffers(shard), buffers, strict=True):
                host[i] = value
        resident = _Resident(self.transfer.fetch(host), shard.nbytes, self.ledger, "shard state")
        self._outstanding.append(resident)
        return resident

    def _run(self, shard: Shard, tensors: Sequence[Tensor], x: Tensor, first: bool) -> Tensor:
        """Shard ``shard``'s forward with ``tensors`` in place of its host tensors."""
        slots = [self.array._slots[j] for j in shard.slots]
        host = self._host(shard)
        for slot, t in zip(slots, tensors, strict=True):
            for d, name in slot.places:
                d[name] = t
        try:
            out = shard.array(x, shared=first)
        finally:
            for slot, t in zip(slots, host, strict=True):
                for d, name in slot.places:
                    d[name] = t
        if not isinstance(out, Tensor):
            raise OffloadError(
                f"offload passes one tensor between shards; layers {shard.nodes} returned "
                f"{type(out).__name__}"
            )
        return out

    def _release(self) -> None:
        """Let go of what an earlier forward kept (its backward never came, or it is done)."""
        for resident in self._outstanding:  # after an error too: nothing stays counted
            resident.release()
        self._outstanding = []
        self._last = None
        for held in self._saved:
            held.release()
        self._saved = []
        self._before = []
        self._input = None

    def _forward(self, x: Tensor, keep: bool) -> Tensor:
        """Run every shard on ``x``; with ``keep``, save what the backward needs."""
        self._release()
        try:
            return self._forward_shards(x, keep)
        except BaseException:
            self._release()
            raise

    def _forward_shards(self, x: Tensor, keep: bool) -> Tensor:
        n = len(self.shards)
        with torch.no_grad(), self.ledger.phase("forward"):
            pending = self._fetch(0)
            value = x
            for k, shard in enumerate(self.shards):
                resident = pending
                if self.prefetch and k + 1 < n:
                    pending = self._fetch(k + 1)
                tensors = resident.tensors()
                at = self._buffers(shard)
                host = self._host(shard)
                if keep:
                    self._before.append([host[i].clone() for i in at])
                value = self._run(shard, tensors, value, first=k == 0)
                if at:  # the forward's buffer updates go back to the host
                    written = self.transfer.to_host([tensors[i] for i in at])
                    for i, w in zip(at, written, strict=True):
                        host[i].copy_(w)
                if keep and k == n - 1:
                    for i, before in zip(at, self._before[k], strict=True):
                        tensors[i].copy_(before)  # the recomputation starts from these
                    self._last = resident
                else:
                    resident.release()
                if keep and k < n - 1:
                    self._saved.append(_Held(value, self.ledger))
                if not self.prefetch and k + 1 < n:
                    pending = self._fetch(k + 1)
        if keep:
            self._input = x
            self._generation += 1
        return value

    def _backward(self, grad: Tensor, generation: int) -> Tensor | None:
        """Shard by shard from the last: recompute, backward, gradients to the host. Returns the
        gradient of the input (``None`` when it needs none)."""
        if generation != self._generation or self._input is None:
            raise OffloadError(
                "an offloaded array keeps one forward for backward at a time: backward went "
                "through the output of an earlier forward, released by a later one"
            )
        try:
            return self._backward_shards(grad)
        finally:
            self._release()

    def _backward_shards(self, grad: Tensor) -> Tensor | None:
        x = self._input
        if x is None or self._last is None:
            raise OffloadError(
                "an offloaded array keeps one forward for backward at a time: backward went "
                "through the output of an earlier forward, released by a later one"
            )
        n = len(self.shards)
        resident: _Resident | None = self._last
        self._last = None
        x_grad: Tensor | None = None
        with self.ledger.phase("backward"):
            for k in reversed(range(n)):
                shard = self.shards[k]
                if resident is None:
                    resident = self._fetch(k, self._before[k])
                pending = None
                if self.prefetch and k > 0:
                    pending = self._fetch(k - 1, self._before[k - 1])
                grad = self._shard_backward(k, shard, resident, grad, x)
                resident.release()
                if k > 0:
                    self._saved[k - 1].release()
                elif x.requires_grad:
                    x_grad = grad
                resident = pending
        return x_grad

    def _shard_backward(
        self, k: int, shard: Shard, resident: _Resident, grad: Tensor, x: Tensor
    ) -> Tensor:
        """Recompute shard ``k`` with autograd and run its backward from ``grad``; add its
        parameter gradients to the host's. Returns its input's gradient."""
        tensors = resident.tensors()
        params = [self.array._slots[j] for j in shard.slots]
        host = self._host(shard)
        trained = [
            i
            for i, (slot, h) in enumerate(zip(params, host, strict=True))
            if slot.is_param and h.requires_grad
        ]
        for i in trained:
            tensors[i].requires_grad_(True)
        if k == 0:
            source = x.detach().requires_grad_(x.requires_grad)
        else:
            saved = self._saved[k - 1].value
            assert saved is not None
            source = saved.detach().requires_grad_(True)
        with torch.enable_grad():
            out = self._run(shard, tensors, source, first=k == 0)
        inputs = [tensors[i] for i in trained]
        if source.requires_grad:
            inputs.append(source)
        if not inputs:
            return grad
        grads = torch.autograd.grad(out, inputs, grad, allow_unused=True)
        # a parameter the shard did not use gets no gradient, as with autograd on the array
        used = [(i, g) for i, g in zip(trained, grads, strict=False) if g is not None]
        param_grads = [g for _, g in used]
        nbytes = stacked_bytes(param_grads)
        self.ledger.add("gradients", nbytes)
        try:
            back = self.transfer.to_host(param_grads)
        finally:
            self.ledger.remove("gradients", nbytes)
        del param_grads
        with torch.no_grad():
            for (i, _), g in zip(used, back, strict=True):
                p = host[i]
                if p.grad is None:
                    p.grad = g
                else:
                    p.grad.add_(g)
        return grads[-1] if source.requires_grad else grad
