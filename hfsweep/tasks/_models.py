"""The models of the ready tasks: small, standard architectures built from a config."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor, nn

__all__ = ["MLP", "BasicBlock", "DigitsCNN", "ResNet", "TokenTransformer"]


def _p(config: Mapping[str, Any]) -> float:
    return float(config.get("dropout") or 0.0)


class MLP(nn.Module):
    """``d_in -> hidden x depth -> classes``, ReLU, dropout before the head."""

    def __init__(self, d_in: int, hidden: int, depth: int, classes: int, dropout: float) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        width = d_in
        for _ in range(depth):
            layers += [nn.Linear(width, hidden), nn.ReLU()]
            width = hidden
        layers += [nn.Dropout(dropout), nn.Linear(width, classes)]
        self.net = nn.Sequential(*layers)

    def forward(self, x: Tensor) -> Tensor:
        return self.net(x)


class DigitsCNN(nn.Module):
    """Two 3x3 convolutions, max pooling and a two-layer head, for ``[N, 64]`` 8x8 digits."""

    def __init__(self, channels: int, hidden: int, dropout: float) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, channels, 3, padding=1),
            nn.ReLU(),
            nn.Conv2d(channels, 2 * channels, 3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
        )
        self.head = nn.Sequential(
            nn.Flatten(),
            nn.Linear(2 * channels * 16, hidden),
            nn.ReLU(),
            nn.Dropout(dropout),
            nn.Linear(hidden, 10),
        )

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.features(x.view(-1, 1, 8, 8)))


class BasicBlock(nn.Module):
    """ResNet's basic block: two 3x3 convolutions with BatchNorm, a projection shortcut when
    the shape changes."""

    def __init__(self, c_in: int, c_out: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(c_in, c_out, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(c_out)
        self.conv2 = nn.Conv2d(c_out, c_out, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(c_out)
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or c_in != c_out:
            self.shortcut = nn.Sequential(
                nn.Conv2d(c_in, c_out, 1, stride, bias=False), nn.BatchNorm2d(c_out)
            )

    def forward(self, x: Tensor) -> Tensor:
        out = torch.relu(self.bn1(self.conv1(x)))
        return torch.relu(self.bn2(self.conv2(out)) + self.shortcut(x))


class ResNet(nn.Module):
    """A CIFAR-style ResNet: a 3x3 stem and three stages of basic blocks (widths w, 2w, 4w),
    global average pooling, dropout, a linear head. ``blocks=2`` is ResNet-20's shape halved."""

    def __init__(self, width: int, blocks: int, classes: int, dropout: float) -> None:
        super().__init__()
        self.stem = nn.Sequential(
            nn.Conv2d(3, width, 3, 1, 1, bias=False), nn.BatchNorm2d(width), nn.ReLU()
        )
        stages: list[nn.Module] = []
        c = width
        for k, stride in enumerate((1, 2, 2)):
            out = width * 2**k
            for b in range(blocks):
                stages.append(BasicBlock(c, out, stride if b == 0 else 1))
                c = out
        self.stages = nn.Sequential(*stages)
        self.head = nn.Sequential(
            nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Dropout(dropout), nn.Linear(c, classes)
        )

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.stages(self.stem(x)))


class TokenTransformer(nn.Module):
    """A causal Transformer language model: token and position embeddings, pre-norm encoder
    layers with a causal mask, a linear head over the vocabulary; ``[N, T] -> [N, T, vocab]``.
    ``dropout`` is every dropout of the encoder layers, the attention weights' included, as in
    ``nn.TransformerEncoderLayer``; a fused array gives each member its own."""

    mask: Tensor

    def __init__(
        self, vocab: int, length: int, d_model: int, heads: int, layers: int, dropout: float
    ) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d_model)
        self.position = nn.Parameter(torch.zeros(length, d_model))
        nn.init.normal_(self.position, std=0.02)
        layer = nn.TransformerEncoderLayer(
            d_model, heads, 4 * d_model, dropout, batch_first=True, norm_first=True
        )
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab)
        self.register_buffer(
            "mask", torch.triu(torch.full((length, length), float("-inf")), 1), persistent=False
        )

    def forward(self, tokens: Tensor) -> Tensor:
        t = tokens.shape[-1]
        h = self.embed(tokens) + self.position[:t]
        h = self.encoder(h, mask=self.mask[:t, :t], is_causal=True)
        return self.head(self.norm(h))
