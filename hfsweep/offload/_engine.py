"""The offload engine: a fused array kept in host storage and run on the compute side shard by
shard (:class:`OffloadedArray`).

This module runs shards cut along a ``torch.fx`` trace; a model cut between its blocks instead
(``cut="blocks"``) runs its own forward with its units streamed by
:class:`~hfsweep.offload._streamed.BlockRunner`, under the same ledger, budget and transfer.

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
  on the stacked host tensors; nothing of it is on the compute side); or, after
  :meth:`OffloadedArray.step_on_device`, each shard is stepped on the compute side right after
  its backward, its optimizer state fetched for it and written back with its parameters
  (module ``_step``).

Frozen tensors kept once for all members (``share_frozen``) are kept once in host storage too,
copied in once per shard for all members and never given a gradient; a member-independent
shard (see :mod:`._shards`) runs once for all members. The backward stops at the first shard
that trains a parameter (or at the input, where it needs a gradient): the shards before it (a
frozen backbone in front of trained heads) are neither fetched nor recomputed, as autograd on
the whole array would not go through them either.

Why not PyTorch's own: ``torch.utils.checkpoint`` recomputes with the parameters it ran with
(gone from the compute side by then) and runs buffer updates twice; FSDP2's
``CPUOffloadPolicy`` shards ``DTensor`` parameters over a process group with its own per-module
hooks, which the fused array's stacked tensors, swapped under ``vmap`` and replayed from
traces, escape. Used from PyTorch: pinned memory, ``non_blocking``
copies on a side stream with events (:class:`~hfsweep.offload.CudaTransfer`), ``torch.fx`` to
find cuts, and autograd for the shard-wise backward.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Generator, Sequence
from typing import Any, TypeVar

import torch
from torch import Tensor

from ..fusion import FusedArray
from ._errors import OffloadError
from ._ledger import ResidentLedger
from ._resident import _Held, _Resident, grads_to_host
from ._shards import Shard, plan_shards, stacked_bytes
from ._step import _DeviceStep, _step_shard
from ._streamed import BlockRunner
from ._transfer import Transfer, default_transfer
from ._units import plan_units

__all__ = ["CUTS", "OffloadedArray"]

_T = TypeVar("_T")


def _drain(steps: Generator[None, None, _T]) -> _T:
    """Run ``steps`` to the end (one array alone: nothing runs between its shards)."""
    while True:
        try:
            next(steps)
        except StopIteration as done:
            return done.value


#: how the engine may cut a model: ``graph`` (a ``torch.fx`` trace), ``blocks`` (its repeated
#: blocks, streamed while its own forward runs), ``auto`` (the graph, else the blocks)
CUTS = ("auto", "graph", "blocks")


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
    benchmark's baseline). ``prefetch_depth`` (default 1) is how many shards ahead of the one
    computing are fetched or on their way: more keeps a slow link busy while other arrays
    compute (:class:`~hfsweep.offload.AlternatingArrays`); with a budget, the shard limit is
    then the budget over ``prefetch_depth + 3`` (a quarter at depth 1), leaving a part for the
    boundary activations. ``shard_bytes`` sets the shard limit itself (a hard limit with a
    budget). Exactly the array's results (outputs, gradients, buffer updates) within rounding.

    ``ledger`` counts the engine's bytes in a ledger it shares with other engines (arrays
    stepped together, :class:`~hfsweep.offload.AlternatingArrays`) instead of a ledger of its
    own; its budget is then the budget.

    ``cut`` says how the model is cut: ``"graph"`` along a ``torch.fx`` trace of its forward
    (module ``_shards``), ``"blocks"`` between its repeated blocks while its own forward runs
    (modules ``_units``, ``_streamed``: for models fx cannot cut, such as transformers'
    encoders), ``"auto"`` (the default) the graph, else the blocks where the graph cannot cut
    it within the shard limit (or cannot be traced).
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
        cut: str = "auto",
        ledger: ResidentLedger | None = None,
        prefetch_depth: int = 1,
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
        if (
            isinstance(prefetch_depth, bool)
            or not isinstance(prefetch_depth, int)
            or prefetch_depth < 1
        ):
            raise OffloadError(f"prefetch_depth must be an int >= 1, got {prefetch_depth!r}")
        #: how many shards ahead of the one computing are fetched (with prefetch)
        self.prefetch_depth = prefetch_depth
        if ledger is not None and budget_bytes not in (None, ledger.budget):
            raise OffloadError(
                f"budget_bytes={budget_bytes} with a ledger of budget {ledger.budget}: give one"
            )
        if ledger is not None:
            budget_bytes = ledger.budget
        self.ledger = ledger if ledger is not None else ResidentLedger(budget_bytes)
        if shard_bytes is not None and (
            isinstance(shard_bytes, bool) or not isinstance(shard_bytes, int) or shard_bytes < 1
        ):
            raise OffloadError(f"shard_bytes must be an int >= 1, got {shard_bytes!r}")
        self._shard_bytes = shard_bytes
        self._budget = budget_bytes
        #: the optimizer step on the compute side (:meth:`step_on_device`), or ``None``: host
        self._stepper: _DeviceStep | None = None
        #: parameter-sized tensors of optimizer state the shard limit leaves room for: the
        #: device step's optimizer's, none on the host step
        self._reserved = 0
        #: every cut made, by shard limit and layout (a step switched back finds its own)
        self._cuts: dict[tuple[int, tuple[bool, ...]], tuple[list[Shard], BlockRunner | None]]
        self._cuts = {}
        if cut not in CUTS:
            raise OffloadError(f"cut must be one of {CUTS}, got {cut!r}")
        self.cut = cut
        #: the runner of the model's own forward where it is streamed unit by unit
        self._blocks: BlockRunner | None = None
        #: the shards, in forward order
        self.shards: list[Shard] = []
        self._layout: tuple[bool, ...] = ()
        self._plan()
        #: the first shard the latest kept forward's backward runs (see _first_backward)
        self._stop = 0
        self._anchor = torch.zeros((), requires_grad=True)
        self._input: Tensor | None = None
        self._saved: list[_Held] = []
        self._before: list[list[Tensor]] = []
        self._last: _Resident | None = None
        #: every shard fetched since the last release (released ones included)
        self._outstanding: list[_Resident] = []
        #: counts the forwards kept for backward: a backward must be the latest one's
        self._generation = 0
        #: the fetch a step suspended between shards waits on (``None``: fetched on resume)
        self._waiting: _Resident | None = None
        #: its fetches go first on a shared link (``AlternatingArrays(urgent=...)``)
        self._urgent = False

    # ------------------------------------------------------------------ public
    def __call__(self, x: Tensor) -> Tensor:
        """Every member's output on the shared input ``x`` (``[B, N, ...]``), as ``array(x)``.
        With autograd on, ``backward`` through the result runs the engine's backward."""
        if not isinstance(x, Tensor):
            raise OffloadError(f"an offloaded array takes one tensor input, got {type(x).__name__}")
        if self._blocks is not None:
            self._replan_if_unshared()
            if self._blocks is not None:
                return self._blocks(x)
        if torch.is_grad_enabled():
            out: Tensor = _Sharded.apply(self, x, self._anchor)
            return out
        return self._forward(x, keep=False)

    def close(self) -> None:
        """Drop what is held on the compute side and stop the transfer's threads or streams."""
        self._release()
        self.transfer.close()

    @property
    def shards_stepped(self) -> int:
        """Shards this backward's device step has begun to update (then it cannot be replayed)."""
        return self._stepper.written if self._stepper is not None else 0

    @property
    def steps_on_device(self) -> bool:
        """Whether a backward steps the optimizer shard by shard (never for a streamed model)."""
        return self._stepper is not None and self._blocks is None

    def step_on_device(self, optimizer: Any | None) -> None:
        """Step ``optimizer`` (an ``hs.optim`` optimizer of this array's parameters) on the
        compute side, each shard right after its backward (``None``: back to the host step,
        the default). Its parameters' gradients then never reach the host: ``optimizer.step()``
        is not called (with no host gradients it would do nothing), an LR schedule steps as
        usual after the backward. With a budget, the shards are cut for the step in use
        (between steps only): leaving room for one shard's optimizer state beside the shards
        held on the device step, none on the host step, so that a host step is cut as it is
        without ever stepping on the device; each cut is made once and kept, so switching back
        and forth traces nothing again. A model streamed between its blocks is refused (a
        tensor tied into two units is in two shards and would be stepped twice), and so is a
        cut the budget cannot hold; either way the engine stays as it was."""
        if self._stepper is not None and self._stepper.optimizer is optimizer:
            return  # as it is (the trainer says so before every step)
        stepper = None if optimizer is None else _DeviceStep(optimizer, self.device)
        before = self._stepper, self._reserved
        self._stepper, self._reserved = stepper, 0 if stepper is None else stepper.parts
        try:
            if self._reserved != before[1] and self._budget is not None:
                self._release()
                self._plan()
            if stepper is not None and self._blocks is not None:  # the re-cut fell back too
                raise OffloadError(
                    "offload_step='device' steps each shard after its backward; this model is "
                    "streamed between its blocks (cut='blocks'), which is not supported yet: "
                    "use offload_step='host'"
                )
        except BaseException:
            replanned = self._reserved != before[1] and self._budget is not None
            self._stepper, self._reserved = before
            if replanned:
                self._plan()  # the cut it had, kept
            raise

    # ------------------------------------------------------------------ internals
    def _plan(self) -> None:
        """Put the array's tensors in host storage and cut it into shards, for the layout its
        tensors have now (which are kept once for all members), or take the cut made before
        for this limit and layout."""
        self._to_host_storage()
        self._layout = tuple(s.shared for s in self.array._slots)
        if self._shard_bytes is not None:
            limit = self._shard_bytes
        elif self._budget is not None:
            # the shard computing, the depth's shards ahead and the gradients (at most a
            # shard) take depth + 2 parts, the boundary activations the last: quarters at 1
            # (with the device step, one shard's optimizer state takes as many parts more
            # as the optimizer keeps parameter-sized tensors)
            limit = self._budget // (self.prefetch_depth + 3 + self._reserved)
        else:
            limit = max(math.ceil(stacked_bytes(self.array._state()) / 4), 1)
        # cuts of an earlier layout (before a tensor kept once became per member) never serve
        self._cuts = {k: v for k, v in self._cuts.items() if k[1] == self._layout}
        known = self._cuts.get((limit, self._layout))
        if known is not None:
            self.shards, self._blocks = known
            return
        strict = self._budget is not None
        self._blocks = None
        if self.cut != "blocks":
            try:
                self.shards = plan_shards(self.array, limit, strict=strict)
            except OffloadError as exc:
                if self.cut == "graph":
                    raise
                # the graph cannot cut it (untraceable, or a layer call over the limit):
                # stream its blocks while its own forward runs, where it has any
                try:
                    self.shards = plan_units(self.array, limit, strict=strict)
                except OffloadError as blocks:
                    raise OffloadError(
                        f"{exc}; nor can it be streamed by its blocks: {blocks}"
                    ) from exc
                self._blocks = BlockRunner(self, self.shards)
        else:
            self.shards = plan_units(self.array, limit, strict=strict)
            self._blocks = BlockRunner(self, self.shards)
        self._cuts[(limit, self._layout)] = (self.shards, self._blocks)

    def _replan_if_unshared(self) -> None:
        """A tensor kept once becomes per member when a module that writes it is switched to
        training (BatchNorm statistics) or a loaded state differs between members; the shards
        are cut again for the new layout (between steps: nothing is held then)."""
        self.array._unshare_written()
        if tuple(s.shared for s in self.array._slots) != self._layout:
            self._release()
            self._plan()

    def _trained(self, shard: Shard) -> list[int]:
        """Positions, within the shard's tensors, of the parameters that get a gradient."""
        host = self._host(shard)
        return [
            i
            for i, j in enumerate(shard.slots)
            if self.array._slots[j].is_param and host[i].requires_grad
        ]

    def _first_backward(self, x: Tensor) -> int:
        """The first shard a backward runs: the first that trains a parameter, or 0 where the
        input needs a gradient; ``len(shards)`` where nothing does. The shards before it need
        no gradient of their input, so their backward is skipped."""
        if x.requires_grad:
            return 0
        return next(
            (k for k, shard in enumerate(self.shards) if self._trained(shard)), len(self.shards)
        )

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
        """Positions, within the shard's tensors, of its buffers (what a forward may write);
        not those kept once for all members, which no forward writes."""
        return [
            i
            for i, j in enumerate(shard.slots)
            if not self.array._slots[j].is_param and not self.array._slots[j].shared
        ]

    def _fetch(self, k: int, buffers: Sequence[Tensor] | None = None) -> _Resident:
        """Start copying shard ``k``'s tensors in, its buffers from ``buffers`` when given."""
        shard = self.shards[k]
        host = self._host(shard)
        if buffers is not None:
            for i, value in zip(self._buffers(shard), buffers, strict=True):
                host[i] = value
        if self._urgent:  # ahead of other arrays' fetches on the link (AlternatingArrays)
            fetch = self.transfer.fetch(host, urgent=True)
        else:
            fetch = self.transfer.fetch(host)
        resident = _Resident(fetch, shard.nbytes, self.ledger, "shard state", self._urgent)
        self._outstanding.append(resident)
        return resident

    def _fetch_state(self, shard: Shard) -> tuple[list[Tensor], _Resident | None]:
        """Start copying in the optimizer state of the shard's trained parameters that have
        one (the device step's; a parameter's first step makes its state after its backward,
        as the host step would, only where it got a gradient): those parameters, the fetch."""
        stepper = self._stepper
        assert stepper is not None
        host = self._host(shard)
        state = stepper.optimizer.state
        params = [
            host[i] for i in self._trained(shard) if stepper.steps(host[i]) and state.get(host[i])
        ]
        if not params:
            return [], None
        return params, self._fetch_tensors(stepper.state_tensors(params), "optimizer state")

    def _fetch_tensors(self, tensors: list[Tensor], kind: str) -> _Resident:
        """Start copying ``tensors`` in, counted in the ledger as ``kind`` until released."""
        if self._urgent:
            fetch = self.transfer.fetch(tensors, urgent=True)
        else:
            fetch = self.transfer.fetch(tensors)
        resident = _Resident(fetch, stacked_bytes(tensors), self.ledger, kind, self._urgent)
        self._outstanding.append(resident)
        return resident

    def _run(self, shard: Shard, tensors: Sequence[Tensor], x: Tensor) -> Tensor:
        """Shard ``shard``'s forward with ``tensors`` in place of its host tensors; one value
        for all members where the shard is member-independent."""
        slots = [self.array._slots[j] for j in shard.slots]
        host = self._host(shard)
        array = shard.array
        assert array is not None  # a graph shard (groups of units run in _streamed)
        for slot, t in zip(slots, tensors, strict=True):
            for d, name in slot.places:
                d[name] = t
        try:
            out = array(x, shared=shard.shared_input)
        finally:
            for slot, t in zip(slots, host, strict=True):
                for d, name in slot.places:
                    d[name] = t
        if not isinstance(out, Tensor):
            raise OffloadError(
                f"offload passes one tensor between shards; layers {shard.nodes} returned "
                f"{type(out).__name__}"
            )
        return out.squeeze(0) if shard.shared_output else out

    def _release(self) -> None:
        """Let go of what an earlier forward kept (its backward never came, or it is done)."""
        if self._blocks is not None:
            self._blocks.release()
        for resident in self._outstanding:  # after an error too: nothing stays counted
            resident.release()
        self._outstanding = []
        self._last = None
        self._waiting = None
        for held in self._saved:
            held.release()
        self._saved = []
        self._before = []
        self._input = None

    def _forward(self, x: Tensor, keep: bool) -> Tensor:
        """Run every shard on ``x``; with ``keep``, save what the backward needs."""
        return _drain(self._forward_steps(x, keep))

    def _forward_steps(self, x: Tensor, keep: bool) -> Generator[None, None, Tensor]:
        """:meth:`_forward` one shard at a time: it yields before each shard computes (its
        next shard's fetch not yet started), so that a scheduler can run other arrays'
        shards in between (:class:`~hfsweep.offload.AlternatingArrays`); returns the output."""
        self._release()
        self._replan_if_unshared()
        try:
            return (yield from self._forward_shards(x, keep))
        except BaseException:  # an error, or a scheduler closing the steps: nothing stays held
            self._release()
            raise

    def _forward_shards(self, x: Tensor, keep: bool) -> Generator[None, None, Tensor]:
        # grad mode and the ledger's phase are entered per shard, never held across a yield:
        # another array's steps run in between, with their own
        n = len(self.shards)
        # the backward starts from the last shard and stops at this one: only its input and
        # those after it are kept
        stop = self._stop = self._first_backward(x) if keep else n
        # with prefetch, shards k .. k + depth - 1 are fetched (or on their way) when shard k's
        # turn comes, and shard k + depth's fetch starts as it computes
        ahead = self.prefetch_depth if self.prefetch else 1
        with torch.no_grad(), self.ledger.phase("forward"):
            pending = deque(self._fetch(j) for j in range(min(ahead, n)))
        following = len(pending)  # the next shard to fetch
        value = x
        for k, shard in enumerate(self.shards):
            self._waiting = pending[0]
            yield
            self._waiting = None
            with torch.no_grad(), self.ledger.phase("forward"):
                resident = pending.popleft()
                if self.prefetch and following < n:
                    pending.append(self._fetch(following))
                    following += 1
                tensors = resident.tensors()
                at = self._buffers(shard)
                host = self._host(shard)
                if keep:
                    self._before.append([host[i].clone() for i in at] if k >= stop else [])
                value = self._run(shard, tensors, value)
                if at:  # the forward's buffer updates go back to the host
                    written = self.transfer.to_host([tensors[i] for i in at])
                    for i, w in zip(at, written, strict=True):
                        host[i].copy_(w)
                if keep and k == n - 1 and stop < n:
                    for i, before in zip(at, self._before[k], strict=True):
                        tensors[i].copy_(before)  # the recomputation starts from these
                    self._last = resident
                else:
                    resident.release()
                if keep and k < n - 1:
                    # shard k+1's input, needed where its backward runs
                    self._saved.append(_Held(value if k + 1 >= stop else None, self.ledger))
                if not self.prefetch and following < n:
                    pending.append(self._fetch(following))
                    following += 1
        if keep:
            self._input = x
            self._generation += 1
        return value

    def _backward(self, grad: Tensor, generation: int) -> Tensor | None:
        """Shard by shard from the last: recompute, backward, gradients to the host. Returns the
        gradient of the input (``None`` when it needs none)."""
        return _drain(self._backward_steps(grad, generation))

    def _backward_steps(
        self, grad: Tensor, generation: int
    ) -> Generator[None, None, Tensor | None]:
        """:meth:`_backward` one shard at a time, yielding before each shard (see
        :meth:`_forward_steps`)."""
        if generation != self._generation or self._input is None:
            raise OffloadError(
                "an offloaded array keeps one forward for backward at a time: backward went "
                "through the output of an earlier forward, released by a later one"
            )
        try:
            return (yield from self._backward_shards(grad))
        finally:
            self._release()

    def _backward_shards(self, grad: Tensor) -> Generator[None, None, Tensor | None]:
        x = self._input
        n, stop = len(self.shards), self._stop
        if stop >= n:
            return None  # nothing to train, no input gradient asked for
        if x is None or self._last is None:
            raise OffloadError(
                "an offloaded array keeps one forward for backward at a time: backward went "
                "through the output of an earlier forward, released by a later one"
            )
        # as in the forward: shards k .. k - depth + 1 are in (or on their way) when shard
        # k's turn comes, the last one kept from the forward
        pending: deque[_Resident] = deque([self._last])
        self._last = None
        following = n - 2  # the next shard to fetch
        x_grad: Tensor | None = None
        if self._stepper is not None:
            self._stepper.begin()
        for k in reversed(range(stop, n)):
            self._waiting = pending[0] if pending else None
            yield
            self._waiting = None
            with self.ledger.phase("backward"):
                shard = self.shards[k]
                if not pending:  # without prefetch
                    pending.append(self._fetch(k, self._before[k]))
                    following = k - 1
                resident = pending.popleft()
                # the device step's state, copied in while the shard recomputes
                state = self._fetch_state(shard) if self._stepper is not None else None
                if self.prefetch:
                    while following >= stop and following >= k - self.prefetch_depth:
                        pending.append(self._fetch(following, self._before[following]))
                        following -= 1
                grad = self._shard_backward(
                    k, shard, resident, grad, x, needs_input=k > stop, state=state
                )
                resident.release()
                if k > 0:
                    self._saved[k - 1].release()
                elif x.requires_grad:
                    x_grad = grad
        if self._stepper is not None:  # every shard stepped: the optimizer's post hooks
            self._stepper.finish()
        return x_grad

    def _shard_backward(
        self,
        k: int,
        shard: Shard,
        resident: _Resident,
        grad: Tensor,
        x: Tensor,
        *,
        needs_input: bool,
        state: tuple[list[Tensor], _Resident | None] | None = None,
    ) -> Tensor:
        """Recompute shard ``k`` with autograd and run its backward from ``grad``; add its
        parameter gradients to the host's, or, with the device step, step its parameters with
        them and its optimizer ``state`` (:meth:`_fetch_state`). Returns its input's gradient
        (where ``needs_input``, or the array's input needs one)."""
        tensors = resident.tensors()
        host = self._host(shard)
        trained = self._trained(shard)
        for i in trained:
            tensors[i].requires_grad_(True)
        if k == 0:
            source = x.detach().requires_grad_(x.requires_grad)
        else:
            saved = self._saved[k - 1].value
            assert saved is not None
            source = saved.detach().requires_grad_(needs_input)
        with torch.enable_grad():
            out = self._run(shard, tensors, source)
        inputs = [tensors[i] for i in trained]
        if source.requires_grad:
            inputs.append(source)
        if not inputs:
            return grad
        grads = torch.autograd.grad(out, inputs, grad, allow_unused=True)
        # a parameter the shard did not use gets no gradient, as with autograd on the array
        used = [(i, g) for i, g in zip(trained, grads, strict=False) if g is not None]
        stepper = self._stepper
        if stepper is None or state is None:
            grads_to_host(used, host, self.transfer, self.ledger)
        else:
            others = [(i, g) for i, g in used if not stepper.steps(host[i])]
            if others:  # not the optimizer's: their gradients go to the host as without it
                grads_to_host(others, host, self.transfer, self.ledger)
            stepped = [(i, g) for i, g in used if stepper.steps(host[i])]
            if stepped:
                _step_shard(self, stepper, host, tensors, stepped, state)
        return grads[-1] if source.requires_grad else grad
