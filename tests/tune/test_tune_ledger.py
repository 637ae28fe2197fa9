"""The fused Tune sweep's state holds the sweep core's ledger (hfsweep.core.ledger.Ledger): its
decision log, the members' ends and the array sizes, saved as the ledger's ``state_dict`` inside
the searcher's checkpoint (format ``hfsweep.tune/3``); a restored sweep tells nothing twice."""

from __future__ import annotations

import copy
import pickle
from typing import Any

import pytest

pytest.importorskip("ray.tune")

from test_tune_state import _asha_state_after_one_report, _report, _state

from hfsweep.core.ledger import Ledger
from hfsweep.core.status import Status


def test_the_states_ledger_round_trips_through_pickle() -> None:
    state, _ = _asha_state_after_one_report()
    assert isinstance(state.ledger, Ledger) and state.packer.sizes is state.ledger.sizes
    assert state.ledger.ended == {"A-1": Status.STOPPED}  # ASHA stopped A-1 at the first rung
    saved = pickle.loads(pickle.dumps(state.state_dict()))  # as Tune checkpoints the searcher
    assert saved["format"] == "hfsweep.tune/3"
    assert saved["ledger"] == state.ledger.state_dict()
    assert saved["ledger"]["decisions"] == {"A-0@5": True, "A-1@5": False}
    assert saved["ledger"]["ended"] == {"A-1": "stopped"} and saved["ledger"]["sizes"] == {
        state.members["A-0"].key: 2
    }
    assert "decisions" not in saved and "sizes" not in saved  # the ledger's, not beside it

    restored, _, _ = _state([], members=2, size=2)
    restored.load_state_dict(saved)
    assert restored.ledger.state_dict() == state.ledger.state_dict()
    assert restored.packer.sizes is restored.ledger.sizes  # still one dict after the restore
    assert restored.decisions is restored.ledger.decisions


@pytest.mark.parametrize("how", ["state_dict", "whole state"])
def test_a_restored_sweep_tells_nothing_twice(how: str) -> None:
    state, posted = _asha_state_after_one_report()
    if how == "state_dict":
        restored, searcher2, posted2 = _state([], members=2, size=2)
        restored.load_state_dict(pickle.loads(pickle.dumps(state.state_dict())))
    else:  # the state object pickled whole (its link to the hub stays behind)
        restored = pickle.loads(pickle.dumps(state))
        _, searcher2, posted2 = _state([], members=2, size=2)
        restored.searcher = searcher2
        restored.post = lambda token, message: posted2.__setitem__(token, message)
    # the array resumes from a checkpoint before its first report and replays it
    restored.on_result("A", _report("t9", [("A-0", 1, 0.9), ("A-1", 1, 0.1)]))
    assert posted2["t9"]["go"] == posted["t1"]["go"] == {"A-0": True, "A-1": False}
    assert not searcher2.told
    restored.on_result("A", _report("t10", [("A-0", 4, 0.95)], final=True))
    assert searcher2.outcome == {"A-0": "COMPLETE"}
    restored.on_complete("A", _report("t11", [("A-0", 4, 0.95)], final=True))
    assert dict(searcher2.told) == {"A-0": 1}
    assert restored.ledger.ended == {"A-1": Status.STOPPED, "A-0": Status.COMPLETED}
    assert restored.members["A-0"].status is Status.COMPLETED


def _as_format_2(saved: dict[str, Any]) -> dict[str, Any]:
    """``saved`` as hfsweep wrote it before the core's ledger (format 2): the decision log and
    sizes beside the members, each end only in its member's record."""
    old = {k: v for k, v in saved.items() if k != "ledger"}
    old.update(
        format="hfsweep.tune/2",
        decisions=saved["ledger"]["decisions"],
        sizes=saved["ledger"]["sizes"],
    )
    return old


def test_a_sweep_saved_in_format_2_gets_its_ledger_and_goes_on() -> None:
    state, posted = _asha_state_after_one_report()
    old = _as_format_2(copy.deepcopy(state.state_dict()))
    restored, searcher2, posted2 = _state([], members=2, size=2)
    restored.load_state_dict(old)
    assert restored.ledger.ended == {"A-1": Status.STOPPED}  # from A-1's record
    assert restored.ledger.decisions == state.ledger.decisions
    assert restored.packer.sizes == state.packer.sizes
    restored.on_result("A", _report("t9", [("A-0", 1, 0.9), ("A-1", 1, 0.1)]))  # a replay
    assert posted2["t9"]["go"] == posted["t1"]["go"] and not searcher2.told
    assert restored.state_dict()["format"] == "hfsweep.tune/3"


def test_a_restore_brings_the_records_and_the_ledger_to_agree() -> None:
    state, _ = _asha_state_after_one_report()
    saved = copy.deepcopy(state.state_dict())
    # an end only the record holds is recorded in the ledger, and an end only the
    # ledger holds is the record's too: neither member is told again
    saved["ledger"]["ended"] = {"A-0": "failed"}
    restored, searcher2, _ = _state([], members=2, size=2)
    restored.load_state_dict(saved)
    assert restored.ledger.ended == {"A-0": Status.FAILED, "A-1": Status.STOPPED}
    assert restored.members["A-0"].status is Status.FAILED and restored.members["A-0"].told
    restored.on_complete("A", None, error=True)
    assert not searcher2.told


def test_a_state_pickled_under_the_earlier_module_names_unpickles() -> None:
    """Tune pickles the searcher, and with it the sweep state, into the experiment's tuner.pkl:
    an experiment an hfsweep before the one sweep core started names the state's classes by
    their old modules (``_tune_state``, ``_tune_records``), and ``Tuner.restore`` finds them."""
    state, _ = _asha_state_after_one_report()
    data = pickle.dumps(state, protocol=0)  # protocol 0 names each class as "module\nname\n"
    old = data.replace(b"hfsweep.schedulers._tune_sweep\n", b"hfsweep.schedulers._tune_state\n")
    old = old.replace(b"hfsweep.core.members\n", b"hfsweep.schedulers._tune_records\n")
    assert b"_tune_state\nSweepState\n" in old and b"_tune_records\nMemberRecord\n" in old
    loaded = pickle.loads(old)
    assert type(loaded) is type(state)
    assert type(loaded.members["A-0"]) is type(state.members["A-0"])

    def plain(s: Any) -> dict[str, Any]:
        return {k: v for k, v in s.state_dict().items() if k != "decider"}

    assert plain(loaded) == plain(state)
