"""Atomic file writes: a temporary file in the same folder, flushed to disk, then renamed over
the target, so a crash at any moment leaves the old file or the new one, never half of one."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

import torch

__all__ = ["atomic_save", "atomic_write_text"]


def _atomic(path: Path, mode: str, write: Callable[[IO[Any]], object]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        opts: dict[str, Any] = {"encoding": "utf-8", "newline": ""} if "b" not in mode else {}
        with os.fdopen(fd, mode, **opts) as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def atomic_write_text(path: Path, text: str) -> None:
    """Write ``text`` (UTF-8) to ``path`` atomically."""
    _atomic(path, "w", lambda f: f.write(text))


def atomic_save(obj: Any, path: Path) -> None:
    """``torch.save(obj)`` to ``path`` atomically."""
    _atomic(path, "wb", lambda f: torch.save(obj, f))
