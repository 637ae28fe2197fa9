"""A real PostgreSQL server for tests, on loopback, in a temporary directory.

Tests of shared studies need what users run: a PostgreSQL server that two drivers reach over
TCP, that can be restarted mid-sweep and that refuses a wrong password. :class:`PostgresServer`
starts one with Debian's binaries (``initdb``, ``pg_ctl``; ``.ci/run`` installs the
``postgresql`` package where they are absent), listening on ``127.0.0.1`` only, on a free port,
with password authentication, and removes it at the end. As root (``initdb`` refuses to run as
root) the server runs as the ``postgres`` user through ``runuser``.

The ``postgres`` fixture (tests/conftest.py) gives one server per test session and a fresh
database per test; tests that restart or stop the server take ``postgres_server`` of their own.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import tempfile
import time
import uuid
from pathlib import Path

from _ready import SERVER_START_S, start_with_retries

#: where Debian's postgresql-NN package puts its server binaries, newest first
_DEBIAN_BIN = sorted(Path("/usr/lib/postgresql").glob("*/bin"), reverse=True)
USER = "hfsweep"
PASSWORD = "s3cret-test"


def binaries() -> Path | None:
    """The folder holding ``initdb``, ``pg_ctl`` and ``postgres``, or None if absent."""
    for folder in _DEBIAN_BIN:
        if (folder / "initdb").exists() and (folder / "pg_ctl").exists():
            return folder
    found = shutil.which("initdb")
    if found and shutil.which("pg_ctl") and shutil.which("postgres"):
        return Path(found).parent
    return None


def skip_reason() -> str | None:
    """Why a real PostgreSQL cannot be started here, or None if it can."""
    if binaries() is None:
        return "PostgreSQL server binaries (initdb, pg_ctl) are not installed: apt-get install postgresql"
    if os.geteuid() == 0 and shutil.which("runuser") is None:
        return "running as root without runuser, and initdb refuses to run as root"
    try:
        import psycopg2  # noqa: F401
    except ImportError:
        return 'the postgres extra is not installed: pip install "hfsweep[postgres]"'
    return None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class PostgresServer:
    """One PostgreSQL server on ``127.0.0.1:port`` with user :data:`USER` / :data:`PASSWORD`."""

    def __init__(self) -> None:
        bin_dir = binaries()
        assert bin_dir is not None, skip_reason()
        self.bin = bin_dir
        self.root = Path(tempfile.mkdtemp(prefix="hfsweep-pg-"))
        self.data = self.root / "data"
        self.port = 0  # chosen as the server starts
        self._as_postgres = os.geteuid() == 0
        if self._as_postgres:
            os.chmod(self.root, 0o755)
            shutil.chown(self.root, "postgres", "postgres")
        pwfile = self.root / "pw"
        pwfile.write_text(PASSWORD + "\n")
        if self._as_postgres:
            shutil.chown(pwfile, "postgres", "postgres")
        self._run(
            "initdb",
            "-D", str(self.data),
            "-U", USER,
            "--pwfile", str(pwfile),
            "--auth", "scram-sha-256",
            "-E", "UTF8",
            "--no-sync",
        )  # fmt: skip
        with (self.data / "postgresql.conf").open("a") as conf:
            conf.write(
                f"listen_addresses = '127.0.0.1'\n"
                f"unix_socket_directories = '{self.root}'\nfsync = off\n"
                "synchronous_commit = off\nfull_page_writes = off\nmax_connections = 200\n"
            )
        # a port found free may be taken before the server binds it: each try takes a new one
        try:
            start_with_retries(
                f"PostgreSQL in {self.root}", self._start_on_a_free_port, self._stop_quietly
            )
        except BaseException:
            shutil.rmtree(self.root, ignore_errors=True)
            raise

    def _start_on_a_free_port(self) -> None:
        self.port = free_port()
        with (self.data / "postgresql.conf").open("a") as conf:
            conf.write(f"port = {self.port}\n")  # the file's last setting wins
        self.start()

    def _stop_quietly(self) -> None:
        with contextlib.suppress(subprocess.CalledProcessError):
            self.stop("immediate")

    def _run(self, program: str, *args: str) -> None:
        cmd = [str(self.bin / program), *args]
        if self._as_postgres:
            cmd = ["runuser", "-u", "postgres", "--", *cmd]
        subprocess.run(cmd, check=True, capture_output=True, cwd=self.root)

    def start(self) -> None:
        """Start the server and wait until it accepts connections (a generous wait: on a
        loaded machine pg_ctl's default of 60 s has been too short)."""
        self._run(
            "pg_ctl", "-D", str(self.data), "-l", str(self.root / "log"),
            "-w", "-t", str(SERVER_START_S), "start",
        )  # fmt: skip

    def stop(self, mode: str = "fast") -> None:
        """Stop the server (``fast`` ends open connections, as a restart by an admin would)."""
        self._run(
            "pg_ctl", "-D", str(self.data), "-m", mode, "-w", "-t", str(SERVER_START_S), "stop"
        )

    def restart(self, down_s: float = 0.0) -> None:
        """Stop the server, wait ``down_s`` seconds, start it again."""
        self.stop()
        time.sleep(down_s)
        self.start()

    def url(self, database: str = "postgres", driver: str = "") -> str:
        scheme = "postgresql" + (f"+{driver}" if driver else "")
        return f"{scheme}://{USER}:{PASSWORD}@127.0.0.1:{self.port}/{database}"

    def create_database(self) -> str:
        """A new empty database; returns its URL."""
        import psycopg2

        name = "t_" + uuid.uuid4().hex[:12]
        conn = psycopg2.connect(self.url())
        try:
            conn.autocommit = True
            with conn.cursor() as cur:
                cur.execute(f'CREATE DATABASE "{name}"')
        finally:
            conn.close()
        return self.url(name)

    def close(self) -> None:
        with contextlib.suppress(subprocess.CalledProcessError):  # already stopped
            self.stop("immediate")
        shutil.rmtree(self.root, ignore_errors=True)
