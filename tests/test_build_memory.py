"""``benchmarks/build_memory.py`` at its smallest: the member models the trainer holds at fuse
time are one backbone plus the adapters with ``share_frozen`` on, one backbone per member off."""

from __future__ import annotations

import importlib
import json
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"


@pytest.mark.slow
def test_the_build_holds_one_backbone_with_share_frozen(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("peft")
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    script = importlib.import_module("build_memory")
    monkeypatch.setitem(script.SETTINGS, "d_model", 64)
    monkeypatch.setitem(script.SETTINGS, "layers", 2)
    monkeypatch.setitem(script.SETTINGS, "vocab", 500)
    stem = tmp_path / "build_memory_test"
    assert script.main(["--members", "1", "3", "--out", str(stem)]) == 0
    rows = {
        (r["members"], r["share_frozen"]): r
        for r in json.loads(stem.with_suffix(".json").read_text())["rows"]
    }
    one = rows[(1, True)]["models"]
    assert rows[(1, False)]["models"] == one
    assert rows[(3, False)]["models"] == 3 * one  # three backbones alive at fuse time
    shared = rows[(3, True)]["models"]
    assert one < shared < 1.2 * one  # one backbone, three adapters and heads
    assert rows[(3, True)]["array"] < 1.2 * one  # the fused array keeps the backbone once too
    assert "| 3 | on |" in stem.with_suffix(".md").read_text()
