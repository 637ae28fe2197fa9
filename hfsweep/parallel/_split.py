"""How a data-parallel array splits each global batch between its k workers.

Rows (dimension 0 of every tensor in the batch) are split into k contiguous shards whose sizes
differ by at most one, the larger shards first: a batch of 10 rows on 3 workers gives 4, 3 and
3. The split depends only on the batch's row count and k, so every worker knows every shard's
size (the weights of the loss) without communication. A batch with fewer rows than workers
leaves the last workers an empty shard; they contribute zero gradient and zero weight.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch import Tensor

__all__ = ["batch_rows", "shard_bounds", "shard_sizes", "take_rows"]


def shard_sizes(rows: int, workers: int) -> list[int]:
    """The rows of each of ``workers`` shards of a batch of ``rows`` (larger shards first)."""
    if workers < 1:
        raise ValueError(f"workers must be >= 1, got {workers!r}")
    if rows < 0:
        raise ValueError(f"rows must be >= 0, got {rows!r}")
    base, extra = divmod(rows, workers)
    return [base + (1 if r < extra else 0) for r in range(workers)]


def shard_bounds(rows: int, workers: int, rank: int) -> tuple[int, int]:
    """``(start, stop)`` of worker ``rank``'s rows in a batch of ``rows``."""
    if not 0 <= rank < workers:
        raise ValueError(f"rank must be in 0..{workers - 1}, got {rank!r}")
    sizes = shard_sizes(rows, workers)
    start = sum(sizes[:rank])
    return start, start + sizes[rank]


def batch_rows(batch: Any) -> int:
    """The rows of ``batch``: dimension 0 of its first tensor (depth first), as the trainer's
    evaluation counts them; a batch without a tensor is refused."""
    for leaf in _tensors(batch):
        if leaf.dim() == 0:
            raise ValueError(
                "a data-parallel array splits batches along dimension 0 of every tensor; this "
                "batch holds a 0-dimensional tensor"
            )
        return int(leaf.shape[0])
    raise ValueError(
        f"a data-parallel array splits batches along dimension 0 of their tensors; this batch "
        f"({type(batch).__name__}) holds none"
    )


def take_rows(batch: Any, start: int, stop: int) -> Any:
    """``batch`` with every tensor cut to rows ``start .. stop`` (tuples, lists and mappings
    are walked; other values are kept as they are). Every tensor must have the same rows."""
    rows = batch_rows(batch)
    for leaf in _tensors(batch):
        if leaf.dim() == 0 or leaf.shape[0] != rows:
            raise ValueError(
                f"a data-parallel array splits batches along dimension 0 of every tensor; this "
                f"batch holds tensors of shapes {[tuple(t.shape) for t in _tensors(batch)]}, "
                "whose first dimensions differ"
            )
    return _cut(batch, start, stop)


def _cut(batch: Any, start: int, stop: int) -> Any:
    if isinstance(batch, Tensor):
        return batch[start:stop]
    if isinstance(batch, tuple | list):
        return type(batch)(_cut(b, start, stop) for b in batch)
    if isinstance(batch, Mapping):
        return {k: _cut(v, start, stop) for k, v in batch.items()}
    return batch


def _tensors(batch: Any) -> list[Tensor]:
    if isinstance(batch, Tensor):
        return [batch]
    if isinstance(batch, tuple | list):
        return [t for b in batch for t in _tensors(b)]
    if isinstance(batch, Mapping):
        return [t for v in batch.values() for t in _tensors(v)]
    return []
