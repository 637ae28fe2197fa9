"""The array trainer: a member trained in an array = the same trial trained alone (float64),
checkpoint/resume = an uninterrupted run, report/refill/OOM-split/non-finite behaviour."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from _tasks import make_task

import hfsweep as hs
from hfsweep.fusion import FusedArray

# Eight trials, every per-member key different (same shared config: architecture and data).
CONFIGS: list[dict[str, Any]] = [
    {
        "seed": i,
        "lr": 0.02 + 0.01 * i,
        "momentum": 0.1 * (i % 5),
        "weight_decay": 1e-3 * i,
        "dropout": 0.05 * i,
        "label_smoothing": 0.02 * i,
        "grad_clip": None if i % 2 else 0.5 + 0.1 * i,
        "eta_min": 1e-4 * i,
        "epochs": 2 + i % 3,
        "lr_schedule": "cosine",
    }
    for i in range(8)
]


def _members(configs: list[dict[str, Any]], prefix: str = "t") -> list[hs.Member]:
    return [hs.Member(f"{prefix}{i}", c) for i, c in enumerate(configs)]


def _trainer(task: hs.Task, **kw: Any) -> hs.ArrayTrainer:
    return hs.ArrayTrainer(task, dtype=torch.float64, **kw)


def _assert_same(a: hs.MemberResult, b: hs.MemberResult, rtol: float = 1e-7) -> None:
    assert a.status == b.status and a.steps == b.steps
    assert len(a.history) == len(b.history)
    for ra, rb in zip(a.history, b.history, strict=True):
        assert ra.keys() == rb.keys()
        for k in ra:
            assert ra[k] == pytest.approx(rb[k], rel=rtol, abs=1e-12), (a.id, k)
    assert a.state is not None and b.state is not None
    for k, v in a.state["model"].items():
        torch.testing.assert_close(v, b.state["model"][k], rtol=rtol, atol=1e-12, msg=k)
    for k, st in a.state["optimizer"]["state"].items():
        for name, v in st.items():
            torch.testing.assert_close(
                v, b.state["optimizer"]["state"][k][name], rtol=rtol, atol=1e-12
            )
    assert a.state["rng"] == b.state["rng"]


@pytest.mark.parametrize("bn", [False, True], ids=["mlp", "batchnorm"])
def test_array_members_train_as_alone(bn: bool) -> None:
    task = make_task(bn)
    fused = _trainer(task).run(_members(CONFIGS))
    assert [r.status for r in fused] == ["completed"] * 8
    assert [r.steps for r in fused] == [5 * (2 + i % 3) for i in range(8)]
    for i, config in enumerate(CONFIGS):
        alone = _trainer(task).run([hs.Member(f"t{i}", config)])[0]
        _assert_same(fused[i], alone)


def test_adamw_step_schedule_members_train_as_alone() -> None:
    task = make_task()
    configs = [
        {
            "optimizer": "adamw",
            "lr": 1e-3 * (i + 1),
            "beta1": 0.8 + 0.05 * i,
            "beta2": 0.99 + 0.003 * i,
            "eps": 1e-8 * (i + 1),
            "weight_decay": 0.01 * i,
            "lr_schedule": "step",
            "step_size": 1,
            "gamma": 0.5 + 0.1 * i,
            "seed": 10 + i,
        }
        for i in range(3)
    ]
    fused = _trainer(task).run(_members(configs))
    for i, c in enumerate(configs):
        _assert_same(fused[i], _trainer(task).run([hs.Member(f"t{i}", c)])[0])


def test_member_state_loads_into_the_users_model_and_torch_optimizer() -> None:
    task = make_task(bn=True)
    result = _trainer(task).run([hs.Member("a", {"momentum": 0.9, "epochs": 1})])[0]
    model = task.model(task.resolve({})).double()
    model.load_state_dict(result.state["model"])
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    opt.load_state_dict(result.state["optimizer"])
    assert opt.state[next(model.parameters())]["momentum_buffer"] is not None


class _Crash(Exception):
    pass


def test_resume_from_a_mid_training_checkpoint_equals_an_uninterrupted_run(tmp_path) -> None:
    task = make_task(bn=True)
    configs = CONFIGS[:4]
    full = _trainer(task).run(_members(configs))

    evaluations = 0

    def crash_on_third(evals: list[hs.Evaluation]) -> None:
        nonlocal evaluations
        evaluations += 1
        if evaluations == 3:
            raise _Crash

    with pytest.raises(_Crash):
        _trainer(task, checkpoint_dir=tmp_path).run(_members(configs), report=crash_on_third)
    assert (tmp_path / "array.pt").exists()
    seen: list[str] = []
    resumed = _trainer(task, checkpoint_dir=tmp_path).run(
        _members(configs), resume=True, on_finish=lambda r: seen.append(r.id)
    )
    assert [r.id for r in resumed] == [r.id for r in full]
    for a, b in zip(resumed, full, strict=True):
        _assert_same(a, b)
    # t0 and t3 (2 epochs) had finished before the crash at the third evaluation
    assert sorted(seen) == ["t1", "t2"]
    # a resume of a finished run trains nothing and returns the same results
    again = _trainer(task, checkpoint_dir=tmp_path).run(
        _members(configs), resume=True, on_finish=lambda r: seen.append(r.id)
    )
    assert len(seen) == 2
    for a, b in zip(again, full, strict=True):
        _assert_same(a, b)


def test_finished_members_are_not_trained_again_after_a_crash(tmp_path) -> None:
    task = make_task()
    configs = [{"epochs": 1, "seed": 1}, {"epochs": 3, "seed": 2}]

    def crash_late(evals: list[hs.Evaluation]) -> None:
        if evals[0].epoch >= 2:
            raise _Crash

    with pytest.raises(_Crash):
        _trainer(task, checkpoint_dir=tmp_path).run(_members(configs), report=crash_late)
    finished: list[str] = []
    results = _trainer(task, checkpoint_dir=tmp_path).run(
        _members(configs), resume=True, on_finish=lambda r: finished.append(r.id)
    )
    assert finished == ["t1"]
    assert [r.status for r in results] == ["completed", "completed"]
    assert (tmp_path / "members" / "t0.pt").exists()


def test_report_stops_members_and_refill_fills_their_slots() -> None:
    task = make_task()
    queue = [hs.Member(f"new{i}", {"seed": 20 + i, "epochs": 2}) for i in range(3)]
    calls: list[list[str]] = []

    def report(evals: list[hs.Evaluation]) -> dict[str, bool]:
        calls.append([e.member for e in evals])
        return {e.member: e.member != "t1" for e in evals}  # stop t1 at its first evaluation

    results = _trainer(task).run(
        _members([{"epochs": 3, "seed": 0}, {"epochs": 3, "seed": 1}]),
        report=report,
        refill=lambda: queue.pop(0) if queue else None,
    )
    status = {r.id: r.status for r in results}
    assert status == {
        "t0": "completed",
        "t1": "stopped",
        "new0": "completed",
        "new1": "completed",
        "new2": "completed",
    }
    steps = {r.id: r.steps for r in results}
    assert steps["t1"] == 5 and steps["t0"] == 15 and steps["new0"] == 10
    assert calls[0] == ["t0", "t1"]
    # every evaluation of a member happens at its own epoch boundary
    for r in results:
        assert [h["epoch"] for h in r.history] == [1.0 * (k + 1) for k in range(len(r.history))]


def test_refill_rejects_an_incompatible_member() -> None:
    task = make_task()
    with pytest.raises(hs.TaskError, match="hidden=32"):
        _trainer(task).run(
            _members([{"epochs": 1}, {"epochs": 2}]),
            refill=lambda: hs.Member("x", {"hidden": 32}),
        )


def test_a_nonfinite_member_fails_alone(monkeypatch) -> None:
    task = make_task()
    good = [{"seed": 1, "lr": 0.05}, {"seed": 2, "lr": 0.1}]
    with_bad = [good[0], {"seed": 3, "lr": 1e300}, good[1]]
    # in float32 the huge step overflows the member's weights to inf, then its loss is NaN
    results = hs.ArrayTrainer(task).run(_members(with_bad))
    assert [r.status for r in results] == ["completed", "failed", "completed"]
    assert results[1].error is not None and results[1].steps < 5
    reference = hs.ArrayTrainer(task).run(_members(good))
    _assert_same(results[0], reference[0], rtol=0)
    assert results[2].history == reference[1].history


def test_out_of_memory_splits_the_array_and_loses_nothing(monkeypatch, tmp_path) -> None:
    task = make_task(bn=True)
    configs = CONFIGS[:5]
    reference = _trainer(task).run(_members(configs))
    forward = FusedArray.forward
    calls = {"n": 0}

    def small_memory(self: FusedArray, *args: Any, **kwargs: Any) -> Any:
        calls["n"] += 1
        # arrays of more than 2 members run out of memory on their 7th training step
        if self.training and self.size > 2 and calls["n"] >= 7:
            raise torch.OutOfMemoryError("simulated: CUDA out of memory")
        return forward(self, *args, **kwargs)

    monkeypatch.setattr(FusedArray, "forward", small_memory)
    results = _trainer(task, checkpoint_dir=tmp_path).run(_members(configs))
    assert [r.id for r in results] == [r.id for r in reference]
    for a, b in zip(results, reference, strict=True):
        _assert_same(a, b)


def test_bad_arguments() -> None:
    task = make_task()
    with pytest.raises(ValueError, match="eval_every"):
        hs.ArrayTrainer(task, eval_every=0)
    with pytest.raises(ValueError, match="appears twice"):
        _trainer(task).run([hs.Member("a", {}), hs.Member("a", {})])
    with pytest.raises(hs.TaskError, match="hidden"):
        _trainer(task).run([hs.Member("a", {}), hs.Member("b", {"hidden": 8})])
    with pytest.raises(ValueError, match="at least one member"):
        _trainer(task).run([])


def test_array_compacts_when_most_slots_are_idle(monkeypatch) -> None:
    import hfsweep.trainer as trainer_module

    sizes: list[int] = []
    fuse = trainer_module.fuse

    def recording_fuse(models, **kw):
        sizes.append(len(models))
        return fuse(models, **kw)

    monkeypatch.setattr(trainer_module, "fuse", recording_fuse)
    task = make_task()
    # budgets 2, 3, 4, 2, 3, 4, 2, 3 epochs: 5 members left after epoch 2, 2 after epoch 3
    results = _trainer(task).run(_members(CONFIGS))
    assert sizes == [8, 2]
    assert [r.steps for r in results] == [5 * (2 + i % 3) for i in range(8)]


def test_on_finish_once_per_member_and_no_refill_lost_across_a_crash(tmp_path) -> None:
    task = make_task()
    configs = [{"seed": 0, "epochs": 2}, {"seed": 1, "lr": 1e300, "epochs": 2}]
    queue = [hs.Member("new0", {"seed": 5, "epochs": 1})]  # the searcher outlives the crash
    told: list[str] = []

    def crash_at_first_evaluation(evals: list[hs.Evaluation]) -> None:
        raise _Crash

    with pytest.raises(_Crash):
        hs.ArrayTrainer(task, checkpoint_dir=tmp_path).run(
            _members(configs),
            report=crash_at_first_evaluation,
            refill=lambda: queue.pop(0) if queue else None,
            on_finish=lambda r: told.append(r.id),
        )
    assert told == ["t1"] and not queue  # t1 failed at a step without evaluation; new0 joined
    results = hs.ArrayTrainer(task, checkpoint_dir=tmp_path).run(
        _members(configs),
        resume=True,
        refill=lambda: queue.pop(0) if queue else None,
        on_finish=lambda r: told.append(r.id),
    )
    assert sorted(told) == ["new0", "t0", "t1"]
    assert {r.id: r.status for r in results} == {
        "t0": "completed",
        "t1": "failed",
        "new0": "completed",
    }


def test_out_of_memory_in_backward_replays_the_step_exactly(monkeypatch) -> None:
    import hfsweep.trainer as trainer_module

    task = make_task(bn=True)
    configs = CONFIGS[:4]
    reference = _trainer(task).run(_members(configs))
    backward = trainer_module.backward
    calls = {"n": 0}

    def oom_after_forward(task, array, *args):
        losses = backward(task, array, *args)  # forward ran: BatchNorm and dropout moved on
        calls["n"] += 1
        if array.size > 2 and calls["n"] >= 4:
            raise torch.OutOfMemoryError("simulated: CUDA out of memory")
        return losses

    monkeypatch.setattr(trainer_module, "backward", oom_after_forward)
    results = _trainer(task).run(_members(configs))
    for a, b in zip(results, reference, strict=True):
        _assert_same(a, b)


def test_member_files_of_similar_ids_do_not_collide(tmp_path) -> None:
    task = make_task()
    members = [
        hs.Member("lr=0.1", {"lr": 0.1, "epochs": 1}),
        hs.Member("lr_0.1", {"lr": 0.3, "epochs": 2}),
    ]
    first = _trainer(task, checkpoint_dir=tmp_path).run(members)
    again = _trainer(task, checkpoint_dir=tmp_path).run(members, resume=True)
    assert (
        [(r.id, r.config["lr"], r.steps) for r in again]
        == [(r.id, r.config["lr"], r.steps) for r in first]
        == [("lr=0.1", 0.1, 5), ("lr_0.1", 0.3, 10)]
    )


def test_hooks_draw_from_the_callers_generator() -> None:
    task = make_task()
    drawn: list[float] = []

    def refill() -> hs.Member | None:
        drawn.append(float(torch.rand(())))
        return None

    firsts = []
    for seed in (1, 2):
        torch.manual_seed(seed)
        drawn.clear()
        _trainer(task).run(_members([{"epochs": 1}, {"epochs": 2}]), refill=refill)
        firsts.append(drawn[0])
    expected = [float(torch.rand((), generator=torch.Generator().manual_seed(s))) for s in (1, 2)]
    assert firsts == expected


def test_resume_refuses_other_settings(tmp_path) -> None:
    task = make_task()
    _trainer(task, checkpoint_dir=tmp_path).run(_members([{"epochs": 1}]))
    with pytest.raises(
        ValueError, match="written with eval_every=None, this trainer has eval_every=2"
    ):
        _trainer(task, checkpoint_dir=tmp_path, eval_every=2).run(_members([{}]), resume=True)
    with pytest.raises(
        ValueError, match=r"dtype='torch\.float64', this trainer has dtype='torch\.float32'"
    ):
        hs.ArrayTrainer(task, checkpoint_dir=tmp_path).run(_members([{}]), resume=True)
