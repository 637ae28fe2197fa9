"""Stopping a sweep on a signal: SIGTERM as Ctrl-C.

SIGTERM is what ``timeout``, ``docker stop``, Slurm and Kubernetes send before they kill a job.
Left at its default, it ends the process where it stands; the sweep is then as after a
SIGKILL (resumable, but with no word said). :func:`stopping_on_signals` turns it into
:class:`Terminated`, a :class:`KeyboardInterrupt`, raised in the main thread at its next
bytecode, so a SIGTERM takes the very path a Ctrl-C takes: the executor stops its arrays where
they are (their checkpoints resume them), the ledger and the study keep every trial told, the
trials still training stay ``RUNNING`` for ``--resume``, and ``hfsweep run`` prints the command
that resumes it and exits ``128 + 15``.

A second SIGINT or SIGTERM while the sweep stops raises the stop again, which cuts short the
wait under way (an executor's threads, Ray's actors), except in a :func:`shielded` block (Ray's
shutdown, which must not leave its processes behind); later ones are ignored until the block
ends, so the stop's last steps, and the message, run to their end.

Handlers are installed only from the main thread (Python allows no other) and only over
Python's defaults (SIG_DFL for SIGTERM, ``default_int_handler`` for SIGINT): a program that set
its own keeps it. They are restored as they were when the block ends, whatever a library
installed meanwhile. ``ray.init`` installs a SIGTERM handler of its own (one that calls
``sys.exit``) and ``ray.shutdown`` leaves it: hfsweep starts Ray inside :func:`handlers_kept`,
which puts back the handlers found before, and :func:`reclaim` puts this module's back where a
library replaced it while the sweep runs.
"""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from types import FrameType
from typing import Any

__all__ = [
    "Terminated",
    "exit_code",
    "handlers_kept",
    "interruptible",
    "reclaim",
    "settle",
    "shielded",
    "stopped_by",
    "stopping_on_signals",
]

#: the signals a sweep stops on
_SIGNALS: tuple[int, ...] = (signal.SIGINT, signal.SIGTERM)


class Terminated(KeyboardInterrupt):
    """The process received SIGTERM (``signum``) while a sweep ran: it stops as after Ctrl-C.
    A :class:`KeyboardInterrupt`, so every clean-up written for Ctrl-C runs for it too."""

    def __init__(self, signum: int = signal.SIGTERM) -> None:
        super().__init__(f"stopped by {signal.Signals(signum).name}")
        self.signum = signum


def exit_code(stop: BaseException) -> int:
    """The exit status of a command stopped by ``stop``: ``128 + signal``, as a shell reports a
    process a signal ended (130 for Ctrl-C, 143 for SIGTERM)."""
    return 128 + (stop.signum if isinstance(stop, Terminated) else int(signal.SIGINT))


def _stop(signum: int) -> KeyboardInterrupt:
    return KeyboardInterrupt() if signum == signal.SIGINT else Terminated(signum)


@dataclass
class _State:
    """The signals' handling while a :func:`stopping_on_signals` block is open."""

    #: the handlers found when the outermost block opened, restored when it ends
    previous: dict[int, Any] = field(default_factory=dict)
    #: the signal that started the stop, and whether a second one cut it short
    first: int | None = None
    hurried: bool = False
    #: open :func:`shielded` blocks, and a signal that arrived inside one
    shields: int = 0
    held: int | None = None


_state: _State | None = None
_depth = 0


def _handle(signum: int, frame: FrameType | None) -> None:
    """The handler: the first signal raises the stop, a second raises it again (outside a
    :func:`shielded` block), later ones are ignored."""
    state = _state
    if state is None:  # a block ended between the signal and this call
        return
    if state.shields:
        if state.held is None:
            state.held = signum
        return
    if state.first is None:
        state.first = signum
        raise _stop(signum)
    if not state.hurried:
        state.hurried = True
        _say(f"{signal.Signals(signum).name} again: stopping without waiting\n")
        raise _stop(state.first)  # the first signal's kind: one exit status per stop


def _say(text: str) -> None:
    """Write ``text`` to stderr without Python's buffers (it may be mid-write in this thread)."""
    with suppress(OSError):
        os.write(2, text.encode())


def _ours(signum: int, current: Any) -> bool:
    """Whether to handle ``signum`` whose handler is ``current``: only over Python's default."""
    if signum == signal.SIGINT:
        return current is signal.default_int_handler
    return current == signal.SIG_DFL


@contextmanager
def stopping_on_signals() -> Iterator[None]:
    """Within the block, SIGTERM raises :class:`Terminated` and SIGINT ``KeyboardInterrupt``
    in the main thread (see the module docstring); the handlers found are restored after.
    Nested blocks share the outermost's handling. Outside the main thread it does nothing."""
    global _state, _depth
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    if _depth == 0:
        state = _State()
        for signum in _SIGNALS:
            current = signal.getsignal(signum)
            if _ours(signum, current):
                state.previous[signum] = current
        _state = state
        for taken in state.previous:
            signal.signal(taken, _handle)
    _depth += 1
    try:
        yield
    finally:
        _depth -= 1
        if _depth == 0:
            ending, _state = _state, None
            assert ending is not None
            for restored, previous in ending.previous.items():
                signal.signal(restored, previous)


@contextmanager
def handlers_kept() -> Iterator[None]:
    """The SIGINT and SIGTERM handlers as they are now, put back when the block ends (in the
    main thread): for a library call that installs its own (``ray.init``)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    found = {signum: signal.getsignal(signum) for signum in _SIGNALS}
    try:
        yield
    finally:
        for signum, handler in found.items():
            if handler is not None and signal.getsignal(signum) is not handler:
                signal.signal(signum, handler)


def reclaim() -> None:
    """Put this module's handler back where a library replaced it while the block is open
    (``ray.init`` installs a SIGTERM handler that calls ``sys.exit``); the block still restores
    the handlers it found first."""
    state = _state
    if state is None or threading.current_thread() is not threading.main_thread():
        return
    for signum in state.previous:
        if signal.getsignal(signum) is not _handle:
            signal.signal(signum, _handle)


def stopped_by() -> int | None:
    """The signal that started a stop in the open block, or ``None``."""
    return _state.first if _state is not None else None


def settle() -> None:
    """Ignore every further signal until the open block ends: the stop is done and its
    message being written."""
    state = _state
    if state is not None:
        state.first = state.first if state.first is not None else int(signal.SIGINT)
        state.hurried = True


@contextmanager
def shielded() -> Iterator[None]:
    """A block no signal interrupts (a shutdown that must finish); one that arrives meanwhile
    is handled as the block ends."""
    state = _state
    if state is None or threading.current_thread() is not threading.main_thread():
        yield
        return
    state.shields += 1
    try:
        yield
    finally:
        state.shields -= 1
        held, state.held = state.held, None
        if held is not None and state.shields == 0:
            _handle(held, None)


@contextmanager
def interruptible() -> Iterator[None]:
    """A wait inside a :func:`shielded` block where a stop may come at once: nothing is half
    done while it waits (a retry's pause while the database does not answer). A signal held
    by the shield, or one that comes meanwhile, raises here."""
    state = _state
    if (
        state is None
        or not state.shields
        or threading.current_thread() is not threading.main_thread()
    ):
        yield
        return
    shields, state.shields = state.shields, 0
    try:
        held, state.held = state.held, None
        if held is not None:
            _handle(held, None)
        yield
    finally:
        state.shields = shields
