"""``python _kill_after_create.py N ARGS...`` runs ``hfsweep ARGS...`` and SIGKILLs it just
after its storage created its ``N``-th trial, before anything else about the trial is written:
the window between Optuna's create and hfsweep's next write (issue 45), hit on purpose."""

from __future__ import annotations

import os
import signal
import sys
from typing import Any

from optuna.storages import JournalStorage

from hfsweep.cli import main
from hfsweep.storage.database import RetryingStorage

_made = [0]


def _killing(cls: Any, nth: int) -> None:
    """``cls.create_new_trial`` that kills this process after the ``nth`` trial it created
    (in any storage of this process: a sweep uses one)."""
    original = cls.create_new_trial

    def create(self: Any, study_id: int, template_trial: Any = None) -> Any:
        ident = original(self, study_id, template_trial)
        _made[0] += 1
        if _made[0] == nth:
            os.kill(os.getpid(), signal.SIGKILL)
        return ident

    cls.create_new_trial = create


if __name__ == "__main__":
    nth = int(sys.argv[1])
    _killing(RetryingStorage, nth)  # a database (it wraps Optuna's RDB storage)
    _killing(JournalStorage, nth)  # a journal:// file
    sys.exit(main(sys.argv[2:]))
