"""``member_results(experiment_dir)`` reads the fused sweep's state from the file Tune pickles
into the experiment directory without running code from it (no Ray cluster needed)."""

from __future__ import annotations

import pickle
from dataclasses import asdict
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("ray.tune")

from _tune_toy import TASK
from hfsweep.schedulers._tune_state import MemberRecord
from hfsweep.schedulers.tune import Fusion, member_results, sweep_state
from ray import cloudpickle
from ray.tune.schedulers import ASHAScheduler
from ray.tune.search import Searcher, SearchGenerator

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


def _experiment(folder: Path, extra: Any = None) -> tuple[Path, Fusion]:
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
        state="COMPLETE",
        history=[{"val_accuracy": 0.5, "epoch": 1.0, "step": 10.0}],
        value=0.5,
    )
    state["members"] = {"m0": asdict(member)}
    searcher.set_state(state)
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
