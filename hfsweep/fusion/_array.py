"""``FusedArray``: B models of one architecture stored as ``[B, ...]`` tensors and run as one.

How a call runs. The array keeps a private *template*: a copy of member 0's module tree whose
parameters and buffers are the stacked ``[B, ...]`` tensors, with a few layers swapped for the fused
layers of :mod:`hfsweep.nn`. A call runs the user's own ``forward`` under ``torch.func.vmap`` with
the stacked tensors swapped in for the duration of the call, so each member sees ordinary
``[N, ...]`` tensors and user code (views, residuals, ``torch.cat``, functional calls) works as is.

Eager ``vmap`` costs a fixed Python overhead per call that dominates small models. So by default the
vmapped forward is traced once per input signature (``make_fx`` on fake tensors) into a graph of
plain batched aten ops, which later calls replay. A trace is only used where it cannot differ from
eager: forward code that switches grad mode, changes Python attributes of its modules or branches
on tensor values is detected while tracing and runs eagerly instead. Forward code that draws from
Python's own ``random`` module would be frozen by a trace: use ``hs.fuse(..., trace=False)``.
"""

from __future__ import annotations

import copy
import logging
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from typing import Any, cast

import torch
from torch import Tensor, nn

from .._checks import is_int
from .._compat import pytree
from .._errors import FusionError
from ._check import check_compatible, per_member_attributes
from ._compile import check_compile
from ._graph_fold import forget_views
from ._peft import load_member_lora, set_member_lora
from ._plan import unsupported_reason
from ._random import STREAM_KEY, FunctionalStream
from ._shared import same_values, unshare_slot, writes_buffers
from ._state import StackedSlot, _owners, _places, _plan_state_dict, _with_metadata
from ._streams import (
    _assign_dropout,
    _check_stream_value,
    _is_attention,
    _stream_entry,
    _stream_probability,
    _update_attention_masks,
    _write_stream,
)
from ._tracing import _GradModeWatch, _one_tensor_spec, _Outputs, _Tracing

__all__ = ["FusedArray"]

_log = logging.getLogger("hfsweep.fusion")


class FusedArray(_Tracing, nn.Module):
    """B models of one architecture trained as one module. Build it with :func:`hfsweep.fuse`.

    ``array(x)`` feeds one input to every member and returns ``[B, N, ...]``;
    ``array(xs, shared=False)`` takes one input per member (``[B, N, ...]``). Every parameter and
    buffer is stacked with the member as dimension 0 and lives under ``array.module``: that is
    what optimizers update (``array.parameters()``), what ``state_dict()`` saves, and what
    :meth:`member` and :meth:`load_member` slice. The exception is :attr:`shared_frozen`: frozen
    tensors equal in every member, kept once as unstacked buffers (see :func:`hfsweep.fuse`). ``array.module`` itself is storage, not a model:
    call the array, not the module.

    Dropout layers, and ``MultiheadAttention`` for its attention weights, draw each member's
    masks from that member's own deterministic stream (:meth:`manual_seed`, :meth:`rng_state`,
    :meth:`set_rng_state`). So do the random calls forward code makes itself (``F.dropout``,
    LSTM/GRU dropout between layers, ``F.scaled_dot_product_attention(dropout_p=...)``,
    ``torch.rand``/``randn``); other random ops are refused, naming the op and the submodule.
    """

    _prototype: nn.Module

    def __init__(
        self,
        template: nn.Module,
        prototype: nn.Module,
        size: int,
        slots: list[StackedSlot],
        trace: bool,
        functional: FunctionalStream | None = None,
    ) -> None:
        super().__init__()
        self.module = template
        #: the stream of the random calls forward code makes itself (see ``_random``), when the
        #: model may make any
        self.functional = functional
        # The prototype is member 0's module tree on the meta device, in its original classes:
        # the factory for member(i). It is not registered, so it holds no state of the array.
        object.__setattr__(self, "_prototype", prototype)
        self._size = size
        self._slots = slots
        self._swap_places: list[tuple[dict[str, Any], str, int]] = []
        self._first_places: list[tuple[dict[str, Any], str]] = []
        self._dims: tuple[int | None, ...] = ()
        self._index_places()
        #: modules that hold shared buffers they would write in training mode (BatchNorm
        #: statistics): checked at every call and at ``train()``
        self._watched = [
            (template.get_submodule(path), j)
            for j, s in enumerate(slots)
            if s.shared and not s.is_param
            for path, _ in s.owners or []
        ]
        self._trace_enabled = trace
        self._traces: dict[Any, Any] = {}
        self._shared_traces: dict[Any, Any] | None = None
        self._template_modules = list(template.modules())
        # a per-member setting's template value (member 0's dropout p) is not what the fused
        # layer computes with, so it stays out of the trace key: arrays whose first members
        # differ in it share traces
        self._template_dicts = [
            (m.__dict__, per_member_attributes(m)) for m in self._template_modules
        ]
        self._public_keys = [(frozenset(), ()) for _ in self._template_dicts]  # see _attributes
        self._state_plan: Any = False  # see _member_state_plan; False: not made yet
        #: every layer with per-member dropout streams, and the attribute it reads p from
        self._streams = [
            (path, m, "dropout" if _is_attention(m) else "p")
            for path, m in template.named_modules()
            if hasattr(m, "member_p")
        ]
        #: the dropout layers among them (``dropout=``, :attr:`dropout` and set_dropout)
        self._dropouts = [(path, m) for path, m, attr in self._streams if attr == "p"]
        self._last_call_traced = False
        self._grad_watch: _GradModeWatch | None = None  # set while tracing
        #: seconds this array has spent tracing (callers that time steps leave them out)
        self._tracing_seconds = 0.0
        self._trace_after = 1  # a signature is traced at this call of it (_defer_tracing)
        self._untraced_calls: dict[Any, int] = {}
        #: ``compile=`` of :func:`hfsweep.fuse` (see ``_compile``); False: traces replay as they are
        self._compile: bool | str = False
        #: seconds this array's first calls of compiled traces took (compiling; in
        #: ``_tracing_seconds`` too, so step timers leave them out)
        self._compile_seconds = 0.0
        #: where set, random calls of forward code are refused with this reason instead of
        #: drawn from torch's global generator (the offload engine's shards: see ``_random``)
        self._draws_refused: str | None = None

    # ------------------------------------------------------------------ public API
    @property
    def size(self) -> int:
        """Number of members B."""
        return self._size

    @property
    def shared_frozen(self) -> list[str]:
        """Names (as in a member's ``state_dict``) of the tensors kept once for all members:
        identical in every member and not trained (see ``share_frozen`` of :func:`hfsweep.fuse`).
        They are buffers of ``array.module``, unstacked; ``member(i)`` and
        ``member_state_dict(i)`` still give each member its full model."""
        return [s.name for s in self._slots if s.shared]

    @property
    def dropout(self) -> dict[str, list[float]]:
        """Per-member dropout probability of each dropout layer, by submodule path."""
        return {path: m.member_p.tolist() for path, m in self._dropouts}

    def forward(self, *args: Any, shared: bool = True, **kwargs: Any) -> Any:
        """Run every member; tensors in ``args``/``kwargs`` are shared unless ``shared=False``.

        Outputs keep the structure of the model's output with a leading member dimension on
        every tensor. With ``shared=False`` every tensor argument must have size B in dimension 0.
        """
        if len(args) == 1 and not kwargs and isinstance(args[0], Tensor):
            leaves, spec, tensor_at, tensors = list(args), _one_tensor_spec(), [0], list(args)
        else:
            leaves, spec = pytree.tree_flatten((args, kwargs))
            tensor_at = [i for i, leaf in enumerate(leaves) if isinstance(leaf, Tensor)]
            tensors = [leaves[i] for i in tensor_at]
        if not shared:
            for i, t in zip(tensor_at, tensors, strict=True):
                if t.dim() == 0 or t.shape[0] != self._size:
                    raise FusionError(
                        f"with shared=False every tensor argument needs the member dimension first "
                        f"(size {self._size}); argument {i} has shape {tuple(t.shape)}. Pass "
                        "shared=True to feed one input to all members."
                    )
        self._unshare_written()
        state = self._state()
        if shared and all(d is None for d in self._dims):
            # no per-member state (none at all, or all shared): vmap needs one batched input
            tensors = [t.expand(self._size, *t.shape) for t in tensors]
            shared = False
        if not tensors and not state:
            raise FusionError("a fused array needs at least one tensor input or parameter")
        trace = self._lookup_trace(leaves, spec, tensor_at, tensors, shared, state)
        if trace is not None:
            replayed = self._replay(trace, state, tensors)
            if replayed is not None:
                self._last_call_traced = True
                return self._rebuild(replayed, trace.outputs)
        self._last_call_traced = False
        outputs = _Outputs()
        with self._locate_errors():
            out = self._vmapped(leaves, spec, tensor_at, shared)(outputs)(*state, *tensors)
        return self._rebuild(out, outputs)

    def member(self, i: int) -> nn.Module:
        """A standalone model of the original class holding member ``i``'s current state.

        Parameters and buffers are copies (later training of the array does not change it);
        ``member(i).state_dict()`` loads into a fresh instance of the user's class. Its dropout
        layers are plain torch layers with member ``i``'s ``p``: they draw masks from torch's
        generator, not from the member's stream (:meth:`rng_state`).
        """
        i = self._index(i)
        model = copy.deepcopy(self._prototype)  # meta tensors, tying intact
        owners = _owners(model)
        with torch.no_grad():
            for slot, stacked in zip(self._slots, self._state(), strict=True):
                if slot.setting:
                    continue
                value: Tensor = (stacked if slot.shared else stacked[i]).detach().clone()
                if slot.is_param:
                    value = nn.Parameter(
                        value, requires_grad=not slot.shared and stacked.requires_grad
                    )
                for module, name in owners[slot.name]:
                    setattr(module, name, value)  # one object in every tied place
        for path, m, attr in self._streams:
            setattr(model.get_submodule(path), attr, float(m.get_buffer("member_p")[i]))
        set_member_lora(self.module, i, model)
        model.train(self.training)
        return model

    def member_state_dict(
        self, i: int, *, device: str | torch.device | None = None
    ) -> dict[str, Any]:
        """``member(i).state_dict()`` read straight from the stacked tensors, without building
        the module (a deep copy of the model tree, which costs far more than the copy of the
        tensors for small models; checkpoints take one per member at every evaluation).

        Same keys in the same order, copied values (on ``device``, default the array's), tied
        entries sharing one tensor, and torch's ``_metadata`` (module versions), so it loads into
        a fresh model of the user's class. A model whose ``state_dict`` holds more than its
        parameters and persistent buffers (``get_extra_state``, hooks that change values) is
        read through :meth:`member`.
        """
        i = self._index(i)
        plan = self._member_state_plan()
        if plan is None:
            out = self.member(i).state_dict()
            if device is None:
                return out
            moved = {k: v.to(device) if isinstance(v, Tensor) else v for k, v in out.items()}
            return _with_metadata(moved, out)
        keys, metadata = plan
        state = self._state()
        copies: dict[int, Tensor] = {}
        values = OrderedDict()
        with torch.no_grad():
            for key, j in keys:
                value = copies.get(j)
                if value is None:
                    row = (state[j] if self._slots[j].shared else state[j][i]).detach()
                    value = copies[j] = row.clone() if device is None else row.to(device, copy=True)
                values[key] = value
        values._metadata = copy.deepcopy(metadata)  # type: ignore[attr-defined]
        return values

    def load_member_state_dict(self, i: int, state_dict: Mapping[str, Any]) -> None:
        """Write a ``state_dict`` of one model of the array's architecture into slot ``i``:
        what :meth:`member_state_dict` returned, or the user's model's ``state_dict()``.

        The inverse of :meth:`member_state_dict`, without building a module: the keys must be
        exactly the model's, each value shaped like one member's tensor (values are cast to
        the array's dtype and device). Dropout probabilities and streams are left as they are.
        """
        i = self._index(i)
        plan = self._member_state_plan()
        if plan is None:
            model = self.member(i)  # member i's dropout p
            model.load_state_dict(state_dict)
            streams = self.rng_state(i)
            self.load_member(i, model)
            self.set_rng_state(i, streams)
            return
        keys, _ = plan
        names = [k for k, _ in keys]
        if set(state_dict) != set(names):
            missing = [k for k in names if k not in state_dict]
            unexpected = [k for k in state_dict if k not in set(names)]
            raise KeyError(
                f"state dict does not match the array's model: missing {missing}, unexpected "
                f"{unexpected}"
            )
        state = self._state()
        with torch.no_grad():
            for key, j in keys:
                value = state_dict[key]
                shape = state[j].shape if self._slots[j].shared else state[j].shape[1:]
                if not isinstance(value, Tensor) or value.shape != shape:
                    got = tuple(value.shape) if isinstance(value, Tensor) else type(value)
                    raise ValueError(
                        f"state dict entry {key!r} has shape {got}, one member's "
                        f"{key!r} has shape {tuple(shape)}"
                    )
            for key, j in keys:  # a shared tensor this member does not hold: its own copy
                if self._slots[j].shared and not same_values(state[j], state_dict[key]):
                    self._unshare(j, reason=f"member {i}'s loaded {key!r} differs")
            state = self._state()
            for key, j in keys:
                if not self._slots[j].shared:
                    state[j][i].copy_(state_dict[key])

    def _member_state_plan(self) -> tuple[list[tuple[str, int]], Any] | None:
        """``(state_dict key, stacked tensor index)`` pairs and the metadata of a member's
        ``state_dict``, made once from the prototype; ``None`` when it is not a plain read."""
        if self._state_plan is False:
            self._state_plan = _plan_state_dict(self._prototype, self._slots)
        return cast(tuple[list[tuple[str, int]], Any] | None, self._state_plan)

    def load_member(self, i: int, module: nn.Module) -> None:
        """Write ``module``'s parameters, buffers and dropout probabilities into slot ``i``.

        This is how a freed slot is refilled with a new trial. ``module`` must have the array's
        architecture; values are copied and cast to the array's dtype and device. The slot's
        dropout streams restart (call counters back to 0) and keep their seed: call
        :meth:`manual_seed` to give the new trial its own.
        """
        i = self._index(i)
        check_compatible([self._prototype, module], unsupported_reason, "module", placement=False)
        places = _places(module)
        with torch.no_grad():
            for j, (slot, stacked) in enumerate(zip(self._slots, self._state(), strict=True)):
                if slot.shared:
                    owner, name = places[slot.name][0]
                    if not same_values(stacked, owner[name]):
                        self._unshare(j, reason=f"the model loaded into slot {i} differs")
            for slot, stacked in zip(self._slots, self._state(), strict=True):
                if slot.setting or slot.shared:
                    continue
                owner, name = places[slot.name][0]
                stacked[i].copy_(owner[name])
            for path, m, attr in self._streams:
                m.member_p[i] = _stream_probability(module.get_submodule(path), attr, path)
                m.get_buffer("member_calls")[i] = 0
                if attr == "dropout":
                    _update_attention_masks(m)
            if self.functional is not None:
                self.functional.member_calls[i] = 0
            load_member_lora(self.module, i, module)

    def load_state_dict(
        self, state_dict: Mapping[str, Any], strict: bool = True, assign: bool = False
    ) -> Any:
        """``nn.Module.load_state_dict``, then each attention layer's ``hfsweep_masks`` from
        the probabilities it loaded.

        A state dict saved by an array that shared other tensors loads too: a stacked
        ``[B, ...]`` value for a tensor this array shares is taken once when its rows are equal
        (else the tensor becomes per member), an unstacked value for a tensor this array
        stacks is given to every member."""
        state_dict = self._adapt_shared(state_dict)
        result = super().load_state_dict(state_dict, strict=strict, assign=assign)
        for _, m, attr in self._streams:
            if attr == "dropout":
                _update_attention_masks(m)
        return result

    def set_dropout(self, p: Sequence[float] | Mapping[str, Sequence[float]]) -> None:
        """Set per-member dropout probabilities: one list of B values for every dropout layer,
        or ``{submodule path: B values}`` for some of them."""
        _assign_dropout(self._dropouts, self._size, p)

    def manual_seed(self, i: int, seed: int) -> None:
        """Seed member ``i``'s dropout masks and restart its streams.

        Every dropout layer of member ``i`` gets ``seed`` (the layers still draw distinct masks:
        each mixes in its own index) and its call counter goes back to 0. From then on the
        member's masks depend only on ``seed`` and its own training forwards, not on the array
        size, its slot or torch's global generator: the trial draws the same masks alone
        (``hs.fuse([model])``), in any other array and after a resume (:meth:`rng_state`).
        ``member(i)`` returns plain ``nn.Dropout`` layers, which draw from torch's generator.

        Args:
            i: member index (negative counts from the end).
            seed: an int in ``[0, 2**63)``.

        Arrays without dropout layers ignore the call (the index is still checked).
        """
        i = self._index(i)
        value = _check_stream_value("seed", seed)
        for _, m, _ in self._streams:
            _write_stream(m, i, value, 0)
        if self.functional is not None:
            _write_stream(self.functional, i, value, 0)

    def rng_state(self, i: int) -> dict[str, list[int]]:
        """Member ``i``'s dropout streams: ``{layer path: [seed, calls]}`` in plain ints.

        ``calls`` counts the training-mode forwards member ``i`` has run through that layer
        (for a ``MultiheadAttention``, those that drew a mask for it: none while its attention
        dropout is 0, in any array). The dict is JSON-serialisable; :meth:`set_rng_state` resumes
        the masks exactly where they were. An array without dropout layers returns ``{}``.

        ``"<functional>"`` is the stream of the random calls forward code makes itself
        (``F.dropout``, an LSTM's dropout between layers, ``torch.rand``...), whose ``calls``
        counts the training forwards that drew. It is listed once member ``i`` has drawn from
        it, or when it is the array's only stream; before, the layers' streams carry its seed.
        """
        i = self._index(i)
        out = {
            path: [int(m.get_buffer("member_seed")[i]), int(m.get_buffer("member_calls")[i])]
            for path, m, _ in self._streams
        }
        if self._lists_functional(i):
            assert self.functional is not None
            out[STREAM_KEY] = [
                int(self.functional.member_seed[i]),
                int(self.functional.member_calls[i]),
            ]
        return out

    def _lists_functional(self, i: int) -> bool:
        """Whether :meth:`rng_state` lists member ``i``'s functional stream (``"<functional>"``):
        once it has drawn, or when it is the array's only stream. Before it has drawn, the
        layers' streams carry its seed (:meth:`manual_seed` gives every stream one seed)."""
        if self.functional is None:
            return False
        return not self._streams or int(self.functional.member_calls[i]) > 0

    def set_rng_state(self, i: int, state: Mapping[str, Sequence[int]]) -> None:
        """Restore member ``i``'s dropout streams from :meth:`rng_state` (e.g. on resume).

        ``state`` must name exactly the array's dropout layers, each with ``[seed, calls]``
        (ints in ``[0, 2**63)``). It is checked whole before anything changes.
        """
        i = self._index(i)
        if not isinstance(state, Mapping):
            raise TypeError(
                "rng state must be a dict {layer path: [seed, calls]}, got "
                f"{type(state).__name__}"
            )
        known = [path for path, _, _ in self._streams]
        if self.functional is not None:
            known.append(STREAM_KEY)
        # attention layers' streams are newer than dropout layers': a state saved without
        # them leaves them as they are
        needed = [path for path, _, attr in self._streams if attr == "p"]
        missing = [path for path in needed if path not in state]
        unknown = [path for path in state if path not in known]
        if missing or unknown:
            raise ValueError(
                f"rng state must name exactly the array's dropout streams {known}; "
                f"missing {missing}, unknown {unknown}"
            )
        values: list[tuple[nn.Module, int, int]] = []
        for path, m, _ in self._streams:
            if path not in state or path == STREAM_KEY:
                continue
            values.append((m, *_stream_entry(path, state[path])))
        if self.functional is not None:
            if STREAM_KEY in state:
                values.append((self.functional, *_stream_entry(STREAM_KEY, state[STREAM_KEY])))
            elif values:  # not drawn yet when saved: the layers' seed, no calls
                values.append((self.functional, values[0][1], 0))
        for m, seed, calls in values:
            _write_stream(m, i, seed, calls)

    def train(self, mode: bool = True) -> FusedArray:
        """``nn.Module.train``; shared buffers that a module now in training mode would write
        per member (BatchNorm statistics) become per member."""
        super().train(mode)
        self._unshare_written()
        return self

    def extra_repr(self) -> str:
        extra = f", compile={self._compile!r}" if self._compile is not False else ""
        return f"size={self._size}, trace={self._trace_enabled}{extra}"

    def _set_compile(self, value: bool | str) -> None:
        """Compile the traced forwards from now on (``value``: see ``compile`` of
        :func:`hfsweep.fuse`); traces made before are dropped so they are made again."""
        value = check_compile(value)
        if value is not False and not self._trace_enabled:
            raise ValueError(
                f"compile={value!r} needs the traced forward, but the array was fused with "
                "trace=False: torch.compile compiles the trace. Drop trace=False, or compile=False."
            )
        if value != self._compile:
            self._compile = value
            self._traces.clear()
            self._untraced_calls.clear()

    # ------------------------------------------------------------------ internals
    def _index(self, i: int) -> int:
        if not is_int(i) or not -self._size <= i < self._size:
            raise IndexError(
                f"member index {i!r} is out of range for an array of size {self._size}"
            )
        return int(i) % self._size

    def _index_places(self) -> None:
        """Where each slot's tensor lives and whether vmap batches it (after a layout change)."""
        self._swap_places = [(d, n, j) for j, s in enumerate(self._slots) for d, n in s.places]
        self._first_places = [s.places[0] for s in self._slots]
        self._dims = tuple(None if s.shared else 0 for s in self._slots)

    def _unshare_written(self) -> None:
        """Give each member its own copy of the shared buffers that a module in training mode
        would write per member (checked at every call: a submodule's mode can change directly)."""
        for module, j in self._watched:
            if self._slots[j].shared and writes_buffers(module):
                self._unshare(j, reason=f"{type(module).__name__} is in training mode")

    def _unshare(self, j: int, reason: str) -> None:
        """Stack slot ``j``'s shared tensor B times and store it as it would have been without
        sharing (a parameter where it was one, with ``requires_grad=False``). Optimizers built
        before do not see it: it is frozen, so they need not."""
        slot = self._slots[j]
        unshare_slot(slot, self.module, self._prototype, self._size)
        self._index_places()
        self._state_plan = False
        _log.info("%s is now kept per member: %s", slot.name, reason)

    def _adapt_shared(self, state_dict: Mapping[str, Any]) -> Mapping[str, Any]:
        """``state_dict`` (of this array, perhaps saved by an array that shared other tensors) with
        each value in this array's layout: a stacked value for a tensor this array shares is taken
        once when its rows are equal (else the tensor becomes per member, :meth:`_unshare`), an
        unstacked value for a tensor this array stacks is given to every member."""
        where = {(id(d), n): j for d, n, j in self._swap_places}
        keys: dict[str, int] = {}
        for path, m in self.module.named_modules(remove_duplicate=False):
            for store in (m._parameters, m._buffers):
                for n in store:
                    j = where.get((id(store), n))
                    if j is not None:
                        keys[f"module.{path}.{n}" if path else f"module.{n}"] = j
        out = OrderedDict(state_dict)
        out._metadata = getattr(state_dict, "_metadata", None)  # type: ignore[attr-defined]
        size = self.size
        for key, j in keys.items():
            value = out.get(key)
            if not isinstance(value, Tensor):
                continue
            current = self._state()[j]
            if self._slots[j].shared:
                if value.dim() == current.dim() + 1 and value.shape == (size, *current.shape):
                    if all(torch.equal(value[0], v) for v in value[1:]):
                        out[key] = value[0]
                    else:
                        self._unshare(j, reason=f"the loaded {key!r} differs between members")
            elif value.shape == current.shape[1:]:
                out[key] = value.unsqueeze(0).expand(size, *value.shape)
        return out

    def _forward_buffers(self) -> list[Tensor]:
        """The buffers a forward may update (BatchNorm statistics, dropout call counters): every
        buffer but the frozen parameters kept once, which nothing writes. What a caller backs up
        to replay a step exactly (the trainer, after an out-of-memory error)."""
        frozen = {
            id(t)
            for t, s in zip(self._state(), self._slots, strict=True)
            if s.shared and s.is_param
        }
        return [b for b in self.buffers() if id(b) not in frozen]

    def _state(self) -> tuple[Tensor, ...]:
        """The stacked tensors, read from the template on every call (``.to()`` replaces them)."""
        return tuple([owner[name] for owner, name in self._first_places])

    def __getstate__(self) -> dict[str, Any]:
        """Pickles and deep copies leave the traces behind: they are caches, rebuilt on demand."""
        state = self.__dict__.copy()
        state["_traces"] = {}
        state["_shared_traces"] = None
        state["_untraced_calls"] = {}
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        """A copy's modules have new ``__dict__`` objects: the trace key must read those (else
        the copy's ``eval()`` would go unseen and replay its training-mode trace)."""
        super().__setstate__(state)
        self._template_dicts = [
            (m.__dict__, per_member_attributes(m)) for m in self._template_modules
        ]
        self._public_keys = [(frozenset(), ()) for _ in self._template_dicts]  # see _attributes

    def _apply(self, fn: Any, recurse: bool = True) -> FusedArray:
        self._traces.clear()
        forget_views(self._state())  # views kept of the memory this may replace
        return super()._apply(fn, recurse)
