"""A toy task for the Tune plugin tests whose workers keep hfsweep's log: every process that
builds its model or data writes the ``hfsweep`` loggers' records (INFO and up) to
``<log_dir>/<pid>.log``, ``log_dir`` being a key of the task's config. So a test reads what the
trainer said in a Tune trial's worker (whether an array ran compiled, offloaded, ...)."""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from _tune_toy import _data, _model
from torch import nn

import hfsweep as hs
from hfsweep.tasks import TensorBatches

#: the folders this process already logs to
_LOGGING: set[str] = set()


def _log_to(folder: str) -> None:
    """Send the ``hfsweep`` loggers' records of this process to ``folder`` (once)."""
    if not folder or folder in _LOGGING:
        return
    _LOGGING.add(folder)
    handler = logging.FileHandler(Path(folder) / f"{os.getpid()}.log")
    handler.setLevel(logging.INFO)
    handler.setFormatter(logging.Formatter("%(name)s %(message)s"))
    logger = logging.getLogger("hfsweep")
    logger.setLevel(logging.INFO)
    logger.addHandler(handler)


def _logged_model(config: Mapping[str, Any]) -> nn.Module:
    _log_to(config["log_dir"])
    return _model(config)


def _logged_data(config: Mapping[str, Any]) -> tuple[TensorBatches, TensorBatches]:
    _log_to(config["log_dir"])
    return _data(config)


TASK = hs.Task(
    name="tune_logged",
    model=_logged_model,
    data=_logged_data,
    defaults={"hidden": 8, "batch_size": 32, "epochs": 2, "log_dir": ""},
)
