"""GPU checks of the trainer and the profiler (skipped without CUDA)."""

from __future__ import annotations

import pytest
import torch
from _tasks import make_task

import hfsweep as hs
from hfsweep import profiler, tasks

pytestmark = pytest.mark.gpu


def test_trainer_on_cuda_members_train_as_alone() -> None:
    task = make_task(bn=True)
    configs = [
        {
            "seed": i,
            "lr": 0.05 * (i + 1),
            "momentum": 0.5,
            "dropout": 0.1 * i,
            "label_smoothing": 0.05 * i,
            "grad_clip": 1.0,
            "lr_schedule": "cosine",
            "epochs": 2 + i % 2,
        }
        for i in range(4)
    ]
    trainer = hs.ArrayTrainer(task, device="cuda", dtype=torch.float64)
    fused = trainer.run([hs.Member(f"t{i}", c) for i, c in enumerate(configs)])
    for i, c in enumerate(configs):
        alone = hs.ArrayTrainer(task, device="cuda", dtype=torch.float64).run(
            [hs.Member(f"t{i}", c)]
        )[0]
        assert fused[i].steps == alone.steps
        for a, b in zip(fused[i].history, alone.history, strict=True):
            for k in a:
                assert a[k] == pytest.approx(b[k], rel=1e-7, abs=1e-12)
        for k, v in fused[i].state["model"].items():
            torch.testing.assert_close(v, alone.state["model"][k], rtol=1e-7, atol=1e-12)


@pytest.mark.parametrize("name", sorted(tasks.TASKS))
def test_memory_model_predicts_the_peak_within_10_percent(name: str) -> None:
    profile = hs.profile_task(tasks.get(name), device="cuda", sizes=[1, 2, 4, 8], min_seconds=0.1)
    ms = list(profile.measurements)
    fit = profiler.MemoryModel.fit(ms[:-1])
    assert fit.predict(ms[-1].size) == pytest.approx(ms[-1].peak_bytes, rel=0.10)
