"""The ledger as an in-memory object (hfsweep.core.ledger): its whole state as plain data
(``state_dict``/``load_state_dict``), which is what ``state.json`` holds; a ledger without a
file (the Tune plugin's, saved by its owner) or without a scheduler (its owner decides and logs)."""

from __future__ import annotations

import json
import pickle
from pathlib import Path

import pytest
from hfsweep.schedulers import Report, TrialScheduler, make_scheduler

from hfsweep.core._ledger_file import LedgerFile
from hfsweep.core._parts import _Array  # the engine's record of an array
from hfsweep.core.ledger import Ledger
from hfsweep.core.status import Status


def _asha() -> TrialScheduler:
    return make_scheduler("asha", mode="max", max_resource=4, grace_period=1, reduction_factor=2)


def _files(folder: Path) -> LedgerFile:
    return LedgerFile(folder / "state.json", folder / "state.jsonl")


def _driven(ledger: Ledger) -> dict[str, bool]:
    """Two rounds of four members: joint decisions, ends, an array, a size, the best kept."""
    ledger.arrays.append(_Array(0, "k", 4))
    ledger.sizes["k"] = 4
    first = ledger.decide([(Report(f"t{i}", 1.0, 0.1 * i), 5) for i in range(4)])
    for m, go in first.items():
        if not go:
            ledger.end(m, Status.STOPPED)
    alive = [m for m, go in first.items() if go]
    second = ledger.decide([(Report(m, 2.0, 0.5), 10) for m in alive])
    for m in alive:
        ledger.end(m, Status.COMPLETED)
    ledger.arrays[0].done = True
    ledger.best = [(0.5, 3)]
    return {**first, **second}


def test_the_state_dict_is_what_state_json_holds_and_loads_into_a_new_ledger(
    tmp_path: Path,
) -> None:
    ledger = Ledger(_files(tmp_path), _asha(), lambda: 2.0)
    _driven(ledger)
    ledger.compact()
    state = ledger.state_dict()
    on_disk = json.loads((tmp_path / "state.json").read_text())
    assert {k: v for k, v in on_disk.items() if k not in ("version", "seq")} == state
    assert state["ended"] == {
        "t0": "stopped",
        "t1": "stopped",
        "t2": "completed",
        "t3": "completed",
    }
    reports = [Report("t9", 1.0, 0.0), Report("t8", 1.0, 0.9)]
    expected = ledger.decide([(r, 5) for r in reports])  # the next rung, by the original

    for copied in (json.loads(json.dumps(state)), pickle.loads(pickle.dumps(state))):
        fresh = Ledger(None, _asha(), lambda: 0.0)
        fresh.load_state_dict(copied, _Array)
        assert fresh.state_dict() == state
        assert fresh.ended["t0"] is Status.STOPPED and fresh.arrays == [_Array(0, "k", 4, True)]
        # the scheduler's state came along: the next rung is decided as by the original
        assert fresh.decide([(r, 5) for r in reports]) == expected


def test_a_ledger_without_a_file_or_scheduler_records_what_its_owner_decided() -> None:
    ledger = Ledger()
    ledger.log("m0", 5, True)
    ledger.log("m1", 5, False)
    assert ledger.logged("m0", 5) is True and ledger.logged("m1", 5) is False
    assert ledger.logged("m0", 10) is None
    assert ledger.end("m1", "stopped") is True
    assert ledger.end("m1", Status.FAILED) is False  # ended once: the first end stays
    assert ledger.status("m1") is Status.STOPPED and ledger.status("m0") is None
    with pytest.raises(RuntimeError, match="no trial scheduler"):
        ledger.decide([(Report("m0", 1.0, 0.5), 5)])
    with pytest.raises(RuntimeError, match="no file to save to"):
        ledger.save()

    restored = pickle.loads(pickle.dumps(ledger))  # the Tune plugin's state pickles it whole
    assert restored.state_dict() == ledger.state_dict()
    again = Ledger()
    again.load_state_dict(pickle.loads(pickle.dumps(ledger.state_dict())))
    assert again.decisions == {"m0@5": True, "m1@5": False}
    assert again.ended == {"m1": Status.STOPPED} and again.state_dict()["scheduler"] is None


def test_a_logged_decision_is_saved_and_restored_from_the_files_too(tmp_path: Path) -> None:
    ledger = Ledger(_files(tmp_path))
    ledger.save()  # the first save writes the snapshot
    ledger.log("m0", 5, False)
    ledger.end("m0", Status.STOPPED)
    ledger.save()  # appended to state.jsonl, not in the snapshot
    assert json.loads((tmp_path / "state.json").read_text())["decisions"] == {}

    restored = Ledger(_files(tmp_path))
    saved = restored.file.read() if restored.file is not None else None
    assert saved is not None
    restored.restore(saved, _Array)
    assert restored.decisions == {"m0@5": False} and restored.ended == {"m0": Status.STOPPED}


def test_loading_keeps_the_sizes_dict_an_owner_shares() -> None:
    ledger = Ledger()
    shared = ledger.sizes  # e.g. the packer's sizes: one dict, the ledger saves it
    ledger.load_state_dict({**Ledger().state_dict(), "sizes": {"k": 3}})
    assert ledger.sizes is shared and shared == {"k": 3}
    with pytest.raises(ValueError, match="no maker of array records"):
        ledger.load_state_dict({**Ledger().state_dict(), "arrays": [_Array(0, "k", 1).__dict__]})
