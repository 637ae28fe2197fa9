"""Cutting a model between its repeated blocks where ``torch.fx`` cannot cut it: the *units*
that the engine streams while the model's own forward runs (:func:`plan_units`).

A Hugging Face encoder (``BertModel``, ``GPT2Model``) cannot be traced by ``torch.fx``: its
forward branches on tensor values (attention-mask preprocessing) and loops over its layers in
Python. What it does have is a list of same-structured blocks (``encoder.layer``, ``h``: an
``nn.ModuleList`` whose children have one class and the same tensors' shapes) called one after
another from that loop. A *unit* is one such block, or one submodule outside every block list
that holds state (the embeddings, the pooler, a dropout, the classifier head): the largest
submodule that is neither a block list nor holds one. Every stacked tensor of the array belongs
to a unit (a model that keeps a tensor on a module above the units is refused, naming it); a
tensor tied into two units (an embedding tied to the output layer) belongs to both, which is
safe because no forward writes a parameter, and is refused for a buffer a forward may write.

Each unit runs as a :class:`~hfsweep.fusion.FusedArray` of its own over the array's very module
(the same stacked tensors, dropout streams and LoRA settings), as the traced shards do, so it
computes exactly what that module computes inside the whole array. The engine's side of it is
``_streamed``.

Consecutive units (in module order) are grouped into one shard while the group's stacked
state fits the shard limit, by the rule the graph cut sizes its shards with
(:func:`~hfsweep.offload._shards.grow_runs`; a tensor two units share counts once): a group is
fetched to the compute side once for all its units, so a model of many small blocks makes one
fetch per group, not per block, where the budget allows; under a tight budget each block is a
shard of its own. A unit is never cut inside.
"""

from __future__ import annotations

import dataclasses

from torch import nn

from ..fusion import FusedArray, StackedSlot
from ._errors import OffloadError
from ._shards import (
    _DRAWS_REFUSED,
    Shard,
    _check_one_input,
    _module_slots,
    _slot_index,
    grow_runs,
)

__all__ = ["plan_units", "repeated_blocks"]


def _signature(module: nn.Module) -> tuple[object, ...]:
    """A block's class and the names and shapes of its tensors: equal for repeated blocks."""
    tensors = [*module.named_parameters(), *module.named_buffers()]
    return (type(module), tuple(sorted((n, tuple(t.shape), t.dtype) for n, t in tensors)))


def repeated_blocks(model: nn.Module) -> list[str]:
    """Paths of the outermost ``nn.ModuleList``\\ s of ``model`` whose two or more children are
    same-structured blocks (one class, the same tensors' names and shapes)."""
    found: list[str] = []
    for path, m in model.named_modules():
        if any(path.startswith(f"{p}.") for p in found):
            continue  # inside a block list already found
        if isinstance(m, nn.ModuleList) and len(m) >= 2:
            kinds = {_signature(child) for child in m}
            if len(kinds) == 1:
                found.append(path)
    return found


def _join(path: str, name: str) -> str:
    return f"{path}.{name}" if path else name


def _unit_paths(template: nn.Module, lists: list[str], model_name: str) -> list[str]:
    """The units of ``template`` (see the module's docstring), in module order."""
    units: list[str] = []

    def holds_list(path: str) -> bool:
        return any(p == path or p.startswith(f"{path}.") for p in lists) or not path

    def direct_state(module: nn.Module) -> list[str]:
        return [
            n for n, t in [*module._parameters.items(), *module._buffers.items()] if t is not None
        ]

    def walk(module: nn.Module, path: str) -> None:
        own = direct_state(module)
        if own:
            raise OffloadError(
                f"offload streams {model_name}'s blocks and the modules around them, and needs "
                f"every tensor held by one of those modules; {path or 'the model'} "
                f"({type(module).__name__}), which holds blocks, holds {own} itself. Use a "
                "budget its one-layer shards fit (device_memory), or offload: none"
            )
        for name, child in module.named_children():
            p = _join(path, name)
            if p in lists:
                units.extend(_join(p, n) for n, _ in child.named_children())
            elif holds_list(p):
                walk(child, p)
            elif next(iter([*child.parameters(), *child.buffers()]), None) is not None:
                units.append(p)

    walk(template, "")
    return units


def _within(slot: StackedSlot, path: str) -> StackedSlot:
    """``slot`` as a unit at ``path`` sees it: the owners of a tensor kept once (where it goes
    back to when it becomes per member) relative to the unit, those outside it left out (the
    whole array unshares, and the engine cuts its units again, before any unit runs)."""
    if slot.owners is None:
        return slot
    prefix = f"{path}."
    owners = [(p.removeprefix(prefix), a) for p, a in slot.owners if p.startswith(prefix)]
    return dataclasses.replace(slot, owners=owners)


def plan_units(array: FusedArray, limit: int, *, strict: bool = True) -> list[Shard]:
    """The shards of ``array`` streamed between its blocks: groups of consecutive units (its
    repeated blocks and the modules around them, see the module's docstring), each group
    holding at most ``limit`` bytes of stacked state (tensors kept once for all members
    counted once, a tensor tied into two units of a group once); :class:`OffloadError` where
    one unit holds more (``strict``; else it is a group of its own), where the model has no
    repeated blocks, or where a buffer a forward may write is tied into two units."""
    name = type(array._prototype).__name__
    _check_one_input(array._prototype)  # the engine passes one tensor in
    template = array.module
    lists = repeated_blocks(template)
    if not lists:
        raise OffloadError(
            f"offload can stream a model fx cannot cut only between its repeated blocks (an "
            f"nn.ModuleList of same-structured layers, as BERT's encoder.layer or GPT-2's h); "
            f"{name} has none"
        )
    paths = _unit_paths(template, lists, name)
    index = _slot_index(array)
    sizes = [t.numel() * t.element_size() for t in array._state()]
    owner: dict[int, str] = {}
    shards: list[Shard] = []
    for path in paths:
        module = template.get_submodule(path)
        if any(getattr(m, "gradient_checkpointing", False) is True for m in module.modules()):
            raise OffloadError(
                f"offload streams {name}'s blocks and recomputes each in the backward already; "
                f"{path} ({type(module).__name__}) checkpoints its activations too, which would "
                "run its forward, and its dropout draws, twice: turn gradient checkpointing off "
                "(gradient_checkpointing: false) with offload"
            )
        slots = sorted(_module_slots(module, index))
        for j in slots:
            slot = array._slots[j]
            if j in owner and not slot.is_param and not slot.shared:
                raise OffloadError(
                    f"offload streams {name} module by module; buffer {slot.name!r} is held by "
                    f"both {owner[j]} and {path}, and a forward may write it. Use offload: none"
                )
            owner.setdefault(j, path)
        nbytes = sum(sizes[j] for j in slots)
        if strict and nbytes > limit:
            raise OffloadError(
                f"offload: {name}'s {path} ({type(module).__name__}) holds {nbytes} bytes of "
                f"stacked state, over the shard limit of {limit} bytes (a quarter of the budget "
                "unless shard_bytes says otherwise); give a larger budget (device_memory) or "
                "fewer members"
            )
        shared = all(array._slots[j].shared for j in slots)
        unit = FusedArray(
            module,
            array._prototype.get_submodule(path),
            array.size,
            [_within(array._slots[j], path) for j in slots],
            array._trace_enabled,
        )
        unit._defer_tracing(array._trace_after)
        unit._draws_refused = _DRAWS_REFUSED
        shards.append(Shard(unit, slots, nbytes, [path], False, shared))
    missing = sorted(set(range(len(array._slots))) - set(owner))
    stray = [array._slots[j].name for j in missing if not array._slots[j].setting]
    if stray:
        raise OffloadError(
            f"offload streams {name}'s blocks and the modules around them; {stray[:4]} belong "
            "to none of them. Use offload: none for this model"
        )
    return _groups(shards, sizes, limit)


def _groups(units: list[Shard], sizes: list[int], limit: int) -> list[Shard]:
    """``units`` grouped, in order, into shards of at most ``limit`` bytes where they fit
    (:func:`~hfsweep.offload._shards.grow_runs`, a cut allowed between any two units)."""
    runs = grow_runs([set(u.slots) for u in units], sizes, limit, [True] * len(units))
    groups = []
    for a, b in runs:
        members = units[a:b]
        slots = sorted(set().union(*(u.slots for u in members)))
        groups.append(
            Shard(
                None,
                slots,
                sum(sizes[j] for j in slots),
                [n for u in members for n in u.nodes],
                False,
                all(u.shared_output for u in members),
                members,
            )
        )
    return groups
