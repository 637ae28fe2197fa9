"""The data-parallel shard of the batch the current forward runs on, for random draws.

A data-parallel array (:mod:`hfsweep.parallel`) runs each member's forward on k workers, each
on a slice of rows of the global batch. A member's dropout masks (and ``torch.rand``/``randn``
drawn in its forward) are counter-based hashes of the element index (see ``_dropout``), so the
mask of the global batch is known to every worker without communication: a worker draws the
mask of the *global* shape and keeps its own rows. Its masks are then exactly the 1-worker
run's, whatever k is. :func:`batch_shard` says which rows the forward runs on; the draws ask
:func:`global_shape` for the shape to draw. The shard is part of a traced forward's key (the
trace bakes the slice in).

A draw is widened only where its batch dimension (dimension 0, or the one the caller names)
has the shard's size: a draw whose leading dimension is not the batch (a sequence-first RNN's
``[T, N, H]``) is drawn for the worker's shape, with the same distribution as the 1-worker run's
masks but other values (docs/elastic.md).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["batch_shard", "current_shard", "global_shape"]

#: (offset, rows, total) of the running forward's shard, or None (the whole batch)
_SHARD: tuple[int, int, int] | None = None


@contextmanager
def batch_shard(offset: int, rows: int, total: int) -> Iterator[None]:
    """While it is open, forwards run on rows ``offset .. offset + rows`` of a global batch of
    ``total`` rows (a no-op for the whole batch)."""
    if not (offset >= 0 and rows > 0 and offset + rows <= total):
        raise ValueError(
            f"a shard of rows {offset}..{offset + rows} does not fit a batch of {total} rows"
        )
    global _SHARD
    previous = _SHARD
    _SHARD = None if rows == total else (offset, rows, total)
    try:
        yield
    finally:
        _SHARD = previous


def current_shard() -> tuple[int, int, int] | None:
    """``(offset, rows, total)`` of the running forward's shard, or ``None``."""
    return _SHARD


def global_shape(shape: tuple[int, ...], dim: int = 0) -> tuple[tuple[int, ...], int, int] | None:
    """``(global shape, offset, rows)`` of a draw of ``shape`` whose dimension ``dim`` is the
    batch: the shape to draw, and the slice of dimension ``dim`` that is this worker's. ``None``
    when no shard is open or dimension ``dim`` is not the shard's size (draw ``shape`` as is)."""
    shard = _SHARD
    if shard is None or len(shape) <= dim or shape[dim] != shard[1]:
        return None
    offset, rows, total = shard
    return (*shape[:dim], total, *shape[dim + 1 :]), offset, rows
