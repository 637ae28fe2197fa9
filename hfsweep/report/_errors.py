"""The report's errors, and the advice its messages share."""

from __future__ import annotations

__all__ = ["NothingToReport", "ReportError"]

_RUN_FIRST = "run `hfsweep run sweep.yaml` first"


class ReportError(Exception):
    """A run directory that cannot be reported.

    The message names the path (the run directory, its ``sweep.json``, the journal file or the
    storage URL) and what is missing or expected there.
    """


class NothingToReport(ReportError):
    """The run directory is a sweep's, but it has nothing to draw yet: no trial has finished,
    or none of those that finished has a value or a history (all failed before evaluating).

    The message names the run directory and counts its trials by state. The CLI exits 1 on it
    (a sweep that has not got far enough), 2 on any other :class:`ReportError`.
    """
