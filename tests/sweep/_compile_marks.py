"""The toy task with a loss that leaves a mark when it runs compiled: the process id of every
process whose trainer ran it under ``torch.compile``, one empty file each in
``$HFSWEEP_CACHE_DIR/compiled-loss/`` (the tests' own cache folder, which Ray workers inherit).
A Ray worker's log line says what the driver asked of it; this says what the worker did.

The mark is taken by a function dynamo leaves out of the graph (``torch._dynamo.disable``),
called with ``torch.compiler.is_compiling()``, which is true only while dynamo traces the loss:
the compiled loss calls it with ``True`` on every call, the eager loss with ``False``.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import torch
from torch import Tensor

import hfsweep as hs

from ._toy import TASK as TOY


def marks() -> set[int]:
    """The ids of the processes that ran the loss compiled (this test session's)."""
    folder = _folder()
    return {int(p.name) for p in folder.iterdir()} if folder.is_dir() else set()


def _folder() -> Path:
    return Path(os.environ["HFSWEEP_CACHE_DIR"]) / "compiled-loss"


@torch._dynamo.disable  # type: ignore[misc]
def _mark(compiling: bool) -> None:
    if compiling:
        _folder().mkdir(parents=True, exist_ok=True)
        (_folder() / str(os.getpid())).touch()


def _loss(outputs: Tensor, target: Tensor) -> Tensor:
    """Each member's mean cross-entropy, as the toy's own loss, marked when compiled."""
    _mark(torch.compiler.is_compiling())
    return hs.member_losses(outputs, target)


def marked(task: hs.Task) -> hs.Task:
    """``task`` (a cross-entropy task) with the marking loss, and its accuracy metric."""
    return dataclasses.replace(task, loss=_loss, metrics=["accuracy"])


TASK = marked(TOY)
