"""A sweep file cannot make hfsweep hang or crash: YAML aliases that would expand past a bound
(a "billion laughs"), nesting past a depth, and files past a size are refused (exit 2, naming the
file and the bound), and checking a sweep is linear in its keys (a space of 10,000 params)."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest
from hfsweep.search_spaces import _yaml

import hfsweep as hs
from hfsweep.cli import main
from hfsweep.config import ConfigError, load_sweep, parse_sweep
from hfsweep.core._dryrun import _configs

from ._toy import _data, _model

HEAD = """task: digits_mlp
search_space: sgd_momentum
budget: {trials: 2, epochs: 1}
metric: val_accuracy
mode: max
"""


def _bomb(levels: int = 9) -> str:
    """Anchors of ten aliases of the anchor before: 10**levels leaves from a few hundred bytes."""
    lines = ['l0: &l0 "lol"']
    for i in range(1, levels + 1):
        lines.append(f"l{i}: &l{i} [{', '.join([f'*l{i - 1}'] * 10)}]")
    return "\n".join(f"  {line}" for line in lines) + "\n"


def _refused(tmp_path: Path, text: str, capsys: pytest.CaptureFixture[str]) -> str:
    """The message ``validate --file-only`` and ``run`` exit 2 with, the same for both."""
    file = tmp_path / "sweep.yaml"
    file.write_text(text)
    with pytest.raises(ConfigError) as info:
        load_sweep(file)
    assert info.value.file == str(file)
    for command in (["validate", "--file-only", str(file)], ["run", str(file)]):
        assert main(command) == 2
        err = capsys.readouterr().err
        assert str(file) in err and "Traceback" not in err
    assert not (tmp_path / "runs").exists()
    return str(info.value)


def test_an_alias_bomb_in_config_is_refused_naming_the_bound(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    message = _refused(tmp_path, HEAD + "config:\n" + _bomb(), capsys)
    assert f"more than {_yaml.MAX_ALIAS_NODES:,} nodes" in message
    assert "*l" in message and "line" in message


def test_aliases_within_the_bound_still_load(tmp_path: Path) -> None:
    file = tmp_path / "sweep.yaml"
    file.write_text(HEAD.replace("search_space: sgd_momentum\n", "") + "search_space:\n"
                    "  lr: &range {type: float, low: 0.01, high: 0.1}\n"
                    "  weight_decay: *range\n")  # fmt: skip
    sweep = load_sweep(file)
    assert sweep.space["lr"] == sweep.space["weight_decay"].__class__("lr", low=0.01, high=0.1)


def test_a_recursive_alias_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    message = _refused(tmp_path, HEAD + "config: &c {hidden: [*c]}\n", capsys)
    assert "refers to a node that contains it" in message


@pytest.mark.parametrize("flow", [True, False])
def test_deep_nesting_is_refused_naming_the_depth(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], flow: bool
) -> None:
    if flow:  # 10,000 levels, as in the report (block style would need 50 MB of indentation)
        nested = "[" * 10_000 + "]" * 10_000
    else:
        nested = "\n" + "".join(" " * (i + 4) + "- \n" for i in range(300))
    message = _refused(tmp_path, HEAD + f"config:\n  hidden: {nested}\n", capsys)
    assert f"deeper than {_yaml.MAX_DEPTH} levels" in message


def test_nesting_through_aliases_counts_toward_the_depth(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    lines = ["  a0: &a0 [0]"] + [f"  a{i}: &a{i} [*a{i - 1}]" for i in range(1, 150)]
    message = _refused(tmp_path, HEAD + "config:\n" + "\n".join(lines) + "\n", capsys)
    assert (
        f"deeper than {_yaml.MAX_DEPTH} levels" in message
        and "counting what aliases bring in" in message
    )


def test_a_file_past_the_size_bound_is_not_read(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(_yaml, "MAX_FILE_BYTES", 1024, raising=False)  # not 8 MiB in a test
    message = _refused(tmp_path, HEAD + "# padding\n" * 200, capsys)
    assert "more than 1,024" in message and "bytes" in message


def test_a_space_file_past_the_size_bound_names_that_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(_yaml, "MAX_FILE_BYTES", 1024, raising=False)
    space = tmp_path / "space.yaml"
    space.write_text("lr: 0.1\n" + "# padding\n" * 200)
    with pytest.raises(hs.search_spaces.SpaceError) as info:
        hs.search_spaces.load_space(str(space))
    assert info.value.file == str(space) and "more than 1,024" in str(info.value)


# ---------------------------------------------------------------------------- linear checks
class _TooMany(Exception):
    pass


class _Key(str):
    """A config key that counts the comparisons and hashes made of it (every sort, set and
    dict lookup of keys goes through them), and stops the test past ``budget`` of them."""

    ops = 0
    budget: int | None = None  # None: not counting

    @classmethod
    def _count(cls) -> None:
        cls.ops += 1
        if cls.budget is not None and cls.ops > cls.budget:
            raise _TooMany(f"more than {cls.budget:,} key operations")

    def __hash__(self) -> int:
        self._count()
        return str.__hash__(self)

    def __eq__(self, other: object) -> bool:
        self._count()
        return str.__eq__(self, other)

    def __lt__(self, other: str) -> bool:
        self._count()
        return str.__lt__(self, other)


def _ops_to_check(n: int, budget: int) -> int:
    keys = [_Key(f"k{i:05d}") for i in range(n)]
    task = hs.Task(
        name="wide", model=_model, data=_data, defaults={"hidden": 8, **dict.fromkeys(keys, 0.0)}
    )
    space: Mapping[str, Any] = {key: {"type": "fixed", "value": 0.5} for key in keys}
    space = {**space, "lr": {"type": "float", "low": 1e-3, "high": 0.1}}
    _Key.ops, _Key.budget = 0, budget
    try:  # the file's checks, then the dry run's configs (resolved, split into their keys)
        sweep = parse_sweep(
            {
                "task": task,
                "search_space": space,
                "budget": {"trials": 2, "epochs": 1},
                "metric": "val_loss",
                "mode": "min",
                "searcher": "random",
            }
        )
        configs = _configs(sweep)
    finally:
        _Key.budget = None
    assert configs
    assert len(sweep.space) == n + 1
    return _Key.ops


def test_checking_a_space_of_10000_params_is_linear_in_its_keys() -> None:
    """Each of a space's keys checked against a fresh sort of the task's keys, and each key of
    a config split against a fresh set of the per-member keys, made this quadratic (over 15
    minutes for 10,000 params); every key now costs a bounded number of hashes and
    comparisons, so ten times the keys cost about ten times the operations."""
    per_key = 1_000  # above the few hundred a key costs (22 sampled configs resolve each)
    small = _ops_to_check(1_000, per_key * 1_000)
    large = _ops_to_check(10_000, per_key * 10_000)  # _TooMany if it grows faster than linear
    assert large <= 12 * small


def test_a_set_value_past_a_bound_is_refused_as_the_value() -> None:
    from hfsweep.cli import _parse_sets

    levels = ["&l0 [lol]"] + [f"&l{i} [{', '.join([f'*l{i - 1}'] * 10)}]" for i in range(1, 10)]
    with pytest.raises(ValueError, match=r"--set 'hidden=.*not valid YAML.*more than 100,000"):
        _parse_sets([f"hidden=[{', '.join(levels)}]"])


def test_the_summary_of_a_large_space_lists_a_few_names_and_counts_the_rest(
    tmp_path: Path,
) -> None:
    keys = [f"k{i:05d}" for i in range(1_000)]
    task = hs.Task(name="wide", model=_model, data=_data, defaults=dict.fromkeys(keys, 0.0))
    space = {key: {"type": "float", "low": 0.0, "high": 1.0} for key in keys}
    sweep = parse_sweep(
        {
            "task": task,
            "search_space": space,
            "budget": {"trials": 2, "epochs": 1},
            "metric": "val_loss",
            "mode": "min",
            "searcher": "random",
            "output": str(tmp_path / "run"),
        }
    )
    line = next(x for x in sweep.summary().splitlines() if x.startswith("search space:"))
    assert line.startswith("search space: k00000, k00001, ") and "k00999" not in line
    assert line.endswith("k00039 and 960 more")
