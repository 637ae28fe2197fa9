"""Tracing a fused array's forward: each call signature's vmapped forward is traced once
(``make_fx`` on fake tensors) into a graph of plain batched aten ops that later calls replay, where
the trace cannot differ from eager (see :mod:`hfsweep.fusion._array`). :class:`_Tracing` holds the
array's tracing methods; the trace cache can be shared between arrays of one architecture."""

from __future__ import annotations

import functools
import linecache
import logging
import time
import traceback
import warnings
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, cast

import torch
from torch import Tensor, nn
from torch.func import vmap
from torch.overrides import TorchFunctionMode

from .._compat import pytree
from .._errors import FusionError
from ..nn import current_shard
from ._check import describe_path
from ._compile import (
    compile_error,
    compile_graph,
    compiling_backward_now,
    mode_for,
    warn_fallback,
)
from ._graph import simplify
from ._random import FunctionalStream, member_randomness
from ._recompute import intercepting
from ._state import StackedSlot

_log = logging.getLogger("hfsweep.fusion")

_PLAIN = (bool, int, float, str, type(None))


@dataclass
class _Outputs:
    """Structure of a forward's output: the pytree spec and its non-tensor leaves."""

    spec: Any = None
    leaves: list[Any] | None = None
    #: the checkpointed regions a traced forward started (see _recompute): such a call runs
    #: eagerly, where each region is recomputed in the backward
    regions: list[Any] | None = None


@dataclass
class _Trace:
    graph: Callable[..., Any]
    outputs: _Outputs
    seconds: float = 0.0  #: how long tracing took (what a new array size would pay again)
    replayed: bool = False  #: a replay has run to the end (see FusedArray._replay)
    #: the uncompiled graph while ``graph`` is its ``torch.compile``d version (``compile=``)
    plain: Callable[..., Any] | None = None


_EAGER = object()  # cache value: this signature runs eagerly


def _self_contained(entry: Any) -> bool:
    """A traced graph that reads no tensor constants: a function of its inputs alone."""
    if not isinstance(entry, _Trace):
        return False
    graph = getattr(entry.plain or entry.graph, "__self__", None)
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


class _Tracing:
    """The tracing half of :class:`~hfsweep.fusion.FusedArray`: building the vmapped forward,
    looking up, making, replaying and dropping traces, and naming the submodule a call failed
    in. The array's constructor sets the attributes declared here."""

    module: nn.Module
    functional: FunctionalStream | None
    _size: int
    _draws_refused: str | None
    _slots: list[StackedSlot]
    _swap_places: list[tuple[dict[str, Any], str, int]]
    _dims: tuple[int | None, ...]
    _trace_enabled: bool
    _traces: dict[Any, Any]
    _shared_traces: dict[Any, Any] | None
    _template_modules: list[nn.Module]
    _template_dicts: list[tuple[dict[str, Any], Any]]
    #: per template dict: the key set its public settings were worked out from, and those
    #: settings' names (see _attributes)
    _public_keys: list[tuple[frozenset[str], tuple[str, ...]]]
    _grad_watch: _GradModeWatch | None
    _tracing_seconds: float
    _trace_after: int
    _untraced_calls: dict[Any, int]
    _compile: bool | str
    _compile_seconds: float

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

    def _vmapped(
        self, leaves: list[Any], spec: Any, tensor_at: list[int], shared: bool
    ) -> Callable[[_Outputs], Callable[..., tuple[Tensor, ...]]]:
        n_state = len(self._slots)
        # the state a checkpointed region may write (set back while it is recomputed)
        buffer_at = tuple(j for j, s in enumerate(self._slots) if not s.is_param and not s.shared)

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
                with (
                    _batchable_attention(),
                    member_randomness(self.functional, self.module, self._draws_refused),
                    intercepting(
                        state,
                        self._swap_places,
                        buffer_at,
                        _batchable_attention,
                        self.module,
                        rec.regions,
                    ),
                ):
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
            dims = self._dims
            if self._size == 1:
                # One member: run forward on its slice of the stacked tensors, no vmap needed.
                # The slice is squeeze(0), a view whose backward is a view: s[0] (select) would
                # give each parameter's gradient through select_backward, a zero-filled
                # [1, ...] tensor and a copy into it, per parameter and step.
                def single(*flat: Tensor) -> tuple[Tensor, ...]:
                    state = tuple(
                        s if d is None else s.squeeze(0)
                        for s, d in zip(flat[:n_state], dims, strict=True)
                    )
                    inputs = (
                        flat[n_state:] if shared else tuple(t.squeeze(0) for t in flat[n_state:])
                    )
                    out = per_member(state, inputs, rec)
                    return tuple(o.unsqueeze(0) for o in out)

                return single
            batched = vmap(
                lambda s, t: per_member(s, t, rec),
                in_dims=(dims, None if shared else 0),  # shared frozen state: None
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
        # frozen parameters kept once (see _shared) are never written: not worth a copy
        buffers = [t for t, s in zip(state, self._slots, strict=True) if not s.is_param]
        with torch.no_grad():
            saved = [t.clone() for t in buffers]
        start = time.perf_counter()
        try:
            if trace.plain is not None:
                with compiling_backward_now():
                    out = trace.graph(*state, *tensors)
            else:
                out = trace.graph(*state, *tensors)
        except torch.OutOfMemoryError:
            raise
        except Exception as exc:
            with torch.no_grad():
                for t, value in zip(buffers, saved, strict=True):
                    t.copy_(value)
            if trace.plain is not None:  # the compiled graph failed: go on with the trace
                trace.graph, trace.plain = trace.plain, None
                warn_fallback(f"torch.compile failed on the traced forward ({compile_error(exc)})")
                return self._replay(trace, state, tensors)
            self._drop_trace(trace)
            warnings.warn(
                f"replaying the traced forward of a fused array failed at {_graph_line(exc, trace)} "
                f"({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}); this "
                "call signature runs eagerly (slower, same results). Please report it with the "
                "model.",
                stacklevel=3,
            )
            return None
        if trace.plain is not None:
            # the first call of a compiled graph compiles it (the forward, and with AOTAutograd
            # the backward's graph): time the steps leave out, as they leave out tracing
            seconds = time.perf_counter() - start
            self._compile_seconds += seconds
            self._tracing_seconds += seconds
            trace.seconds += seconds  # what an array of another size would pay again
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

        Part of every call's trace key: names and values, objects by identity. Attributes that
        are per-member data in the array (dropout ``p``, read from ``member_p``) are left out.
        Which of a module's keys are public settings is remembered with the key set it was
        worked out from (:data:`_public_keys`): a call compares each module's keys with that set
        (one comparison in C) and reads only the remembered settings' values, since reading
        every key of every module's ``__dict__`` on each call would be most of the trace
        lookup's time. A key added, removed or replaced since is seen by the comparison, and the
        settings are worked out again; a changed value is read on the next call.
        """
        out: list[Any] = []
        cache = self._public_keys
        for i, (d, per_member) in enumerate(self._template_dicts):
            keys, public = cache[i]
            if d.keys() != keys:
                keys = frozenset(d)
                public = tuple(k for k in d if k[0] != "_" and k not in per_member)
                cache[i] = (keys, public)
            for k in public:
                v = d[k]
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
                current_shard(),  # a data-parallel worker's rows: baked into random draws
                shared,
                spec,
                tuple(None if isinstance(x, Tensor) else x for x in leaves),
                tuple((t.shape, t.dtype, t.device, t.requires_grad) for t in tensors),
                tuple(
                    (t.shape if d is None else t.shape[1:], d, t.dtype, t.device, t.requires_grad)
                    for t, d in zip(state, self._dims, strict=True)
                ),
                type(self.module),
                self._compile,
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

        rec = _Outputs(regions=[])
        start = time.perf_counter()
        before = self._attributes()
        saved = [(m, dict(m.__dict__)) for m in self._template_modules]
        watch = self._grad_watch = _GradModeWatch()
        graph = None
        failure = ""
        mode = mode_for(self._compile, _device_of(state, tensors))
        try:
            with self._locate_errors(), warnings.catch_warnings():
                warnings.simplefilter("ignore")
                graph = simplify(
                    make_fx(call(rec), tracing_mode="fake")(*state, *tensors),
                    fold_state=mode is None,
                )
        except FusionError:
            raise
        except Exception as exc:  # data-dependent control flow and the like: stay eager
            _log.debug("tracing failed, running eagerly: %s", exc)
            lines = str(exc).strip().splitlines()
            failure = f"{type(exc).__name__}: {lines[0] if lines else ''}"
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
            self._compile_fallback("its forward changes Python attributes of its modules")
            return _EAGER
        if graph is None:
            self._compile_fallback(f"its forward cannot be traced ({failure})")
            return _EAGER
        if rec.regions:
            # a trace would hold the checkpointed regions' ops inline, saved for the backward:
            # the regions are recomputed only when the call runs them (eagerly)
            _log.debug("forward checkpoints activations; running eagerly")
            self._compile_fallback("its forward checkpoints activations, so it is not traced")
            return _EAGER
        if watch.changed:
            _log.debug("forward switches grad mode; running eagerly")
            self._compile_fallback("its forward switches grad mode, so it is not traced")
            return _EAGER
        # the generated forward itself: GraphModule.__call__ adds Module-call machinery per call
        trace = _Trace(graph=graph.forward, outputs=rec, seconds=time.perf_counter() - start)
        if mode is not None:
            trace.plain = trace.graph
            trace.graph = compile_graph(graph, mode, state)
        return trace

    def _compile_fallback(self, reason: str) -> None:
        """Warn that a call signature of an array asked to compile runs uncompiled."""
        if self._compile is not False:
            warn_fallback(reason, stacklevel=6)

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
                shared = [s.name for s in self._slots if s.shared and not s.is_param]
                hint = (
                    f" Buffers {shared} are kept once for all members (equal in all of them and "
                    "non-persistent): if forward writes one per member, fuse with "
                    "hs.fuse(..., share_frozen=False)."
                    if shared and "inplace" in text
                    else ""
                )
                raise FusionError(
                    f"{describe_path(path)} ({type(module).__name__}) cannot run in a fused array: "
                    f"{text.splitlines()[0].rstrip('.')}. Fused layers exist for Linear, convolutions, "
                    "BatchNorm, Dropout, LSTM/GRU/RNN and attention; replace this layer or open an "
                    f"issue with the model.{hint}"
                ) from exc
            if hasattr(exc, "add_note"):
                exc.add_note(f"(raised in {describe_path(path)} of a fused array, per member)")
            raise
        finally:
            h1.remove()
            h2.remove()


def _device_of(state: Sequence[Tensor], tensors: Sequence[Tensor]) -> torch.device:
    """The device a call runs on: its first tensor's (the CPU for a call without any)."""
    for t in (*state, *tensors):
        return t.device
    return torch.device("cpu")


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
