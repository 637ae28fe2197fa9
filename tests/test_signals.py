"""SIGTERM as Ctrl-C while a sweep runs (hfsweep._signals): the handlers, the stop they raise,
a second signal, shielded blocks, and the process's handlers left as they were found."""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import hfsweep as hs
from hfsweep import _signals
from hfsweep._signals import Terminated, exit_code, shielded, stopping_on_signals

pytestmark = pytest.mark.skipif(not hasattr(signal, "SIGKILL"), reason="needs POSIX signals")

_SIGNALS = (signal.SIGINT, signal.SIGTERM)


@pytest.fixture(autouse=True)
def _handlers_kept() -> Iterator[None]:
    """Each test starts with Python's default handlers and leaves them so."""
    before = {s: signal.getsignal(s) for s in _SIGNALS}
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    yield
    for s, handler in before.items():
        signal.signal(s, handler)


def _handlers() -> dict[int, Any]:
    return {s: signal.getsignal(s) for s in _SIGNALS}


def test_sigterm_raises_terminated_a_keyboard_interrupt_and_the_handlers_come_back() -> None:
    before = _handlers()
    with pytest.raises(Terminated) as raised, stopping_on_signals():
        assert _handlers() != before
        signal.raise_signal(signal.SIGTERM)
        pytest.fail("the SIGTERM did not stop the block at once")
    assert isinstance(raised.value, KeyboardInterrupt)  # Ctrl-C's clean path
    assert str(raised.value) == "stopped by SIGTERM" and exit_code(raised.value) == 143
    assert _handlers() == before
    with pytest.raises(KeyboardInterrupt) as interrupted, stopping_on_signals():
        signal.raise_signal(signal.SIGINT)
    assert type(interrupted.value) is KeyboardInterrupt and exit_code(interrupted.value) == 130
    assert _handlers() == before


def test_a_second_signal_cuts_the_stop_short_and_later_ones_wait_for_its_end(
    capfd: pytest.CaptureFixture[str],
) -> None:
    cleaned: list[str] = []
    with pytest.raises(Terminated), stopping_on_signals():
        try:
            signal.raise_signal(signal.SIGTERM)
        finally:  # the stop's clean-up: a wait the second signal ends
            try:
                signal.raise_signal(signal.SIGINT)
                cleaned.append("waited to the end")
            except Terminated:  # the first signal's kind: one exit status
                cleaned.append("cut short")
            signal.raise_signal(signal.SIGTERM)  # a third: ignored, the rest runs
            cleaned.append("last steps")
    assert cleaned == ["cut short", "last steps"]
    assert "SIGINT again: stopping without waiting" in capfd.readouterr().err


def test_a_shielded_block_finishes_before_the_signal_is_handled() -> None:
    steps: list[str] = []
    with pytest.raises(Terminated), stopping_on_signals():
        with shielded():
            signal.raise_signal(signal.SIGTERM)
            steps.append("shutdown finished")
        steps.append("after the shield")
    assert steps == ["shutdown finished"]


def test_a_handler_the_program_set_is_left_alone() -> None:
    got: list[int] = []

    def mine(signum: int, frame: object) -> None:
        got.append(signum)

    signal.signal(signal.SIGTERM, mine)
    with stopping_on_signals():
        assert signal.getsignal(signal.SIGTERM) is mine
        signal.raise_signal(signal.SIGTERM)
        _signals.reclaim()  # puts back only the handlers the block took over
        assert signal.getsignal(signal.SIGTERM) is mine
    assert got == [signal.SIGTERM] and signal.getsignal(signal.SIGTERM) is mine


def test_a_library_handler_installed_meanwhile_is_replaced_while_running_then_undone() -> None:
    """As ``ray.init`` does: its SIGTERM handler calls ``sys.exit``."""

    def library(signum: int, frame: object) -> None:
        raise SystemExit(signum)

    with pytest.raises(Terminated), stopping_on_signals():
        signal.signal(signal.SIGTERM, library)
        _signals.reclaim()
        signal.raise_signal(signal.SIGTERM)
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL


def test_a_handler_a_library_installs_while_starting_ray_is_taken_back() -> None:
    """``ray.init`` installs a SIGTERM handler and ``ray.shutdown`` leaves it: hfsweep starts Ray
    inside ``handlers_kept``, so a program's handler (here one an earlier Ray left, which the
    sweep's block does not take over) is the same object after as before."""

    def earlier(signum: int, frame: object) -> None:
        raise SystemExit(signum)

    def library(signum: int, frame: object) -> None:
        raise SystemExit(signum)

    signal.signal(signal.SIGTERM, earlier)
    try:
        with stopping_on_signals(), _signals.handlers_kept():
            signal.signal(signal.SIGTERM, library)
        assert signal.getsignal(signal.SIGTERM) is earlier
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)


def test_outside_the_main_thread_nothing_is_installed() -> None:
    seen: list[object] = []

    def in_thread() -> None:
        with stopping_on_signals():
            seen.append(signal.getsignal(signal.SIGTERM))

    thread = threading.Thread(target=in_thread)
    thread.start()
    thread.join()
    assert seen == [signal.SIG_DFL]


def _toy_sweep(output: Path) -> dict[str, Any]:
    return {
        "task": f"{Path(__file__).resolve().parent / 'sweep' / '_toy.py'}:TASK",
        "search_space": {"lr": {"type": "float", "low": 0.01, "high": 0.5}},
        "searcher": "random",
        "budget": {"trials": 2, "epochs": 1},
        "metric": "val_accuracy",
        "mode": "max",
        "fusion": {"size": 2, "device": "cpu"},
        "output": str(output),
    }


def test_a_sweep_from_python_leaves_the_handlers_as_it_found_them(tmp_path: Path) -> None:
    """Also from a thread other than the main one, where no handler can be installed."""
    before = _handlers()
    seen: dict[str, Any] = {}

    class Watch(hs.Callback):
        def on_trial_start(self, trial: Any) -> None:
            seen.setdefault("while", _handlers())

    hs.sweep(_toy_sweep(tmp_path / "main"), progress=False, callbacks=[Watch()])
    assert seen["while"][signal.SIGTERM] is not signal.SIG_DFL  # SIGTERM stops it meanwhile
    assert _handlers() == before
    errors: list[BaseException] = []

    def in_thread() -> None:
        try:
            hs.sweep(_toy_sweep(tmp_path / "thread"), progress=False)
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    thread = threading.Thread(target=in_thread)
    thread.start()
    thread.join()
    assert errors == [] and _handlers() == before


def test_a_wait_inside_a_shielded_block_may_be_interrupted() -> None:
    """A retry's pause while the database does not answer: nothing half done, so a stop held
    by the shield (or one that comes meanwhile) raises there instead of after the retries."""
    from hfsweep._signals import interruptible

    steps: list[str] = []
    with pytest.raises(Terminated), stopping_on_signals(), shielded():
        signal.raise_signal(signal.SIGTERM)  # held
        steps.append("call failed")
        with interruptible():
            steps.append("waiting")  # pragma: no cover - raised before
        steps.append("retried")  # pragma: no cover
    assert steps == ["call failed"]
    with pytest.raises(KeyboardInterrupt), stopping_on_signals(), shielded(), interruptible():
        signal.raise_signal(signal.SIGINT)  # comes while it waits
        pytest.fail("the wait was not interrupted")
