"""The CPU thread count the trainer trains with: the idle cores, chosen at the start and again at
every evaluation boundary, never above torch's own setting, which is set back at the end."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from _tasks import make_task

import hfsweep as hs
from hfsweep.training import _threads


@pytest.fixture
def four_cores(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """A process on 4 cores with torch at 4 threads (set back afterwards), the variable unset."""
    before = torch.get_num_threads()
    monkeypatch.setattr(_threads, "_cores", lambda: 4)
    monkeypatch.delenv(_threads.ENV, raising=False)
    torch.set_num_threads(4)
    yield
    torch.set_num_threads(before)


def test_choose_threads_takes_the_idle_cores_within_torchs_setting() -> None:
    assert _threads.choose_threads(ceiling=4, cores=4, others=0) == 4
    assert _threads.choose_threads(ceiling=4, cores=4, others=1) == 3
    assert _threads.choose_threads(ceiling=2, cores=2, others=2) == 1
    assert _threads.choose_threads(ceiling=2, cores=2, others=9) == 1
    assert _threads.choose_threads(ceiling=2, cores=8, others=1) == 2  # never above torch's
    assert _threads.choose_threads(ceiling=3, cores=4, others=None) == 3  # unknown load


def test_others_running_is_the_machines_runnable_threads_less_this_process(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    stat = tmp_path / "stat"
    stat.write_text("cpu  1 2 3\nctxt 99\nprocs_running 5\nprocs_blocked 0\n")
    assert _threads._procs_running(stat) == 5
    assert _threads._procs_running(tmp_path / "missing") is None
    tasks = tmp_path / "task"
    for tid, state in [(1, "R"), (2, "S"), (3, "R")]:
        (tasks / str(tid)).mkdir(parents=True)
        # a thread name with a space and a parenthesis: the state follows the last ')'
        (tasks / str(tid) / "stat").write_text(f"{tid} (pt main) x) {state} 1 2 3\n")
    assert _threads._own_running(tasks) == 2
    monkeypatch.setattr(_threads, "_procs_running", lambda: 5)
    monkeypatch.setattr(_threads, "_own_running", lambda: 2)
    assert _threads.others_running() == 3
    monkeypatch.setattr(_threads, "_procs_running", lambda: None)
    assert _threads.others_running() is None


def _threads_seen(monkeypatch: pytest.MonkeyPatch, others: list[int]) -> list[int]:
    """Train a toy array for 3 epochs while other processes have ``others`` threads ready to
    run at each decision (start, then each boundary); torch's thread count at each report."""
    load = iter(others)
    monkeypatch.setattr(_threads, "others_running", lambda: next(load))
    seen: list[int] = []

    def report(evals: list[hs.Evaluation]) -> dict[str, bool]:
        seen.append(torch.get_num_threads())
        return {e.member: True for e in evals}

    members = [hs.Member(f"t{i}", {"seed": i, "epochs": 3}) for i in range(2)]
    hs.ArrayTrainer(make_task(), dtype=torch.float64).run(members, report=report)
    return seen


def test_the_trainer_trains_with_the_idle_cores_and_sets_torchs_count_back(
    four_cores: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    # busy at the start, quiet after the first epoch, half busy after the second
    assert _threads_seen(monkeypatch, [4, 0, 2, 0]) == [1, 4, 2]
    assert torch.get_num_threads() == 4


def test_the_variable_fixes_the_count_or_leaves_torchs(
    four_cores: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(_threads.ENV, "torch")
    assert _threads_seen(monkeypatch, [4, 4, 4, 4]) == [4, 4, 4]
    monkeypatch.setenv(_threads.ENV, "2")
    assert _threads_seen(monkeypatch, [0, 0, 0, 0]) == [2, 2, 2]
    assert torch.get_num_threads() == 4
    monkeypatch.setenv(_threads.ENV, "many")
    with pytest.raises(ValueError, match=r"HFSWEEP_CPU_THREADS='many' \(environment\)"):
        _threads_seen(monkeypatch, [0])


def test_overlapping_runs_set_torchs_count_back_once_the_last_ends(four_cores: None) -> None:
    with _threads.training_threads(lambda: 3) as outer:
        assert outer.current == 1 and torch.get_num_threads() == 1
        with _threads.training_threads(lambda: 0) as inner:
            assert inner.ceiling == 4 and inner.current == 4  # torch's count from before both
    assert torch.get_num_threads() == 4
