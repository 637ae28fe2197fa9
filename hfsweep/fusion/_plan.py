"""Which layers of a model are swapped for a fused layer, and which cannot be fused at all."""

from __future__ import annotations

from torch import nn
from torch.nn.utils.parametrizations import _SpectralNorm, _WeightNorm

from ..nn import (
    FusedBatchNormMixin,
    FusedConvMixin,
    FusedDropoutMixin,
    FusedEmbeddingMixin,
    FusedLinearMixin,
    FusedMultiheadAttentionMixin,
    FusedRNNMixin,
    FusedRReLUMixin,
    FusedSpectralNormMixin,
    FusedWeightNormMixin,
    feature_dims,
)

__all__ = ["dropout_feature_dims", "fused_class", "stream_attribute", "unsupported_reason"]

_DROPOUTS: dict[type[nn.Module], int] = {
    nn.Dropout: feature_dims["Dropout"],
    nn.Dropout1d: feature_dims["Dropout1d"],
    nn.Dropout2d: feature_dims["Dropout2d"],
    nn.Dropout3d: feature_dims["Dropout3d"],
}
_BATCHNORMS = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d)
_RNNS = (nn.LSTM, nn.GRU, nn.RNN)
_CONVS = (nn.Conv1d, nn.Conv2d, nn.Conv3d)


def dropout_feature_dims(module: nn.Module) -> int | None:
    """Trailing dims sharing one mask for a per-member-``p`` dropout layer, else ``None``."""
    return _DROPOUTS.get(type(module))


def stream_attribute(module: nn.Module) -> str | None:
    """The attribute holding ``module``'s dropout probability when the array gives it per-member
    dropout streams: ``p`` of a dropout layer, ``dropout`` (the attention weights') of a
    ``MultiheadAttention``; ``None`` for other modules (and for subclasses, which keep their own
    forward)."""
    cls = type(module)
    if cls in _DROPOUTS:
        return "p"
    if cls is nn.MultiheadAttention:
        return "dropout"
    return None


def _fused(mixin: type[nn.Module], base: type[nn.Module]) -> type[nn.Module]:
    """``class FusedX(mixin, X)``: the mixin's forward, everything else from torch's class ``X``.

    The class is a global of this module under its ``__qualname__``, so pickled arrays (saved
    whole, or sent to another process) come back with their fused layers. ``__name__`` stays the
    torch class's, which is what reprs and error messages show.
    """
    cls = type(f"Fused{base.__name__}", (mixin, base), {"__module__": __name__})
    globals()[cls.__qualname__] = cls
    cls.__name__ = base.__name__
    return cls


_FUSED: dict[type[nn.Module], type[nn.Module]] = {
    nn.Linear: _fused(FusedLinearMixin, nn.Linear),
    nn.Embedding: _fused(FusedEmbeddingMixin, nn.Embedding),
    nn.RReLU: _fused(FusedRReLUMixin, nn.RReLU),
    nn.MultiheadAttention: _fused(FusedMultiheadAttentionMixin, nn.MultiheadAttention),
    **{cls: _fused(FusedBatchNormMixin, cls) for cls in _BATCHNORMS},
    **{cls: _fused(FusedConvMixin, cls) for cls in _CONVS},
    **{cls: _fused(FusedDropoutMixin, cls) for cls in _DROPOUTS},
    **{cls: _fused(FusedRNNMixin, cls) for cls in _RNNS},
    _SpectralNorm: _fused(FusedSpectralNormMixin, _SpectralNorm),
    _WeightNorm: _fused(FusedWeightNormMixin, _WeightNorm),
}


def fused_class(module: nn.Module, size: int) -> type[nn.Module] | None:
    """The class to give ``module`` in an array of ``size`` members, or ``None`` to keep its own.

    Only exact torch classes are swapped: a user subclass may override ``forward``. An array of
    one member runs without ``vmap``, where torch's own Linear and convolutions are the fast ones
    (MultiheadAttention stays fused there: its attention dropout must come from the member's
    stream, as in larger arrays).
    """
    cls = type(module)
    if (cls is nn.Linear or cls in _CONVS) and size == 1:
        return None
    return _FUSED.get(cls)


def unsupported_reason(module: nn.Module) -> str | None:
    """Why ``module`` cannot run in a fused array, or ``None`` if it can."""
    if isinstance(module, nn.modules.rnn.RNNBase) and type(module) not in _RNNS:
        return (
            "custom recurrent subclasses have no batching rule; use nn.LSTM, nn.GRU or nn.RNN "
            "(hfsweep replaces those with a fused recurrence)"
        )
    if isinstance(module, nn.SyncBatchNorm):
        return "SyncBatchNorm synchronises across processes; use nn.BatchNorm{1,2,3}d in an array"
    if isinstance(module, nn.Embedding | nn.EmbeddingBag):
        if module.max_norm is not None:
            return (
                f"max_norm={module.max_norm} renormalises the weight in place during forward, "
                "which cannot be done per member; use max_norm=None"
            )
        if module.sparse:
            return "sparse=True gradients cannot be stacked per member; use sparse=False"
    if (
        isinstance(module, nn.modules.batchnorm._BatchNorm)
        and type(module) not in _BATCHNORMS
        and module.momentum is None
        and module.track_running_stats
    ):
        return (
            "momentum=None in a BatchNorm subclass is not supported (hfsweep fuses it only "
            "in nn.BatchNorm1d/2d/3d); give a numeric momentum"
        )
    return None
