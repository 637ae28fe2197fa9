"""``member_results(experiment_dir)`` reads the fused sweep's state from the file Tune pickles
into the experiment directory without running code from it (no Ray cluster needed)."""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("ray.tune")

from _tune_toy import TASK
from hfsweep.schedulers.tune import Fusion, member_results, sweep_state
from ray import cloudpickle
from ray.tune.schedulers import ASHAScheduler
from ray.tune.search import Searcher, SearchGenerator

from hfsweep.core.members import MemberRecord
from hfsweep.core.status import Status
from hfsweep.training.packed import UnsafeFileError


class _Inner(Searcher):
    """A searcher with nothing to suggest (the file is written before the sweep starts)."""

    def suggest(self, trial_id: str) -> dict[str, Any] | None:
        return None


class _Planted:
    """Pickles as a call of ``exec`` that leaves ``marker`` behind when loaded with pickle."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (exec, (f"open({str(self.marker)!r}, 'w').close()",))


def _experiment(
    folder: Path, extra: Any = None, saved: dict[str, Any] | None = None
) -> tuple[Path, Fusion]:
    """An experiment directory holding the searcher state file as Tune writes it, with
    ``extra`` where Tune keeps its own objects (pickled by value)."""
    fusion = Fusion(TASK, members=2, array_size=2)
    searcher = fusion.searcher(_Inner(metric="val_accuracy", mode="max"))
    fusion.scheduler(ASHAScheduler(max_t=4, grace_period=1))
    searcher.set_search_properties("val_accuracy", "max", {"lr": 0.1})
    generator = SearchGenerator(searcher)
    generator._experiment = extra  # Tune's Experiment, with the user's trainable by value
    state = searcher.get_state()
    member = MemberRecord(
        id="m0",
        config={"lr": 0.1, "choice": "wide"},
        key="k",
        array="a0",
        status=Status.COMPLETED,
        history=[{"val_accuracy": 0.5, "epoch": 1.0, "step": 10.0}],
        value=0.5,
    )
    state["members"] = {"m0": member.as_dict()}
    searcher.set_state(state)
    if saved is not None:  # a state as another version saved it, written as it is
        searcher.get_state = lambda: saved  # type: ignore[method-assign]
    folder.mkdir(parents=True)
    generator.save_to_dir(str(folder), "2026-01-01_00-00-00")
    assert len(list(folder.glob("search_gen_state-*.json"))) == 1
    return folder, fusion


def test_the_state_loads_without_tunes_objects(tmp_path: Path) -> None:
    local = lambda x: x + 1  # noqa: E731 - pickled by value, as cloudpickle does a trainable
    folder, _ = _experiment(tmp_path / "exp", extra={"trainable": local})
    state = sweep_state(folder)
    assert state["decider"] is None  # the inner scheduler is Tune's own object: not loaded
    table = member_results(folder)
    assert list(table["member"]) == ["m0"] and list(table["value"]) == [0.5]


def test_a_planted_call_in_tunes_part_of_the_file_does_not_run(tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    pickle.loads(cloudpickle.dumps(_Planted(marker)))
    assert marker.exists()  # it would run when unpickled
    marker.unlink()
    folder, _ = _experiment(tmp_path / "exp", extra=_Planted(marker))
    assert list(member_results(folder)["member"]) == ["m0"]
    assert not marker.exists()


def test_a_planted_call_in_the_members_is_refused_by_file(tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    folder, _ = _experiment(tmp_path / "exp")
    (path,) = folder.glob("search_gen_state-*.json")
    saved = pickle.loads(path.read_bytes())  # the test's own file: trusted
    saved["name:FusedSearcher"]["members"]["m0"]["config"]["choice"] = _Planted(marker)
    path.write_bytes(cloudpickle.dumps(saved))
    with pytest.raises(UnsafeFileError, match=rf"^{path}: not loaded: .*builtins\.exec"):
        member_results(folder)
    assert not marker.exists()


#: a member as hfsweep saved it in format 1, before the one status vocabulary (Optuna's names)
_FORMAT_1_MEMBER = {
    "id": "m0",
    "config": {"lr": 0.1},
    "key": "k",
    "array": "a0",
    "state": "PRUNED",
    "history": [{"val_accuracy": 0.25, "epoch": 1.0, "step": 10}],
    "value": 0.25,
    "error": None,
    "clock_shift": 0.0,
}


def _format_1(state: dict[str, Any]) -> dict[str, Any]:
    """``state`` as format 1 held it: the decision log and sizes beside the members, no ledger."""
    ledger = state.pop("ledger")
    state.update(decisions=ledger["decisions"], sizes=ledger["sizes"])
    return {**state, "format": "hfsweep.tune/1", "members": {"m0": dict(_FORMAT_1_MEMBER)}}


def test_the_table_says_the_cores_status_words_and_optunas_names_beside(tmp_path: Path) -> None:
    folder, fusion = _experiment(tmp_path / "exp")
    table = member_results(folder)
    assert list(table["status"]) == ["completed"] and list(table["state"]) == ["COMPLETE"]
    assert sweep_state(folder)["members"]["m0"]["status"] == "completed"  # as state.json says
    assert sweep_state(folder)["format"] == "hfsweep.tune/3"
    assert member_results(fusion)[["status", "state"]].equals(table[["status", "state"]])


def test_a_state_saved_in_the_previous_format_is_read_and_restored(tmp_path: Path) -> None:
    fusion = Fusion(TASK, members=2, array_size=2)
    searcher = fusion.searcher(_Inner(metric="val_accuracy", mode="max"))
    old = _format_1(searcher.get_state())
    folder, _ = _experiment(tmp_path / "exp", saved=old)
    table = member_results(folder)
    assert list(table["status"]) == ["stopped"] and list(table["state"]) == ["PRUNED"]
    assert list(table["value"]) == [0.25]
    searcher.set_state(old)  # Tuner.restore of an experiment the previous hfsweep saved
    assert fusion.state.members["m0"].status is Status.STOPPED and fusion.state.members["m0"].told
    saved = searcher.get_state()
    assert saved["format"] == "hfsweep.tune/3" and saved["members"]["m0"]["status"] == "stopped"
    assert "state" not in saved["members"]["m0"]


def test_a_format_this_version_does_not_read_is_refused_by_name(tmp_path: Path) -> None:
    fusion = Fusion(TASK, members=2, array_size=2)
    searcher = fusion.searcher(_Inner(metric="val_accuracy", mode="max"))
    newer = {**searcher.get_state(), "format": "hfsweep.tune/9"}
    with pytest.raises(ValueError, match=r"format 'hfsweep\.tune/9'.*reads 'hfsweep\.tune/3'"):
        searcher.set_state(newer)
    folder, _ = _experiment(tmp_path / "exp", saved=newer)
    (path,) = folder.glob("search_gen_state-*.json")
    with pytest.raises(ValueError, match=rf"^{path}: .*format 'hfsweep\.tune/9'"):
        member_results(folder)
