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
import functools
import linecache
import logging
import operator
import time
import traceback
import warnings
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, cast

import torch
import torch.utils._pytree as pytree
from torch import Tensor, nn
from torch.func import vmap
from torch.overrides import TorchFunctionMode

from .._checks import is_int
from .._errors import FusionError
from ._check import check_compatible, describe_path, per_member_attributes
from ._graph import simplify
from ._plan import dropout_feature_dims, stream_attribute, unsupported_reason
from ._random import STREAM_KEY, FunctionalStream, StreamFloat, member_randomness

__all__ = ["FusedArray"]

_log = logging.getLogger("hfsweep.fusion")

_PLAIN = (bool, int, float, str, type(None))


@dataclass
class _Slot:
    """One stacked tensor and every place in the template that refers to it (tied weights)."""

    name: str
    is_param: bool
    places: list[tuple[dict[str, Any], str]]
    setting: bool = False  # a per-member setting of hfsweep's (dropout p), not model state


@dataclass
class _Outputs:
    """Structure of a forward's output: the pytree spec and its non-tensor leaves."""

    spec: Any = None
    leaves: list[Any] | None = None


@dataclass
class _Trace:
    graph: Callable[..., Any]
    outputs: _Outputs
    seconds: float = 0.0  #: how long tracing took (what a new array size would pay again)
    replayed: bool = False  #: a replay has run to the end (see FusedArray._replay)


_EAGER = object()  # cache value: this signature runs eagerly


def _self_contained(entry: Any) -> bool:
    """A traced graph that reads no tensor constants: a function of its inputs alone."""
    if not isinstance(entry, _Trace):
        return False
    graph = getattr(entry.graph, "__self__", None)
    nodes = getattr(getattr(graph, "graph", None), "nodes", None)
    return nodes is not None and all(n.op != "get_attr" for n in nodes)


_TENSOR = object()  # marks where a tensor goes in a recorded output structure


class _GradModeWatch(TorchFunctionMode):
    """Notices forward code that changes grad mode (``torch.no_grad()`` inside forward)."""

    def __init__(self) -> None:
        super().__init__()
        self.expected = torch.is_grad_enabled()
        self.changed = False

    def __torch_function__(
        self, func: Any, types: Any, args: Sequence[Any] = (), kwargs: Any = None
    ) -> Any:
        if torch.is_grad_enabled() != self.expected:
            self.changed = True
        return func(*args, **(kwargs or {}))


class FusedArray(nn.Module):
    """B models of one architecture trained as one module. Build it with :func:`hfsweep.fuse`.

    ``array(x)`` feeds one input to every member and returns ``[B, N, ...]``;
    ``array(xs, shared=False)`` takes one input per member (``[B, N, ...]``). Every parameter and
    buffer is stacked with the member as dimension 0 and lives under ``array.module``: that is
    what optimizers update (``array.parameters()``), what ``state_dict()`` saves, and what
    :meth:`member` and :meth:`load_member` slice. ``array.module`` itself is storage, not a model:
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
        slots: list[_Slot],
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
        self._swap_places = [(d, n, j) for j, s in enumerate(slots) for d, n in s.places]
        self._first_places = [s.places[0] for s in slots]
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

    # ------------------------------------------------------------------ public API
    @property
    def size(self) -> int:
        """Number of members B."""
        return self._size

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
        state = self._state()
        if not state and shared:
            # a model without parameters or buffers: vmap needs one batched input
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
                value: Tensor = stacked[i].detach().clone()
                if slot.is_param:
                    value = nn.Parameter(value, requires_grad=stacked.requires_grad)
                for module, name in owners[slot.name]:
                    setattr(module, name, value)  # one object in every tied place
        for path, m, attr in self._streams:
            setattr(model.get_submodule(path), attr, float(m.get_buffer("member_p")[i]))
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
                    row = state[j][i].detach()
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
                target = state[j][i]
                if not isinstance(value, Tensor) or value.shape != target.shape:
                    shape = tuple(value.shape) if isinstance(value, Tensor) else type(value)
                    raise ValueError(
                        f"state dict entry {key!r} has shape {shape}, one member's "
                        f"{key!r} has shape {tuple(target.shape)}"
                    )
                target.copy_(value)

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
            for slot, stacked in zip(self._slots, self._state(), strict=True):
                if slot.setting:
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

    def load_state_dict(
        self, state_dict: Mapping[str, Any], strict: bool = True, assign: bool = False
    ) -> Any:
        """``nn.Module.load_state_dict``, then each attention layer's ``hfsweep_masks`` from
        the probabilities it loaded."""
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

    def extra_repr(self) -> str:
        return f"size={self._size}, trace={self._trace_enabled}"

    # ------------------------------------------------------------------ internals
    def _index(self, i: int) -> int:
        if not is_int(i) or not -self._size <= i < self._size:
            raise IndexError(
                f"member index {i!r} is out of range for an array of size {self._size}"
            )
        return int(i) % self._size

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

    def _share_traces(self, cache: dict[Any, Any]) -> None:
        """Look traces up in, and add them to, ``cache`` too: a cache shared by arrays of one
        architecture (the trainer's arrays of one compatibility key), so an array rebuilt at
        another size or after a refill does not trace again. Only graphs that depend on
        nothing but their inputs (no tensor constants) are shared; keys include the stacked
        state's shapes, dtypes and devices."""
        self._shared_traces = cache

    def _defer_tracing(self, calls: int) -> None:
        """Run a new call signature eagerly until its ``calls``-th call, then trace it. A trace
        costs as much as tens of eager calls of a small model, so signatures an array calls
        only a few times (an epoch's shorter last batch, evaluation) are better left eager.
        The array's first signature (its training step) is traced at once, and a trace found
        in the shared cache is used at once. Eager and traced calls run the same batched ops."""
        self._trace_after = max(1, int(calls))

    def _retrace_seconds(self, size: int) -> float:
        """Seconds an array of this architecture with ``size`` members would spend tracing the
        call signatures this array has used so far (training and evaluation batches): the
        measured time of each of this array's traces whose counterpart at ``size`` is not in
        the shared cache. What rebuilding at another size costs beyond building it."""
        shared = self._shared_traces or {}
        total = 0.0
        for key, entry in self._traces.items():
            if isinstance(entry, _Trace) and (size, *key[1:]) not in shared:
                total += entry.seconds
        return total

    def _apply(self, fn: Any, recurse: bool = True) -> FusedArray:
        self._traces.clear()
        return super()._apply(fn, recurse)

    def _vmapped(
        self, leaves: list[Any], spec: Any, tensor_at: list[int], shared: bool
    ) -> Callable[[_Outputs], Callable[..., tuple[Tensor, ...]]]:
        n_state = len(self._slots)

        def per_member(
            state: tuple[Tensor, ...], tensors: tuple[Tensor, ...], rec: _Outputs
        ) -> Any:
            saved = [(d, n, d[n]) for d, n, _ in self._swap_places]
            for d, n, j in self._swap_places:
                d[n] = state[j]
            try:
                filled = list(leaves)
                for i, t in zip(tensor_at, tensors, strict=True):
                    filled[i] = t
                args, kwargs = pytree.tree_unflatten(filled, spec)
                with _batchable_attention(), member_randomness(self.functional, self.module):
                    if self._grad_watch is not None:
                        with self._grad_watch:
                            out = self.module(*args, **kwargs)
                    else:
                        out = self.module(*args, **kwargs)
            finally:
                for d, n, v in saved:
                    d[n] = v
            out_leaves, rec.spec = pytree.tree_flatten(out)
            rec.leaves = [_TENSOR if isinstance(x, Tensor) else x for x in out_leaves]
            result = tuple(x for x in out_leaves if isinstance(x, Tensor))
            if not result:
                raise FusionError("the model's forward returned no tensor")
            return result

        def make(rec: _Outputs) -> Callable[..., tuple[Tensor, ...]]:
            if self._size == 1:
                # One member: run forward on its slice of the stacked tensors, no vmap needed.
                def single(*flat: Tensor) -> tuple[Tensor, ...]:
                    state = tuple(s[0] for s in flat[:n_state])
                    inputs = flat[n_state:] if shared else tuple(t[0] for t in flat[n_state:])
                    out = per_member(state, inputs, rec)
                    return tuple(o.unsqueeze(0) for o in out)

                return single
            batched = vmap(
                lambda s, t: per_member(s, t, rec),
                in_dims=(0, None if shared else 0),
                randomness="error",  # every random op is routed to the member's stream
            )
            return lambda *flat: batched(tuple(flat[:n_state]), tuple(flat[n_state:]))

        return make

    def _replay(
        self, trace: _Trace, state: tuple[Tensor, ...], tensors: list[Tensor]
    ) -> Sequence[Tensor] | None:
        """Run a traced graph; ``None`` if its first replay failed and the call must run eagerly.

        Tracing checks what it can, but an op of the graph may still fail when it runs for real
        (an op the trace recorded that cannot be called as recorded). On a trace's first replay
        such an error drops the trace with a warning naming the op, the buffers the partial
        replay may have updated (BatchNorm statistics, dropout call counters) are put back, and
        the call runs eagerly. A trace that has replayed once runs the same ops on tensors of the
        same shapes, so a later error is the data's (an index out of range), which eager code
        would raise too: it is raised, naming the op.
        """
        if trace.replayed:
            try:
                return cast(Sequence[Tensor], trace.graph(*state, *tensors))
            except Exception as exc:
                if hasattr(exc, "add_note"):
                    exc.add_note(
                        f"(raised in a fused array's traced forward, at {_graph_line(exc, trace)})"
                    )
                raise
        buffers = [t for t in state if not isinstance(t, nn.Parameter)]
        with torch.no_grad():
            saved = [t.clone() for t in buffers]
        try:
            out = trace.graph(*state, *tensors)
        except torch.OutOfMemoryError:
            raise
        except Exception as exc:
            with torch.no_grad():
                for t, value in zip(buffers, saved, strict=True):
                    t.copy_(value)
            self._drop_trace(trace)
            warnings.warn(
                f"replaying the traced forward of a fused array failed at {_graph_line(exc, trace)} "
                f"({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}); this "
                "call signature runs eagerly (slower, same results). Please report it with the "
                "model.",
                stacklevel=3,
            )
            return None
        trace.replayed = True
        return cast(Sequence[Tensor], out)

    def _drop_trace(self, trace: _Trace) -> None:
        """Run every signature that used ``trace`` eagerly from now on."""
        for cache in (self._traces, self._shared_traces or {}):
            for key, entry in list(cache.items()):
                if entry is trace:
                    cache[key] = _EAGER

    def _rebuild(self, out: Sequence[Tensor], rec: _Outputs) -> Any:
        assert rec.leaves is not None
        if rec.spec.is_leaf() and rec.leaves[0] is _TENSOR:
            return out[0]  # a bare tensor out: nothing to rebuild
        it = iter(out)
        leaves = [next(it) if x is _TENSOR else x for x in rec.leaves]
        return pytree.tree_unflatten(leaves, rec.spec)

    def _attributes(self) -> tuple[Any, ...]:
        """Every plain Python setting of the template's modules (train/eval mode included).

        Part of every call's trace key (about 6 us for a small MLP): names and values, objects by
        identity. Attributes that are per-member data in the array (dropout ``p``, read from
        ``member_p``) are left out.
        """
        out: list[Any] = []
        for d, per_member in self._template_dicts:
            for k, v in d.items():
                if k[0] != "_" and k not in per_member:
                    out.append(k)
                    out.append(v if type(v) in _PLAIN else id(v))
        return tuple(out)

    def _lookup_trace(
        self,
        leaves: list[Any],
        spec: Any,
        tensor_at: list[int],
        tensors: list[Tensor],
        shared: bool,
        state: tuple[Tensor, ...],
    ) -> _Trace | None:
        if not self._trace_enabled:
            return None
        try:
            # the size first, then the state without its member dimension: the same key with
            # another size is the same call in an array of that size (see _retrace_seconds)
            key = (
                self._size,
                self._attributes(),
                torch.is_grad_enabled(),
                torch.is_inference_mode_enabled(),
                _autocast_state(),
                shared,
                spec,
                tuple(None if isinstance(x, Tensor) else x for x in leaves),
                tuple((t.shape, t.dtype, t.device, t.requires_grad) for t in tensors),
                tuple((t.shape[1:], t.dtype, t.device, t.requires_grad) for t in state),
                type(self.module),
            )
            entry = self._traces.get(key)
            if entry is None and self._shared_traces is not None:
                entry = self._shared_traces.get(key)
                if entry is not None:
                    self._traces[key] = entry  # the signatures this array uses
        except TypeError:  # an unhashable non-tensor argument: run eagerly
            return None
        if entry is None:
            calls = self._untraced_calls.get(key, 0) + 1
            if calls < self._trace_after and self._traces:
                self._untraced_calls[key] = calls
                return None  # not called often enough yet to pay for a trace: eager
            self._untraced_calls.pop(key, None)
            start = time.perf_counter()
            entry = self._trace(self._vmapped(leaves, spec, tensor_at, shared), state, tensors)
            self._tracing_seconds += time.perf_counter() - start
            if self._trace_enabled:
                self._traces[key] = entry
                if self._shared_traces is not None and _self_contained(entry):
                    self._shared_traces[key] = entry
        return None if entry is _EAGER else entry

    def _trace(
        self,
        call: Callable[[_Outputs], Callable[..., tuple[Tensor, ...]]],
        state: tuple[Tensor, ...],
        tensors: list[Tensor],
    ) -> Any:
        from torch.fx.experimental.proxy_tensor import make_fx

        rec = _Outputs()
        start = time.perf_counter()
        before = self._attributes()
        saved = [(m, dict(m.__dict__)) for m in self._template_modules]
        watch = self._grad_watch = _GradModeWatch()
        graph = None
        try:
            with self._locate_errors(), warnings.catch_warnings():
                warnings.simplefilter("ignore")
                graph = simplify(make_fx(call(rec), tracing_mode="fake")(*state, *tensors))
        except FusionError:
            raise
        except Exception as exc:  # data-dependent control flow and the like: stay eager
            _log.debug("tracing failed, running eagerly: %s", exc)
        finally:
            self._grad_watch = None
        if self._attributes() != before:
            for m, d in saved:  # undo what the traced forward did, before it runs for real
                m.__dict__.clear()
                m.__dict__.update(d)
            self._trace_enabled = False
            warnings.warn(
                "a forward of this model changes Python attributes of its modules, so its calls "
                "cannot be replayed from a trace; the array runs eagerly (slower, same results)",
                stacklevel=4,
            )
            return _EAGER
        if graph is None:
            return _EAGER
        if watch.changed:
            _log.debug("forward switches grad mode; running eagerly")
            return _EAGER
        # the generated forward itself: GraphModule.__call__ adds Module-call machinery per call
        return _Trace(graph=graph.forward, outputs=rec, seconds=time.perf_counter() - start)

    @contextmanager
    def _locate_errors(self) -> Iterator[None]:
        """Name the submodule that was running when a call failed."""
        names = {id(m): path for path, m in self.module.named_modules()}
        stack: list[str] = []

        def enter(module: nn.Module, args: Any) -> None:
            if id(module) in names:
                stack.append(names[id(module)])

        def leave(module: nn.Module, args: Any, out: Any) -> None:
            if stack and id(module) in names:
                stack.pop()

        h1 = nn.modules.module.register_module_forward_pre_hook(enter)
        h2 = nn.modules.module.register_module_forward_hook(leave)
        try:
            yield
        except FusionError:
            raise
        except Exception as exc:
            if not stack:
                raise
            path = stack[-1]
            module = self.module.get_submodule(path)
            text = str(exc)
            if "vmap" in text or "atching rule" in text:
                raise FusionError(
                    f"{describe_path(path)} ({type(module).__name__}) cannot run in a fused array: "
                    f"{text.splitlines()[0].rstrip('.')}. Fused layers exist for Linear, convolutions, "
                    "BatchNorm, Dropout, LSTM/GRU/RNN and attention; replace this layer or open an "
                    "issue with the model."
                ) from exc
            if hasattr(exc, "add_note"):
                exc.add_note(f"(raised in {describe_path(path)} of a fused array, per member)")
            raise
        finally:
            h1.remove()
            h2.remove()


def _graph_line(exc: BaseException, trace: _Trace) -> str:
    """The line of a traced graph's code that raised ``exc`` (it names the op), or a phrase."""
    code = getattr(getattr(trace.graph, "__func__", trace.graph), "__code__", None)
    line = ""
    for frame, lineno in traceback.walk_tb(exc.__traceback__):
        if frame.f_code is code:
            line = linecache.getline(frame.f_code.co_filename, lineno)
    line = line.split(";")[0].strip()
    return f"`{line}`" if line else "an op of the graph"


@contextmanager
def _batchable_attention() -> Iterator[None]:
    """Keep attention on kernels that ``vmap`` batches, inside the batched forward.

    Under ``vmap`` the batched stand-ins of parameters report ``requires_grad=False``, so
    ``MultiheadAttention`` and ``TransformerEncoderLayer`` in eval mode would pick their inference
    fast path, which has no batching rule (a loop over members) and no derivative. The fused
    flash/memory-efficient SDPA kernels have no batching rule either; SDPA's math backend is made
    of batched matrix products and a softmax.
    """
    from torch.nn.attention import SDPBackend, sdpa_kernel

    enabled = torch.backends.mha.get_fastpath_enabled()
    torch.backends.mha.set_fastpath_enabled(False)
    try:
        with sdpa_kernel(SDPBackend.MATH):
            yield
    finally:
        torch.backends.mha.set_fastpath_enabled(enabled)


@functools.cache
def _one_tensor_spec() -> Any:
    """Pytree spec of ``((tensor,), {})``, the arguments of the common call ``array(x)``."""
    return pytree.tree_flatten(((torch.empty(0),), {}))[1]


def _autocast_state() -> tuple[Any, ...]:
    out: list[Any] = []
    for device in ("cpu", "cuda"):
        enabled = torch.is_autocast_enabled(device)
        out.append(enabled)
        if enabled:
            out.append(torch.get_autocast_dtype(device))
    return tuple(out)


def _owners(model: nn.Module) -> dict[str, list[tuple[nn.Module, str]]]:
    """Every (module, attribute) holding each parameter/buffer, keyed by the tensor's first name.

    A tensor tied into several modules (shared embedding and output weights) appears once, with
    all the places that hold it.
    """
    first: dict[int, str] = {}
    out: dict[str, list[tuple[nn.Module, str]]] = {}
    for path, module in model.named_modules(remove_duplicate=False):
        for store in (module._parameters, module._buffers):
            for name, t in store.items():
                if t is None:
                    continue
                full = f"{path}.{name}" if path else name
                key = first.setdefault(id(t), full)
                out.setdefault(key, []).append((module, name))
    return out


def _plan_state_dict(
    prototype: nn.Module, slots: list[_Slot]
) -> tuple[list[tuple[str, int]], Any] | None:
    """Which stacked tensor each entry of a member's ``state_dict`` is, from the prototype's
    ``state_dict`` on the meta device; ``None`` if some entry is not one of them (extra state,
    a hook that makes new values) or the prototype's ``state_dict`` fails on meta tensors."""
    owners = _owners(prototype)
    index: dict[int, int] = {}
    for position, slot in enumerate(slots):
        if slot.setting:
            continue
        for module, name in owners.get(slot.name, []):
            index[id(getattr(module, name))] = position
    try:
        entries = prototype.state_dict(keep_vars=True)
    except Exception:  # a state_dict hook that cannot run on meta tensors
        return None
    keys: list[tuple[str, int]] = []
    for key, value in entries.items():
        j: int | None = index.get(id(value)) if isinstance(value, Tensor) else None
        if j is None:
            return None
        keys.append((key, j))
    return keys, getattr(entries, "_metadata", None)


def _with_metadata(values: dict[str, Any], like: Any) -> dict[str, Any]:
    """``values`` as an ordered state dict carrying ``like``'s ``_metadata``."""
    out = OrderedDict(values)
    out._metadata = getattr(like, "_metadata", None)  # type: ignore[attr-defined]
    return out


def _places(model: nn.Module) -> dict[str, list[tuple[dict[str, Any], str]]]:
    """Like :func:`_owners`, with the module's parameter or buffer dict in place of the module."""
    return {
        key: [(m._parameters if name in m._parameters else m._buffers, name) for m, name in owners]
        for key, owners in _owners(model).items()
    }


_STREAM_LIMIT = 1 << 63  # seeds and call counts are non-negative int64


def _is_attention(module: nn.Module) -> bool:
    from ..nn import FusedMultiheadAttentionMixin

    return isinstance(module, FusedMultiheadAttentionMixin)


#: attention layers' stream salts start here (dropout layers' are their index, from 0)
_ATTENTION_SALTS = 1 << 20


def _stream_probability(module: nn.Module, attr: str, path: str) -> float:
    """A stream layer's probability, checked: torch's dropout layers refuse one outside
    [0, 1] when built, but ``MultiheadAttention`` keeps any float."""
    p = float(getattr(module, attr))
    if not 0.0 <= p <= 1.0:
        raise FusionError(
            f"{describe_path(path)} ({type(module).__name__}): {attr}={p} is not a probability "
            "in [0, 1]"
        )
    return p


def _update_attention_masks(attention: nn.Module) -> None:
    """Whether a fused attention layer draws masks: only while some member's ``p`` is above 0,
    so arrays without attention dropout skip the masks (a plain attribute: part of the trace
    key, so a change is traced anew)."""
    attention.__dict__["hfsweep_masks"] = bool((attention.get_buffer("member_p") > 0).any())


def _check_stream_value(what: str, value: Any) -> int:
    """``value`` as a dropout-stream int in ``[0, 2**63)``, or an error naming it.

    Anything integer-like (``int``, NumPy integers) is accepted; ``bool`` and floats are not.
    """
    if isinstance(value, bool) or not hasattr(type(value), "__index__"):
        raise TypeError(f"{what} must be an int in [0, 2**63), got {value!r}")
    number = operator.index(value)
    if not 0 <= number < _STREAM_LIMIT:
        raise ValueError(f"{what} must be an int in [0, 2**63), got {number}")
    return number


def _stream_entry(path: str, entry: Any) -> tuple[int, int]:
    """``(seed, calls)`` of one entry of an rng state, checked."""
    if isinstance(entry, str | bytes) or not isinstance(entry, Sequence) or len(entry) != 2:
        raise ValueError(f"rng state for {path!r} must be [seed, calls], got {entry!r}")
    seed = _check_stream_value(f"seed of {path!r}", entry[0])
    return seed, _check_stream_value(f"calls of {path!r}", entry[1])


def _write_stream(dropout: nn.Module, i: int, seed: int, calls: int) -> None:
    """Set member ``i``'s seed and call count in one fused dropout layer."""
    with torch.no_grad():
        dropout.get_buffer("member_seed")[i] = seed
        dropout.get_buffer("member_calls")[i] = calls


def _assign_dropout(
    dropouts: list[tuple[str, nn.Module]],
    size: int,
    p: Sequence[float] | Mapping[str, Sequence[float]],
) -> None:
    if isinstance(p, Mapping):
        known = dict(dropouts)
        targets = []
        for path, values in p.items():
            if path not in known:
                raise FusionError(
                    f"dropout[{path!r}]: no per-member dropout layer at that path; dropout layers "
                    f"are {sorted(known) or 'none'}"
                )
            targets.append((path, known[path], values))
    else:
        if not dropouts:
            raise FusionError(
                "dropout= was given but the model has no nn.Dropout/Dropout1d/2d/3d layer"
            )
        targets = [(path, m, p) for path, m in dropouts]
    for path, m, values in targets:
        vals = [float(v) for v in values]
        if len(vals) != size:
            raise FusionError(
                f"dropout for {describe_path(path)}: got {len(vals)} values for {size} members; "
                "give one probability per member"
            )
        bad = [v for v in vals if not 0.0 <= v <= 1.0]
        if bad:
            raise FusionError(
                f"dropout for {describe_path(path)}: {bad[0]} is not a probability in [0, 1]"
            )
        buf = m.get_buffer("member_p")
        with torch.no_grad():
            buf.copy_(torch.tensor(vals, dtype=buf.dtype))


def _peeked_seeds(size: int) -> Tensor:
    """Default seeds for a model whose only random draws are its forward's own calls: what
    ``torch.randint`` would draw, read from a copy of torch's generator, which stays as it was
    (fusing a model without dropout layers never moved it)."""
    generator = torch.Generator()
    generator.set_state(torch.get_rng_state())
    return torch.randint(0, _STREAM_LIMIT - 1, (size,), generator=generator)


def build_array(
    models: Sequence[nn.Module],
    dropout: Sequence[float] | Mapping[str, Sequence[float]] | None,
    trace: bool,
) -> FusedArray:
    """Check ``models``, stack their state and assemble the array (see :func:`hfsweep.fuse`)."""
    from ._plan import fused_class
    from ._random import draws_functionally

    models = list(models)
    check_compatible(models, unsupported_reason)
    ref = models[0]
    size = len(models)

    # Copies of member 0's tree whose tensors are meta placeholders: no data is duplicated.
    def meta_copy() -> nn.Module:
        memo: dict[int, Any] = {}
        for t in [*ref.parameters(), *ref.buffers()]:
            empty = torch.empty_like(t, device="meta")
            memo[id(t)] = (
                nn.Parameter(empty, requires_grad=t.requires_grad)
                if isinstance(t, nn.Parameter)
                else empty
            )
        return copy.deepcopy(ref, memo)

    prototype = meta_copy()
    template = meta_copy()
    dropout_paths: list[str] = []
    stream_attributes: list[str] = []
    for path, module in template.named_modules():
        dims = dropout_feature_dims(module)
        attr = stream_attribute(module)
        cls = fused_class(module, size)
        if cls is not None:
            module.__class__ = cls
        if attr is not None:
            module._hfsweep_feature_dims = dims or 0
            # the layer's own stream within a member: its index among the dropout layers, or
            # among the attention layers in a range of their own (so adding attention streams
            # left the dropout layers' masks as they were)
            offset = _ATTENTION_SALTS if attr == "dropout" else 0
            module._hfsweep_salt = stream_attributes.count(attr) + offset
            dropout_paths.append(path)
            stream_attributes.append(attr)

    member_places = [_places(m) for m in models]
    template_places = _places(template)
    slots: list[_Slot] = []
    with torch.no_grad():
        for name, places in template_places.items():
            owner0, attr0 = member_places[0][name][0]
            first = owner0[attr0]
            stacked = torch.stack([mp[name][0][0][mp[name][0][1]].detach() for mp in member_places])
            is_param = isinstance(first, nn.Parameter)
            value: Tensor = (
                nn.Parameter(stacked, requires_grad=first.requires_grad) if is_param else stacked
            )
            for owner, attr in places:
                owner[attr] = value
            slots.append(_Slot(name=name, is_param=is_param, places=places))

    device = slots[0].places[0][0][slots[0].places[0][1]].device if slots else torch.device("cpu")
    # One default dropout seed per member from torch's global generator (on the CPU, so the
    # same torch.manual_seed gives the same streams on every device); drawn only when needed,
    # so arrays without dropout (attention layers whose dropout is 0 included) leave the
    # generator alone.
    probabilities = {
        path: [_stream_probability(m.get_submodule(path), attr, path) for m in models]
        for path, attr in zip(dropout_paths, stream_attributes, strict=True)
    }
    draws = any(
        attr == "p" or any(p > 0 for p in probabilities[path])
        for path, attr in zip(dropout_paths, stream_attributes, strict=True)
    )
    functional = draws_functionally(ref)
    seeds = (
        torch.randint(0, _STREAM_LIMIT - 1, (size,))
        if draws
        else _peeked_seeds(size)
        if functional
        else torch.zeros(size, dtype=torch.int64)
    )
    for path, attr in zip(dropout_paths, stream_attributes, strict=True):
        module = template.get_submodule(path)
        ps = probabilities[path]
        settings = {
            "member_p": torch.tensor(ps, dtype=torch.float32, device=device),
            "member_seed": seeds.to(device, copy=True),  # one tensor per layer, never shared
            "member_calls": torch.zeros(size, dtype=torch.int64, device=device),
        }
        for name, value in settings.items():
            module.register_buffer(name, value)
            slots.append(_Slot(f"{path}.{name}", False, [(module._buffers, name)], setting=True))
        if attr == "dropout":
            _update_attention_masks(module)
        else:  # forward code reading the layer's p for a functional dropout gets its stream
            module.__dict__["p"] = StreamFloat(ps[0], module)
    stream = None
    if functional:
        stream = FunctionalStream(seeds.to(device, copy=True))
        for name in ("member_seed", "member_calls"):
            slots.append(
                _Slot(f"<functional>.{name}", False, [(stream._buffers, name)], setting=True)
            )
    array = FusedArray(template, prototype, size, slots, trace, stream)
    if dropout is not None:
        array.set_dropout(dropout)
    return array
