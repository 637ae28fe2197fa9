"""``hs.retrain``: a finished trial trained again alone matches its recorded history, also one
that joined its array by refill; clear errors for trials it cannot retrain."""

from __future__ import annotations

from pathlib import Path

import pytest

import hfsweep as hs

from ._toy import TASK, sweep_config


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, hs.SweepResult]:
    path = tmp_path_factory.mktemp("retrain") / "run"
    config = sweep_config(
        path,
        scheduler={"name": "asha", "options": {"grace_period": 1, "reduction_factor": 2}},
        budget={"trials": 8, "epochs": 3},
        fusion={"size": 3, "device": "cpu", "dtype": "float64"},
    )
    return path, hs.sweep(config, progress=False)


def test_every_trial_retrains_alone_to_its_recorded_history(run) -> None:
    path, result = run
    starts = {t.number: t.user_attrs["start_step"] for t in result.study.trials}
    assert min(starts.values()) == 0 and max(starts.values()) > 0  # some joined by refill
    for number in starts:
        check = hs.retrain(path, number, task=TASK)
        assert check.start_step == starts[number]
        assert check.matches, check.table()
        assert len(check.result.history) == len(check.recorded)
    pruned = [t for t in result.study.trials if t.state.name == "PRUNED"]
    assert pruned and all(
        len(hs.retrain(path, t.number, task=TASK).result.history) < 3 for t in pruned[:1]
    )  # stopped where the sweep stopped it


def test_a_changed_history_does_not_match(run) -> None:
    path, result = run
    number = result.study.trials[0].number
    history = path / "histories" / f"trial-{number}.csv"
    original = history.read_text()
    try:
        lines = original.splitlines()
        header, first = lines[0].split(","), lines[1].split(",")
        column = header.index("val_loss")
        first[column] = str(float(first[column]) * 1.001)
        history.write_text("\n".join([lines[0], ",".join(first), *lines[2:]]) + "\n")
        check = hs.retrain(path, number, task=TASK)
        assert not check.matches
        assert check.max_rel_diff == pytest.approx(1e-3, rel=1e-2)
        assert "DIFFERS" in check.table()
    finally:
        history.write_text(original)


def test_trials_it_cannot_retrain_are_named(run) -> None:
    path, _ = run
    with pytest.raises(ValueError, match="has no trial 99; its trials are numbered 0 to 7"):
        hs.retrain(path, 99, task=TASK)
    with pytest.raises(ValueError, match=r"task was a Python object .* task=your_task"):
        hs.retrain(path, 0)
    missing = path / "histories" / "trial-0.csv"
    saved = missing.read_text()
    missing.unlink()
    try:
        with pytest.raises(ValueError, match=r"trial 0 has no recorded evaluation"):
            hs.retrain(path, 0, task=TASK)
    finally:
        missing.write_text(saved)
