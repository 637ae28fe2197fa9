"""Cutting a fused array into shards: runs of consecutive layers, each small enough for the budget.

The model's forward is traced symbolically (``torch.fx``'s tracer on the array's prototype,
member 0's module tree on the meta device): its graph is the order in which layers are called. A
submodule whose own forward cannot be traced is one layer call (:class:`_LayerWhereUntraceable`).
A cut may go between two nodes only where exactly one value flows across it (the activation that
the next shard takes as its input), that value is not what an untraceable submodule returned
(not known to be one tensor), and no layer's tensors are used on both sides (tied weights stay
in one shard), but for tensors kept once for all members: no forward writes them, so every
shard that uses one (a frozen embedding tied to the output layer) copies it in. Shards are
grown greedily in graph order up to ``limit`` bytes of stacked state (parameters and buffers
of every member; :func:`grow_runs`, the rule the units streamed between blocks are grouped
by too).

Each shard runs as a :class:`~hfsweep.fusion.FusedArray` of its own whose template is a
``GraphModule`` over the array's own fused layers (the same module objects, so the same stacked
tensors, dropout streams and BatchNorm statistics): a shard computes exactly what that stretch of
the whole array computes.

Frozen tensors the array keeps once for all members (``share_frozen``, :attr:`FusedArray.
shared_frozen`) stay once in their shard: a shard's bytes count them once, and the engine copies
them to the compute side once for all members. A shard whose input is the same for every member
(the model's input, or the output of such a shard) and whose tensors are all kept once computes
the same value for every member: it runs once, as an array of one member, and hands the next
shard one value for all members (*member-independent*, :attr:`Shard.shared_output`), as the
whole array's ``vmap`` leaves such values unbatched. A frozen backbone in front of per-member
heads is computed once per step, not B times.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from torch import Tensor, fx, nn

from ..fusion import FusedArray, draws_functionally, is_random_call
from ._errors import OffloadError

__all__ = ["Shard", "plan_shards"]


@dataclass
class Shard:
    """Consecutive layers of an array run as one :class:`FusedArray` (``array``), with the
    indices of the array's stacked tensors it holds (``slots``) and their bytes: what the
    engine copies to the compute side in one fetch.

    Where the model is streamed between its blocks (``_units``), a shard is a group of
    consecutive units (``units``, each a ``Shard`` of its own whose ``array`` runs that unit,
    called by the model's own code), fetched together; the group's ``array`` is ``None``."""

    array: FusedArray | None
    slots: list[int]
    nbytes: int
    #: the graph nodes it runs (their names), for messages and the docs
    nodes: list[str] = field(default_factory=list)
    #: its input is one value for every member (unbatched: the array's input, or a
    #: member-independent shard's output)
    shared_input: bool = True
    #: it is member-independent (see the module's docstring): ``array`` has one member and the
    #: shard's output is one value for every member (a group of units: every unit's tensors
    #: are kept once for all members)
    shared_output: bool = False
    #: the units of a group streamed between blocks, in module order (empty for a graph shard
    #: and for a unit itself)
    units: list[Shard] = field(default_factory=list)


def _slot_index(array: FusedArray) -> dict[tuple[int, str], int]:
    """(id of a module's parameter or buffer dict, name) -> index of the stacked tensor there."""
    out: dict[tuple[int, str], int] = {}
    for j, slot in enumerate(array._slots):
        for d, name in slot.places:
            out[(id(d), name)] = j
    return out


def _module_slots(module: nn.Module, index: dict[tuple[int, str], int]) -> set[int]:
    found: set[int] = set()
    for sub in module.modules():
        for store in (sub._parameters, sub._buffers):
            for name, t in store.items():
                if t is not None and (id(store), name) in index:
                    found.add(index[(id(store), name)])
    return found


class _Root(nn.Module):
    """The model called as a layer, so that a forward taking ``*args`` traces with one input."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x: Tensor) -> Any:
        return self.inner(x)


class _LayerWhereUntraceable(fx.Tracer):
    """``torch.fx``'s tracer, but a module whose own forward cannot be traced (Python control
    flow on tensor values or shapes, a loop over a traced value: peft's LoRA layers) is
    recorded as one layer call, as ``torch.nn``'s own layers are, instead of failing the whole
    trace: its tensors then go to one shard together, and the shard calls the module itself."""

    def __init__(self) -> None:
        super().__init__()
        #: the modules recorded as one call because their forward could not be traced
        self.untraceable: list[str] = []
        self._leaves: set[str] = set()

    def call_module(
        self,
        m: nn.Module,
        forward: Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> Any:
        path = self.path_of_module(m)
        if path == "inner":  # the model itself: traced through (its failure is the trace's)
            return forward(*args, **kwargs)
        if self.is_leaf_module(m, path):
            return super().call_module(m, forward, args, kwargs)
        made, scopes = len(self.graph.nodes), len(self.module_stack)
        try:
            return super().call_module(m, forward, args, kwargs)
        except Exception:
            for node in reversed(list(self.graph.nodes)[made:]):  # its partial trace
                self.graph.erase_node(node)
            while len(self.module_stack) > scopes:  # the scopes the failure left open
                self.module_stack.popitem(last=True)
            self.untraceable.append(path.removeprefix("inner."))
            self._leaves.add(path)
            return super().call_module(m, forward, args, kwargs)

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        return module_qualified_name in self._leaves or super().is_leaf_module(
            m, module_qualified_name
        )


def _check_one_input(model: nn.Module) -> None:
    """Refuse a model whose forward needs more than one argument: the engine passes one tensor
    in (and one between shards)."""
    params = list(inspect.signature(model.forward).parameters.values())
    required = [
        p.name
        for p in params
        if p.default is inspect.Parameter.empty
        and p.kind not in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
    ]
    if len(required) > 1:
        raise OffloadError(
            f"offload needs a model whose forward takes one tensor; "
            f"{type(model).__name__}.forward takes {required}"
        )


def _trace(array: FusedArray) -> tuple[fx.Graph, set[str]]:
    """The graph of the prototype's forward on one input, its layers named as in the array's
    template, and the modules that could not be traced inside (single layer calls)."""
    prototype = array._prototype
    _check_one_input(prototype)
    tracer = _LayerWhereUntraceable()
    try:
        graph = tracer.trace(_Root(prototype))
    except Exception as exc:
        raise OffloadError(
            f"offload runs a model layer by layer and needs its forward traceable by "
            f"torch.fx.symbolic_trace; {type(prototype).__name__} is not ({type(exc).__name__}: "
            f"{str(exc).splitlines()[0] if str(exc) else ''}). Use offload: none for this model, "
            "or write its forward without control flow on tensor values"
        ) from exc
    for node in graph.nodes:
        if node.op in ("call_module", "get_attr"):
            node.target = str(node.target).removeprefix("inner.")
    return graph, set(tracer.untraceable)


def plan_shards(array: FusedArray, limit: int, *, strict: bool = True) -> list[Shard]:
    """The shards of ``array``, each holding at most ``limit`` bytes of stacked state where the
    model's graph can be cut that finely; where it cannot, :class:`OffloadError` naming the
    layers (``strict``) or a larger shard (``strict=False``: ``limit`` is only a target).
    Tensors kept once for all members count once (see the module's docstring)."""
    graph, opaque = _trace(array)
    inputs = [n for n in graph.nodes if n.op == "placeholder"]
    if len(inputs) != 1:
        raise OffloadError(
            f"offload needs a model whose forward takes one tensor; "
            f"{type(array._prototype).__name__}.forward takes {[n.target for n in inputs]}"
        )
    body = [n for n in graph.nodes if n.op not in ("placeholder", "output")]
    if array.functional is not None:
        _check_no_random_calls(array, body)
    output = next(n for n in graph.nodes if n.op == "output")
    if not body:
        raise OffloadError("offload needs a model with at least one layer")
    index = _slot_index(array)
    template = array.module
    sizes = [t.numel() * t.element_size() for t in array._state()]
    node_slots: list[set[int]] = []
    for n in body:
        if n.op == "get_attr":
            raise OffloadError(
                f"offload needs every tensor of the model read through a layer call; "
                f"{type(array._prototype).__name__}'s forward reads {n.target!r} directly"
            )
        if n.op == "call_module":
            node_slots.append(_module_slots(template.get_submodule(str(n.target)), index))
        else:
            node_slots.append(set())
    # a tensor no layer call holds is one the forward never reads (reads outside a layer are
    # refused above): it stays in host storage, never fetched (peft's original head, which
    # modules_to_save replaces), as the whole array never reads it either
    position = {n: i for i, n in enumerate(body)}
    position.update({n: -1 for n in inputs})
    # a cut after body[i] is allowed when one value crosses it and no tensor is used on both
    # sides, but for one kept once for all members: nothing writes it, so each shard that uses
    # it (a frozen embedding tied to the output layer) takes its own copy in
    last_use = {n: max((position.get(u, len(body)) for u in n.users), default=-1) for n in position}
    span: dict[int, tuple[int, int]] = {}
    for i, uses in enumerate(node_slots):
        for j in uses:
            if array._slots[j].shared:
                continue
            first, _ = span.get(j, (i, i))
            span[j] = (first, i)
    crossing: list[list[fx.Node]] = []
    allowed: list[bool] = []
    for i in range(len(body)):
        live = [n for n, p in position.items() if p <= i and last_use[n] > i]
        crossing.append(live)
        tied = any(a <= i < b for a, b in span.values())
        # what a module fx could not trace returns is not known to be one tensor (transformers'
        # models return ModelOutput objects): no cut right after it
        unknown = bool(live) and live[0].op == "call_module" and str(live[0].target) in opaque
        allowed.append(len(live) == 1 and not tied and not unknown)
    ranges = grow_runs(node_slots, sizes, limit, allowed)
    shards = []
    shared_input = True  # the array's input is one value for every member
    for a, b in ranges:
        slots = sorted(set().union(*node_slots[a:b]))
        nbytes = sum(sizes[j] for j in slots)
        names = [str(n.target) if n.op == "call_module" else n.name for n in body[a:b]]
        if strict and nbytes > limit:
            raise OffloadError(
                f"offload: the smallest run of layers that can be cut out around {names[:4]} "
                f"holds {nbytes} bytes of stacked state, over the shard limit of {limit} bytes "
                "(a quarter of the budget, less with a deeper prefetch or the optimizer step on the "
                "device, unless shard_bytes says otherwise); give a larger budget "
                "(device_memory) or fewer members"
            )
        source = inputs[0] if a == 0 else crossing[a - 1][0]
        result = output.args[0] if b == len(body) else crossing[b - 1][0]
        module = _shard_module(template, source, body[a:b], result)
        prototype = _shard_module(array._prototype, source, body[a:b], result)
        # member-independent: the same input and the same (shared) tensors for every member; the
        # last shard is not, so the engine returns [B, ...] as the array does
        independent = shared_input and b < len(body) and all(array._slots[j].shared for j in slots)
        # no functional stream: the check above found no random call in forward code
        shard_array = FusedArray(
            module,
            prototype,
            1 if independent else array.size,
            [array._slots[j] for j in slots],
            array._trace_enabled,
        )
        shard_array._defer_tracing(array._trace_after)
        shard_array._draws_refused = _DRAWS_REFUSED
        shards.append(Shard(shard_array, slots, nbytes, names, shared_input, independent))
        shared_input = independent
    return shards


#: why a shard refuses a random call of forward code (see _check_no_random_calls)
_DRAWS_REFUSED = (
    "offload runs the model shard by shard, and a member's stream for the random calls of "
    "forward code counts the whole array's forwards, so a shard cannot draw from it. Use "
    "nn.Dropout layers (each keeps its own streams), or offload: none"
)


def _known_to_draw(module: nn.Module) -> bool:
    """Whether a layer of torch's own classes draws random numbers in its forward (an
    ``nn.RReLU``, an alpha dropout, an RNN's dropout between layers). Layers of other
    classes (a library's, such as peft's LoRA layers) may or may not: their random calls are
    refused when the shard runs (:data:`_DRAWS_REFUSED`)."""
    return draws_functionally(module) and all(
        type(m).__module__.startswith("torch.nn.") for m in module.modules()
    )


def _check_no_random_calls(array: FusedArray, body: Sequence[fx.Node]) -> None:
    """Refuse forward code that draws random numbers itself (``F.dropout``, ``torch.rand``...):
    the array routes those through one stream per member that counts the array's forwards, and
    each shard would count one. Layers (``nn.Dropout``, attention) keep their own streams and
    are fine; a random call this check cannot see (inside a layer of a library's class) is
    refused when the shard runs (every shard refuses them, with one member too, where no
    ``vmap`` does), never drawn wrongly."""
    for n in body:
        drawn = None
        if n.op == "call_function" and is_random_call(n.target):
            drawn = getattr(n.target, "__name__", str(n.target))
        elif n.op == "call_method" and is_random_call(getattr(Tensor, str(n.target), None)):
            drawn = f"Tensor.{n.target}"
        elif n.op == "call_module" and _known_to_draw(
            array._prototype.get_submodule(str(n.target))
        ):
            drawn = type(array._prototype.get_submodule(str(n.target))).__name__
        if drawn is not None:
            raise OffloadError(
                f"offload cannot split a model whose forward code draws random numbers itself: "
                f"{type(array._prototype).__name__}'s forward calls {drawn} (at {n.name}), which "
                "would advance the member's stream once per shard. Use nn.Dropout layers, or "
                "offload: none"
            )


def _shard_module(
    root: nn.Module, source: fx.Node, nodes: Sequence[fx.Node], result: object
) -> fx.GraphModule:
    """A ``GraphModule`` running ``nodes`` on ``source``'s value and returning ``result``'s, its
    layers the very modules of ``root`` (not copies)."""
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {source: graph.placeholder("x")}
    for n in nodes:
        env[n] = graph.node_copy(n, lambda m: env[m])
    graph.output(fx.map_arg(result, lambda m: env[m]))  # type: ignore[arg-type,type-var]
    return fx.GraphModule(root, graph)


def grow_runs(
    holds: Sequence[set[int]], sizes: Sequence[int], limit: int, allowed: Sequence[bool]
) -> list[tuple[int, int]]:
    """The shard sizing rule, one for every way the engine cuts a model: runs ``[a, b)`` of
    consecutive items (graph nodes, or units streamed between blocks), where item ``i`` holds
    the stacked tensors ``holds[i]`` (indices into ``sizes``, their bytes). A run grows
    greedily, item by item, while the bytes of the union of its items' tensors stay within
    ``limit`` (a tensor two items share counts once); a cut after item ``i`` goes only where
    ``allowed[i]``, so a run may end over the limit where no cut is allowed (the caller
    refuses it, or takes ``limit`` as a target only). An item over the limit on its own is a
    run of its own where the cuts around it are allowed."""
    if not holds:
        return []
    runs: list[tuple[int, int]] = []
    start, held = 0, set(holds[0])
    for i in range(1, len(holds)):
        grown = held | holds[i]
        if sum(sizes[j] for j in grown) > limit and allowed[i - 1]:
            runs.append((start, i))
            start, held = i, set(holds[i])
        else:
            held = grown
    runs.append((start, len(holds)))
    return runs


def stacked_bytes(tensors: Sequence[Tensor]) -> int:
    """Bytes of ``tensors``."""
    return sum(t.numel() * t.element_size() for t in tensors)
