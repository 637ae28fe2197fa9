"""Reading a run directory without writing to it: ``sweep.json`` and the Optuna study it names
(the journal file, only its whole records when its tail is torn, or the ``storage`` URL)."""

from __future__ import annotations

import json
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from ..storage.db_url import UnsetVariable, for_driver, scrub, shown
from ._errors import _RUN_FIRST, ReportError

if TYPE_CHECKING:
    import optuna


@dataclass(frozen=True)
class SweepRecord:
    """What the report (and :func:`hfsweep.retrain`) needs from a run's ``sweep.json``."""

    metric: str
    mode: Literal["max", "min"]
    storage: str | None
    study_name: str
    resource: Literal["epoch", "step"]  # the learning curves' x axis, from the budget's unit


def read_sweep(run: Path) -> SweepRecord:
    """``run/sweep.json``, checked for the keys the report uses; :class:`ReportError` names
    what is missing."""
    if not run.exists():
        raise ReportError(f"{run}: no such run directory; {_RUN_FIRST}")
    if not run.is_dir():
        raise ReportError(
            f"{run}: not a directory; expected a sweep's run directory{_sweep_file_hint(run)}"
        )
    path = run / "sweep.json"
    if not path.is_file():
        raise ReportError(
            f"{path}: missing, so {run} is not a run directory; a run directory holds the "
            f"sweep.json that `hfsweep run` writes{_run_dirs_below(run) or f' ({_RUN_FIRST})'}"
        )
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ReportError(f"{path}: cannot be read as JSON ({exc})") from exc
    if not isinstance(raw, dict):
        raise ReportError(
            f"{path}: expected a JSON object (the resolved sweep config), got {type(raw).__name__}"
        )

    def string(key: str, what: str) -> str:
        value = raw.get(key)
        if not isinstance(value, str) or not value:
            shown = "missing" if key not in raw else f"{value!r}"
            raise ReportError(f"{path}: {key} is {shown}; expected {what}")
        return value

    metric = string("metric", "the name of the metric the sweep optimised")
    mode = raw.get("mode")
    if mode not in ("max", "min"):
        shown = "missing" if "mode" not in raw else f"{mode!r}"
        raise ReportError(f"{path}: mode is {shown}; expected 'max' or 'min'")
    storage = raw.get("storage")
    if storage is not None and not isinstance(storage, str):
        raise ReportError(f"{path}: storage is {storage!r}; expected null or an Optuna storage URL")
    study_name = string("study_name", "the Optuna study's name")
    budget = raw.get("budget")
    resource: Literal["epoch", "step"] = (
        "step" if isinstance(budget, Mapping) and budget.get("steps") is not None else "epoch"
    )
    return SweepRecord(metric, "max" if mode == "max" else "min", storage, study_name, resource)


def _sweep_file_hint(path: Path) -> str:
    """For a sweep file given instead of its run directory: where its run directory is."""
    if path.suffix.lower() not in (".yaml", ".yml"):
        return ""
    output = None
    try:
        import yaml

        raw = yaml.safe_load(path.read_text(encoding="utf-8"))
        if isinstance(raw, Mapping) and isinstance(raw.get("output"), str):
            output = Path(raw["output"]).expanduser()
    except Exception:  # any unreadable file: fall back to the default output
        output = None
    run = path.parent / (output if output is not None else Path("runs") / path.stem)
    return f"; {path} looks like a sweep file: report its run directory, `hfsweep report {run}`"


def _run_dirs_below(folder: Path) -> str:
    """For a folder holding run directories (``runs/``): name them."""
    try:
        found = sorted(p.name for p in folder.iterdir() if (p / "sweep.json").is_file())
    except OSError:
        return ""
    if not found:
        return ""
    shown = ", ".join(found[:5]) + (f" and {len(found) - 5} more" if len(found) > 5 else "")
    return f"; the run directories in it: {shown} (e.g. `hfsweep report {folder / found[0]}`)"


def _sqlite_file(url: str) -> Path | None:
    """The database file of a ``sqlite:///`` URL (None for other URLs and in-memory databases).

    Checked before loading because SQLAlchemy would create an empty database at a missing path.
    """
    prefix = "sqlite:///"
    if not url.startswith(prefix):
        return None
    rest = url[len(prefix) :].split("?", 1)[0]
    return None if rest in ("", ":memory:") else Path(rest)


def load_study(run: Path, sweep: SweepRecord) -> optuna.Study:
    """The sweep's study: from ``sweep.storage`` if set, else from ``run/optuna.journal``."""
    import optuna
    from optuna.storages import BaseStorage, JournalStorage
    from optuna.storages.journal import JournalFileBackend

    from ..storage.journal import JournalPrefix, find_torn_tail
    from ..storage.journal_url import is_journal, journal_file

    storage: str | BaseStorage
    if sweep.storage is None or is_journal(sweep.storage):  # a run dir's or a shared journal
        try:
            journal = (
                run / "optuna.journal" if sweep.storage is None else journal_file(sweep.storage)
            )
        except UnsetVariable as exc:
            raise ReportError(
                f"storage {sweep.storage} (from {run / 'sweep.json'}): {exc}"
            ) from None
        where = str(journal)
        # Opening a journal backend creates a missing file: check first, so a wrong directory is
        # reported instead of getting an empty study file.
        if not journal.is_file():
            raise ReportError(
                f"{journal}: missing; a sweep with storage: null keeps its Optuna study in this "
                f"journal file ({_RUN_FIRST})"
            )
        try:
            torn = find_torn_tail(journal)
            if torn is None:
                storage = JournalStorage(JournalFileBackend(str(journal)))
            else:
                # read the whole records only; the report leaves the file as it is (a sweep
                # may be resuming from it; the run directory may be read-only)
                warnings.warn(
                    f"{torn.describe(journal)}; `hfsweep run SWEEP --resume` drops it from the "
                    "file, keeping a copy",
                    stacklevel=3,
                )
                storage = JournalStorage(JournalPrefix(journal, torn.offset))
        except Exception as exc:
            raise ReportError(f"{journal}: cannot be opened as an Optuna journal ({exc})") from exc
    else:
        where = f"storage {shown(sweep.storage)!r} (from {run / 'sweep.json'})"
        try:
            storage = for_driver(_unmasked(sweep.storage))
        except UnsetVariable as exc:
            raise ReportError(f"{where}: {exc}") from None
        database = _sqlite_file(storage)
        if database is not None and not database.is_file():
            raise ReportError(f"{where}: the database file {database} is missing; {_RUN_FIRST}")
    try:
        return optuna.load_study(study_name=sweep.study_name, storage=storage)
    except KeyError as exc:
        try:
            names = sorted(optuna.get_all_study_names(storage))
        except Exception:
            raise ReportError(f"{where}: no study named {sweep.study_name!r}") from exc
        raise ReportError(
            f"{where}: no study named {sweep.study_name!r}; it holds {names or 'no studies'}"
            + ("" if names else f" ({_RUN_FIRST})")
        ) from exc
    except Exception as exc:
        reason = scrub(str(exc), storage) if isinstance(storage, str) else str(exc)
        hint = (
            "; sweep.json keeps the URL without its password: give it in the PGPASSWORD "
            "environment variable (or ~/.pgpass), or as ${NAME} in the sweep file's storage"
            if isinstance(storage, str) and sweep.storage and "***@" in sweep.storage
            else ""
        )
        raise ReportError(
            f"{where}: cannot load study {sweep.study_name!r} ({reason}){hint}"
        ) from exc


def _unmasked(url: str) -> str:
    """``url`` without the password ``sweep.json`` masked (``user:***@``): the database
    driver then takes it from its own places (PostgreSQL's ``PGPASSWORD``, ``~/.pgpass``)."""
    return url.replace(":***@", "@", 1)
