"""sweep.yaml input that PyYAML or the schema used to accept silently: keys given twice and
budgets no machine could run."""

from __future__ import annotations

from pathlib import Path

import pytest

from hfsweep.cli import main
from hfsweep.config import ConfigError, load_sweep

HEAD = "task: digits_mlp\nsearch_space: sgd_momentum\nmetric: val_accuracy\n"
GOOD = HEAD + "budget: {trials: 4, epochs: 2}\nmode: max\n"


def write(folder: Path, text: str, name: str = "sweep.yaml") -> Path:
    path = folder / name
    path.write_text(text, encoding="utf-8")
    return path


# ---------------------------------------------------------------------------- duplicate keys
DUPLICATES = [
    # id, sweep file, YAML path, lines
    ("top-level", GOOD + "mode: min\n", "mode", (5, 6)),
    (
        "nested",
        HEAD + "mode: max\nbudget:\n  trials: 4\n  epochs: 2\n  trials: 9\n",
        "budget.trials",
        (6, 8),
    ),
    (
        "flow-mapping",
        HEAD + "mode: max\nbudget: {trials: 4, epochs: 2, epochs: 3}\n",
        "budget.epochs",
        (5, 5),
    ),
    (
        "search-space",
        HEAD.replace("search_space: sgd_momentum\n", "")
        + "mode: max\nbudget: {trials: 4, epochs: 2}\nsearch_space:\n"
        "  lr: {type: float, low: 0.01, high: 0.1}\n"
        "  momentum:\n    type: float\n    low: 0.0\n    high: 0.9\n    low: 0.5\n",
        "search_space.momentum.low",
        (9, 11),
    ),
    (
        "options",
        GOOD + "searcher:\n  name: tpe\n  options: {constant_liar: true}\n"
        "scheduler: {name: asha, options: {grace_period: 1, grace_period: 2}}\n",
        "scheduler.options.grace_period",
        (9, 9),
    ),
    (
        "in-a-list",
        GOOD + "config:\n  layers:\n    - {w: 1}\n    - {w: 1, w: 2}\n",
        "config.layers[1].w",
        (9, 9),
    ),
    ("numbers-that-are-equal", GOOD + "config:\n  1: a\n  1.0: b\n", "config.1.0", (7, 8)),
]


@pytest.mark.parametrize(
    ("text", "path", "lines"), [d[1:] for d in DUPLICATES], ids=[d[0] for d in DUPLICATES]
)
def test_a_key_given_twice_is_refused_with_its_path_and_both_lines(
    tmp_path: Path, text: str, path: str, lines: tuple[int, int]
) -> None:
    file = write(tmp_path, text)
    with pytest.raises(ConfigError) as info:
        load_sweep(file)
    exc = info.value
    assert (exc.file, exc.path) == (str(file), path), str(exc)
    key = "1.0" if path == "config.1.0" else path.rsplit(".", 1)[-1]
    assert f"key {key} is given twice" in exc.problem.replace("'", ""), exc.problem
    first, second = lines
    where = f"both on line {first}" if first == second else f"on lines {first} and {second}"
    assert where in exc.problem, exc.problem


def test_mode_max_then_min_exits_2_naming_both_lines(tmp_path: Path, monkeypatch, capsys) -> None:
    """The issue's case: the later ``mode: min`` used to win, minimising val_accuracy."""
    monkeypatch.chdir(tmp_path)
    write(tmp_path, GOOD + "mode: min\n")
    assert main(["validate", "sweep.yaml"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("hfsweep validate: sweep.yaml: mode: key 'mode' is given twice")
    assert "on lines 5 and 6" in err
    assert main(["run", "sweep.yaml"]) == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["sweep.yaml"]


def test_a_key_given_twice_in_a_space_file_names_that_file(tmp_path: Path) -> None:
    write(
        tmp_path,
        "lr: {type: float, low: 0.01, high: 0.1}\nlr: {type: float, low: 0.1, high: 0.5}\n",
        "space.yaml",
    )
    file = write(tmp_path, GOOD.replace("sgd_momentum", "space.yaml"))
    with pytest.raises(ConfigError) as info:
        load_sweep(file)
    assert info.value.path == "search_space.lr"
    assert info.value.problem.startswith(f"in {tmp_path / 'space.yaml'}: key 'lr' is given twice")
    assert "on lines 1 and 2" in info.value.problem


def test_merge_keys_may_still_override_what_they_bring_in(tmp_path: Path) -> None:
    """``<<: *anchor`` followed by one of the anchor's keys is an override, not a duplicate."""
    text = (
        HEAD.replace("search_space: sgd_momentum\n", "")
        + "mode: max\nbudget: {trials: 4, epochs: 2}\n"
        "search_space:\n"
        "  lr: &range {type: float, low: 0.01, high: 0.1}\n"
        "  momentum:\n    <<: *range\n    low: 0.0\n    high: 0.9\n"
    )
    sweep = load_sweep(write(tmp_path, text))
    momentum = sweep.space["momentum"]
    assert (momentum.low, momentum.high) == (0.0, 0.9)  # type: ignore[attr-defined]
    assert sweep.space["lr"].low == 0.01  # type: ignore[attr-defined]


# ---------------------------------------------------------------------------- budgets
def budget(text: str) -> str:
    return HEAD + f"mode: max\nbudget: {text}\n"


BUDGETS = [
    # id, budget, YAML path, message fragment
    ("trials-exponent", "{trials: 1e23, epochs: 1}", "budget.trials", "1e+23 (float) is not an"),
    ("trials-fraction", "{trials: 2.5, epochs: 1}", "budget.trials", "write a whole number"),
    (
        "trials-huge",
        "{trials: 100000000000000000000000, epochs: 1}",
        "budget.trials",
        "is more than 1,000,000 trials",
    ),
    ("trials-one-too-many", "{trials: 1000001, epochs: 1}", "budget.trials", "at most 1,000,000"),
    ("epochs-huge", "{trials: 4, epochs: 100001}", "budget.epochs", "more than 100,000 epochs"),
    ("steps-huge", "{trials: 4, steps: 1000000001}", "budget.steps", "1,000,000,000 steps"),
    ("steps-float", "{trials: 4, steps: 1.0e3}", "budget.steps", "1000.0 (float) is not an"),
    (
        "time-huge",
        "{trials: 4, epochs: 1, time_limit: 1e12}",
        "budget.time_limit",
        "longer than a year",
    ),
    (
        "time-huge-string",
        "{trials: 4, epochs: 1, time_limit: 9000h}",
        "budget.time_limit",
        "'9000h' (32,400,000 s) is longer than a year",
    ),
]


@pytest.mark.parametrize(
    ("text", "path", "fragment"), [b[1:] for b in BUDGETS], ids=[b[0] for b in BUDGETS]
)
def test_absurd_budgets_are_refused_with_their_path(
    tmp_path: Path, text: str, path: str, fragment: str
) -> None:
    with pytest.raises(ConfigError) as info:
        load_sweep(write(tmp_path, budget(text)))
    assert info.value.path == path, str(info.value)
    assert fragment in info.value.problem, info.value.problem


def test_the_largest_budgets_are_accepted(tmp_path: Path) -> None:
    sweep = load_sweep(write(tmp_path, budget("{trials: 1000000, steps: 1000000000}")))
    assert (sweep.budget.trials, sweep.budget.steps) == (1_000_000, 1_000_000_000)
    sweep = load_sweep(write(tmp_path, budget("{trials: 1, epochs: 100000, time_limit: 8784h}")))
    assert (sweep.budget.epochs, sweep.budget.time_limit_s) == (100_000, 8784 * 3600.0)


@pytest.mark.parametrize(
    ("text", "line"),
    [
        ("{trials: 4, epochs: 2}", "4 trials of 2 epochs each, time limit unbounded"),
        (
            "{trials: 4, epochs: 2, time_limit: 90}",
            "4 trials of 2 epochs each, time limit 90 s (1m30s)",
        ),
        (
            "{trials: 4, steps: 50, time_limit: 1h30m}",
            "4 trials of 50 steps each, time limit 5400 s (1h30m)",
        ),
        ("{trials: 4, steps: 50, time_limit: 20s}", "4 trials of 50 steps each, time limit 20 s"),
    ],
)
def test_validate_says_unbounded_where_there_is_no_time_limit(
    tmp_path: Path, monkeypatch, capsys, text: str, line: str
) -> None:
    monkeypatch.chdir(tmp_path)
    write(tmp_path, budget(text))
    assert main(["validate", "sweep.yaml"]) == 0
    assert f"\n  {line}\n" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("item", "fragment"),
    [
        ("layers={w: 1, w: 2}", "key 'w' is given twice (both on line 1)"),
        ("layers=[", "the value is not valid YAML (while parsing"),
    ],
)
def test_profile_set_values_are_read_like_a_sweep_file(
    tmp_path: Path, monkeypatch, capsys, item: str, fragment: str
) -> None:
    monkeypatch.chdir(tmp_path)
    assert main(["profile", "digits_mlp", "--set", item, "--no-plot", "--no-cache"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"hfsweep profile: --set {item!r}: ") and fragment in err, err
    assert list(tmp_path.iterdir()) == []
