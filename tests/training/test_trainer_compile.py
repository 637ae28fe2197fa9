"""``hs.ArrayTrainer(..., compile=True)``: the compiled fused step (forward, backward, the
task's loss and the fused optimizer's update compiled) trains every member exactly as the
uncompiled trainer does, per-member dropout, label smoothing, clipping and schedules included."""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
from _tasks import make_task

import hfsweep as hs
from hfsweep.fusion._compile import CompileFallbackWarning
from hfsweep.training import _compiled

CONFIGS: list[dict[str, Any]] = [
    {
        "seed": i,
        "lr": 0.05 + 0.02 * i,
        "momentum": 0.3 * i,
        "dropout": 0.1 * i,
        "label_smoothing": 0.05 * i,
        "grad_clip": None if i % 2 else 0.5,
        "epochs": 1 + i % 2,
        "lr_schedule": "cosine",
    }
    for i in range(3)
]


def _run(**kw: Any) -> list[hs.MemberResult]:
    trainer = hs.ArrayTrainer(make_task(), dtype=torch.float64, eval_every=3, **kw)
    results = trainer.run([hs.Member(f"m{i}", c) for i, c in enumerate(CONFIGS)])
    if trainer.compile:  # the optimizer's update compiled too, its compiling left out
        assert trainer._update is not None and trainer._update.fallback is None
        assert trainer._update.seconds > 0
    else:
        assert trainer._update is None
    return results


@pytest.mark.slow
@pytest.mark.timeout(900)  # compiling on a shared 2-core CPU
def test_compiled_trainer_matches_the_uncompiled_one_in_float64() -> None:
    eager = _run()
    compiled = _run(compile=True)
    for a, b in zip(compiled, eager, strict=True):
        assert (a.status, a.steps) == (b.status, b.steps)
        for ra, rb in zip(a.history, b.history, strict=True):
            for k in rb:
                assert ra[k] == pytest.approx(rb[k], rel=1e-9, abs=1e-12), (a.id, k)
        assert a.state is not None and b.state is not None
        for k, v in b.state["model"].items():
            torch.testing.assert_close(a.state["model"][k], v, rtol=1e-9, atol=1e-12, msg=k)
        assert a.state["rng"] == b.state["rng"]  # dropout streams advanced alike


def test_a_loss_that_does_not_compile_runs_uncompiled_with_one_warning(monkeypatch) -> None:
    def broken(fn: Any, **kw: Any) -> Any:
        def call(*args: Any) -> Any:
            raise RuntimeError("dynamo cannot trace this loss")

        return call

    monkeypatch.setattr(_compiled.torch, "compile", broken)
    task = make_task()
    loss = _compiled.CompiledLoss(task, "default")
    out, y = torch.randn(2, 5, 4), torch.tensor([0, 1, 2, 3, 0])
    with pytest.warns(CompileFallbackWarning, match="dynamo cannot trace this loss"):
        got = loss(out, y, None)
    torch.testing.assert_close(got, task.member_loss(out, y, None))
    torch.testing.assert_close(loss(out, y, None), got)  # eager from now on, no new warning


def test_compile_needs_the_trace_and_a_valid_value() -> None:
    with pytest.raises(ValueError, match="trace=True"):
        hs.ArrayTrainer(make_task(), trace=False, compile=True)
    with pytest.raises(ValueError, match="compile='on' is not valid"):
        hs.ArrayTrainer(make_task(), compile="on")


@pytest.mark.parametrize("works", [True, False], ids=["compiled", "fell-back"])
def test_the_log_says_whether_the_array_ran_compiled(monkeypatch, caplog, works: bool) -> None:
    """With ``compile`` on, each array's end says in the trainer's log (``sweep.log``) whether
    its fused step ran compiled, and what tracing and compiling cost it. ``torch.compile`` is
    stood in for: compiling returns the function itself, or for the array's traced graph one
    that fails when called (the loss and the optimizer's update compile as themselves)."""

    def stand_in(fn: Any, **kw: Any) -> Any:
        if works or not isinstance(fn, torch.fx.GraphModule):
            return fn

        def call(*args: Any, **kwargs: Any) -> Any:
            raise RuntimeError("inductor could not lower op foo")

        return call

    monkeypatch.setattr(torch, "compile", stand_in)
    # compiled updates are kept per function for the process: none of the stand-in's may stay
    monkeypatch.setattr("hfsweep.optim._compiled._CACHE", {})
    trainer = hs.ArrayTrainer(make_task(), dtype=torch.float64, eval_every=3, compile=True)
    with caplog.at_level("INFO", logger="hfsweep.trainer"), warnings.catch_warnings():
        warnings.simplefilter("ignore", CompileFallbackWarning)
        trainer.run([hs.Member(f"m{i}", c) for i, c in enumerate(CONFIGS[:2])])
    said = [r.getMessage() for r in caplog.records if "compiled" in r.getMessage()]
    if works:
        assert len(said) == 1 and said[0].startswith("the array's fused step ran compiled ("), said
    else:
        assert said == [
            "compile is on but no call signature of the array ran compiled (the "
            "CompileFallbackWarning says why)"
        ]
