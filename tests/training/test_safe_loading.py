"""Opening a run directory never runs code from it: the trainer's checkpoints, member states and
delivered log load plain data and tensors only, and refuse anything else by file name
(``hfsweep.training.packed.load``/``loads``)."""

from __future__ import annotations

import base64
import datetime
import pickle
from collections import OrderedDict
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path, PurePosixPath
from typing import Any

import numpy as np
import pytest
import torch
from _tasks import make_task

import hfsweep as hs
from hfsweep.training.packed import UnsafeFileError, load, pack


class _Planted:
    """Pickles as a call of ``exec`` that leaves ``marker`` behind: what a booby-trapped file
    in a shared run directory would run when loaded with ``pickle``."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (exec, (f"open({str(self.marker)!r}, 'w').close()",))


class _Restoring:
    """An object of a class of the test's own, whose ``__setstate__`` leaves ``marker`` behind."""

    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __setstate__(self, state: dict[str, Any]) -> None:
        Path(state["marker"]).touch()
        self.__dict__.update(state)


@dataclass(frozen=True)
class _Choice:
    """A config value of the user's own type."""

    name: str


def _live(obj: object, marker: Path) -> None:
    """``obj`` does run code when ``pickle`` loads it (so the tests below would notice)."""
    pickle.loads(pickle.dumps(obj))
    assert marker.exists()
    marker.unlink()


def _members(n: int) -> list[hs.Member]:
    return [hs.Member(f"t{i}", {"epochs": 1, "hidden": 8}) for i in range(n)]


def _trained(folder: Path) -> None:
    """A finished array's checkpoint in ``folder``: array.pt, delivered.log, members/*.pt."""
    hs.ArrayTrainer(make_task(), checkpoint_dir=folder, keep_states=True).run(_members(2))
    assert (folder / "array.pt").exists() and (folder / "members" / "t0.pt").exists()


def _resume(folder: Path) -> list[hs.MemberResult]:
    trainer = hs.ArrayTrainer(make_task(), checkpoint_dir=folder, keep_states=True)
    return trainer.run(_members(2), resume=True)


def test_plain_values_of_every_kind_come_back(tmp_path: Path) -> None:
    values = {
        "numbers": [1, 2.5, complex(1, 2), True, None, float("inf")],
        "text": ("a", b"bytes", bytearray(b"x")),
        "sets": [{1, 2}, frozenset({3})],
        "ordered": OrderedDict(a=1),
        "numpy": [np.float64(0.1), np.int64(3), np.float32(2.0), np.arange(3), np.bool_(True)],
        "dates": [datetime.datetime(2026, 1, 2, 3, 4), datetime.timedelta(seconds=5)],
        "paths": [Path("/data/x"), PurePosixPath("a/b")],
        "fraction": Fraction(1, 3),
        "torch": [torch.float16, torch.device("cpu"), torch.Size([2, 3])],
        "tensors": {"w": torch.randn(2, 3), "sparse": torch.eye(2).to_sparse()},
    }
    torch.save(pack(values), tmp_path / "array.pt")
    out = load(tmp_path / "array.pt")
    assert out.keys() == values.keys()
    for key in ("numbers", "text", "sets", "ordered", "dates", "paths", "fraction", "torch"):
        assert out[key] == values[key], key
    assert [type(v) for v in out["numpy"]] == [type(v) for v in values["numpy"]]
    assert np.array_equal(out["numpy"][3], values["numpy"][3])
    assert torch.equal(out["tensors"]["w"], values["tensors"]["w"])
    assert torch.equal(out["tensors"]["sparse"].to_dense(), torch.eye(2))


def test_a_packed_call_is_refused_by_file_and_name_and_nothing_runs(tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    planted = _Planted(marker)
    _live(planted, marker)
    path = tmp_path / "array.pt"
    torch.save(pack({"version": 3, "config": {"lr": planted}, "w": torch.ones(2)}), path)
    with pytest.raises(UnsafeFileError, match=rf"^{path}: not loaded: it needs builtins\.exec"):
        load(path)
    assert not marker.exists()


def test_an_unpacked_object_of_a_custom_class_is_refused(tmp_path: Path) -> None:
    """The file around the packed structure is read by ``torch.load(weights_only=True)``."""
    marker = tmp_path / "ran"
    _live(_Restoring(marker), marker)
    path = tmp_path / "array.pt"
    torch.save({"version": 3, "extra": _Restoring(marker)}, path)
    with pytest.raises(UnsafeFileError, match=rf"^{path}: not loaded: it needs .*_Restoring"):
        load(path)
    assert not marker.exists()


def test_a_value_of_the_users_type_loads_once_allowed(tmp_path: Path) -> None:
    path = tmp_path / "array.pt"
    torch.save(pack({"config": {"choice": _Choice("wide")}}), path)
    with pytest.raises(UnsafeFileError, match=r"_Choice.*add_safe_globals"):
        load(path)
    with torch.serialization.safe_globals([_Choice]):
        assert load(path) == {"config": {"choice": _Choice("wide")}}


@pytest.mark.parametrize("planted_in", ["array.pt", "members/t0.pt", "delivered.log"])
def test_a_resume_refuses_a_planted_file_and_runs_nothing(tmp_path: Path, planted_in: str) -> None:
    """Each file of a trainer's checkpoint folder that a resume reads, booby-trapped: the
    resume (and ``checkpointed_members``) stop with an error naming it; nothing ran."""
    folder = tmp_path / "ckpt"
    _trained(folder)
    marker = tmp_path / "ran"
    planted = _Planted(marker)
    target = folder / planted_in
    if planted_in == "delivered.log":
        record = {"id": "t0", "config": {"lr": planted}}
        line = base64.b64encode(pickle.dumps(record)).decode()
        with target.open("a") as f:
            f.write(line + "\n")
    elif planted_in == "array.pt":
        torch.save(pack({"version": 3, "order": ["t0"], "key": planted}), target)
    else:
        torch.save({"model": planted}, target)
    with pytest.raises(UnsafeFileError, match=rf"^{target}: not loaded"):
        _resume(folder)
    if planted_in == "array.pt":
        with pytest.raises(UnsafeFileError, match=rf"^{target}: not loaded"):
            hs.ArrayTrainer.checkpointed_members(folder)
    assert not marker.exists()


def test_an_untouched_checkpoint_still_resumes(tmp_path: Path) -> None:
    folder = tmp_path / "ckpt"
    _trained(folder)
    assert hs.ArrayTrainer.checkpointed_members(folder) == {"t0", "t1"}
    results = _resume(folder)
    assert [r.status for r in results] == ["completed", "completed"]
    assert all(r.state is not None for r in results)


@pytest.mark.parametrize(
    ("optimizer", "schedule"),
    [
        ("sgd", "cosine"),  # with momentum (below): an optimizer state
        ("adam", "step"),
        ("adamw", "exponential"),
        ("rmsprop", "constant"),
        ("adagrad", "cosine"),
    ],
)
def test_a_checkpoint_taken_mid_run_loads_with_every_optimizer_and_schedule(
    tmp_path: Path, optimizer: str, schedule: str
) -> None:
    """What the trainer saves of a training member (model, optimizer, schedule and dropout
    states, history, config) is all plain data and tensors."""
    folder = tmp_path / "ckpt"
    mid = tmp_path / "mid.pt"

    def report(evaluations: Any) -> None:  # the checkpoint of the evaluation before
        if (folder / "array.pt").exists() and not mid.exists():
            mid.write_bytes((folder / "array.pt").read_bytes())

    config = {"epochs": 2, "hidden": 8, "optimizer": optimizer, "lr_schedule": schedule}
    if optimizer in ("sgd", "rmsprop"):
        config["momentum"] = 0.9
    members = [hs.Member(f"t{i}", {**config, "lr": 0.01 * (i + 1)}) for i in range(2)]
    hs.ArrayTrainer(make_task(), checkpoint_dir=folder).run(members, report=report)
    payload = load(mid)
    saved = [s["saved"] for a in payload["arrays"] for s in a["slots"] if s is not None]
    assert len(saved) == 2
    assert all(s["model"] and s["optimizer"]["state"] for s in saved)
    assert all((s["scheduler"] is None) == (schedule == "constant") for s in saved)
