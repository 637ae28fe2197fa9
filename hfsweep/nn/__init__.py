"""Fused layers for the places where ``torch.func.vmap`` alone is slow, inexact or impossible.

``hs.fuse`` swaps these in automatically (in its private copy of the model, never in the user's
modules): Linear gets a one-kernel batching rule, Conv1d/2d/3d one grouped convolution with
the bias folded in, MultiheadAttention one batched product per
projection and per-member attention dropout, BatchNorm per-member running statistics (also with
``momentum=None``), Dropout a per-member probability, LSTM/GRU/RNN a step-by-step recurrence
that ``vmap`` can batch, Embedding a ``padding_idx`` that holds per member, RReLU (which ``vmap`` does not support) its own random slopes, and the weight_norm and spectral_norm parametrizations batched ops. Each is a mixin placed in front of the torch class, so parameter names,
``isinstance`` checks and state dicts stay those of the torch module.

The dropout helpers (:func:`stream_multiplier`, :func:`key_multiplier`, :func:`key_uniform`,
:func:`apply_multiplier`, ``feature_dims``) and the batch shard of a data-parallel worker's
forward (:func:`batch_shard`, :func:`current_shard`) are what the fusion and the data-parallel
trainer share with these layers.
"""

from ._activation import FusedRReLUMixin
from ._attention import FusedMultiheadAttentionMixin
from ._batchnorm import FusedBatchNormMixin
from ._conv import FusedConvMixin
from ._dropout import (
    FusedDropoutMixin,
    apply_multiplier,
    feature_dims,
    key_multiplier,
    key_uniform,
    stream_multiplier,
)
from ._embedding import FusedEmbeddingMixin
from ._linear import FusedLinearMixin, fused_linear
from ._parametrizations import FusedSpectralNormMixin, FusedWeightNormMixin
from ._rnn import FusedRNNMixin
from ._shard import batch_shard, current_shard

__all__ = [
    "FusedBatchNormMixin",
    "FusedConvMixin",
    "FusedDropoutMixin",
    "FusedEmbeddingMixin",
    "FusedLinearMixin",
    "FusedMultiheadAttentionMixin",
    "FusedRNNMixin",
    "FusedRReLUMixin",
    "FusedSpectralNormMixin",
    "FusedWeightNormMixin",
    "apply_multiplier",
    "batch_shard",
    "current_shard",
    "feature_dims",
    "fused_linear",
    "key_multiplier",
    "key_uniform",
    "stream_multiplier",
]
