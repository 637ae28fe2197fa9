"""Cutting a fused array into shards: runs of consecutive layers, each small enough for the budget.

The model's forward is traced symbolically (``torch.fx.symbolic_trace`` of the array's prototype,
member 0's module tree on the meta device): its graph is the order in which layers are called. A
cut may go between two nodes only where exactly one value flows across it (the activation that
the next shard takes as its input) and no layer's tensors are used on both sides (tied weights
stay in one shard). Shards are grown greedily in graph order up to ``limit`` bytes of stacked
state (parameters and buffers of every member).

Each shard runs as a :class:`~hfsweep.fusion.FusedArray` of its own whose template is a
``GraphModule`` over the array's own fused layers (the same module objects, so the same stacked
tensors, dropout streams and BatchNorm statistics): a shard computes exactly what that stretch of
the whole array computes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from torch import Tensor, fx, nn

from ..fusion import FusedArray
from ..fusion._random import _REFUSED, _ROUTES, draws_functionally
from ._errors import OffloadError

__all__ = ["Shard", "plan_shards"]


@dataclass
class Shard:
    """Consecutive layers of an array run as one :class:`FusedArray` (``array``), with the
    indices of the array's stacked tensors it holds (``slots``) and their bytes."""

    array: FusedArray
    slots: list[int]
    nbytes: int
    #: the graph nodes it runs (their names), for messages and the docs
    nodes: list[str] = field(default_factory=list)


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


def _trace(array: FusedArray) -> fx.Graph:
    prototype = array._prototype
    try:
        return fx.symbolic_trace(prototype).graph
    except Exception as exc:
        raise OffloadError(
            f"offload runs a model layer by layer and needs its forward traceable by "
            f"torch.fx.symbolic_trace; {type(prototype).__name__} is not ({type(exc).__name__}: "
            f"{str(exc).splitlines()[0] if str(exc) else ''}). Use offload: none for this model, "
            "or write its forward without control flow on tensor values"
        ) from exc


def plan_shards(array: FusedArray, limit: int, *, strict: bool = True) -> list[Shard]:
    """The shards of ``array``, each holding at most ``limit`` bytes of stacked state where the
    model's graph can be cut that finely; where it cannot, :class:`OffloadError` naming the
    layers (``strict``) or a larger shard (``strict=False``: ``limit`` is only a target)."""
    if any(s.shared for s in array._slots):
        raise OffloadError(
            f"offload keeps every tensor per member; this array shares {array.shared_frozen} "
            "(build it with hs.fuse(..., share_frozen=False))"
        )
    graph = _trace(array)
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
    covered = set().union(*node_slots)
    # the functional stream's counters are no layer's: no random call uses them (checked)
    stream = array.functional._buffers if array.functional is not None else None
    missing = [
        s.name
        for j, s in enumerate(array._slots)
        if j not in covered and s.places[0][0] is not stream
    ]
    if missing:
        raise OffloadError(
            f"offload: the model's forward never calls the layers holding {missing[:3]}; "
            "offload needs every tensor inside a called layer"
        )
    position = {n: i for i, n in enumerate(body)}
    position.update({n: -1 for n in inputs})
    # a cut after body[i] is allowed when one value crosses it and no tensor is used on both sides
    last_use = {n: max((position.get(u, len(body)) for u in n.users), default=-1) for n in position}
    span: dict[int, tuple[int, int]] = {}
    for i, uses in enumerate(node_slots):
        for j in uses:
            first, _ = span.get(j, (i, i))
            span[j] = (first, i)
    crossing: list[list[fx.Node]] = []
    allowed: list[bool] = []
    for i in range(len(body)):
        live = [n for n, p in position.items() if p <= i and last_use[n] > i]
        crossing.append(live)
        tied = any(a <= i < b for a, b in span.values())
        allowed.append(len(live) == 1 and not tied)
    ranges: list[tuple[int, int]] = []
    start, held = 0, set(node_slots[0])
    for i in range(1, len(body)):
        grown = held | node_slots[i]
        if sum(sizes[j] for j in grown) > limit and allowed[i - 1]:
            ranges.append((start, i))
            start, held = i, set(node_slots[i])
        else:
            held = grown
    ranges.append((start, len(body)))
    shards = []
    for a, b in ranges:
        slots = sorted(set().union(*node_slots[a:b]))
        nbytes = sum(sizes[j] for j in slots)
        names = [n.name for n in body[a:b]]
        if strict and nbytes > limit:
            raise OffloadError(
                f"offload: the smallest run of layers that can be cut out around {names[:4]} "
                f"holds {nbytes} bytes of stacked state, over the shard limit of {limit} bytes "
                "(a quarter of the budget unless shard_bytes says otherwise); give a larger budget "
                "(device_memory) or fewer members"
            )
        source = inputs[0] if a == 0 else crossing[a - 1][0]
        result = output.args[0] if b == len(body) else crossing[b - 1][0]
        module = _shard_module(template, source, body[a:b], result)
        prototype = _shard_module(array._prototype, source, body[a:b], result)
        # no functional stream: the check above found no random call in forward code
        shard_array = FusedArray(
            module, prototype, array.size, [array._slots[j] for j in slots], array._trace_enabled
        )
        shard_array._defer_tracing(array._trace_after)
        shards.append(Shard(shard_array, slots, nbytes, names))
    return shards


def _check_no_random_calls(array: FusedArray, body: Sequence[fx.Node]) -> None:
    """Refuse forward code that draws random numbers itself (``F.dropout``, ``torch.rand``...):
    the array routes those through one stream per member that counts the array's forwards, and
    each shard would count one. Layers (``nn.Dropout``, attention) keep their own streams and
    are fine; a random op this check misses is still refused when the shard runs (``vmap``'s
    ``randomness="error"``), never drawn wrongly."""
    random = {*_ROUTES, *_REFUSED}
    for n in body:
        drawn = None
        if n.op == "call_function" and n.target in random:
            drawn = getattr(n.target, "__name__", str(n.target))
        elif n.op == "call_method" and getattr(Tensor, str(n.target), None) in random:
            drawn = f"Tensor.{n.target}"
        elif n.op == "call_module" and draws_functionally(
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


def stacked_bytes(tensors: Sequence[Tensor]) -> int:
    """Bytes of ``tensors``."""
    return sum(t.numel() * t.element_size() for t in tensors)
