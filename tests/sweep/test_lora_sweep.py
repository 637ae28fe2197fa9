"""A LoRA fine-tuning sweep from a sweep file: ``fusion.share_frozen`` is read, checked and
reaches the arrays, and ``examples/lora_asha.yaml`` (the ready ``text_lora`` task, TPE + ASHA
over lr, weight decay, lora_alpha and lora_dropout) runs end to end with a small budget, its
trials of different lora_alpha and lora_dropout in one array."""

from __future__ import annotations

import csv
from pathlib import Path
from typing import Any

import pytest
import yaml

from hfsweep.cli import main
from hfsweep.config import ConfigError, load_sweep, parse_sweep
from hfsweep.fusion import FusedArray

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
BASE: dict[str, Any] = {
    "task": "digits_mlp",
    "search_space": "sgd_momentum",
    "budget": {"trials": 8, "epochs": 3},
    "metric": "val_accuracy",
    "mode": "max",
}


def test_fusion_share_frozen_defaults_to_true_and_is_checked(tmp_path: Path) -> None:
    assert parse_sweep(BASE).fusion.share_frozen is True
    off = parse_sweep({**BASE, "fusion": {"share_frozen": False}})
    assert off.fusion.share_frozen is False
    assert off.to_dict()["fusion"]["share_frozen"] is False
    file = tmp_path / "sweep.yaml"
    file.write_text(yaml.safe_dump({**BASE, "fusion": {"share_frozen": "yes"}}))
    with pytest.raises(ConfigError) as info:
        load_sweep(file)
    assert info.value.path == "fusion.share_frozen"
    assert "'yes' (str) is not true or false" in info.value.problem


def test_the_lora_example_validates_with_its_lora_keys_per_member() -> None:
    sweep = load_sweep(EXAMPLES / "lora_asha.yaml")
    assert sweep.task.name == "text_lora" and sweep.fusion.share_frozen is True
    assert {"lora_alpha", "lora_dropout", "lr", "weight_decay"} <= set(sweep.space.names)
    assert {"lora_alpha", "lora_dropout"} <= sweep.task.per_member_keys
    assert "lora_r" in sweep.config and "lora_r" not in sweep.task.per_member_keys


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore::FutureWarning")
def test_the_lora_example_runs_end_to_end(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("transformers")
    pytest.importorskip("peft")
    sweep = yaml.safe_load((EXAMPLES / "lora_asha.yaml").read_text())
    sweep["config"].update({"n_train": 64, "n_val": 32, "batch_size": 16, "pretrain_steps": 10})
    sweep["budget"] = {"trials": 4, "epochs": 3}
    sweep["fusion"].update({"size": 4, "share_frozen": False})  # reaches hs.fuse: see below
    file = tmp_path / "lora.yaml"
    file.write_text(yaml.safe_dump(sweep))
    arrays: list[FusedArray] = []
    import hfsweep.training.live as live

    fuse = live.fuse

    def recording(*args: Any, **kwargs: Any) -> FusedArray:
        arrays.append(fuse(*args, **kwargs))
        return arrays[-1]

    monkeypatch.setattr(live, "fuse", recording)
    assert main(["run", str(file), "--output", str(tmp_path / "run")]) == 0
    assert "Sweep finished" in capsys.readouterr().out
    with (tmp_path / "run" / "trials.csv").open(newline="") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 4 and {r["state"] for r in rows} <= {"COMPLETE", "PRUNED"}
    assert len({r["params_lora_alpha"] for r in rows}) == 4
    # the four trials, of four lora_alpha and lora_dropout values, trained as one array (after
    # the dry run's array of two; later a smaller one once ASHA stopped some), with every
    # tensor per member as the file asked
    assert [a.size for a in arrays][:2] == [2, 4]
    assert all(a.shared_frozen == [] for a in arrays)
