"""The ready LoRA task (``text_lora``) through the Ray Tune plugin: ``examples/tune_lora.py``'s
sweep with a small budget on the tests' local Ray (2 CPUs, loopback). Every member is told
once, ASHA stops some at its rung, and the best member's weights load into the task's model,
whose adapter saves with peft."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("ray")
pytest.importorskip("transformers")
pytest.importorskip("peft")

from hfsweep.schedulers.tune import best_member, member_results

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "tune_lora.py"
SMALL = {"n_train": 64, "n_val": 32, "batch_size": 16, "pretrain_steps": 10}


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore::FutureWarning")
def test_the_lora_task_sweeps_through_the_tune_plugin(shared_ray: Any, tmp_path: Path) -> None:
    shared_ray.start()
    spec = importlib.util.spec_from_file_location("tune_lora", EXAMPLE)
    assert spec is not None and spec.loader is not None
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    fusion, results = example.sweep(4, 3, 4, str(tmp_path / "tune"), SMALL)
    table = member_results(results)
    assert len(results) == 1 and len(table) == 4  # one array of the four members
    assert set(table["state"]) <= {"COMPLETE", "PRUNED"} and "COMPLETE" in set(table["state"])
    assert table["config/lora_alpha"].nunique() == 4
    best = best_member(results)
    model = best.load_model(fusion.task)
    model.model.save_pretrained(tmp_path / "adapter")
    saved = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert saved["lora_alpha"] == pytest.approx(best.config["lora_alpha"])
    assert saved["r"] == 4
