"""Streaming a model's units while its own forward runs (:class:`BlockRunner`): the offload
engine's way for models ``torch.fx`` cannot cut (see ``_units``).

The whole array's forward runs as it does without offload (the user's ``forward`` under the
array's ``vmap``, eagerly), but each unit's ``forward`` is replaced, for the duration of the
engine's call, by a call of a custom ``torch.autograd.Function`` that

- in the forward (no autograd graph inside): makes the unit's shard (its group of consecutive
  units, see ``_units``) the one on the compute side, fetching it unless it is there already
  (the shard the previous forward called next is prefetched meanwhile), runs the unit as its
  own fused array on the unit's inputs with its tensors from the shard, writes its buffer
  updates (dropout call counters) back to the host and keeps its inputs (the *boundary
  activations*: the hidden states, the attention mask) for the backward; the shard is
  released when the model's code calls a unit of another shard, or its forward ends;
- in the backward: the same by shard in reverse (the shard of the call before is
  prefetched), fetching of a shard only the units whose calls autograd goes back through,
  with each unit's buffers as they were before its call; it recomputes the unit from the kept
  inputs with autograd, adds its parameter gradients to the host parameters' ``.grad`` and
  hands autograd the gradients of its inputs.

A shard whose units the model's code calls one after another is fetched once per direction;
one whose units it calls apart (a block called again at the end) is fetched again, and stays
exact: a unit called twice computes the second time from the buffers its first call wrote,
and its backward starts each recomputation from the buffers of its own call.

The model's own code between the units (mask preprocessing, residual additions, slicing) runs
once, with autograd, as it would in the whole array: no cut needs to know what crosses it, and
however many tensors a block takes (hidden states, attention mask, position ids) each is kept
once. Under ``vmap`` the ``Function``'s ``vmap`` rule receives the unbatched tensors and their
batch dimensions, the public way out of a ``vmap`` to code that runs its own. A unit whose
tensors are all kept once and whose inputs are the same for every member (the embeddings of a
frozen backbone) runs once and returns one value for all members, as the whole array's ``vmap``
leaves such values unbatched; autograd does not go back through it where nothing before it
needs a gradient.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from .._compat import pytree
from ..fusion import FusedArray
from ._errors import OffloadError
from ._resident import _Resident, grads_to_host
from ._shards import Shard

if TYPE_CHECKING:
    from ._view import EngineView

__all__ = ["BlockRunner"]

_PLAIN = (bool, int, float, str, type(None), torch.dtype, torch.device)
_TENSOR = object()  # marks a tensor leaf in a recorded output structure


@dataclass
class _Call:
    """One call of a unit: its arguments' structure, and what its backward needs."""

    runner: BlockRunner
    unit: int
    leaves: list[Any]
    spec: Any
    tensor_at: list[int]
    generation: int
    in_dims: tuple[int | None, ...] = ()
    out_dims: tuple[int | None, ...] = ()
    out_leaves: list[Any] = field(default_factory=list)
    out_spec: Any = None
    #: the unit's inputs, kept for the backward (``None``: released, or never kept)
    inputs: list[Tensor] | None = None
    #: the unit's per-member buffers as they were before the call (host copies)
    before: list[Tensor] = field(default_factory=list)
    #: position among the calls kept in this forward
    index: int = -1
    #: autograd records the call (grad mode was on where the model's code made it)
    grad_enabled: bool = False


class _UnitFn(torch.autograd.Function):
    """A unit's call: fetch, run, release; its backward by recomputation. Under the array's
    ``vmap`` its ``vmap`` rule runs it again on the unbatched tensors (with their batch
    dimensions in ``call.in_dims``) and says which outputs carry the member dimension.
    ``anchor`` requires a gradient where the unit trains a parameter (so that autograd runs the
    backward); ``witness`` is there for ``vmap`` (see :meth:`BlockRunner._witness`)."""

    @staticmethod
    def forward(
        call: _Call, anchor: Tensor, witness: Tensor, *tensors: Tensor
    ) -> tuple[Tensor, ...]:
        keep = call.grad_enabled and any(t.requires_grad for t in (anchor, *tensors))
        return call.runner._forward_call(call, tensors, keep)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: tuple[Tensor, ...]) -> None:
        ctx.call = inputs[0]
        ctx.mark_non_differentiable(*[o for o in output if not o.is_floating_point()])

    @staticmethod
    def backward(ctx: Any, *grads: Tensor) -> tuple[Tensor | None, ...]:
        call: _Call = ctx.call
        needs = tuple(ctx.needs_input_grad[3:])
        return (None, None, None, *call.runner._backward_call(call, grads, needs))

    @staticmethod
    def vmap(
        info: Any,
        in_dims: tuple[int | None, ...],
        call: _Call,
        anchor: Tensor,
        witness: Tensor,
        *tensors: Tensor,
    ) -> tuple[tuple[Tensor, ...], tuple[int | None, ...]]:
        call.in_dims = tuple(in_dims[3:])
        outs: tuple[Tensor, ...] = _UnitFn.apply(call, anchor, witness, *tensors)
        return outs, call.out_dims


class _Group:
    """Some of group ``index``'s stacked tensors (``slots``) on the compute side, fetched
    together; each unit of the group takes its own from them. ``fresh`` maps a unit to the
    call whose buffers (as before that call) the fetched tensors hold: a backward's
    recomputation of that call needs no copy of them."""

    def __init__(self, index: int, slots: Sequence[int], resident: _Resident) -> None:
        self.index = index
        self.resident = resident
        self._at = {j: i for i, j in enumerate(slots)}
        self.fresh: dict[int, int] = {}

    def holds(self, slots: Sequence[int]) -> bool:
        return all(j in self._at for j in slots)

    def tensors(self, slots: Sequence[int]) -> list[Tensor]:
        fetched = self.resident.tensors()
        return [fetched[self._at[j]] for j in slots]


class BlockRunner:
    """The units of ``engine``'s array streamed while the model's own forward runs (see the
    module's docstring), fetched by groups of consecutive units (``shards``, from
    :func:`~hfsweep.offload._units.plan_units`): a group stays on the compute side while the
    model's code calls its units, and goes when it calls a unit of another group.

    Counted in the engine's ledger: each group's tensors while fetched (a computing group and
    a prefetched one), a unit's gradients before they go back to the host, and the kept inputs
    of every call whose backward will run (each tensor once, however many units take it; the
    caller's input is not counted). The tensors the model's own code between the units keeps
    for its backward are not counted (BERT's and GPT-2's keep none of a block's size)."""

    def __init__(self, engine: EngineView, shards: list[Shard]) -> None:
        self.engine = engine
        self.shards = shards
        #: every unit, in module order; ``_group_of[u]``: the shard (group) that holds unit u
        self.units = [u for shard in shards for u in shard.units]
        self._group_of = [g for g, shard in enumerate(shards) for _ in shard.units]
        self._arrays: list[FusedArray] = []
        for unit in self.units:
            assert unit.array is not None  # every unit runs as an array of its own
            self._arrays.append(unit.array)
        self._modules = [a.module for a in self._arrays]
        self._originals = [m.forward for m in self._modules]
        self._had_forward = ["forward" in m.__dict__ for m in self._modules]
        # made once: the module's __dict__ is part of a unit array's trace key
        self._wrappers = [self._wrapper(k) for k in range(len(self.units))]
        self._single: dict[int, FusedArray] = {}
        self._inside = False
        self._generation = 0
        self._host_state: tuple[Tensor, ...] = ()
        self._caller: set[int] = set()
        #: the units called by the latest forward, in order (the next forward's prefetch plan)
        self._order: list[int] = []
        self._position = 0
        self._forward_order: list[int] = []
        self._calls: list[_Call] = []
        self._pending = 0
        #: the group computing, by direction ("f": forward, "b": backward)
        self._current: dict[str, _Group] = {}
        #: the group prefetched next, by direction and group
        self._prefetched: dict[tuple[str, int], _Group] = {}
        self._outstanding: list[_Resident] = []
        #: kept inputs by storage: [bytes, holders]
        self._saved: dict[int, list[int]] = {}
        self._idle = torch.zeros(())

    # ------------------------------------------------------------------ the engine's call
    def __call__(self, x: Tensor) -> Tensor:
        self.release()
        self._generation += 1
        array = self.engine.array
        self._host_state = array._state()
        self._caller = {x.untyped_storage().data_ptr()}
        self._position = 0
        order: list[int] = []
        self._forward_order = order
        traced = array._trace_enabled
        try:
            with self.engine.ledger.phase("forward"), self._intercepting():
                array._trace_enabled = False  # the outer forward runs eagerly, hooks and all
                try:
                    out: Tensor = array(x)
                finally:
                    array._trace_enabled = traced
        except BaseException:
            self.release()
            raise
        finally:
            self._leave("f")
        self._order = order
        if self._pending == 0:
            self.release()  # nothing kept for a backward
        return out

    def release(self) -> None:
        """Let go of everything held for the latest forward (after its backward, or an error)."""
        for resident in self._outstanding:
            resident.release()
        self._outstanding = []
        self._prefetched = {}
        self._current = {}
        for call in self._calls:
            if call.inputs is not None:
                self._drop(call.inputs)
                call.inputs = None
        self._calls = []
        self._pending = 0

    # ------------------------------------------------------------------ interception
    def _wrapper(self, k: int) -> Callable[..., Any]:
        original = self._originals[k]

        def forward(*args: Any, **kwargs: Any) -> Any:
            if self._inside:  # the unit's own array running it
                return original(*args, **kwargs)
            return self._call(k, args, kwargs)

        return forward

    @contextmanager
    def _intercepting(self) -> Iterator[None]:
        for m, wrapper in zip(self._modules, self._wrappers, strict=True):
            m.forward = wrapper
        try:
            yield
        finally:
            for m, original, had in zip(
                self._modules, self._originals, self._had_forward, strict=True
            ):
                if had:
                    m.forward = original
                else:
                    del m.__dict__["forward"]

    def _call(self, k: int, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """The model's code calling unit ``k``: through :class:`_Lift` under the array's
        ``vmap``, through :class:`_UnitFn` where one member runs without it."""
        leaves, spec = pytree.tree_flatten((args, kwargs))
        tensor_at = [i for i, leaf in enumerate(leaves) if isinstance(leaf, Tensor)]
        for leaf in leaves:
            if not isinstance(leaf, (Tensor, *_PLAIN)):
                raise OffloadError(
                    f"offload streams {type(self.engine.array._prototype).__name__} module by "
                    f"module and passes tensors and plain values into each; "
                    f"{self.units[k].nodes[0]} is called with a {type(leaf).__name__} (a cache "
                    "of past keys and values: use_cache=False). Use offload: none otherwise"
                )
        call = _Call(self, k, leaves, spec, tensor_at, self._generation)
        tensors = [leaves[i] for i in tensor_at]
        anchor = self.engine._anchor if self._trains(k) else self._idle
        call.in_dims = (None,) * len(tensors)  # the vmap rule gives the batched ones
        call.grad_enabled = torch.is_grad_enabled()
        outs = _UnitFn.apply(call, anchor, self._witness(k), *tensors)
        if self.engine.array.size == 1:  # no vmap: one member's values, without its dimension
            outs = tuple(
                o.squeeze(0) if d == 0 else o for o, d in zip(outs, call.out_dims, strict=True)
            )
        it = iter(outs)
        filled = [next(it) if leaf is _TENSOR else leaf for leaf in call.out_leaves]
        return pytree.tree_unflatten(filled, call.out_spec)

    def _witness(self, k: int) -> Tensor:
        """What unit ``k``'s first per-member tensor is where the model's code runs (under the
        array's ``vmap``, batched), detached: an operand of the call that carries the member
        dimension, so that ``vmap`` hands a unit with per-member tensors to its rule even where
        its inputs are one value for all members (the embeddings in front of per-member
        blocks); ``vmap`` would otherwise take its outputs for one value too."""
        slots = self.engine.array._slots
        for j in self.units[k].slots:
            if not slots[j].shared:
                d, name = slots[j].places[0]
                value: Tensor = d[name]
                return value.detach()
        return self._idle

    def _trains(self, k: int) -> bool:
        return bool(self._trained(k)) and torch.is_grad_enabled()

    def _trained(self, k: int) -> list[int]:
        """Positions, within unit ``k``'s tensors, of the parameters that get a gradient."""
        slots = self.engine.array._slots
        return [
            i
            for i, j in enumerate(self.units[k].slots)
            if slots[j].is_param and self._host_state[j].requires_grad
        ]

    # ------------------------------------------------------------------ groups on the compute side
    def _host(self, k: int) -> list[Tensor]:
        return [self._host_state[j] for j in self.units[k].slots]

    def _fetch(self, g: int, calls: Sequence[_Call] | None = None) -> _Group:
        """Start copying group ``g``'s tensors in: all of them (the forward), or (the backward)
        those of the units of ``calls``, each unit's buffers as they were before the latest
        of its calls there."""
        shard = self.shards[g]
        slots = shard.slots
        latest: dict[int, _Call] = {}
        if calls is not None:
            for call in calls:
                latest[call.unit] = call
            slots = sorted({j for u in latest for j in self.units[u].slots})
        host = [self._host_state[j] for j in slots]
        at = {j: i for i, j in enumerate(slots)}
        for u, call in latest.items():
            unit = self.units[u]
            for i, value in zip(self.engine._buffers(unit), call.before, strict=True):
                host[at[unit.slots[i]]] = value
        engine = self.engine
        nbytes = sum(t.numel() * t.element_size() for t in host)
        resident = _Resident(engine.transfer.fetch(host), nbytes, engine.ledger, "shard state")
        self._outstanding.append(resident)
        group = _Group(g, slots, resident)
        group.fresh = {u: call.index for u, call in latest.items()}
        return group

    def _enter(self, way: str, g: int, unit: int, calls: Sequence[_Call] | None) -> _Group:
        """Group ``g`` as the one computing in direction ``way`` (holding ``unit``'s tensors):
        the one computing already, else the prefetched one, else fetched now; the group it
        replaces is released."""
        current = self._current.get(way)
        slots = self.units[unit].slots
        if current is not None and current.index == g and current.holds(slots):
            return current
        self._leave(way, prefetched=False)
        group = self._prefetched.pop((way, g), None)
        if group is not None and not group.holds(slots):
            group.resident.release()
            group = None
        if group is None:
            group = self._fetch(g, calls)
        self._current[way] = group
        return group

    def _leave(self, way: str, *, prefetched: bool = True) -> None:
        """Release the group computing in direction ``way`` (and, with ``prefetched``, the
        one prefetched for it)."""
        current = self._current.pop(way, None)
        if current is not None:
            current.resident.release()
        if prefetched:
            for key in [k for k in self._prefetched if k[0] == way]:
                self._prefetched.pop(key).resident.release()

    def _prefetch(self, way: str, g: int, calls: Sequence[_Call] | None = None) -> None:
        """Start copying group ``g`` in for direction ``way``; one prefetched at a time (one
        the model's code did not call after all is released)."""
        if (way, g) in self._prefetched:
            return
        for key in [k for k in self._prefetched if k[0] == way]:
            self._prefetched.pop(key).resident.release()
        self._prefetched[(way, g)] = self._fetch(g, calls)

    # ------------------------------------------------------------------ forward and backward
    def _forward_call(
        self, call: _Call, tensors: Sequence[Tensor], keep: bool
    ) -> tuple[Tensor, ...]:
        k = call.unit
        unit = self.units[k]
        host = self._host(k)
        at = self.engine._buffers(unit)
        if keep:
            call.before = [host[i].clone() for i in at]
        # a unit called again while its group stays computes on the buffers its earlier call
        # wrote there, as the host holds them
        group = self._enter("f", self._group_of[k], k, None)
        self._forward_order.append(k)
        self._position += 1
        self._prefetch_next(k)
        fetched = group.tensors(unit.slots)
        outs = self._compute(call, fetched, tensors)
        if at:  # the call's buffer updates go back to the host
            written = self.engine.transfer.to_host([fetched[i] for i in at])
            for i, w in zip(at, written, strict=True):
                host[i].copy_(w)
        if keep:
            call.inputs = list(tensors)
            self._hold(call.inputs)
            call.index = len(self._calls)
            self._calls.append(call)
            self._pending += 1
        return outs

    def _prefetch_next(self, k: int) -> None:
        """Start copying in the group the previous forward called after unit ``k``'s (or, on
        the first forward, the next group)."""
        if not self.engine.prefetch:
            return
        g = self._group_of[k]
        ahead = [self._group_of[u] for u in self._order[self._position :]]
        nxt = next((h for h in ahead if h != g), None if ahead else g + 1)
        if nxt is not None and nxt < len(self.shards):
            self._prefetch("f", nxt)

    def _compute(
        self, call: _Call, fetched: Sequence[Tensor], tensors: Sequence[Tensor]
    ) -> tuple[Tensor, ...]:
        """Unit ``call.unit`` on ``tensors`` (unbatched, batched in ``call.in_dims``) with
        ``fetched`` in place of its host tensors; records the output's structure and member
        dimensions in ``call``."""
        k = call.unit
        unit = self.units[k]
        size = self.engine.array.size
        unbatched = all(d is None for d in call.in_dims)
        independent = unbatched and unit.shared_output
        array = self._single_array(k) if independent else self._arrays[k]
        if unbatched:
            inputs = list(tensors)
        else:  # every input with the member dimension first (one value for all: expanded)
            inputs = [
                t.movedim(d, 0) if d is not None else t.expand(size, *t.shape)
                for t, d in zip(tensors, call.in_dims, strict=True)
            ]
        leaves = list(call.leaves)
        for i, t in zip(call.tensor_at, inputs, strict=True):
            leaves[i] = t
        args, kwargs = pytree.tree_unflatten(leaves, call.spec)
        slots = [self.engine.array._slots[j] for j in unit.slots]
        saved = [[(d, name, d[name]) for d, name in slot.places] for slot in slots]
        for slot, t in zip(slots, fetched, strict=True):
            for d, name in slot.places:
                d[name] = t
        self._inside = True
        try:
            out = array(*args, shared=unbatched, **kwargs)
        finally:
            self._inside = False
            for places in saved:
                for d, name, value in places:
                    d[name] = value
        out_leaves, call.out_spec = pytree.tree_flatten(out)
        call.out_leaves = [_TENSOR if isinstance(x, Tensor) else x for x in out_leaves]
        outs = tuple(x for x in out_leaves if isinstance(x, Tensor))
        if independent:
            call.out_dims = (None,) * len(outs)
            return tuple(o.squeeze(0) for o in outs)
        call.out_dims = (0,) * len(outs)
        return outs

    def _single_array(self, k: int) -> FusedArray:
        """Unit ``k`` as an array of one member: a call whose inputs and tensors are the same
        for every member runs once."""
        if k not in self._single:
            unit = self._arrays[k]
            array = FusedArray(
                unit.module, unit._prototype, 1, list(unit._slots), unit._trace_enabled
            )
            array._defer_tracing(unit._trace_after)
            array._draws_refused = unit._draws_refused
            self._single[k] = array
        return self._single[k]

    def _backward_call(
        self, call: _Call, grads: Sequence[Tensor], needs: Sequence[bool]
    ) -> list[Tensor | None]:
        """Recompute unit ``call.unit`` with autograd from its kept inputs, its buffers as they
        were before the call; its parameter gradients to the host. Returns its inputs'
        gradients."""
        if call.generation != self._generation or call.inputs is None:
            raise OffloadError(
                "an offloaded array keeps one forward for backward at a time: backward went "
                "through the output of an earlier forward, released by a later one"
            )
        k = call.unit
        unit = self.units[k]
        engine = self.engine
        with engine.ledger.phase("backward"):
            index = self._group_of[k]
            group = self._enter("b", index, k, self._kept(index))
            self._prefetch_previous(call)
            fetched = group.tensors(unit.slots)
            if group.fresh.pop(k, None) != call.index:
                # the fetched buffers are not this call's: put back those it started from
                with torch.no_grad():
                    for i, before in zip(engine._buffers(unit), call.before, strict=True):
                        fetched[i].copy_(before)
            trained = self._trained(k)
            for i in trained:
                fetched[i].requires_grad_(True)
            sources = [
                t.detach().requires_grad_(bool(n) and (t.is_floating_point() or t.is_complex()))
                for t, n in zip(call.inputs, needs, strict=True)
            ]
            with torch.enable_grad():
                outs = self._compute(call, fetched, sources)
            pairs = [(o, g) for o, g in zip(outs, grads, strict=True) if o.requires_grad]
            wrt = [fetched[i] for i in trained] + [s for s in sources if s.requires_grad]
            found: Sequence[Tensor | None] = [None] * len(wrt)
            if pairs and wrt:
                found = torch.autograd.grad(
                    [o for o, _ in pairs], wrt, [g for _, g in pairs], allow_unused=True
                )
            self._to_host_grads(k, trained, found[: len(trained)])
            rest = iter(found[len(trained) :])
            out = [next(rest) if s.requires_grad else None for s in sources]
            self._drop(call.inputs)
            call.inputs = None
            self._pending -= 1
            if self._pending == 0:
                self.release()
        return out

    def _kept(self, g: int) -> list[_Call]:
        """The calls of group ``g``'s units whose backward has not run yet, in forward order."""
        return [c for c in self._calls if c.inputs is not None and self._group_of[c.unit] == g]

    def _prefetch_previous(self, call: _Call) -> None:
        """Start copying in the group of the kept call before ``call`` that is not ``call``'s
        group (the next group the backward needs), with what its kept calls need."""
        if not self.engine.prefetch:
            return
        g = self._group_of[call.unit]
        prev = next(
            (
                c
                for c in reversed(self._calls[: call.index])
                if c.inputs is not None and self._group_of[c.unit] != g
            ),
            None,
        )
        if prev is not None:
            h = self._group_of[prev.unit]
            self._prefetch("b", h, self._kept(h))

    def _to_host_grads(self, k: int, trained: list[int], grads: Sequence[Tensor | None]) -> None:
        """Add unit ``k``'s parameter gradients to the host parameters' ``.grad``."""
        used = [(i, g) for i, g in zip(trained, grads, strict=True) if g is not None]
        if not used:
            return
        grads_to_host(used, self._host(k), self.engine.transfer, self.engine.ledger)

    # ------------------------------------------------------------------ kept inputs
    def _hold(self, tensors: Sequence[Tensor]) -> None:
        for t in tensors:
            key = t.untyped_storage().data_ptr()
            if key in self._caller:
                continue
            if key in self._saved:
                self._saved[key][1] += 1
            else:
                nbytes = t.untyped_storage().nbytes()
                self.engine.ledger.add("boundary activations", nbytes)
                self._saved[key] = [nbytes, 1]

    def _drop(self, tensors: Sequence[Tensor]) -> None:
        for t in tensors:
            key = t.untyped_storage().data_ptr()
            entry = self._saved.get(key)
            if entry is None:
                continue
            entry[1] -= 1
            if entry[1] == 0:
                self.engine.ledger.remove("boundary activations", entry[0])
                del self._saved[key]
