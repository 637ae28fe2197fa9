"""The fused Tune sweep's own save in the experiment directory, written before its searcher is
told anything, so that ``Tuner.restore`` after a hard kill of the driver takes back no decision.

Tune saves the experiment (the trials, the searcher and with it the sweep's state) now and then:
at most every ``TUNE_GLOBAL_CHECKPOINT_S`` seconds (10 s and more by default) and at the end.
A driver killed between two saves leaves the state of the last one, so a restore would not know
the members suggested since, nor the ends told to the inner searcher since, and would decide
them again. So the sweep saves itself as well, at every change that reaches the outside
(:meth:`~._tune_sweep.SweepState._flush`): its state (:meth:`~._tune_sweep.SweepState.state_dict`),
the inner searcher as it is (its own ``save``: what Tune saves of it) and the calls about to be
made to it (``pending``), in one file, :data:`JOURNAL_FILE`, replaced whole (written beside,
then moved). Each save has a number (``saves``), which the state Tune saves carries too: a
restore whose file is newer than Tune's save loads the file, restores the inner searcher from
it and makes the pending calls (the restored searcher had not heard them), and the sweep
reconciles what it knows with the trials Tune restored (:meth:`~._tune_sweep.SweepState.reconcile`).
"""

from __future__ import annotations

import io
import logging
import os
import tempfile
from collections.abc import Mapping
from typing import Any

from ray import cloudpickle

__all__ = ["JOURNAL_FILE", "JOURNAL_FORMAT", "Journal", "restore_searcher"]

_log = logging.getLogger("hfsweep.tune")

#: the file in the experiment directory that holds the sweep's newest own save (not ``.pkl``
#: nor ``.json``: Tune copies those into its staging folder on restore and back into the
#: experiment directory at each save, which would put an old copy over the newest)
JOURNAL_FILE = "hfsweep-sweep.journal"
#: marks the file's layout
JOURNAL_FORMAT = "hfsweep.tune-journal/1"


class Journal:
    """The sweep's own save in experiment directory ``folder`` on ``fs`` (a pyarrow file
    system: Tune's storage, local or remote)."""

    def __init__(self, fs: Any, folder: str) -> None:
        self.fs = fs
        self.folder = folder
        self.path = f"{folder.rstrip('/')}/{JOURNAL_FILE}"
        self._warned = False
        self._failed = False

    @classmethod
    def of_trial(cls, trial: Any) -> Journal | None:
        """The journal of the experiment Tune trial ``trial`` belongs to (``None`` if the trial
        says nothing of its storage)."""
        storage = getattr(trial, "storage", None)
        fs = getattr(storage, "storage_filesystem", None)
        folder = getattr(storage, "experiment_fs_path", None)
        if fs is None or not folder:
            return None
        return cls(fs, str(folder))

    def write(
        self, number: int, state: Mapping[str, Any], searcher: Any, pending: list[Any]
    ) -> None:
        """Save ``state`` as save ``number``, with the inner ``searcher`` as it is now and the
        calls ``pending`` to it, replacing the previous save whole. Nothing is saved for a
        searcher that cannot save itself: the sweep's state without it would not match the
        searcher a restore gets (Tune's last save of it)."""
        inner = self._searcher_bytes(searcher)
        if inner is None:
            return
        entry = {
            "format": JOURNAL_FORMAT,
            "saves": number,
            "state": dict(state),
            "searcher": inner,
            "pending": list(pending),
        }
        data = cloudpickle.dumps(entry)
        tmp = f"{self.path}.tmp"
        try:
            with self.fs.open_output_stream(tmp) as out:
                out.write(data)
            self.fs.move(tmp, self.path)
        except OSError as exc:  # the sweep goes on; a restore then goes on from Tune's save
            if not self._failed:
                self._failed = True
                _log.warning("the fused sweep cannot save itself to %s: %s", self.path, exc)

    def read(self) -> dict[str, Any] | None:
        """The newest save, or ``None`` when there is none (or it is not this sweep's)."""
        try:
            with self.fs.open_input_stream(self.path) as f:
                data = f.readall()
        except (FileNotFoundError, OSError):
            return None
        entry = cloudpickle.load(io.BytesIO(data))
        if not isinstance(entry, Mapping) or entry.get("format") != JOURNAL_FORMAT:
            _log.warning("%s: not a fused sweep's save of this format; it is ignored", self.path)
            return None
        return dict(entry)

    def _searcher_bytes(self, searcher: Any) -> bytes | None:
        """What the inner searcher's own ``save`` writes (``None`` if it saves nothing)."""
        with tempfile.TemporaryDirectory(prefix="hfsweep-searcher-") as folder:
            path = os.path.join(folder, "searcher.pkl")
            try:
                searcher.save(path)
            except NotImplementedError:
                if not self._warned:
                    self._warned = True
                    _log.warning(
                        "%s cannot save itself: after a hard kill of the driver, a restore "
                        "goes on from Tune's last save of the experiment",
                        type(searcher).__name__,
                    )
                return None
            with open(path, "rb") as f:
                return f.read()


def restore_searcher(searcher: Any, data: bytes) -> None:
    """Load what :meth:`Journal.write` saved of ``searcher`` into it (its own ``restore``)."""
    with tempfile.TemporaryDirectory(prefix="hfsweep-searcher-") as folder:
        path = os.path.join(folder, "searcher.pkl")
        with open(path, "wb") as f:
            f.write(data)
        searcher.restore(path)
