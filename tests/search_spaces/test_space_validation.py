"""Every way a search space can be wrong gives a SpaceError naming the YAML path, the bad value
and what would be valid."""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any

import pytest
from hfsweep.search_spaces import SearchSpace, SpaceError, load_space

F = "float"
CAT = {"type": "categorical", "choices": ["sgd", "adamw"]}

# (case id, spec, YAML path of the error, fragments the message must contain)
CASES: list[tuple[str, Any, str, list[str]]] = [
    # the space as a whole
    ("not a mapping", [1, 2], "search_space", ["[1, 2]", "not a mapping", "lr: {type: float"]),
    ("empty", {}, "search_space", ["empty", "at least one param"]),
    ("int key", {1: 2}, "search_space", ["key 1 (int)", "not a param name", "strings"]),
    ("null key", {None: 2}, "search_space", ["key None", "not a param name"]),
    ("empty key", {"": 2}, "search_space", ["key ''", "non-empty strings"]),
    # the spec of one param
    (
        "list shorthand",
        {"optimizer": ["sgd", "adamw"]},
        "search_space.optimizer",
        ["['sgd', 'adamw'] is a list", "{type: categorical, choices: [...]}"],
    ),
    (
        "object value",
        {"lr": object},
        "search_space.lr",
        ["neither a param spec", "fixed value (str, int, float, bool or null)"],
    ),
    (
        "no type",
        {"lr": {"low": 0.1, "high": 1.0}},
        "search_space.lr",
        ["has no type", "['float', 'int', 'categorical', 'fixed']", "type: float or type: int"],
    ),
    (
        "no type with choices",
        {"o": {"choices": ["a", "b"]}},
        "search_space.o",
        ["has no type", "type: categorical"],
    ),
    (
        "unknown type",
        {"lr": {"type": "real", "low": 0.1, "high": 1.0}},
        "search_space.lr.type",
        ["'real' is not a param type", "float, int, categorical, fixed"],
    ),
    (
        "misspelt type",
        {"lr": {"type": "flaot", "low": 0.1, "high": 1.0}},
        "search_space.lr.type",
        ["'flaot'", "did you mean 'float'?"],
    ),
    (
        "other tool's type",
        {"lr": {"type": "loguniform", "low": 0.1, "high": 1.0}},
        "search_space.lr.type",
        ["'loguniform'", "type: float with log: true"],
    ),
    (
        "non-string type",
        {"lr": {"type": 1, "low": 0.1, "high": 1.0}},
        "search_space.lr.type",
        ["1 is not a param type"],
    ),
    (
        "unknown float key",
        {"lr": {"type": F, "low": 0.1, "high": 1.0, "lgo": True}},
        "search_space.lr.lgo",
        ["'lgo' is not a key of a float param", "type, low, high, step, log, when", "'log'"],
    ),
    (
        "unknown categorical key",
        {"o": {"type": "categorical", "choice": ["a"]}},
        "search_space.o.choice",
        ["'choice' is not a key of a categorical param", "type, choices, when", "'choices'"],
    ),
    (
        "float key on a fixed param",
        {"e": {"type": "fixed", "value": 1, "low": 0}},
        "search_space.e.low",
        ["not a key of a fixed param", "type, value, when"],
    ),
    (
        "non-string spec key",
        {"lr": {"type": F, 1: 2}},
        "search_space.lr",
        ["key 1 (int) is not a spec key", "type, choices"],
    ),
    # float
    (
        "float missing high",
        {"lr": {"type": F, "low": 0.1}},
        "search_space.lr",
        ["needs low and high", "high is missing"],
    ),
    (
        "float low >= high",
        {"lr": {"type": F, "low": 1.0, "high": 0.1}},
        "search_space.lr.high",
        ["0.1 is not greater than low (1.0)", "high must be > low", "type: fixed"],
    ),
    (
        "float low == high",
        {"lr": {"type": F, "low": 0.5, "high": 0.5}},
        "search_space.lr.high",
        ["0.5 is not greater than low (0.5)"],
    ),
    (
        "float log with low 0",
        {"lr": {"type": F, "low": 0.0, "high": 1.0, "log": True}},
        "search_space.lr.low",
        ["0.0 is not > 0", "log scale needs low > 0"],
    ),
    (
        "float log with negative low",
        {"lr": {"type": F, "low": -1.0, "high": 1.0, "log": True}},
        "search_space.lr.low",
        ["-1.0 is not > 0"],
    ),
    (
        "float string bound",
        {"lr": {"type": F, "low": "1e-4", "high": 1.0}},
        "search_space.lr.low",
        ["'1e-4' (str) is not a number", "write 1.0e-4"],
    ),
    (
        "float bool bound",
        {"lr": {"type": F, "low": 0.0, "high": True}},
        "search_space.lr.high",
        ["True (bool) is not a number"],
    ),
    (
        "float null bound",
        {"lr": {"type": F, "low": None, "high": 1.0}},
        "search_space.lr.low",
        ["None (NoneType) is not a number"],
    ),
    (
        "float infinite bound",
        {"lr": {"type": F, "low": 0.0, "high": float("inf")}},
        "search_space.lr.high",
        ["inf is not finite"],
    ),
    (
        "float log not a bool",
        {"lr": {"type": F, "low": 0.1, "high": 1.0, "log": "yes"}},
        "search_space.lr.log",
        ["'yes' is not true or false"],
    ),
    (
        "float step 0",
        {"m": {"type": F, "low": 0.0, "high": 1.0, "step": 0}},
        "search_space.m.step",
        ["0 is not > 0", "positive number"],
    ),
    (
        "float negative step",
        {"m": {"type": F, "low": 0.0, "high": 1.0, "step": -0.1}},
        "search_space.m.step",
        ["-0.1 is not > 0"],
    ),
    (
        "float step not dividing",
        {"m": {"type": F, "low": 0.0, "high": 0.99, "step": 0.04}},
        "search_space.m.step",
        [
            "0.04 does not divide high - low = 0.99 - 0.0",
            "multiple of step",
            "lower high to 0.96",
            "set high to 0.96 or 1.0",
        ],
    ),
    (
        "float step with log",
        {"lr": {"type": F, "low": 0.1, "high": 1.0, "step": 0.1, "log": True}},
        "search_space.lr.step",
        ["step 0.1 cannot be combined with log: true", "Optuna forbids it"],
    ),
    # int
    (
        "int fractional bound",
        {"hidden": {"type": "int", "low": 32.5, "high": 256}},
        "search_space.hidden.low",
        ["32.5 is not an integer", "integer", "type: float"],
    ),
    (
        "int float bound",
        {"hidden": {"type": "int", "low": 32, "high": 256.0}},
        "search_space.hidden.high",
        ["256.0 is not an integer", "write 256"],
    ),
    (
        "int string bound",
        {"hidden": {"type": "int", "low": "32", "high": 256}},
        "search_space.hidden.low",
        ["'32' (str) is not a number"],
    ),
    (
        "int low >= high",
        {"depth": {"type": "int", "low": 4, "high": 1}},
        "search_space.depth.high",
        ["1 is not greater than low (4)"],
    ),
    (
        "int log with low 0",
        {"hidden": {"type": "int", "low": 0, "high": 256, "log": True}},
        "search_space.hidden.low",
        ["0 is not >= 1", "log scale needs low >= 1"],
    ),
    (
        "int step 0",
        {"depth": {"type": "int", "low": 1, "high": 4, "step": 0}},
        "search_space.depth.step",
        ["0 is not > 0", "positive integer"],
    ),
    (
        "int fractional step",
        {"depth": {"type": "int", "low": 1, "high": 4, "step": 0.5}},
        "search_space.depth.step",
        ["0.5 is not an integer"],
    ),
    (
        "int step with log",
        {"hidden": {"type": "int", "low": 32, "high": 256, "step": 32, "log": True}},
        "search_space.hidden.step",
        ["step 32 cannot be combined with log: true", "only step 1"],
    ),
    (
        "int step not dividing",
        {"hidden": {"type": "int", "low": 32, "high": 250, "step": 32}},
        "search_space.hidden.step",
        ["32 does not divide high - low = 218", "set high to 224 or 256"],
    ),
    # categorical
    (
        "no choices",
        {"o": {"type": "categorical"}},
        "search_space.o",
        ["needs choices"],
    ),
    (
        "empty choices",
        {"o": {"type": "categorical", "choices": []}},
        "search_space.o.choices",
        ["[] is empty", "at least one value"],
    ),
    (
        "choices not a list",
        {"o": {"type": "categorical", "choices": "sgd"}},
        "search_space.o.choices",
        ["'sgd' (str) is not a list", "[sgd, adamw]"],
    ),
    (
        "duplicate choices",
        {"o": {"type": "categorical", "choices": ["sgd", "adamw", "sgd"]}},
        "search_space.o.choices[2]",
        ["'sgd' equals choices[0] ('sgd')", "distinct"],
    ),
    (
        "choices equal in Python",
        {"o": {"type": "categorical", "choices": [1, True]}},
        "search_space.o.choices[1]",
        ["True equals choices[0] (1) in Python", "Optuna cannot tell them apart"],
    ),
    (
        "int and float choice",
        {"o": {"type": "categorical", "choices": [1, 1.0]}},
        "search_space.o.choices[1]",
        ["1.0 equals choices[0] (1) in Python"],
    ),
    (
        "list choice",
        {"o": {"type": "categorical", "choices": ["a", [1, 2]]}},
        "search_space.o.choices[1]",
        ["[1, 2] (list) is not a valid choice", "str, int, float (not NaN), bool or null"],
    ),
    (
        "mapping choice",
        {"o": {"type": "categorical", "choices": [{"a": 1}]}},
        "search_space.o.choices[0]",
        ["(mapping) is not a valid choice"],
    ),
    (
        "nan choice",
        {"o": {"type": "categorical", "choices": [0.5, float("nan")]}},
        "search_space.o.choices[1]",
        ["nan (float) is not a valid choice"],
    ),
    # fixed
    ("fixed without value", {"e": {"type": "fixed"}}, "search_space.e", ["needs value"]),
    # when
    (
        "when not a mapping",
        {"o": CAT, "b": {"type": F, "low": 0.1, "high": 0.9, "when": "adamw"}},
        "search_space.b.when",
        ["'adamw' is not a non-empty mapping", "{optimizer: adamw}"],
    ),
    (
        "when empty",
        {"o": CAT, "b": {"type": F, "low": 0.1, "high": 0.9, "when": {}}},
        "search_space.b.when",
        ["{} is not a non-empty mapping"],
    ),
    (
        "when non-string key",
        {"o": CAT, "b": {"type": F, "low": 0.1, "high": 0.9, "when": {1: "a"}}},
        "search_space.b.when",
        ["key 1 (int) is not a param name"],
    ),
    (
        "when empty list",
        {"o": CAT, "b": {"type": F, "low": 0.1, "high": 0.9, "when": {"o": []}}},
        "search_space.b.when.o",
        ["[] lists no value"],
    ),
    (
        "when non-scalar value",
        {"o": CAT, "b": {"type": F, "low": 0.1, "high": 0.9, "when": {"o": ["sgd", {"a": 1}]}}},
        "search_space.b.when.o[1]",
        ["is not a value a param can be tested for", "str, int, float, bool or null"],
    ),
    (
        "when unknown key",
        {"optimizer": CAT, "b": {"type": F, "low": 0.1, "high": 0.9, "when": {"optimzer": "sgd"}}},
        "search_space.b.when.optimzer",
        ["'optimzer' is not a param of the space", "when may name: optimizer"],
    ),
    (
        "when unknown categorical value",
        {"o": CAT, "b": {"type": F, "low": 0.1, "high": 0.9, "when": {"o": "adam"}}},
        "search_space.b.when.o",
        ["'adam' is not a value 'o' can take", "one of ['sgd', 'adamw']"],
    ),
    (
        "when one bad value in a list",
        {"o": CAT, "b": {"type": F, "low": 0.1, "high": 0.9, "when": {"o": ["sgd", "rmsprop"]}}},
        "search_space.b.when.o",
        ["'rmsprop' is not a value 'o' can take"],
    ),
    (
        "when bool for an int choice",
        {
            "o": {"type": "categorical", "choices": [0, 1]},
            "b": {"type": "fixed", "value": 1, "when": {"o": True}},
        },
        "search_space.b.when.o",
        ["True is not a value 'o' can take", "[0, 1]"],
    ),
    (
        "when other fixed value",
        {"bs": 64, "b": {"type": "fixed", "value": 1, "when": {"bs": 32}}},
        "search_space.b.when.bs",
        ["32 is not a value 'bs' can take", "only its fixed value 64"],
    ),
    (
        "when int out of range",
        {
            "depth": {"type": "int", "low": 1, "high": 4},
            "w": {"type": "fixed", "value": 1, "when": {"depth": 5}},
        },
        "search_space.w.when.depth",
        ["5 is not a value 'depth' can take", "int[1, 4]"],
    ),
    (
        "when int off its step",
        {
            "depth": {"type": "int", "low": 1, "high": 5, "step": 2},
            "w": {"type": "fixed", "value": 1, "when": {"depth": 2}},
        },
        "search_space.w.when.depth",
        ["2 is not a value 'depth' can take", "step 2"],
    ),
    (
        "when on a float",
        {
            "lr": {"type": F, "low": 0.1, "high": 1.0},
            "w": {"type": "fixed", "value": 1, "when": {"lr": 0.5}},
        },
        "search_space.w.when.lr",
        ["'lr' is a float param", "categorical, int or fixed"],
    ),
    (
        "when on itself",
        {"o": {"type": "categorical", "choices": ["a", "b"], "when": {"o": "a"}}},
        "search_space.o.when.o",
        ["'o' is conditional on itself"],
    ),
    (
        "cycle of two",
        {
            "a": {"type": "categorical", "choices": [1, 2], "when": {"b": "x"}},
            "b": {"type": "categorical", "choices": ["x", "y"], "when": {"a": 1}},
        },
        "search_space.a.when.b",
        ["conditions form a cycle (a -> b -> a", "remove one of these conditions"],
    ),
    (
        "cycle of three behind a free param",
        {
            "free": {"type": "categorical", "choices": [1, 2]},
            "a": {"type": "categorical", "choices": [1, 2], "when": {"c": 1, "free": 1}},
            "b": {"type": "categorical", "choices": [1, 2], "when": {"a": 1}},
            "c": {"type": "categorical", "choices": [1, 2], "when": {"b": 2}},
        },
        "search_space.a.when.c",
        ["cycle (a -> c -> b -> a"],
    ),
    (
        "chain that can never hold",
        {
            "optimizer": CAT,
            "b": {"type": "categorical", "choices": [1, 2], "when": {"optimizer": "sgd"}},
            "c": {"type": F, "low": 0.1, "high": 0.9, "when": {"b": 1, "optimizer": "adamw"}},
        },
        "search_space.c.when",
        [
            "'c' can never be drawn",
            "b.when needs optimizer in ['sgd']",
            "c.when needs optimizer in ['adamw']",
        ],
    ),
]


@pytest.mark.parametrize(
    ("spec", "path", "fragments"), [c[1:] for c in CASES], ids=[c[0] for c in CASES]
)
def test_invalid_space(spec: Any, path: str, fragments: list[str]) -> None:
    with pytest.raises(SpaceError) as info:
        SearchSpace.from_dict(spec)
    err = info.value
    assert err.path == path
    assert str(err).startswith(f"{path}: ")
    for fragment in fragments:
        assert fragment in str(err), (fragment, str(err))
    assert isinstance(err, ValueError)


def test_error_paths_use_the_callers_prefix() -> None:
    spec = {"lr": {"type": "float", "low": 0.0, "high": 1.0, "log": True}}
    with pytest.raises(SpaceError, match=r"^sweeps\[2\]\.space\.lr\.low: 0\.0 is not > 0"):
        SearchSpace.from_dict(spec, path="sweeps[2].space")
    with pytest.raises(SpaceError, match=r"^lr\.low: ") as info:
        SearchSpace.from_dict(spec, path="")
    assert info.value.path == "lr.low" and info.value.file is None


def test_error_survives_pickling() -> None:
    with pytest.raises(SpaceError) as info:
        SearchSpace.from_dict({"lr": {"type": "float", "low": 1.0, "high": 0.1}})
    copy = pickle.loads(pickle.dumps(info.value))
    assert isinstance(copy, SpaceError)
    assert (copy.path, copy.file, str(copy)) == (info.value.path, None, str(info.value))


def test_valid_edge_cases() -> None:
    space = SearchSpace.from_dict(
        {
            "m": {"type": "float", "low": 0.0, "high": 0.99, "step": 0.03},  # 33 steps exactly
            "w": {"type": "float", "low": 0, "high": 1},  # int bounds for a float param
            "h": {"type": "int", "low": 32, "high": 256, "step": 32},
            "one": {"type": "categorical", "choices": ["only"]},
            "o": {"type": "categorical", "choices": [0.0, 0.5, None, "x", True]},
            "d": {"type": "fixed", "value": 0.1, "when": {"o": [0, None]}},  # 0 matches 0.0
            "e": {"type": "fixed", "value": [64, 64]},
            "f": None,
        }
    )
    assert space["w"].to_spec() == {"type": "float", "low": 0.0, "high": 1.0}
    assert space["d"].when == {"o": (0, None)}
    assert space.fixed == {"e": [64, 64], "f": None}


# ---------------------------------------------------------------------------- files
def test_from_yaml_reads_exponents_as_floats(tmp_path: Path) -> None:
    file = tmp_path / "space.yaml"
    file.write_text("lr: {type: float, low: 1e-4, high: 1, log: true}\nwd: 1E-5\neps: -1e+2\n")
    space = SearchSpace.from_yaml(file)
    assert space.to_dict() == {
        "lr": {"type": "float", "low": 1e-4, "high": 1.0, "log": True},
        "wd": 1e-5,
        "eps": -100.0,
    }


@pytest.mark.parametrize(
    ("text", "path", "fragments"),
    [
        ("lr: {type: float, low: 1.0, high\n", "", ["not valid YAML at line 2", "mapping"]),
        ("", "", ["the file is empty"]),
        ("- lr\n- wd\n", "", ["['lr', 'wd'] (list) is not a mapping"]),
        ("lr: {type: float, low: 0, high: 1, log: true}\n", "lr.low", ["0 is not > 0"]),
        (
            "o: {type: categorical, choices: [a, b]}\nx: {type: fixed, value: 1, when: {o: c}}\n",
            "x.when.o",
            ["'c' is not a value 'o' can take"],
        ),
    ],
    ids=["bad syntax", "empty", "a list", "bad param", "bad condition"],
)
def test_from_yaml_errors_name_the_file(
    tmp_path: Path, text: str, path: str, fragments: list[str]
) -> None:
    file = tmp_path / "space.yaml"
    file.write_text(text)
    with pytest.raises(SpaceError) as info:
        SearchSpace.from_yaml(file)
    err = info.value
    assert err.file == str(file) and err.path == path
    assert str(err).startswith(f"{file}: {path + ': ' if path else ''}")
    for fragment in fragments:
        assert fragment in str(err), (fragment, str(err))


def test_from_yaml_unreadable(tmp_path: Path) -> None:
    missing = tmp_path / "nope.yaml"
    with pytest.raises(SpaceError, match="cannot read the search-space file") as info:
        SearchSpace.from_yaml(missing)
    assert info.value.file == str(missing)
    with pytest.raises(SpaceError, match="cannot read"):
        SearchSpace.from_yaml(tmp_path)  # a directory
    binary = tmp_path / "bin.yaml"
    binary.write_bytes(b"\xff\xfe\x00lr")
    with pytest.raises(SpaceError, match="UTF-8"):
        SearchSpace.from_yaml(binary)


def test_load_space_errors(tmp_path: Path) -> None:
    with pytest.raises(SpaceError) as info:
        load_space("sgd")
    assert info.value.path == "search_space"
    for name in ("adamw", "sgd_momentum", "sgd_or_adamw", ".yaml file"):
        assert name in str(info.value)
    with pytest.raises(SpaceError, match=r"^sweep\.space: 3 \(int\) is not a search space"):
        load_space(3, path="sweep.space")  # type: ignore[arg-type,unused-ignore]
    with pytest.raises(SpaceError, match="cannot read") as info:
        load_space(str(tmp_path / "missing.yml"))
    with pytest.raises(SpaceError, match=r"^search_space\.lr: "):
        load_space({"lr": [1, 2]})
