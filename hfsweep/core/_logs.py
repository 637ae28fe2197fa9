"""Where a sweep's log lines go while it runs: hfsweep's INFO messages into the run directory's
``sweep.log``, and Optuna's own per-trial lines kept quiet (they would drown the progress line;
the log and trials.csv hold the same information).
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

__all__ = ["logged_to", "quiet_optuna"]


@contextmanager
def logged_to(path: Path) -> Iterator[None]:
    """Log hfsweep's INFO messages to ``path`` (the run directory's ``sweep.log``) until the
    block ends; the ``hfsweep`` logger's level is put back as it was."""
    logger = logging.getLogger("hfsweep")
    handler = logging.FileHandler(path, encoding="utf-8")
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    handler.setLevel(logging.INFO)
    level = logger.level
    logger.addHandler(handler)
    if logger.getEffectiveLevel() > logging.INFO:
        logger.setLevel(logging.INFO)
    try:
        yield
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
        handler.close()


@contextmanager
def quiet_optuna() -> Iterator[None]:
    """Optuna's per-trial INFO lines and experimental-feature warnings off until the block
    ends (its verbosity put back as it was)."""
    import optuna

    verbosity = optuna.logging.get_verbosity()
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
            yield
    finally:
        optuna.logging.set_verbosity(verbosity)
