"""Small in-memory datasets for the ready tasks: nothing is downloaded.

Batches come from :class:`TensorBatches`, which shuffles with torch's global generator when an
epoch starts; the trainer seeds that generator per ``(data_seed, epoch)``, so the order is
reproducible and a resumed run sees the same batches.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import Tensor

from .._checks import is_int

__all__ = ["TensorBatches", "digits", "markov_tokens", "pattern_images"]


class TensorBatches:
    """``(x, y)`` batches of two tensors held in memory; re-iterable, with ``len()``."""

    def __init__(self, x: Tensor, y: Tensor, batch_size: int, *, shuffle: bool) -> None:
        if not is_int(batch_size) or batch_size < 1:
            raise ValueError(f"batch_size must be an integer >= 1, got {batch_size!r}")
        if len(x) != len(y):
            raise ValueError(f"x has {len(x)} rows but y has {len(y)}")
        self.x, self.y, self.batch_size, self.shuffle = x, y, int(batch_size), shuffle

    def __len__(self) -> int:
        return -(-len(self.x) // self.batch_size)

    def __iter__(self) -> Iterator[tuple[Tensor, Tensor]]:
        n = len(self.x)
        order = torch.randperm(n) if self.shuffle else torch.arange(n)
        for start in range(0, n, self.batch_size):
            index = order[start : start + self.batch_size]
            yield self.x[index], self.y[index]


def digits(
    seed: int, val_fraction: float = 0.2, *, standardize: bool = True
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """scikit-learn's bundled 8x8 digits (1797 images, 10 classes), split into train and
    validation by ``seed``, with pixels in [0, 1] or, with ``standardize``, standardised with
    the training pixels' mean and deviation: ``(x_train, y_train, x_val, y_val)``, x as
    ``[N, 64]``."""
    try:
        from sklearn.datasets import load_digits
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError(
            "the digits data comes with scikit-learn: pip install 'hfsweep[examples]'"
        ) from e
    data = load_digits()
    x = torch.tensor(data.data, dtype=torch.float32) / 16.0
    y = torch.tensor(data.target, dtype=torch.long)
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(seed))
    n_val = int(len(y) * val_fraction)
    val, train = order[:n_val], order[n_val:]
    if standardize:
        mean, std = x[train].mean(0), x[train].std(0).clamp_min(0.1)
        x = (x - mean) / std
    return x[train], y[train], x[val], y[val]


def pattern_images(
    seed: int, n: int, *, classes: int = 10, size: int = 32, noise: float = 1.0
) -> tuple[Tensor, Tensor]:
    """CIFAR-shaped ``[n, 3, size, size]`` images: each class is a fixed smooth random pattern
    (drawn from ``seed``), each image its class pattern under a random shift plus Gaussian noise.
    Learnable by a small CNN but not trivially: a stand-in for CIFAR-10 that needs no download."""
    gen = torch.Generator().manual_seed(seed)
    coarse = torch.randn(classes, 3, 4, 4, generator=gen)
    patterns = torch.nn.functional.interpolate(coarse, size=(size, size), mode="bicubic")
    labels = torch.randint(classes, (n,), generator=gen)
    shifts = torch.randint(-3, 4, (n, 2), generator=gen)
    images = torch.empty(n, 3, size, size)
    for i in range(n):
        images[i] = torch.roll(patterns[labels[i]], tuple(shifts[i].tolist()), dims=(1, 2))
    images += noise * torch.randn(images.shape, generator=gen)
    return images, labels


def markov_tokens(
    seed: int, n: int, *, vocab: int = 32, length: int = 33, concentration: float = 0.3
) -> Tensor:
    """``[n, length]`` token sequences from a fixed random first-order Markov chain (drawn from
    ``seed``; a small ``concentration`` makes transitions peaked, hence predictable)."""
    gen = torch.Generator().manual_seed(seed)
    # peaked random transition rows: powers of uniforms, normalised (drawn from gen only)
    u = torch.rand(vocab, vocab, generator=gen)
    weights = u.pow(1.0 / concentration)
    transitions = weights / weights.sum(1, keepdim=True)
    tokens = torch.empty(n, length, dtype=torch.long)
    tokens[:, 0] = torch.randint(vocab, (n,), generator=gen)
    for t in range(1, length):
        tokens[:, t] = torch.multinomial(transitions[tokens[:, t - 1]], 1, generator=gen).squeeze(1)
    return tokens
