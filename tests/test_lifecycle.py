"""One sweep's whole life through every front door and on both executors: ask, pack, train, ASHA
stop, refill, SIGKILL, resume.

The front doors are the CLI (``python -m hfsweep run ... --resume``), the Python API (``hs.sweep``
in a process of its own) and the Ray Tune plugin (``Tuner.fit``, then ``Tuner.restore``); the
executors are the local one (also with ``fusion.alternate: 2``: two offloaded arrays at once,
their shards alternating) and the Ray one (``backend: ray``, a local Ray of the sweep's own;
also with ``fusion.alternate: 2`` in its one worker; the Tune plugin runs on Ray only). Each case runs a small ASHA sweep of the toy task in a
subprocess, SIGKILLs it mid-sweep, resumes it in another, and reads what it ended with into one
:class:`Outcome`, which :func:`check` holds to the same rules: every trial of the budget ended,
ASHA stopped some, a freed slot was refilled, an array went on from its checkpoint, no trial was
told twice (where the design says so), and every trial trained exactly as it would alone.
"""

from __future__ import annotations

import json
import os
import re
import signal
import sys
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch
from sweep._killed import (
    TOLD_LINE,
    check_final_study,
    finished,
    reaped,
    start_cli,
    start_python,
    unlogged_tells,
    wait_for_tells,
)
from sweep._toy import HOLD_AFTER
from sweep._toy import TASK as TOY_TASK

import hfsweep as hs

pytestmark = [
    pytest.mark.slow,  # two processes per case, each importing torch (and starting a Ray)
    pytest.mark.skipif(not hasattr(signal, "SIGKILL"), reason="needs POSIX signals"),
]

TESTS = Path(__file__).resolve().parent
TOY = TESTS / "sweep" / "_toy.py"
TRIALS = 12
FINAL = {"COMPLETE", "PRUNED", "FAIL"}

#: runs hs.sweep on the config in the JSON file argv[1]; argv[2] == "resume" resumes it
_API = (
    "import json, sys, hfsweep as hs; "
    "hs.sweep(json.load(open(sys.argv[1])), resume=sys.argv[2] == 'resume', progress=False)"
)


@dataclass
class Outcome:
    """What a killed and resumed sweep ended with, whichever front door ran it."""

    states: dict[str, str]  #: every trial's (member's) final state, by id
    told: Counter[str]  #: how many times each was told to the searcher, over both processes
    #: trials the design allows to be told twice across a hard kill (see the Tune case)
    may_repeat: set[str] = field(default_factory=set)
    refilled: set[str] = field(default_factory=set)  #: trials that joined a running array
    resumed: bool = False  #: an array went on from its checkpoint after the kill
    #: (id, recorded history, the history of the trial trained again alone)
    alone: list[tuple[str, list[dict[str, float]], list[dict[str, float]]]] = field(
        default_factory=list
    )


def check(outcome: Outcome, budget: int) -> None:
    """The rules every front door and executor meet."""
    assert len(outcome.states) == budget
    assert set(outcome.states.values()) <= FINAL, Counter(outcome.states.values())
    assert "PRUNED" in outcome.states.values()  # ASHA stopped some
    assert outcome.refilled, "no freed slot was refilled"
    assert outcome.resumed, "no array went on from its checkpoint"
    assert set(outcome.told) == set(outcome.states)
    twice = {m for m, n in outcome.told.items() if n > 1}
    assert twice <= outcome.may_repeat, outcome.told
    assert max(outcome.told.values()) <= 2, outcome.told
    assert outcome.alone, "no trial was trained again alone"
    for member, recorded, alone in outcome.alone:
        assert len(recorded) >= 1, member
        assert len(alone) >= len(recorded), member
        for got, want in zip(recorded, alone, strict=False):
            assert got["step"] == want["step"], member
            for key in ("train_loss", "val_loss", "val_accuracy"):
                torch.testing.assert_close(got[key], want[key], rtol=1e-4, atol=1e-6)


# ---------------------------------------------------------------- the engine's front doors
def _engine_config(folder: Path, backend: str) -> dict[str, Any]:
    """The sweep: 12 trials of the toy task that holds after two tells (``HELD_TASK``, so the
    kill lands mid-sweep however slowly this test polls), arrays of 4, ASHA. ``local-alternate``:
    the local backend with two offloaded arrays at once, their shards alternating;
    ``ray-alternate``: the same in the one Ray worker the local Ray's 2 CPUs hold."""
    fusion: dict[str, Any] = {"size": 4, "device": "cpu"}
    extra: dict[str, Any] = {}
    if backend.endswith("-alternate"):
        backend = backend.removesuffix("-alternate")
        fusion.update(offload="host", alternate=2)
        if backend == "ray":
            extra["ray"] = {"cpus_per_array": 2}
    return {
        **extra,
        "task": f"{TOY}:HELD_TASK",
        "search_space": {
            "lr": {"type": "float", "low": 1e-3, "high": 0.5, "log": True},
            "momentum": {"type": "float", "low": 0.0, "high": 0.9},
        },
        "searcher": "random",
        "scheduler": {"name": "asha", "options": {"grace_period": 1, "reduction_factor": 2}},
        "budget": {"trials": TRIALS, "epochs": 4},
        "metric": "val_accuracy",
        "mode": "max",
        "fusion": fusion,
        "backend": backend,
        "output": str(folder / "run"),
        "seed": 0,
    }


def _start_engine(door: str, folder: Path, *, resume: bool) -> Any:
    if door == "cli":
        return start_cli(folder / "sweep.yaml", *(["--resume"] if resume else []), session=True)
    return start_python(
        ["-c", _API, str(folder / "sweep.json"), "resume" if resume else "new"],
        folder,
        session=True,
    )


def _engine_lifecycle(door: str, backend: str, folder: Path, hold: pytest.MonkeyPatch) -> Outcome:
    config = _engine_config(folder, backend)
    (folder / "sweep.json").write_text(json.dumps(config))
    (folder / "sweep.yaml").write_text(json.dumps(config))  # JSON is YAML
    run = folder / "run"
    hold.setenv("HFSWEEP_TEST_HOLD_LOG", str(run / "sweep.log"))
    with reaped(_start_engine(door, folder, resume=False)) as proc:
        wait_for_tells(proc, run, HOLD_AFTER)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=60)
    assert proc.returncode == -signal.SIGKILL
    assert finished(run) < TRIALS  # killed mid-sweep
    unlogged = unlogged_tells(run)  # told as the kill came, the line cut off: one at most
    assert len(unlogged) <= 1, unlogged
    hold.delenv("HFSWEEP_TEST_HOLD_LOG")

    with reaped(_start_engine(door, folder, resume=True)) as resumed:
        _out, err = resumed.communicate(timeout=300)
    assert resumed.returncode == 0, err
    trials = check_final_study(run, TRIALS, unlogged)  # the shared helper: told once, by the log
    log = (run / "sweep.log").read_text()
    outcome = Outcome(
        states={str(t.number): t.state.name for t in trials},
        told=Counter(re.findall(TOLD_LINE, log)) + Counter(str(n) for n in unlogged),
        refilled={str(t.number) for t in trials if t.user_attrs.get("start_step", 0) > 0},
        resumed=re.search(r"array \d+ \(.*\): resuming with", log) is not None,
    )
    for t in trials:
        again = hs.retrain(run, t.number, task=TOY_TASK)
        outcome.alone.append((str(t.number), again.recorded, again.result.history))
    return outcome


# ---------------------------------------------------------------- the Tune plugin
def _tune_lifecycle(folder: Path) -> Outcome:
    pytest.importorskip("ray.tune.search.optuna")
    from hfsweep.schedulers.tune import member_results, sweep_state

    sys.path.insert(0, str(TESTS / "tune"))
    try:
        import _tune_lifecycle as tl
        import _tune_toy
    finally:
        sys.path.remove(str(TESTS / "tune"))
    path = os.pathsep.join([str(TESTS / "tune"), os.environ.get("PYTHONPATH", "")])
    script = "import _tune_lifecycle as t; t.main()"
    kw: dict[str, Any] = {"session": True, "env": {"PYTHONPATH": path}}
    with reaped(start_python(["-c", script, "run", str(folder), "3"], folder, **kw)) as first:
        _out, err = first.communicate(timeout=300)
    assert first.returncode == -signal.SIGKILL, err
    experiment = folder / tl.NAME
    with reaped(start_python(["-c", script, "restore", str(folder)], folder, **kw)) as restored:
        _out, err = restored.communicate(timeout=300)
    assert restored.returncode == 0, err

    table = member_results(experiment)
    state = sweep_state(experiment)
    arrays = state["arrays"].values()
    outcome = Outcome(
        states=dict(zip(table["member"], table["state"], strict=True)),
        # told once over both processes: the sweep saves itself before its searcher hears
        # anything, and a restore goes on from that save when Tune's is older
        told=Counter(line.split()[1] for line in _lines(folder / "told.log")),
        refilled={m for a in arrays for m in a["given"] if m not in a["returned"]},
        resumed=any(a["resumes"] for a in arrays),
    )
    # told once to the searcher the experiment ends with (its Optuna study)
    study, by_member = tl.final_study(str(experiment))
    assert len(study.trials) == len(outcome.states)
    told = {m: study.trials[t.number].state.name for m, t in by_member.items()}
    assert told == outcome.states
    # members that started an array train as alone (a refilled one sees other shuffles)
    trainer = hs.ArrayTrainer(_tune_toy.TASK)
    history = dict(zip(table["member"], table["history"], strict=True))
    for member in (m for a in arrays for m in a["members"]):
        alone = trainer.run([hs.Member(member, state["members"][member]["config"])])[0]
        outcome.alone.append((member, history[member], alone.history))
    return outcome


def _lines(path: Path) -> list[str]:
    return path.read_text().splitlines() if path.exists() else []


# ---------------------------------------------------------------- the cases
CASES = [
    pytest.param("local", "cli", id="local-cli"),
    pytest.param("local", "api", id="local-api"),
    pytest.param("local-alternate", "cli", id="local-alternate-cli"),
    pytest.param("ray", "cli", id="ray-cli"),
    pytest.param("ray-alternate", "cli", id="ray-alternate-cli"),
    pytest.param("ray", "api", id="ray-api"),
    pytest.param("ray", "tune", id="ray-tune"),
]


@pytest.mark.parametrize(("executor", "door"), CASES)
def test_a_killed_sweep_resumes_to_the_same_end(
    executor: str, door: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    if executor.startswith("ray"):
        pytest.importorskip("ray")
    if door == "tune":
        outcome = _tune_lifecycle(tmp_path)
    else:
        outcome = _engine_lifecycle(door, executor, tmp_path, monkeypatch)
    check(outcome, TRIALS)
