"""Every layer the fusion engine must support, against B independent torch modules (float64).

Each case is a small model around the layer: parameterless layers sit behind a per-member linear or
1x1 convolution, so that every member sees different values and gradients flow per member.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import nn

from hfsweep.testing import assert_fusion_matches


def randn(*shape: int) -> Callable[[torch.Generator], tuple[torch.Tensor]]:
    return lambda g: (torch.randn(*shape, generator=g),)


def tokens(*shape: int, vocab: int = 11) -> Callable[[torch.Generator], tuple[torch.Tensor]]:
    return lambda g: (torch.randint(0, vocab, shape, generator=g),)


class Behind(nn.Module):
    """``layer(pre(x))``: gives a parameterless layer member-specific inputs."""

    def __init__(self, pre: nn.Module, layer: nn.Module) -> None:
        super().__init__()
        self.pre = pre
        self.layer = layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer(self.pre(x))


def behind_conv(layer: Callable[[], nn.Module], dims: int, channels: int = 2):
    conv = {1: nn.Conv1d, 2: nn.Conv2d, 3: nn.Conv3d}[dims]
    return lambda: Behind(conv(channels, channels, 1), layer())


def behind_linear(layer: Callable[[], nn.Module], features: int = 6):
    return lambda: Behind(nn.Linear(features, features), layer())


class TwoInput(nn.Module):
    def __init__(self, layer: nn.Module) -> None:
        super().__init__()
        self.layer = layer

    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return self.layer(a, b)


class SelfAttention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.mha = nn.MultiheadAttention(8, 2, batch_first=True)

    def forward(self, x: torch.Tensor):
        return self.mha(x, x, x)


class CrossAttention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.mha = nn.MultiheadAttention(8, 2, kdim=6, vdim=5)

    def forward(self, q, k, v):
        out, _ = self.mha(q, k, v, need_weights=False)
        return out


class MaskedAttention(nn.Module):
    """Self-attention with a padding mask and a causal mask, through each of torch's paths:
    SDPA with the causal hint, SDPA with the merged masks, and the explicit weights."""

    def __init__(self, **options: object) -> None:
        super().__init__()
        self.mha = nn.MultiheadAttention(8, 2, batch_first=True, **options)  # type: ignore[arg-type]

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        n, t, _ = x.shape
        causal = nn.Transformer.generate_square_subsequent_mask(t, dtype=x.dtype)
        padding = torch.zeros(n, t, dtype=torch.bool)
        padding[0, -2:] = True  # the first sequence's last two keys are padding
        a, _ = self.mha(x, x, x, attn_mask=causal, need_weights=False, is_causal=True)
        bool_causal = torch.ones(t, t, dtype=torch.bool).triu(1)
        b, _ = self.mha(
            x, x, x, key_padding_mask=padding, attn_mask=bool_causal, need_weights=False
        )
        c, w = self.mha(x, x, x, key_padding_mask=padding, average_attn_weights=False)
        d, _ = self.mha(x, x, x, attn_mask=bool_causal, need_weights=False)
        return a, b, c, w, d


class DistinctInputsAttention(nn.Module):
    """Packed projection weights applied to three different tensors (and to key = value)."""

    def __init__(self) -> None:
        super().__init__()
        self.mha = nn.MultiheadAttention(8, 2, bias=False)

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, ...]:
        a, w = self.mha(q, k, v)
        b, _ = self.mha(q, k, k, need_weights=False)
        return a, w, b


class UnbatchedAttention(nn.Module):
    def __init__(self, **options: object) -> None:
        super().__init__()
        self.mha = nn.MultiheadAttention(8, 2, **options)  # type: ignore[arg-type]

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        padding = torch.zeros(x.shape[0], dtype=torch.bool)
        padding[-1] = True
        a, w = self.mha(x, x, x, key_padding_mask=padding)
        b, _ = self.mha(x, x, x, need_weights=False)
        return a, w, b


class Decoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.TransformerDecoderLayer(8, 2, 16, batch_first=True)

    def forward(self, tgt, memory):
        return self.layer(tgt, memory)


class Unpool(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.pre = nn.Conv2d(2, 2, 1)
        self.pool = nn.MaxPool2d(2, return_indices=True)
        self.unpool = nn.MaxUnpool2d(2)

    def forward(self, x):
        y, idx = self.pool(self.pre(x))
        return self.unpool(y, idx)


LAYERS: dict[str, tuple[Callable[[], nn.Module], Callable[[torch.Generator], tuple]]] = {
    # parameterised layers
    "Linear": (lambda: nn.Linear(5, 4), randn(7, 5)),
    "Linear-3d-input": (lambda: nn.Linear(5, 4), randn(2, 7, 5)),
    "Linear-no-bias": (lambda: nn.Linear(5, 4, bias=False), randn(7, 5)),
    "Bilinear": (
        lambda: TwoInput(nn.Bilinear(4, 3, 5)),
        lambda g: (torch.randn(6, 4, generator=g), torch.randn(6, 3, generator=g)),
    ),
    "Conv1d": (lambda: nn.Conv1d(3, 4, 3, padding=1), randn(5, 3, 9)),
    "Conv2d": (lambda: nn.Conv2d(3, 4, 3, stride=2), randn(5, 3, 9, 9)),
    "Conv2d-groups": (lambda: nn.Conv2d(4, 4, 3, groups=2, padding="same"), randn(3, 4, 6, 6)),
    "Conv3d": (lambda: nn.Conv3d(2, 3, 3), randn(3, 2, 5, 5, 5)),
    "ConvTranspose1d": (lambda: nn.ConvTranspose1d(3, 2, 3, stride=2), randn(4, 3, 6)),
    "ConvTranspose2d": (
        lambda: nn.ConvTranspose2d(3, 2, 3, stride=2, output_padding=1),
        randn(4, 3, 5, 5),
    ),
    "BatchNorm1d": (lambda: nn.BatchNorm1d(4), randn(8, 4)),
    "BatchNorm1d-3d": (lambda: nn.BatchNorm1d(4), randn(6, 4, 5)),
    "BatchNorm2d": (lambda: nn.BatchNorm2d(3), randn(6, 3, 4, 4)),
    "BatchNorm2d-momentum-None": (lambda: nn.BatchNorm2d(3, momentum=None), randn(6, 3, 4, 4)),
    "BatchNorm2d-no-affine": (
        lambda: behind_conv(lambda: nn.BatchNorm2d(2, affine=False), 2)(),
        randn(6, 2, 4, 4),
    ),
    "BatchNorm1d-no-running-stats": (
        lambda: nn.BatchNorm1d(4, track_running_stats=False),
        randn(8, 4),
    ),
    "LayerNorm": (lambda: nn.LayerNorm([3, 4]), randn(5, 3, 4)),
    "GroupNorm": (lambda: nn.GroupNorm(2, 4), randn(5, 4, 3, 3)),
    "Embedding": (lambda: nn.Embedding(11, 4), tokens(5, 7)),
    "Embedding-padding_idx": (lambda: nn.Embedding(11, 4, padding_idx=0), tokens(5, 7)),
    "Embedding-scale_grad_by_freq": (
        lambda: nn.Embedding(11, 4, scale_grad_by_freq=True),
        tokens(5, 7),
    ),
    "PReLU": (lambda: behind_conv(lambda: nn.PReLU(2), 1)(), randn(4, 2, 5)),
    "PReLU-shared": (lambda: behind_linear(lambda: nn.PReLU())(), randn(4, 6)),
    "MultiheadAttention": (SelfAttention, randn(3, 5, 8)),
    "MultiheadAttention-kdim-vdim": (
        CrossAttention,
        lambda g: (
            torch.randn(4, 2, 8, generator=g),
            torch.randn(5, 2, 6, generator=g),
            torch.randn(5, 2, 5, generator=g),
        ),
    ),
    "MultiheadAttention-masks": (MaskedAttention, randn(3, 5, 8)),
    "MultiheadAttention-distinct-inputs": (
        DistinctInputsAttention,
        lambda g: (
            torch.randn(4, 2, 8, generator=g),
            torch.randn(5, 2, 8, generator=g),
            torch.randn(5, 2, 8, generator=g),
        ),
    ),
    "MultiheadAttention-unbatched": (UnbatchedAttention, randn(5, 8)),
    # torch's own forward, kept for these options
    "MultiheadAttention-bias_kv-zero_attn": (
        lambda: UnbatchedAttention(add_bias_kv=True, add_zero_attn=True),
        randn(5, 8),
    ),
    "TransformerEncoderLayer": (
        lambda: nn.TransformerEncoderLayer(8, 2, 16, batch_first=True),
        randn(3, 5, 8),
    ),
    "TransformerEncoderLayer-norm_first-gelu": (
        lambda: nn.TransformerEncoderLayer(8, 2, 16, activation="gelu", norm_first=True),
        randn(5, 3, 8),
    ),
    "TransformerDecoderLayer": (
        Decoder,
        lambda g: (torch.randn(3, 4, 8, generator=g), torch.randn(3, 6, 8, generator=g)),
    ),
    "LSTM": (lambda: nn.LSTM(4, 5, batch_first=True), randn(3, 6, 4)),
    "LSTM-2layer-bidirectional": (
        lambda: nn.LSTM(4, 5, num_layers=2, bidirectional=True),
        randn(6, 3, 4),
    ),
    "LSTM-proj": (lambda: nn.LSTM(4, 5, proj_size=3, batch_first=True), randn(3, 6, 4)),
    "LSTM-unbatched": (lambda: nn.LSTM(4, 5), randn(6, 4)),
    "GRU": (lambda: nn.GRU(4, 5, batch_first=True), randn(3, 6, 4)),
    "GRU-2layer-bidirectional-no-bias": (
        lambda: nn.GRU(4, 5, num_layers=2, bidirectional=True, bias=False),
        randn(6, 3, 4),
    ),
    "RNN-relu": (lambda: nn.RNN(4, 5, nonlinearity="relu"), randn(6, 3, 4)),
    # parameterless layers behind a per-member layer
    "Dropout": (behind_linear(lambda: nn.Dropout(0.3)), randn(4, 6)),
    "Dropout2d": (behind_conv(lambda: nn.Dropout2d(0.3), 2), randn(4, 2, 3, 3)),
    "Flatten": (behind_conv(lambda: nn.Flatten(), 2), randn(4, 2, 3, 3)),
    "Unflatten": (behind_linear(lambda: nn.Unflatten(1, (2, 3))), randn(4, 6)),
    "MaxUnpool2d": (Unpool, randn(3, 2, 4, 4)),
}

POOLS: dict[str, tuple[Callable[[], nn.Module], int]] = {
    "MaxPool1d": (lambda: nn.MaxPool1d(2), 1),
    "MaxPool2d": (lambda: nn.MaxPool2d(3, stride=2, padding=1), 2),
    "MaxPool3d": (lambda: nn.MaxPool3d(2), 3),
    "AvgPool1d": (lambda: nn.AvgPool1d(3, stride=2), 1),
    "AvgPool2d": (lambda: nn.AvgPool2d(2, ceil_mode=True), 2),
    "AvgPool3d": (lambda: nn.AvgPool3d(2), 3),
    "AdaptiveAvgPool1d": (lambda: nn.AdaptiveAvgPool1d(3), 1),
    "AdaptiveAvgPool2d": (lambda: nn.AdaptiveAvgPool2d((2, 3)), 2),
    "AdaptiveAvgPool3d": (lambda: nn.AdaptiveAvgPool3d(1), 3),
    "AdaptiveMaxPool1d": (lambda: nn.AdaptiveMaxPool1d(3), 1),
    "AdaptiveMaxPool2d": (lambda: nn.AdaptiveMaxPool2d(2), 2),
    "AdaptiveMaxPool3d": (lambda: nn.AdaptiveMaxPool3d(2), 3),
    "LPPool1d": (lambda: nn.LPPool1d(2, 2), 1),
    "LPPool2d": (lambda: nn.LPPool2d(2, 2), 2),
}
for name, (make, dims) in POOLS.items():
    LAYERS[name] = (behind_conv(make, dims), randn(3, 2, *([6] * dims)))

ACTIVATIONS: dict[str, Callable[[], nn.Module]] = {
    "ELU": nn.ELU,
    "CELU": nn.CELU,
    "SELU": nn.SELU,
    "GELU": nn.GELU,
    "GELU-tanh": lambda: nn.GELU(approximate="tanh"),
    "GLU": nn.GLU,
    "Hardshrink": nn.Hardshrink,
    "Hardsigmoid": nn.Hardsigmoid,
    "Hardswish": nn.Hardswish,
    "Hardtanh": nn.Hardtanh,
    "LeakyReLU": lambda: nn.LeakyReLU(0.1),
    "LogSigmoid": nn.LogSigmoid,
    "LogSoftmax": lambda: nn.LogSoftmax(-1),
    "Mish": nn.Mish,
    "ReLU": nn.ReLU,
    "ReLU6": nn.ReLU6,
    "RReLU": nn.RReLU,
    "Sigmoid": nn.Sigmoid,
    "SiLU": nn.SiLU,
    "Softmax": lambda: nn.Softmax(-1),
    "Softmin": lambda: nn.Softmin(-1),
    "Softplus": nn.Softplus,
    "Softshrink": nn.Softshrink,
    "Softsign": nn.Softsign,
    "Tanh": nn.Tanh,
    "Tanhshrink": nn.Tanhshrink,
    "Threshold": lambda: nn.Threshold(0.1, -1.0),
    "Identity": nn.Identity,
}
for name, make in ACTIVATIONS.items():
    LAYERS[name] = (behind_linear(make), randn(4, 6))
LAYERS["Softmax2d"] = (behind_conv(nn.Softmax2d, 2), randn(3, 2, 3, 3))

# RReLU draws random slopes in train mode, so only eval mode can match mask for mask.
EVAL_ONLY = {"RReLU"}


@pytest.mark.parametrize("size", [1, 3, 5])
@pytest.mark.parametrize("name", sorted(LAYERS))
def test_layer_matches_independent_modules(name: str, size: int) -> None:
    make_model, make_input = LAYERS[name]
    modes = ("eval",) if name in EVAL_ONLY else ("train", "eval")
    assert_fusion_matches(make_model, make_input, size=size, steps=2, modes=modes)


@pytest.mark.parametrize(
    "name",
    [
        "Linear",
        "Conv2d",
        "BatchNorm2d",
        "LSTM",
        "Embedding",
        "Embedding-padding_idx",
        "Embedding-scale_grad_by_freq",
        "MultiheadAttention",
        "MultiheadAttention-masks",
        "MultiheadAttention-distinct-inputs",
        "GRU",
    ],
)
def test_layer_matches_with_one_input_per_member(name: str) -> None:
    make_model, make_input = LAYERS[name]
    assert_fusion_matches(make_model, make_input, size=3, steps=2, shared=False)


@pytest.mark.parametrize(
    "name", ["BatchNorm2d-momentum-None", "LSTM", "MultiheadAttention", "MultiheadAttention-masks"]
)
def test_layer_matches_without_tracing(name: str) -> None:
    make_model, make_input = LAYERS[name]
    assert_fusion_matches(make_model, make_input, size=3, steps=2, trace=False)
