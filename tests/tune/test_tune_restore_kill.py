"""``Tuner.restore`` after SIGKILLs of the Tune driver keeps every end told before each kill.

One fused experiment (16 members of the toy task, arrays of 4, OptunaSearch + ASHA) runs in a
process that kills itself (SIGKILL) at a seeded call to its inner searcher, is restored with
``Tuner.restore`` in a fresh process that is killed again, five times, and then runs to the end
(tests/tune/_tune_killed.py). Tune saves the experiment either at every step or only at its
first (also seeded), so a restore finds Tune's save behind the kill by up to the whole process.
In the end: every end the inner searcher was told keeps its state and value; every member it
was asked for is in the results, ended; no searcher was told an end it had heard; each
member's evaluations count up once.
"""

from __future__ import annotations

import math
import os
import random
import signal
from collections import Counter
from pathlib import Path

import pytest

pytest.importorskip("ray.tune.search.optuna")

from _tune_lifecycle import final_study
from hfsweep.schedulers.tune import member_results
from sweep._killed import reaped, start_python

TESTS = Path(__file__).resolve().parent

pytestmark = [
    pytest.mark.slow,  # six processes, each starting a local Ray (a few minutes on 2 cores)
    pytest.mark.timeout(1200),
    pytest.mark.skipif(not hasattr(signal, "SIGKILL"), reason="needs POSIX signals"),
]

KILLS = 5
SEED = 46


def _lines(path: Path) -> list[list[str]]:
    return [line.split() for line in path.read_text().splitlines()] if path.exists() else []


def test_a_restore_after_each_sigkill_keeps_every_end_told_before_it(tmp_path: Path) -> None:
    rng = random.Random(SEED)
    path = os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")])
    script = "import _tune_killed as t; t.main()"
    kw = {"session": True, "env": {"PYTHONPATH": path}}
    for stage in range(KILLS + 1):
        kill_at = rng.randint(1, 8) if stage < KILLS else 0
        period = rng.choice(["0", "3600"])
        args = ["-c", script, str(tmp_path), str(stage), str(kill_at), period]
        with reaped(start_python(args, tmp_path, **kw)) as proc:
            _out, err = proc.communicate(timeout=300)
        if stage < KILLS:
            assert proc.returncode == -signal.SIGKILL, (stage, err[-3000:])
        else:
            assert proc.returncode == 0, err[-3000:]
    assert len(_lines(tmp_path / "kills.log")) == KILLS

    table = member_results(tmp_path / "killed").set_index("member")
    assert len(table) == 16
    assert set(table["state"]) <= {"COMPLETE", "PRUNED", "FAIL"}, Counter(table["state"])
    # every member the searcher was asked for, in any process, is in the results
    suggested = {m for _pid, m in _lines(tmp_path / "suggested.log")}
    assert suggested == set(table.index)
    # every end told, in any process, is the member's end, with its value
    told = _lines(tmp_path / "told.log")
    assert {m for _pid, m, _state, _value in told} == set(table.index)
    for _pid, member, state, value in told:
        assert table.loc[member, "state"] == state, (member, told)
        if state != "FAIL":
            assert math.isclose(float(value), table.loc[member, "value"], rel_tol=1e-12), member
    # no searcher was told twice: per process, and by the searcher's own record, restored
    # with it through every save
    assert not _lines(tmp_path / "twice.log"), _lines(tmp_path / "twice.log")
    per_process = Counter((pid, m) for pid, m, _state, _value in told)
    assert set(per_process.values()) == {1}, per_process
    # the searcher the experiment ends with holds each member once, as the results say
    study, by_member = final_study(str(tmp_path / "killed"))
    assert sorted(by_member) == sorted(table.index)
    assert len(study.trials) == 16
    states = {m: study.trials[t.number].state.name for m, t in by_member.items()}
    assert states == dict(table["state"])
    # members trained again after a kill count their evaluations once
    for member, history in table["history"].items():
        iterations = [h["training_iteration"] for h in history]
        assert iterations == list(range(1, len(history) + 1)), (member, iterations)
