"""The model's own activation checkpointing inside a fused array: a region the model wraps in
``torch.utils.checkpoint.checkpoint(fn, *args, use_reentrant=False)`` (or Hugging Face's
``gradient_checkpointing_enable``) is recomputed in the backward for all members at once, and
nothing computed inside it is saved for the backward.

torch's own checkpoint cannot run inside the array's ``vmap``: its recomputation would call ``fn``
in the backward, outside the ``vmap`` that gave ``fn``'s tensors their member dimension. So while a
member's forward runs, :func:`intercepting` puts a stand-in in the places the model calls
checkpoint through (``torch.utils.checkpoint.checkpoint`` and a Hugging Face module's
``_gradient_checkpointing_func``). The stand-in calls one ``autograd.Function``
(:class:`_RegionFunction`) with the region's tensor arguments and the array's state; under
``vmap`` its ``vmap`` rule runs the region for every member at once (``vmap`` over the member's
``fn``) one level down. Its forward runs without autograd; its backward recomputes the region with
autograd on and takes the gradient of the outputs with respect to the inputs (the region's
arguments and the parameters it reads), as ``torch.utils.checkpoint`` does. A trace (``make_fx``)
would hold the region's ops inline and save their results, so a call signature whose forward
checkpoints runs eagerly (see :meth:`_Tracing._trace`). A checkpoint call the stand-in cannot see
(a name bound by ``from torch.utils.checkpoint import checkpoint``), the reentrant form and
selective checkpointing (``context_fn``) are refused with a :class:`FusionError` naming the
submodule.

The recomputation is the forward's, bit for bit: buffers the region writes (each dropout layer's
call count, the functional stream's count, BatchNorm statistics) are set back to their values at
the region's start while it is recomputed and to their current values afterwards, so the masks are
drawn again from the same counts (never new ones, never a count advanced twice) and BatchNorm
statistics are updated once; random calls of forward code use the same positions in the member's
stream (:class:`~hfsweep.fusion._random.MemberRandomness`).
"""

from __future__ import annotations

import functools
import inspect
import weakref
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any

import torch
import torch.utils.checkpoint as _torch_checkpoint
from torch import Tensor, nn
from torch.func import vmap

from .._compat import checkpoint_internals_refused, pytree
from .._errors import FusionError
from ._check import describe_path, ignored_hook
from ._random import MemberRandomness, active_randomness

__all__ = ["RecomputeRegion", "intercepting"]

#: the live regions by id: the op's integer argument names one (the trace or the autograd node
#: that uses a region holds it; the registry does not keep it alive)
_REGIONS: weakref.WeakValueDictionary[int, _Region] = weakref.WeakValueDictionary()
_NEXT_ID = [0]


class _Region:
    """A function of a flat list of tensors that the op runs (and recomputes)."""

    #: positions in the op's inputs of buffers the region may write (set back while recomputing)
    mutable: tuple[int, ...] = ()

    def __init__(self) -> None:
        _NEXT_ID[0] += 1
        self.id = _NEXT_ID[0]
        _REGIONS[self.id] = self
        #: the written buffers' values at the region's start, from the op's forward to autograd
        self.pending: list[Tensor] = []

    def run(self, tensors: Sequence[Tensor]) -> list[Tensor]:
        """The region's output tensors for ``tensors`` (the op's inputs)."""
        raise NotImplementedError  # each kind of region defines it

    def keeps(self) -> list[Any]:
        """What a trace that calls this region must keep alive (itself and inner regions)."""
        return [self]


class RecomputeRegion(_Region):
    """One member's checkpointed call ``fn(*args, **kwargs)``: its tensor arguments and the
    array's state (swapped into the template, as the member's forward does) are the op's
    inputs; the randomness state at the region's start is what its recomputation replays."""

    def __init__(
        self,
        fn: Callable[..., Any],
        leaves: list[Any],
        spec: Any,
        tensor_at: list[int],
        places: list[tuple[dict[str, Any], str, int]],
        buffer_at: tuple[int, ...],
        context: Callable[[], AbstractContextManager[Any]],
        randomness: MemberRandomness | None,
    ) -> None:
        super().__init__()
        self.fn = fn
        self.leaves = leaves
        self.spec = spec
        self.tensor_at = tensor_at
        self.places = places
        self.buffer_at = buffer_at
        self.mutable = tuple(len(tensor_at) + j for j in buffer_at)
        self.context = context
        self.batched: _Batched | None = None  # the region for all members (see _recompute_vmap)
        self.out_spec: Any = None
        self.out_leaves: list[Any] | None = None
        # where the member's random calls stood when the region started: the stream's site and
        # whether this forward had drawn already (then its count was taken, and advanced)
        self.site = randomness._site if randomness is not None else 0
        self.drawn = randomness is not None and randomness._calls is not None
        self.stream = randomness.stream if randomness is not None else None
        self.sites_used = 0

    def run(self, tensors: Sequence[Tensor]) -> list[Tensor]:
        n_args = len(self.tensor_at)
        state = tensors[n_args:]
        saved = [(d, n, d[n]) for d, n, _ in self.places]
        for d, n, j in self.places:
            d[n] = state[j]
        try:
            filled = list(self.leaves)
            for i, t in zip(self.tensor_at, tensors[:n_args], strict=True):
                filled[i] = t
            args, kwargs = pytree.tree_unflatten(filled, self.spec)
            mode = self._randomness()
            with (
                self.context(),
                mode if mode is not None else nullcontext(),
                intercepting(state, self.places, self.buffer_at, self.context),
            ):
                out = self.fn(*args, **kwargs)
            if mode is not None:
                self.sites_used = mode._site - self.site
        finally:
            for d, n, v in saved:
                d[n] = v
        flat, self.out_spec = pytree.tree_flatten(out)
        self.out_leaves = [None if isinstance(x, Tensor) else x for x in flat]
        return [x for x in flat if isinstance(x, Tensor)]

    def keeps(self) -> list[Any]:
        return [self] if self.batched is None else [self, *self.batched.keeps()]

    def _randomness(self) -> MemberRandomness | None:
        """A member-randomness mode that starts where the forward's stood at the region."""
        if self.stream is None:
            return None
        mode = MemberRandomness(self.stream)
        mode._site = self.site
        if self.drawn:  # the forward took its count before the region: the count less one
            mode._calls = self.stream.get_buffer("member_calls").clone().sub_(1)
        return mode

    def rebuild(self, outputs: Sequence[Tensor]) -> Any:
        assert self.out_leaves is not None
        it = iter(outputs)
        leaves = [next(it) if x is None else x for x in self.out_leaves]
        return pytree.tree_unflatten(leaves, self.out_spec)


class _Batched(_Region):
    """A region run for every member at once: ``vmap`` of an inner region over the members."""

    def __init__(self, inner: _Region, dims: Sequence[int | None], randomness: str) -> None:
        super().__init__()
        self.inner = inner
        self.dims = tuple(dims)
        self.randomness = randomness
        self.mutable = inner.mutable

    def run(self, tensors: Sequence[Tensor]) -> list[Tensor]:
        def one(ts: tuple[Tensor, ...]) -> tuple[Tensor, ...]:
            return tuple(self.inner.run(ts))

        out = vmap(one, in_dims=(self.dims,), randomness=self.randomness)(tuple(tensors))
        return list(out)

    def keeps(self) -> list[Any]:
        return [self]


def _region(region: int) -> _Region:
    found = _REGIONS.get(region)
    if found is None:  # pragma: no cover - a trace keeps its regions alive
        raise RuntimeError(f"hfsweep::recompute: region {region} is gone")
    return found


class _RegionFunction(torch.autograd.Function):
    """A region's forward without autograd, its backward by recomputation (see the module
    docstring). Under ``vmap`` (:meth:`vmap`) it runs the region for all members at once one
    level down; dispatch modes (the profiler's memory tracking) see the region's own ops."""

    generate_vmap_rule = False

    @staticmethod
    def forward(region: int, *tensors: Tensor) -> tuple[Tensor, ...]:
        found = _region(region)
        if found.mutable:  # (autograd takes it, or the next call replaces it)
            found.pending = [tensors[i].clone() for i in found.mutable]
        out = found.run(tensors)
        # the outputs must not alias the inputs (a region that returns an argument as is)
        inputs = {id(t) for t in tensors}
        return tuple(t.clone() if id(t) in inputs or t._base is not None else t for t in out)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        region, *tensors = inputs
        found = _region(region)
        ctx.region = found  # keeps the region alive until the backward
        ctx.snapshot, found.pending = found.pending, []
        ctx.needs = [t.requires_grad for t in tensors]
        # the buffers the region writes are kept as they are (their later writes are not the
        # backward's concern: it sets them back itself); everything else as autograd saves
        ctx.buffers = [tensors[i] for i in found.mutable]
        ctx.save_for_backward(*[t for i, t in enumerate(tensors) if i not in found.mutable])

    @staticmethod
    def backward(ctx: Any, *grads: Tensor | None) -> tuple[Tensor | None, ...]:
        return (None, *_recompute_grads(ctx, list(grads)))

    @staticmethod
    def vmap(
        info: Any, in_dims: tuple[Any, ...], region: int, *tensors: Tensor
    ) -> tuple[tuple[Tensor, ...], tuple[int, ...]]:
        inner = _region(region)
        batched = _Batched(inner, in_dims[1:], info.randomness)
        if isinstance(inner, RecomputeRegion):
            inner.batched = batched  # whoever keeps the inner region keeps this one
        out = _RegionFunction.apply(batched.id, *tensors)
        return out, (0,) * len(out)


def _recompute_grads(ctx: Any, grads: list[Tensor | None]) -> list[Tensor | None]:
    found: _Region = ctx.region
    saved = iter(ctx.saved_tensors)
    buffers = iter(ctx.buffers)
    inputs = [
        next(buffers) if i in found.mutable else next(saved).detach().requires_grad_(need)
        for i, need in enumerate(ctx.needs)
    ]
    now = [b.clone() for b in ctx.buffers]
    with torch.no_grad():
        for b, value in zip(ctx.buffers, ctx.snapshot, strict=True):
            b.copy_(value)
    result: list[Tensor | None] = [None] * len(inputs)
    try:
        with torch.enable_grad():
            out = found.run(inputs)
        pairs = [
            (o, g) for o, g in zip(out, grads, strict=True) if g is not None and o.requires_grad
        ]
        wanted = [t for t, need in zip(inputs, ctx.needs, strict=True) if need]
        if pairs and wanted:
            # before the buffers are set back: the recomputed graph may have saved them
            got = iter(
                torch.autograd.grad(
                    [o for o, _ in pairs], wanted, [g for _, g in pairs], allow_unused=True
                )
            )
            for i, need in enumerate(ctx.needs):
                if need:
                    result[i] = next(got)
    finally:
        with torch.no_grad():
            for b, value in zip(ctx.buffers, now, strict=True):
                b.copy_(value)
    return result


def _calling_module(template: nn.Module) -> str:
    """The innermost submodule of ``template`` whose forward is on the Python stack: where a
    refused checkpoint call was made."""
    names = {id(m): path for path, m in template.named_modules()}
    frame = inspect.currentframe()
    while frame is not None:
        owner = frame.f_locals.get("self")
        if owner is not None and id(owner) in names:
            path = names[id(owner)]
            return f"{describe_path(path)} ({type(owner).__name__})"
        frame = frame.f_back
    return "the model"


_REPLACEMENTS = ("use_reentrant", "context_fn", "determinism_check", "debug", "preserve_rng_state")


@contextmanager
def intercepting(
    state: Sequence[Tensor],
    places: list[tuple[dict[str, Any], str, int]],
    buffer_at: tuple[int, ...],
    context: Callable[[], AbstractContextManager[Any]],
    template: nn.Module | None = None,
    record: list[Any] | None = None,
) -> Iterator[None]:
    """While a member's forward runs: checkpoint calls through ``torch.utils.checkpoint.checkpoint``
    and Hugging Face's ``_gradient_checkpointing_func`` become fused regions (see the module
    docstring). ``state`` is the member's state as the forward sees it (what ``places`` hold)."""
    root = template

    def where() -> str:
        return _calling_module(root) if root is not None else "the model"

    def stand_in(function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        options = {k: kwargs.pop(k) for k in _REPLACEMENTS if k in kwargs}
        reentrant = options.get("use_reentrant")
        if reentrant is None or reentrant:
            raise FusionError(
                f"{where()} calls torch.utils.checkpoint.checkpoint with use_reentrant="
                f"{reentrant!r}; a fused array recomputes checkpointed regions for all members "
                "at once only in the non-reentrant form. Pass use_reentrant=False (Hugging Face: "
                "model.gradient_checkpointing_enable(gradient_checkpointing_kwargs="
                "{'use_reentrant': False})): the same gradients, and no input needs requires_grad."
            )
        context_fn = options.get("context_fn", _torch_checkpoint.noop_context_fn)
        if context_fn is not _torch_checkpoint.noop_context_fn:
            raise FusionError(
                f"{where()} calls torch.utils.checkpoint.checkpoint with context_fn={context_fn!r} "
                "(selective checkpointing), which a fused array cannot apply per member; leave "
                "context_fn out (the whole region is recomputed)."
            )
        # a partial's bound arguments (Hugging Face binds a layer's keyword arguments, masks
        # among them) become the region's arguments: tensors must enter it as its inputs
        while isinstance(function, functools.partial):
            args = (*function.args, *args)
            kwargs = {**function.keywords, **kwargs}
            function = function.func
        leaves, spec = pytree.tree_flatten((args, kwargs))
        tensor_at = [i for i, x in enumerate(leaves) if isinstance(x, Tensor)]
        region = RecomputeRegion(
            function,
            [None if isinstance(x, Tensor) else x for x in leaves],
            spec,
            tensor_at,
            places,
            buffer_at,
            context,
            active_randomness(),
        )
        inputs = [leaves[i] for i in tensor_at] + list(state)
        outputs = _RegionFunction.apply(region.id, *inputs)
        mode = active_randomness()
        if mode is not None and region.sites_used:
            # the region drew from the member's stream: go on after its draws, with the count
            # the region took (this forward's draws share one count)
            mode._site = region.site + region.sites_used
            if mode._calls is None:
                mode._calls = mode.stream.get_buffer("member_calls").clone().sub_(1)  # type: ignore[union-attr]
        if record is not None:
            record.extend(region.keeps())
        return region.rebuild(outputs)

    def unseen(reentrant: bool) -> FusionError:
        return FusionError(
            f"{where()} calls torch.utils.checkpoint.checkpoint through a name bound before the "
            "fused array could see it (`from torch.utils.checkpoint import checkpoint`); its "
            "recomputation would run outside the array's vmap. Call it as "
            "torch.utils.checkpoint.checkpoint(fn, *args, use_reentrant=False) (or use Hugging "
            "Face's gradient_checkpointing_enable): the array then recomputes the region for all "
            "members at once."
        )

    patched: list[tuple[Any, str, Any]] = [
        (_torch_checkpoint, "checkpoint", _torch_checkpoint.checkpoint)
    ]
    _torch_checkpoint.checkpoint = stand_in
    hooks: list[tuple[dict[int, Any], int, Any]] = []
    if template is not None:
        for module in template.modules():
            for key, hook in list(module._forward_hooks.items()):
                if ignored_hook("_forward_hooks", hook):  # HF's input-require-grads hook
                    hooks.append((module._forward_hooks, key, hook))
                    del module._forward_hooks[key]
            func = module.__dict__.get("_gradient_checkpointing_func")
            if isinstance(func, functools.partial):
                patched.append((module, "_gradient_checkpointing_func", func))
                module.__dict__["_gradient_checkpointing_func"] = functools.partial(
                    stand_in, *func.args, **func.keywords
                )
    try:
        with checkpoint_internals_refused(unseen):
            yield
    finally:
        for store, key, hook in hooks:
            store[key] = hook
        for owner, name, value in reversed(patched):
            if isinstance(owner, nn.Module):
                owner.__dict__[name] = value
            else:
                setattr(owner, name, value)
