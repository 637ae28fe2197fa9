"""Small reference models written the way users write them, for conformance tests and demos.

Their ``forward`` methods use what real code uses (residual additions, ``view``/``flatten``,
``torch.cat``, functional calls, tied weights), since the fusion engine must run such code as is.
"""

from __future__ import annotations

import itertools

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..tasks import BasicBlock

__all__ = [
    "MLP",
    "LSTMClassifier",
    "LeNet",
    "SmallResNet",
    "TiedLanguageModel",
    "TransformerClassifier",
]


class MLP(nn.Module):
    """``in -> hidden x depth -> out`` with ReLU and dropout."""

    def __init__(
        self,
        d_in: int = 64,
        hidden: int = 32,
        d_out: int = 10,
        depth: int = 2,
        dropout: float = 0.0,
    ) -> None:
        super().__init__()
        dims = [d_in] + [hidden] * depth
        self.layers = nn.ModuleList(nn.Linear(a, b) for a, b in itertools.pairwise(dims))
        self.drop = nn.Dropout(dropout)
        self.head = nn.Linear(dims[-1], d_out)

    def forward(self, x: Tensor) -> Tensor:
        x = x.flatten(1)
        for layer in self.layers:
            x = self.drop(F.relu(layer(x)))
        return self.head(x)


class LeNet(nn.Module):
    """LeNet-style CNN with BatchNorm and Dropout, for ``channels x size x size`` images."""

    def __init__(
        self, channels: int = 1, size: int = 8, classes: int = 10, dropout: float = 0.0
    ) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(channels, 6, 3, padding=1)
        self.bn1 = nn.BatchNorm2d(6)
        self.conv2 = nn.Conv2d(6, 12, 3, padding=1)
        self.bn2 = nn.BatchNorm2d(12)
        self.drop = nn.Dropout(dropout)
        flat = 12 * (size // 4) * (size // 4)
        self.fc1 = nn.Linear(flat, 32)
        self.fc2 = nn.Linear(32, classes)

    def forward(self, x: Tensor) -> Tensor:
        x = F.max_pool2d(F.relu(self.bn1(self.conv1(x))), 2)
        x = F.max_pool2d(F.relu(self.bn2(self.conv2(x))), 2)
        x = x.view(x.size(0), -1)
        return self.fc2(self.drop(F.relu(self.fc1(x))))


class SmallResNet(nn.Module):
    """A ResNet with residual blocks (two stages), for ``3 x size x size`` images."""

    def __init__(self, width: int = 8, classes: int = 10, blocks: int = 1) -> None:
        super().__init__()
        self.stem = nn.Sequential(
            nn.Conv2d(3, width, 3, 1, 1, bias=False), nn.BatchNorm2d(width), nn.ReLU()
        )
        layers: list[nn.Module] = []
        c = width
        for stage, stride in enumerate((1, 2)):
            c_out = width * (2**stage)
            for b in range(blocks):
                layers.append(BasicBlock(c, c_out, stride if b == 0 else 1))
                c = c_out
        self.layers = nn.Sequential(*layers)
        self.fc = nn.Linear(c, classes)

    def forward(self, x: Tensor) -> Tensor:
        x = self.layers(self.stem(x))
        x = F.adaptive_avg_pool2d(x, 1).flatten(1)
        return self.fc(x)


class TransformerClassifier(nn.Module):
    """Token embedding + learned positions, a Transformer encoder, mean pooling, a linear head."""

    def __init__(
        self,
        vocab: int = 50,
        d_model: int = 16,
        heads: int = 2,
        layers: int = 2,
        classes: int = 4,
        max_len: int = 32,
        dropout: float = 0.0,
    ) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d_model, padding_idx=0)
        self.pos = nn.Parameter(torch.randn(max_len, d_model) * 0.02)
        layer = nn.TransformerEncoderLayer(d_model, heads, 2 * d_model, dropout, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(d_model, classes)

    def forward(self, tokens: Tensor) -> Tensor:
        x = self.embed(tokens) + self.pos[: tokens.shape[1]]
        x = self.encoder(x)
        return self.head(x.mean(dim=1))


class LSTMClassifier(nn.Module):
    """Embedding + bidirectional LSTM; the last states of both directions, concatenated."""

    def __init__(
        self, vocab: int = 50, embed: int = 12, hidden: int = 16, classes: int = 4
    ) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, embed, padding_idx=0)
        self.lstm = nn.LSTM(embed, hidden, batch_first=True, bidirectional=True)
        self.head = nn.Linear(2 * hidden, classes)

    def forward(self, tokens: Tensor) -> Tensor:
        _, (h, _) = self.lstm(self.embed(tokens))
        return self.head(torch.cat([h[0], h[1]], dim=-1))


class TiedLanguageModel(nn.Module):
    """A GRU language model whose output layer shares the embedding's weight (weight tying)."""

    def __init__(self, vocab: int = 30, d: int = 12) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.rnn = nn.GRU(d, d, batch_first=True)
        self.out = nn.Linear(d, vocab)
        self.out.weight = self.embed.weight

    def forward(self, tokens: Tensor) -> Tensor:
        h, _ = self.rnn(self.embed(tokens))
        return self.out(h)
