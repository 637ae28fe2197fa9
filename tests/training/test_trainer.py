"""The array trainer: a member trained in an array = the same trial trained alone (float64),
checkpoint/resume = an uninterrupted run, report/refill/OOM-split/non-finite behaviour."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from _tasks import make_attention_task, make_task

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


def test_transformer_members_with_swept_dropout_train_as_alone() -> None:
    """Every dropout of a TransformerEncoderLayer, the attention weights' included, differs per
    member and is drawn from the member's own stream: each trial's history, weights and streams
    are those of the same trial alone (once, differing attention dropout refused to fuse)."""
    task = make_attention_task()
    configs = [{"seed": i, "lr": 0.05, "dropout": p} for i, p in enumerate((0.0, 0.2, 0.5))]
    fused = _trainer(task).run(_members(configs))
    assert [r.status for r in fused] == ["completed"] * 3
    for i, config in enumerate(configs):
        alone = _trainer(task).run([hs.Member(f"t{i}", config)])[0]
        _assert_same(fused[i], alone)
    # masks were drawn for the attention weights of the members that drop, and only for them
    calls = [r.state["rng"]["layer.self_attn"][1] for r in fused]
    assert calls[0] == 0 and calls[1] == calls[2] == fused[1].steps


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


def test_a_refill_that_brings_label_smoothing_turns_it_on_for_that_member() -> None:
    """Without label smoothing in any slot the loss leaves the smoothing term out; a refill
    that brings smoothing into such an array turns it on. The joining member trains exactly
    as when the array's other members smooth too (its own labels are smoothed either way), and
    a member without smoothing trains as alone."""
    task = make_task()
    joining = {"seed": 7, "epochs": 2, "label_smoothing": 0.3}

    def run(smoothing: float) -> dict[str, hs.MemberResult]:
        first = [
            {"seed": 0, "epochs": 3, "label_smoothing": smoothing},
            {"seed": 1, "epochs": 1, "label_smoothing": smoothing},
        ]
        queue = [hs.Member("joining", joining)]
        results = _trainer(task).run(
            _members(first), refill=lambda: queue.pop(0) if queue else None
        )
        return {r.id: r for r in results}

    without, with_ = run(0.0), run(0.1)
    assert without["joining"].steps == 10
    _assert_same(without["joining"], with_["joining"], rtol=0)
    alone = _trainer(task).run([hs.Member("t0", {"seed": 0, "epochs": 3})])[0]
    _assert_same(without["t0"], alone, rtol=0)


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


def _record_sizes(monkeypatch) -> list[int]:
    """The size of every array the trainer builds, in order."""
    import hfsweep.training.live as live_module

    sizes: list[int] = []
    fuse = live_module.fuse

    def recording_fuse(models, **kw):
        sizes.append(len(models))
        return fuse(models, **kw)

    monkeypatch.setattr(live_module, "fuse", recording_fuse)
    return sizes


def test_compaction_is_weighed_with_measured_costs(monkeypatch) -> None:
    """Once at most half the slots are busy, the trainer asks the cost model with what it
    measured (seconds per step at this size, the rebuild: the build and the traces the new
    size lacks) and keeps the array when the model says a rebuild does not pay."""
    import hfsweep.training.run as run_module

    sizes = _record_sizes(monkeypatch)
    asked: list[tuple[int, int, int, dict[int, float], float, float]] = []

    def keep(size, busy, remaining, step_seconds, rebuild_seconds):
        asked.append(
            (size, busy, remaining, dict(step_seconds), rebuild_seconds(busy), rebuild_seconds(8))
        )
        return None

    monkeypatch.setattr(run_module, "_choose_compaction", keep)
    task = make_task()
    # budgets 2, 3, 4, 2, 3, 4, 2, 3 epochs: 5 members left after epoch 2, 2 after epoch 3
    results = _trainer(task).run(_members(CONFIGS))
    assert sizes == [8]
    assert [r.steps for r in results] == [5 * (2 + i % 3) for i in range(8)]
    size, busy, remaining, steps, rebuild_small, rebuild_same = asked[0]
    assert (size, busy, remaining) == (8, 2, 5)  # the 4-epoch members have one epoch left
    assert steps[8] > 0
    # a size never traced pays for its traces; this size's traces are in the cache
    assert rebuild_small > rebuild_same > 0


def _reference_alone(task: hs.Task, configs: list[dict[str, Any]]) -> list[hs.MemberResult]:
    return [_trainer(task).run([hs.Member(f"t{i}", c)])[0] for i, c in enumerate(configs)]


@pytest.mark.parametrize("bn", [False, True], ids=["mlp", "batchnorm"])
def test_members_of_a_compacted_array_train_as_alone(monkeypatch, bn: bool) -> None:
    """Compacting to exactly the busy members or to a power of two with spare slots keeps
    every member equal to the same trial trained alone."""
    import hfsweep.training.run as run_module
    from hfsweep.training.step import _next_power_of_two

    sizes = _record_sizes(monkeypatch)
    # 3 of 8 busy after epoch 2 with these budgets: a bucket of 4 (one spare slot), then
    # 1 of 4 busy: exactly 1
    configs = [{**c, "epochs": {2: 3, 5: 3, 7: 4}.get(i, 2)} for i, c in enumerate(CONFIGS)]
    monkeypatch.setattr(
        run_module,
        "_choose_compaction",
        lambda size, busy, *_: _next_power_of_two(busy) if size > 4 else busy,
    )
    task = make_task(bn)
    fused = _trainer(task).run(_members(configs))
    assert sizes == [8, 4, 1]
    for got, alone in zip(fused, _reference_alone(task, configs), strict=True):
        _assert_same(got, alone)


def test_compaction_keeps_each_members_own_dropout(monkeypatch) -> None:
    """Members whose config leaves dropout to the model (None: the model's own p, here 0.25)
    and members with their own p keep them in a compacted array: the rebuilt array shares one
    model per dropout setting between slots whose weights it loads."""
    from _tasks import Net, data

    import hfsweep.training.run as run_module

    sizes = _record_sizes(monkeypatch)
    monkeypatch.setattr(run_module, "_choose_compaction", lambda size, busy, *_: busy)

    class OwnDropout(Net):
        def __init__(self, hidden: int, p: float | None) -> None:
            super().__init__(hidden, bn=False)
            self.net[2] = torch.nn.Dropout(0.25 if p is None else p)

    task = hs.Task(
        name="own-dropout",
        model=lambda c: OwnDropout(c["hidden"], c["dropout"]),
        data=data,
        defaults={"hidden": 16, "batch_size": 32, "epochs": 3},
    )
    configs = [
        {"seed": 0, "dropout": 0.4, "epochs": 1},
        {"seed": 1, "dropout": None, "epochs": 3},
        {"seed": 2, "dropout": 0.1, "epochs": 3},
        {"seed": 3, "dropout": None, "epochs": 1},
        {"seed": 4, "dropout": 0.4, "epochs": 1},
    ]
    fused = _trainer(task).run(_members(configs))
    assert sizes == [5, 2]
    for got, alone in zip(fused, _reference_alone(task, configs), strict=True):
        _assert_same(got, alone)


def test_spare_slots_of_a_compacted_array_take_refills(monkeypatch, tmp_path) -> None:
    """A compacted array keeps a spare slot (4 slots, 1 busy, rebuilt at 2): a trial refilled
    into it trains exactly as in the array that was not compacted, the first members as alone,
    and a resume from the compacted array's checkpoint equals the uninterrupted run."""
    import hfsweep.training.run as run_module

    sizes = _record_sizes(monkeypatch)
    task = make_task()
    configs = [{"seed": i, "lr": 0.05 + 0.01 * i, "epochs": 1 + 2 * (i == 0)} for i in range(4)]
    late = hs.Member("late", {"seed": 9, "lr": 0.07, "epochs": 1})

    def run(directory, compact_to, crash_at=None, resume=False):
        monkeypatch.setattr(run_module, "_choose_compaction", lambda size, busy, *_: compact_to)
        queue = [] if resume else [late]
        evaluations = []

        def report(evals: list[hs.Evaluation]) -> None:
            evaluations.append(max(e.epoch for e in evals))
            if len(evaluations) == crash_at:
                raise _Crash

        def refill() -> hs.Member | None:
            # the new trial comes once t0 has trained two epochs (t1-t3 ended after one)
            return queue.pop(0) if queue and evaluations[-1] >= 2 else None

        return _trainer(task, checkpoint_dir=directory).run(
            _members(configs), report=report, refill=refill, resume=resume
        )

    kept = run(tmp_path / "kept", compact_to=None)
    assert sizes == [4]
    sizes.clear()
    compacted = run(tmp_path / "compacted", compact_to=2)
    assert sizes == [4, 2]
    assert {r.id: r.steps for r in compacted} == {"t0": 15, "t1": 5, "t2": 5, "t3": 5, "late": 5}
    for got, want in zip(compacted, kept, strict=True):
        _assert_same(got, want)
    for got, alone in zip(compacted, _reference_alone(task, configs), strict=False):
        _assert_same(got, alone)

    # the third evaluation (t0's last, late's first) crashes; the checkpoint before it holds
    # the compacted array with late in its spare slot
    with pytest.raises(_Crash):
        run(tmp_path / "crash", compact_to=2, crash_at=3)
    assert hs.ArrayTrainer.checkpointed_members(tmp_path / "crash") >= {"t0", "late"}
    resumed = run(tmp_path / "crash", compact_to=2, resume=True)
    for got, want in zip(resumed, compacted, strict=True):
        _assert_same(got, want)


def test_choose_compaction_weighs_saved_steps_against_the_rebuild() -> None:
    from hfsweep.training.step import _choose_compaction

    def rebuild(cost_by_size: dict[int, float]):
        return lambda b: cost_by_size[b]

    # a step of 8 costs 8 ms; 2 busy: an array of 2 costs at least 2 ms (unmeasured)
    steps = {8: 0.008}
    assert _choose_compaction(8, 2, 1000, steps, rebuild({2: 0.5})) == 2  # saves up to 6 s
    assert _choose_compaction(8, 2, 10, steps, rebuild({2: 0.5})) is None  # saves 60 ms
    # measured: small arrays cost nearly as much as large ones (overhead-bound)
    flat = {8: 0.008, 2: 0.0079, 4: 0.0079}
    assert _choose_compaction(8, 2, 1000, flat, rebuild({2: 0.5})) is None
    # 3 busy: 4 (traced before, cheap to rebuild) beats 3 (would trace again)
    assert _choose_compaction(8, 3, 1000, steps, rebuild({3: 2.0, 4: 0.01})) == 4
    assert _choose_compaction(8, 3, 1000, steps, rebuild({3: 0.01, 4: 0.01})) == 3
    # never a size that is not smaller
    assert _choose_compaction(4, 3, 10**6, {4: 1.0}, rebuild({3: 0.0, 4: 0.0})) == 3
    assert _choose_compaction(2, 1, 10**6, {2: 1.0}, rebuild({1: 0.0})) == 1


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
    import hfsweep.training.run as run_module

    task = make_task(bn=True)
    configs = CONFIGS[:4]
    reference = _trainer(task).run(_members(configs))
    backward = run_module.backward
    calls = {"n": 0}

    def oom_after_forward(task, array, *args):
        losses = backward(task, array, *args)  # forward ran: BatchNorm and dropout moved on
        calls["n"] += 1
        if array.size > 2 and calls["n"] >= 4:
            raise torch.OutOfMemoryError("simulated: CUDA out of memory")
        return losses

    monkeypatch.setattr(run_module, "backward", oom_after_forward)
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


def test_resume_refuses_a_checkpoint_of_another_version(tmp_path) -> None:
    """Version 3 packs the checkpoint's tensors and draws other dropout masks: a version 2
    checkpoint (unpacked, as it was written then) is refused by name, not resumed with
    different masks."""
    from hfsweep.training.packed import load

    task = make_task()
    _trainer(task, checkpoint_dir=tmp_path).run(_members([{"epochs": 1}]))
    path = tmp_path / "array.pt"
    payload = load(path)
    assert payload["version"] == 3
    torch.save({**payload, "version": 2}, path)
    with pytest.raises(ValueError, match="checkpoint version 2 is not 3"):
        _trainer(task, checkpoint_dir=tmp_path).run(_members([{}]), resume=True)


def test_without_keep_states_a_resume_delivers_undelivered_members_with_their_state(
    tmp_path, monkeypatch
) -> None:
    """The engine's way (keep_states=False): no member files; a member that ended before a
    crash in its on_finish gets on_finish again on resume, with its state from the
    checkpoint, and the results equal an uninterrupted run's, value for value. Compaction is
    off: it is decided from measured step times, so the two runs could otherwise shrink the
    array at different steps, and an array of another size may round differently."""
    import hfsweep.training.run as run_module

    monkeypatch.setattr(run_module, "_choose_compaction", lambda *args: None)
    task = make_task(bn=True)
    configs = CONFIGS[:4]  # t0 and t3 end after 2 epochs, t1 after 3, t2 after 4
    full = _trainer(task).run(_members(configs))

    def crash_at_t1(result: hs.MemberResult) -> None:
        if result.id == "t1":
            raise _Crash

    with pytest.raises(_Crash):
        _trainer(task, checkpoint_dir=tmp_path, keep_states=False).run(
            _members(configs), on_finish=crash_at_t1
        )
    assert not (tmp_path / "members").exists()
    states: dict[str, Any] = {}
    resumed = _trainer(task, checkpoint_dir=tmp_path, keep_states=False).run(
        _members(configs), resume=True, on_finish=lambda r: states.setdefault(r.id, r.state)
    )
    assert sorted(states) == ["t1", "t2"]  # t0 and t3 were delivered before the crash
    full_by_id = {r.id: r for r in full}
    for member_id, state in states.items():
        assert state is not None
        _assert_same(
            hs.MemberResult(
                member_id,
                {},
                "completed",
                full_by_id[member_id].steps,
                full_by_id[member_id].history,
                state,
            ),
            full_by_id[member_id],
        )
    assert [r.id for r in resumed] == [r.id for r in full]
    for a, b in zip(resumed, full, strict=True):
        assert (a.status, a.steps, a.history, a.state) == (b.status, b.steps, b.history, None)


def test_a_delivery_record_cut_short_by_a_crash_means_delivering_again(
    monkeypatch, tmp_path
) -> None:
    import hfsweep.training.run as run_module

    task = make_task()
    configs = [{"seed": 0, "epochs": 1}, {"seed": 1, "epochs": 2}, {"seed": 2, "epochs": 3}]
    full = _trainer(task).run(_members(configs))
    append = run_module.append_lines
    appends = {"n": 0}

    def torn_second_append(path, lines):
        appends["n"] += 1
        if appends["n"] == 2:  # t1's record: half of it reaches the file, then the crash
            with open(path, "ab") as f:
                f.write(lines[0][: len(lines[0]) // 2].encode())
            raise _Crash
        append(path, lines)

    monkeypatch.setattr(run_module, "append_lines", torn_second_append)
    told: list[str] = []
    with pytest.raises(_Crash):
        _trainer(task, checkpoint_dir=tmp_path).run(
            _members(configs), on_finish=lambda r: told.append(r.id)
        )
    monkeypatch.setattr(run_module, "append_lines", append)
    resumed = _trainer(task, checkpoint_dir=tmp_path).run(
        _members(configs), resume=True, on_finish=lambda r: told.append(r.id)
    )
    assert told == ["t0", "t1", "t1", "t2"]  # at least once: t1's record was cut
    for a, b in zip(resumed, full, strict=True):
        _assert_same(a, b)
    # the cut line stays on its own: a third run reads every complete record
    again = _trainer(task, checkpoint_dir=tmp_path).run(_members(configs), resume=True)
    assert [r.id for r in again] == ["t0", "t1", "t2"]
    for a, b in zip(again, full, strict=True):
        _assert_same(a, b)


@pytest.mark.parametrize("final_states", ["all", "completed", "none"])
def test_final_states_says_which_results_carry_their_state(tmp_path, final_states) -> None:
    """Stopped (t1) and failed (t2) members carry their state only with "all"; a resume of the
    finished run gives the same results; the trained members are the same either way."""
    task = make_task()
    configs = [
        {"seed": 0, "epochs": 2},
        {"seed": 1, "epochs": 2},
        {"seed": 2, "lr": 1e300, "epochs": 2},
    ]  # float32: t2 overflows

    def stop_t1(evals: list[hs.Evaluation]) -> dict[str, bool]:
        return {e.member: e.member != "t1" for e in evals}

    told: dict[str, bool] = {}
    trainer = hs.ArrayTrainer(task, checkpoint_dir=tmp_path, final_states=final_states)
    results = trainer.run(
        _members(configs),
        report=stop_t1,
        on_finish=lambda r: told.__setitem__(r.id, r.state is not None),
    )
    assert {r.id: r.status for r in results} == {"t0": "completed", "t1": "stopped", "t2": "failed"}
    expected = {
        "all": {"t0": True, "t1": True, "t2": True},
        "completed": {"t0": True, "t1": False, "t2": False},
        "none": {"t0": False, "t1": False, "t2": False},
    }[final_states]
    assert told == expected
    assert {r.id: r.state is not None for r in results} == expected
    again = hs.ArrayTrainer(task, checkpoint_dir=tmp_path, final_states=final_states).run(
        _members(configs), resume=True
    )
    assert {r.id: r.state is not None for r in again} == expected
    # float32 (t2 must overflow): MKL's rounding can differ between runs, so approximately
    reference = hs.ArrayTrainer(task).run(_members(configs), report=stop_t1)
    for got in (results, again):
        for a, b in zip(got, reference, strict=True):
            assert (a.status, a.steps, len(a.history)) == (b.status, b.steps, len(b.history))
            for ra, rb in zip(a.history, b.history, strict=True):
                assert ra == pytest.approx(rb, rel=1e-5, nan_ok=True)


def test_final_states_must_be_known() -> None:
    with pytest.raises(ValueError, match="final_states must be one of 'all', 'completed', 'none'"):
        hs.ArrayTrainer(make_task(), final_states="best")


def test_the_trainer_names_are_imported_from_hs_and_the_old_modules_are_gone() -> None:
    """The trainer's names come from :mod:`hfsweep` (``hs.ArrayTrainer``...) and
    :mod:`hfsweep.training`; ``hfsweep.trainer`` and ``hfsweep.packing``, which only re-exported
    them (and the packer) under older paths, are gone."""
    import importlib

    import hfsweep.training

    for name in ("ArrayTrainer", "Evaluation", "Member", "MemberResult"):
        assert getattr(hs, name) is getattr(hfsweep.training, name)
    for old in ("hfsweep.trainer", "hfsweep.packing"):
        with pytest.raises(ModuleNotFoundError):
            importlib.import_module(old)
