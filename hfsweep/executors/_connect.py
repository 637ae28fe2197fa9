"""Reaching the Ray cluster of ``ray.address``: a check bounded in time, then ``ray.init``.

``ray.init(address=...)`` has no time limit: at an address where no cluster answers it retries
"Failed to connect to GCS" for ever, and a Ctrl-C reaches it only between its long waits. So
:func:`reach` checks the address first, within ``ray.connect_timeout_s``: a TCP connection to
the cluster's port (refused or unroutable addresses end here, at once), then one request to
Ray's GCS server there, made by a child process that is killed at the deadline (Ray's own GCS
client waits 40 s before giving up, in C++ code that no thread of ours could interrupt). The
sweep's preflight runs it before anything is written, and ``hfsweep validate`` runs it too.

Ray rewrites a loopback address (``127.0.0.1:PORT``, ``localhost:PORT``) to this machine's
other address before connecting, so a cluster whose nodes listen on loopback only (``ray start
--node-ip-address=127.0.0.1``, or ``ray.cluster_utils.Cluster`` on 127.0.0.1) is unreachable
and ``ray.init`` retries for ever. That rewrite is what ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0``
turns off (Ray reads it once, when ``ray`` is imported). :func:`reach` tells the two kinds of
cluster apart (the loopback port answers, or only the rewritten one does) and :func:`connect`
turns the rewrite off while ``ray.init`` connects to a loopback cluster. The same rewrite would
put a local Ray started with ``_node_ip_address="127.0.0.1"`` on that other address:
:func:`on_loopback` keeps it on loopback too.
"""

from __future__ import annotations

import contextlib
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from .._compat import (
    GCS_PROBE,
    ray_auto_address,
    ray_is_localhost,
    ray_localhost_rewritten,
    ray_loopback_switch,
)
from .._signals import handlers_kept

__all__ = ["ClusterUnreachable", "Reached", "connect", "on_loopback", "reach"]

#: the environment variable that stops Ray from rewriting loopback addresses
REWRITE_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"
_rewrite_lock = threading.Lock()


class ClusterUnreachable(RuntimeError):
    """No Ray cluster answered at the address within the time limit; the message says what
    happened (connection refused, no answer, not a Ray cluster)."""


@dataclass(frozen=True)
class Reached:
    """A Ray cluster that answered: the ``address`` to pass to ``ray.init`` and whether it
    listens on ``loopback`` only (Ray's rewrite of the address must then be off)."""

    address: str
    loopback: bool
    nodes: int | None = None


def reach(address: str, timeout_s: float) -> Reached:
    """Check that a Ray cluster answers at ``address`` (``"auto"``, ``host:port`` or
    ``ray://host:port``) within ``timeout_s`` seconds; raise :class:`ClusterUnreachable`
    saying why not. Leaves no thread or process behind."""
    deadline = time.monotonic() + timeout_s
    given = address
    if address == "auto":
        address = _auto_address()
    client = address.startswith("ray://")
    host, port = _host_port(address[len("ray://") :] if client else address, given)
    if client:  # Ray Client: its server speaks gRPC, which ray.init's client retries bound
        _tcp(host, port, deadline, timeout_s, given)
        return Reached(address, loopback=False)
    loopback = _is_loopback(host)
    try:
        _tcp(host, port, deadline, timeout_s, given)
    except ClusterUnreachable:
        if not loopback:
            raise
        # a cluster started with this machine's address: Ray's rewrite reaches it
        other = _rewritten(host)
        if other == host:
            raise
        _tcp(other, port, deadline, timeout_s, given)
        nodes = _gcs(f"{other}:{port}", deadline, timeout_s, given)
        return Reached(address, loopback=False, nodes=nodes)
    nodes = _gcs(address, deadline, timeout_s, given)
    return Reached(address, loopback=loopback, nodes=nodes)


def connect(reached: Reached, **init: Any) -> None:
    """``ray.init(address=...)`` for a cluster :func:`reach` found; for one on loopback with
    Ray's rewrite of loopback addresses off (the setting ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0``
    stands for), so the driver connects on loopback as the cluster's nodes do."""
    import ray

    with on_loopback() if reached.loopback else contextlib.nullcontext(), handlers_kept():
        ray.init(address=reached.address, **init)  # which installs a SIGTERM handler


@contextlib.contextmanager
def on_loopback() -> Iterator[None]:
    """Ray's rewrite of loopback addresses off for the block: what
    ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`` does, for a process that imported ``ray`` before."""
    ray_constants = ray_loopback_switch()
    if ray_constants is None:  # another Ray version
        raise ClusterUnreachable(
            "the Ray cluster listens on loopback only, and this Ray has no switch hfsweep "
            f"knows to stop it from rewriting 127.0.0.1 to this machine's address: set "
            f"{REWRITE_ENV}=0 in the environment of `hfsweep run`, or start the cluster on "
            "this machine's address"
        )
    with _rewrite_lock:
        saved = ray_constants.ENABLE_RAY_CLUSTER
        ray_constants.ENABLE_RAY_CLUSTER = False
        try:
            yield
        finally:
            ray_constants.ENABLE_RAY_CLUSTER = saved


def _auto_address() -> str:
    """The address ``"auto"`` stands for: ``RAY_ADDRESS``, else the cluster started last on
    this machine (what ``ray.init(address="auto")`` connects to)."""
    found: str | None
    try:
        found = ray_auto_address()
    except Exception as exc:  # several clusters on this machine, an unreadable file...
        raise ClusterUnreachable(
            f"'auto' finds no single Ray cluster on this machine: {exc}"
        ) from None
    if not found or found == "auto":
        raise ClusterUnreachable(
            "'auto' finds no Ray cluster running on this machine (none started with `ray "
            "start`, and RAY_ADDRESS is not set)"
        )
    return found


def _host_port(address: str, given: str) -> tuple[str, int]:
    host, sep, port = address.rpartition(":")
    host = host.strip("[]")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ClusterUnreachable(f"{given!r} is not host:port with a port from 1 to 65535")
    return host, int(port)


def _is_loopback(host: str) -> bool:
    """``host`` is one Ray rewrites to this machine's address (Ray's own test, where there
    is one)."""
    return ray_is_localhost(host)


def _rewritten(host: str) -> str:
    """The address Ray connects to in place of the loopback ``host``."""
    return ray_localhost_rewritten(host)


def _tcp(host: str, port: int, deadline: float, timeout_s: float, given: str) -> None:
    left = deadline - time.monotonic()
    try:
        if left <= 0:
            raise TimeoutError
        with socket.create_connection((host, port), timeout=left):
            pass
    except TimeoutError:
        raise ClusterUnreachable(
            f"nothing answered at {given} within {timeout_s:g} s (a host that is down, or a "
            "firewall)"
        ) from None
    except OSError as exc:
        raise ClusterUnreachable(f"cannot connect to {given}: {exc.strerror or exc}") from None


def _gcs(address: str, deadline: float, timeout_s: float, given: str) -> int | None:
    """Ask the GCS server at ``address`` for its nodes from a child process, killed at the
    deadline: the number of nodes alive."""
    left = deadline - time.monotonic()
    try:
        if left <= 0:
            raise subprocess.TimeoutExpired("gcs probe", 0)
        done = subprocess.run(
            [sys.executable, "-c", GCS_PROBE, address, f"{max(left - 0.5, 0.5):g}"],
            capture_output=True,
            text=True,
            timeout=left,
            stdin=subprocess.DEVNULL,
        )
    except subprocess.TimeoutExpired:
        raise ClusterUnreachable(
            f"{given} accepts connections, but no Ray cluster (GCS server) answered there "
            f"within {timeout_s:g} s: is it the cluster's GCS port (`ray start --head` prints "
            "it; 6379 by default), not the dashboard's or Ray Client's?"
        ) from None
    if done.returncode != 0:
        lines = [line for line in done.stderr.strip().splitlines() if line.strip()]
        why = lines[-1][:300] if lines else f"exit status {done.returncode}"
        raise ClusterUnreachable(f"the Ray cluster at {given} did not answer: {why}")
    try:
        return int(done.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        return None
