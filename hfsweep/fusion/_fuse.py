"""``hs.fuse``: the entry point that turns B models into a :class:`FusedArray`."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

from torch import nn

from ._array import FusedArray
from ._build import build_array

__all__ = ["fuse"]


def fuse(
    models: Iterable[nn.Module],
    *,
    dropout: Sequence[float] | Mapping[str, Sequence[float]] | None = None,
    trace: bool = True,
    share_frozen: bool = True,
    compile: bool | str = False,
) -> FusedArray:
    """Fuse B models of one architecture into one :class:`FusedArray`.

    Args:
        models: B unmodified ``nn.Module`` instances of one architecture, each initialised as the
            user likes (their own seeds). The array holds copies of their parameters and buffers
            stacked as ``[B, ...]``; the models passed in are not changed or trained.
        dropout: per-member dropout probabilities. By default each member keeps the ``p`` of its
            own ``nn.Dropout``/``Dropout1d/2d/3d`` layers, which may differ between members. A list
            of B values sets every dropout layer; ``{submodule path: B values}`` sets some.
            Each member's masks come from its own stream, seeded here from torch's global
            generator (one ``torch.randint`` draw per member when the model has dropout layers);
            :meth:`FusedArray.manual_seed` sets a member's seed. Random calls in forward code
            (``F.dropout``, LSTM/GRU dropout between layers, attention ``dropout_p``,
            ``torch.rand``/``randn``) draw from the member's stream too; a dropout probability
            read from a dropout layer (``self.dropout.p``) is that member's. Other random ops
            (``torch.bernoulli``, ``Tensor.normal_``...) raise :class:`FusionError`.
        trace: replay each input signature's batched forward from a trace (fast). ``False`` runs
            ``torch.func.vmap`` eagerly on every call (use it when forward draws from Python's
            ``random`` module, which a trace would freeze).
        compile: compile each traced forward (and, through AOTAutograd, its backward) with
            ``torch.compile`` (inductor) at its first call. ``True`` uses
            ``mode="reduce-overhead"`` (CUDA graphs) on CUDA and ``"default"`` elsewhere; a
            ``torch.compile`` mode name picks the mode. Same results as uncompiled within float
            rounding (dropout masks bit for bit); a call that cannot be compiled runs
            uncompiled with a ``hfsweep.fusion.CompileFallbackWarning`` naming the reason.
            Needs ``trace=True``. See "Compiled arrays" in docs/fusion.md.

    Raises:
        FusionError: the models differ in class, parameter names, shapes, dtypes, devices or
            non-tensor settings, or contain something that cannot be fused; the message names the
            submodule and what would work.
    """
    array = build_array(list(models), dropout, trace, share_frozen)
    array._set_compile(compile)
    return array
