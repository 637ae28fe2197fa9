"""Checks of the machine a sweep is about to run on, made before anything is written.

A sweep file can be valid (:mod:`hfsweep.config` checks what the file says) and still unable to
run here: its run directory cannot be created or written, it asks for CUDA on a machine without
it, or its storage URL needs a database driver that is not installed. Found at run time, each of
these used to surface only after the run directory, its lock and ``sweep.json`` were written.

:func:`preflight` makes every such check. ``hs.sweep`` runs it before it creates or locks the run
directory, and ``hfsweep validate`` runs it too, so both refuse the same sweeps; each problem is a
:class:`~hfsweep.config.ConfigError` naming the sweep file, the YAML path (``output``,
``fusion.device``, ``storage``), the value and what would work. The checks leave nothing
behind: the one that asks whether a folder takes new entries makes an empty folder there and
removes it at once. A check that must pass before anything is created (opening the storage, reaching a Ray
cluster) belongs in :data:`_CHECKS`.
"""

from __future__ import annotations

import contextlib
import os
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from ..config import ConfigError
from ..storage.db_url import mask, scrub
from ..storage.journal_url import is_journal
from ..storage.journal_url import problem as journal_problem

if TYPE_CHECKING:
    from ..config import SweepConfig

__all__ = ["preflight"]

#: files of a run directory that a resumed sweep rewrites (RunDir's names); ``.lock``: one
#: this user cannot open would leave the sweep unlocked, with only a warning
_RUN_FILES = (
    "sweep.json",
    "optuna.journal",
    "state.json",
    "trials.csv",
    "best.json",
    "sweep.log",
    ".lock",
)
#: folders of a run directory that a resumed sweep writes new files into (RunDir's names)
_RUN_FOLDERS = ("histories", "checkpoints", "arrays")
#: SQLAlchemy driver name -> what to install for it
_DRIVER_PACKAGES = {
    "psycopg2": '"hfsweep[postgres]" (psycopg2-binary)',
    "psycopg": '"hfsweep[postgres]" (psycopg[binary])',
    "pg8000": "pg8000",
    "pymysql": "pymysql",
    "mysqldb": "mysqlclient",
    "mysqlconnector": "mysql-connector-python",
    "mariadbconnector": "mariadb",
    "oracledb": "oracledb",
    "cx_oracle": "cx_Oracle",
    "pyodbc": "pyodbc",
    "pymssql": "pymssql",
}
#: a synchronous driver to suggest for a database whose URL names an asyncio one
_SYNC_DRIVERS = {"postgresql": "psycopg2", "mysql": "pymysql", "sqlite": "pysqlite"}


def preflight(sc: SweepConfig) -> None:
    """Raise :class:`~hfsweep.config.ConfigError` if ``sc`` cannot run on this machine: its
    ``output`` cannot be created or written, its ``fusion.device`` is CUDA that this machine
    lacks, its ``storage`` URL's database driver is not installed, or no Ray cluster answers at
    its ``ray.address``. Leaves nothing behind; cheap enough to run more than once."""
    for check in _CHECKS:
        check(sc)


def _error(sc: SweepConfig, path: str, problem: str) -> ConfigError:
    return ConfigError(problem, path=path, file=os.fspath(sc.source) if sc.source else None)


# ---------------------------------------------------------------------------- output
def _check_output(sc: SweepConfig) -> None:
    """The run directory exists and is a writable directory, or the deepest folder above it
    that exists is one (so that it can be created)."""
    out = sc.output
    if "\0" in os.fspath(out):
        raise _error(sc, "output", f"{os.fspath(out)!r} holds a NUL byte, which no path may hold")
    try:
        if out.exists():
            if not out.is_dir():
                raise _error(
                    sc,
                    "output",
                    f"{out} exists and is not a directory; the run directory must be a folder: "
                    "remove the file or set `output` to another path",
                )
            _writable(sc, out, out, "the run directory")
            arrays = out / "arrays"
            folders = [out / name for name in _RUN_FOLDERS]
            if arrays.is_dir():  # an array's checkpoint folder, rewritten when it resumes
                folders += sorted(p for p in arrays.iterdir() if p.is_dir())
            for path in [*(out / name for name in _RUN_FILES), *folders]:
                mode = os.W_OK | os.X_OK if path in folders else os.W_OK
                if path.exists() and not os.access(path, mode):
                    raise _error(
                        sc,
                        "output",
                        f"{path} cannot be written by this user (owner uid "
                        f"{path.stat().st_uid}), so this run directory cannot be resumed or "
                        "reused; fix its permissions or set `output` to another directory",
                    )
            return
        folder = out.parent
        while not folder.exists() and folder != folder.parent:
            folder = folder.parent
        if not folder.is_dir():
            raise _error(
                sc,
                "output",
                f"cannot create the run directory {out}: {folder} is a file, not a folder; set "
                "`output` to a path under a folder",
            )
        _writable(sc, folder, out, f"{folder}, where the run directory would be created,")
    except ConfigError:  # a ValueError too: the refusal above, as it is
        raise
    except (OSError, ValueError) as exc:  # a folder this user may not look into; a NUL byte
        raise _error(
            sc, "output", f"cannot check the run directory {out} ({exc}); set `output` elsewhere"
        ) from None


def _writable(sc: SweepConfig, folder: Path, out: Path, what: str) -> None:
    if os.access(folder, os.W_OK | os.X_OK):
        # os.access answers from permission bits, which root passes everywhere, even in a
        # folder that takes no new entries (/proc, sysfs): make and remove a folder to know
        probe = folder / f".hfsweep-preflight-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        try:
            probe.mkdir()
        except OSError as exc:
            raise _error(
                sc,
                "output",
                f"{what} takes no new folder ({exc.strerror or exc}), so the sweep could not "
                f"write {out}; set `output` to a writable folder (or pass --output)",
            ) from None
        with contextlib.suppress(OSError):  # it could be made, which is what was asked
            probe.rmdir()
        return
    try:
        read_only = bool(os.statvfs(folder).f_flag & os.ST_RDONLY)
    except (OSError, AttributeError):  # no statvfs (Windows)
        read_only = False
    why = "is on a read-only file system" if read_only else "is not writable by this user"
    raise _error(
        sc,
        "output",
        f"{what} {why}, so the sweep could not write {out}; set `output` to a writable "
        "folder (or pass --output)",
    )


# ---------------------------------------------------------------------------- device
def _check_device(sc: SweepConfig) -> None:
    """``cuda``/``cuda:N`` exists here. With ``backend: ray`` and a cluster address the arrays
    run on the cluster's machines, which this one cannot see."""
    device = sc.fusion.device
    if not device.startswith("cuda") or (sc.backend == "ray" and sc.ray.address is not None):
        return
    import torch

    if not torch.cuda.is_available():
        if torch.version.cuda is None:
            why = f"this torch ({torch.__version__}) is built without CUDA"
        else:
            why = f"torch {torch.__version__} (CUDA {torch.version.cuda}) finds no CUDA GPU"
            visible = os.environ.get("CUDA_VISIBLE_DEVICES")
            if visible is not None:
                why += f" (CUDA_VISIBLE_DEVICES={visible!r})"
        raise _error(
            sc,
            "fusion.device",
            f"{device!r} asks for CUDA, but {why}; use device: auto (CUDA where there is one, "
            "else the CPU) or cpu",
        )
    _, _, index = device.partition(":")
    count = torch.cuda.device_count()
    if index and int(index) >= count:
        raise _error(
            sc,
            "fusion.device",
            f"{device!r}: this machine has {count} CUDA device(s), cuda:0 to cuda:{count - 1}",
        )


# ---------------------------------------------------------------------------- storage
def _check_storage(sc: SweepConfig) -> None:
    """An RDB URL's ``${NAME}`` references are set, it names a SQLAlchemy dialect whose
    database driver is installed (Optuna opens the URL through SQLAlchemy, and needs a
    synchronous driver), and its database answers (a wrong password, port or database name
    is found here, with the server's own message, not after the run directory is created)."""
    if sc.storage is None:
        return
    if is_journal(sc.storage):  # a journal file to share: its folder must take it
        found = journal_problem(sc.storage)
        if found is not None:
            raise _error(sc, "storage", f"{sc.storage}: {found}")
        return
    from ..storage.db_url import UnsetVariable, for_driver

    try:
        written = for_driver(sc.storage)  # the password percent-encoded: SQLAlchemy reads it whole
    except UnsetVariable as exc:
        raise _error(sc, "storage", f"{mask(sc.storage)}: {exc}") from None
    try:
        from sqlalchemy.engine import make_url
        from sqlalchemy.exc import ArgumentError, NoSuchModuleError
    except ImportError:
        raise _error(
            sc, "storage", "a storage URL needs SQLAlchemy, which is not installed: pip install "
            "sqlalchemy"
        ) from None  # fmt: skip

    def unreadable(exc: Exception) -> ConfigError:  # a port that is not a number...
        # SQLAlchemy's own message may quote the URL: only a ValueError's is shown, scrubbed
        why = f" ({scrub(str(exc), written)})" if type(exc) is ValueError else ""
        return _error(
            sc, "storage", f"{mask(written)} is not a database URL SQLAlchemy can read{why}; "
            "write dialect[+driver]://user:password@host:port/database (an @ in the query "
            "string as %40)"
        )  # fmt: skip

    try:
        url = make_url(written)
    except (ArgumentError, ValueError) as exc:
        raise unreadable(exc) from None
    shown = url.render_as_string(hide_password=True)
    try:
        dialect = url.get_dialect()
    except NoSuchModuleError:
        backend, _, driver = url.drivername.partition("+")
        what = f"driver {driver!r} of {backend}" if driver else f"database {backend!r}"
        hint = " (write postgresql://)" if backend == "postgres" else ""
        raise _error(
            sc, "storage", f"{shown}: SQLAlchemy knows no {what}{hint}; see the URL forms of "
            "SQLAlchemy's dialects, e.g. postgresql+psycopg2://user@host/db"
        ) from None  # fmt: skip
    except (ArgumentError, ValueError) as exc:
        raise unreadable(exc) from None
    driver = str(dialect.driver)
    if getattr(dialect, "is_async", False):
        raise _error(
            sc,
            "storage",
            f"{shown}: {driver} is an asyncio driver, which Optuna cannot use; name a "
            f"synchronous one, e.g. {url.get_backend_name()}+"
            f"{_SYNC_DRIVERS.get(url.get_backend_name(), '<driver>')}://",
        )
    try:
        dialect.import_dbapi()
    except ImportError as exc:
        package = _DRIVER_PACKAGES.get(driver, driver)
        implied = (
            "" if "+" in url.drivername else f" (SQLAlchemy's default for {url.drivername}://)"
        )
        problem = (
            f"{shown} needs the database driver {driver}{implied}, which is not installed "
            f"({exc}): pip install {package}"
        )
        raise _error(sc, "storage", problem) from None
    from ..storage.database import check_connection

    answer = check_connection(written)
    if answer is not None:
        raise _error(
            sc,
            "storage",
            f"cannot connect to {shown}: {answer}; check the user, password, host, port and "
            "database name (the database must exist)",
        )


# ---------------------------------------------------------------------------- ray
def _check_ray(sc: SweepConfig) -> None:
    """With ``backend: ray`` and a cluster's ``ray.address``, a Ray cluster answers there within
    ``ray.connect_timeout_s`` (``ray.init`` alone would wait for ever)."""
    if sc.backend != "ray" or sc.ray.address is None:
        return
    from ..executors import ClusterUnreachable, reach

    try:
        reach(sc.ray.address, sc.ray.connect_timeout_s)
    except ClusterUnreachable as exc:
        raise _error(
            sc,
            "ray.address",
            f"{sc.ray.address!r}: {exc}. Start the cluster (`ray start --head`), fix "
            "ray.address (null starts a local Ray for the run), or give a cluster that is "
            "starting more time with ray.connect_timeout_s",
        ) from None


_CHECKS: tuple[Callable[[SweepConfig], None], ...] = (
    _check_output, _check_device, _check_storage, _check_ray
)  # fmt: skip
