"""Offloaded arrays trained together (``hs.train_together``), each training step of all of them
one ``AlternatingArrays`` step: every array trains exactly as its ``ArrayTrainer.run`` alone
(float64, rtol 1e-7: tests/_same_results.py), with an optimizer and schedule, dropout,
evaluations, a member going non-finite, budgets that differ, refill, and a checkpoint resumed
mid-run; what it cannot train is refused with the job and what is valid."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from _offload_toy import ADAMW, SGD, toy_task
from _same_results import Crash, assert_same, crashing_report, members

import hfsweep as hs
from hfsweep.offload import AlternatingArrays

F64 = {"dtype": torch.float64, "offload": "host"}
#: array a: SGD with momentum and a cosine schedule, dropout, clipping, label smoothing, one
#: member whose lr makes it non-finite; 4 steps an epoch, 2 epochs
A = [SGD[0], {**SGD[1], "lr": 1e300}, SGD[2]]
#: array b: AdamW with a step schedule and dropout on batches of 12 (its own data stream, 8
#: steps an epoch) and 3 epochs: it trains on after a is done
B = [{**c, "batch_size": 12, "epochs": 3} for c in ADAMW[:2]]


@pytest.fixture
def joint_steps(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The number of arrays in each AlternatingArrays step that ran."""
    sizes: list[int] = []
    step = AlternatingArrays.step

    def counting(self: AlternatingArrays, inputs: Any, losses: Any) -> Any:
        sizes.append(len(self.engines))
        return step(self, inputs, losses)

    monkeypatch.setattr(AlternatingArrays, "step", counting)
    return sizes


def test_arrays_trained_together_equal_each_trained_alone(joint_steps: list[int]) -> None:
    task = toy_task()
    alone_a = hs.ArrayTrainer(task, eval_every=2, **F64).run(members(A, "a"))
    alone_b = hs.ArrayTrainer(task, **F64).run(members(B, "b"))
    assert [r.status for r in alone_a] == ["completed", "failed", "completed"]
    joint_steps.clear()
    before = torch.get_rng_state()
    together = hs.train_together(
        [
            hs.ArrayJob(hs.ArrayTrainer(task, eval_every=2, **F64), members(A, "a")),
            hs.ArrayJob(hs.ArrayTrainer(task, **F64), members(B, "b")),
        ]
    )
    assert torch.equal(torch.get_rng_state(), before)  # the caller's generator as it was
    for got, want in zip([*together[0], *together[1]], [*alone_a, *alone_b], strict=True):
        assert_same(got, want, rng=True)
    # a's 8 steps alternated with b's, then b went on alone for its other 16
    assert joint_steps == [2] * 8 + [1] * 16


def test_schedules_and_a_budget_train_the_same() -> None:
    """Under the ``ready`` schedule, two shards ahead, within a budget that cuts finer than
    alone (a quarter of it over the two arrays), each array still trains as alone."""
    task = toy_task()
    budget = {"device_memory": 256 * 1024}
    alone = [
        hs.ArrayTrainer(task, **F64, **budget).run(members(SGD[:2], "a")),
        hs.ArrayTrainer(task, **F64, **budget).run(members(ADAMW[:2], "b")),
    ]
    together = hs.train_together(
        [
            hs.ArrayJob(hs.ArrayTrainer(task, **F64, **budget), members(SGD[:2], "a")),
            hs.ArrayJob(hs.ArrayTrainer(task, **F64, **budget), members(ADAMW[:2], "b")),
        ],
        schedule="ready",
        prefetch_depth=2,
    )
    for got, want in zip([*together[0], *together[1]], [*alone[0], *alone[1]], strict=True):
        assert_same(got, want, rng=True)


def _refill(configs: list[dict[str, Any]], prefix: str) -> Callable[[], hs.Member | None]:
    """A refill hook giving a member per config, then none."""
    queue = list(members(configs, prefix))

    def refill() -> hs.Member | None:
        return queue.pop(0) if queue else None

    return refill


def test_refill_and_hooks_as_alone() -> None:
    """A member with a short budget ends, the refill hook fills its slot; reports and
    on_finish see what they see alone, in the same order."""
    task = toy_task()
    first = [{**SGD[0], "max_steps": 2}, SGD[2]]
    joining = [{**SGD[1], "max_steps": 3}]

    def job(log: list[str]) -> hs.ArrayJob:
        return hs.ArrayJob(
            hs.ArrayTrainer(task, eval_every=2, **F64),
            members(first, "a"),
            report=lambda evals: log.extend(f"report {e.member} {e.step}" for e in evals),
            refill=_refill(joining, "r"),
            on_finish=lambda r: log.append(f"finish {r.id} {r.status}"),
        )

    alone_log: list[str] = []
    j = job(alone_log)
    alone = j.trainer.run(j.members, report=j.report, refill=j.refill, on_finish=j.on_finish)
    alone_b = hs.ArrayTrainer(task, **F64).run(members(B[:1], "b"))
    log: list[str] = []
    together = hs.train_together(
        [job(log), hs.ArrayJob(hs.ArrayTrainer(task, **F64), members(B[:1], "b"))]
    )
    assert [r.id for r in alone] == ["a0", "a1", "r0"]
    assert log == alone_log and "finish r0 completed" in log
    for got, want in zip([*together[0], *together[1]], [*alone, *alone_b], strict=True):
        assert_same(got, want, rng=True)


def test_resume_mid_run_equals_uninterrupted(tmp_path) -> None:
    """One array's report crashes the joint run at its second evaluation: both stop, and
    resumed together from their checkpoints they end as trained alone without a crash."""
    task = toy_task()

    def trainer(name: str) -> hs.ArrayTrainer:
        return hs.ArrayTrainer(task, eval_every=2, checkpoint_dir=tmp_path / name, **F64)

    reference = [
        hs.ArrayTrainer(task, eval_every=2, **F64).run(members(SGD, "a")),
        hs.ArrayTrainer(task, eval_every=2, **F64).run(members(B, "b")),
    ]
    with pytest.raises(Crash):
        hs.train_together(
            [
                hs.ArrayJob(trainer("a"), members(SGD, "a"), report=crashing_report(2)),
                hs.ArrayJob(trainer("b"), members(B, "b")),
            ]
        )
    assert hs.ArrayTrainer.checkpointed_members(tmp_path / "b") == {"b0", "b1"}
    resumed = hs.train_together(
        [
            hs.ArrayJob(trainer("a"), members(SGD, "a"), resume=True),
            hs.ArrayJob(trainer("b"), members(B, "b"), resume=True),
        ]
    )
    for got, want in zip([*resumed[0], *resumed[1]], [*reference[0], *reference[1]], strict=True):
        assert_same(got, want, rng=True)


def test_out_of_memory_in_a_joint_step_splits_as_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    """An out-of-memory error in a joint step goes to every array in it: each restores its
    buffers and goes on as two halves, losing nothing."""
    task = toy_task()
    reference = [
        hs.ArrayTrainer(task, **F64).run(members(SGD, "a")),
        hs.ArrayTrainer(task, **F64).run(members(ADAMW[:2], "b")),
    ]
    step = AlternatingArrays.step
    calls = {"n": 0}

    def small_memory(self: AlternatingArrays, inputs: Any, losses: Any) -> Any:
        calls["n"] += 1
        if calls["n"] == 3:
            raise torch.OutOfMemoryError("simulated: CUDA out of memory")
        return step(self, inputs, losses)

    monkeypatch.setattr(AlternatingArrays, "step", small_memory)
    together = hs.train_together(
        [
            hs.ArrayJob(hs.ArrayTrainer(task, **F64), members(SGD, "a")),
            hs.ArrayJob(hs.ArrayTrainer(task, **F64), members(ADAMW[:2], "b")),
        ]
    )
    assert calls["n"] > 8  # the halves took turns too
    for got, want in zip([*together[0], *together[1]], [*reference[0], *reference[1]], strict=True):
        assert_same(got, want, rng=True)


def test_what_cannot_be_trained_together_is_refused(tmp_path) -> None:
    task = toy_task()
    off = hs.ArrayTrainer(task, offload="host")
    job = hs.ArrayJob(off, members(SGD[:1]))
    cases: list[tuple[Any, dict[str, Any], str]] = [
        ([], {}, "at least one ArrayJob"),
        ([off], {}, r"jobs\[0\] must be an ArrayJob, got ArrayTrainer"),
        (
            [hs.ArrayJob(hs.ArrayTrainer(task), members(SGD[:1]))],
            {},
            r"jobs\[0\].trainer has offload='none'.*offload='host'",
        ),
        (
            [hs.ArrayJob(hs.ArrayTrainer(task, offload="auto"), members(SGD[:1]))],
            {},
            r"offload='auto'",
        ),
        ([job, hs.ArrayJob(off, members(SGD[1:2]))], {}, r"jobs\[1\].trainer is another job's"),
        (
            [job, hs.ArrayJob(hs.ArrayTrainer(task, offload="host", device_memory=10**6), [])],
            {},
            r"jobs\[1\].trainer computes on cpu with device_memory=1000000, jobs\[0\]'s",
        ),
        (
            [
                hs.ArrayJob(hs.ArrayTrainer(task, offload="host", checkpoint_dir=tmp_path), []),
                hs.ArrayJob(hs.ArrayTrainer(task, offload="host", checkpoint_dir=tmp_path), []),
            ],
            {},
            r"jobs\[1\].trainer's checkpoint_dir .* is also jobs\[0\]'s",
        ),
        ([hs.ArrayJob(off, [], start_step=-1)], {}, r"jobs\[0\].start_step must be an int >= 0"),
        (
            [job],
            {"schedule": "fifo"},
            r"schedule must be one of \('lockstep', 'shifted', 'ready'\)",
        ),
        ([job], {"prefetch_depth": 0}, "prefetch_depth must be an int >= 1, got 0"),
    ]
    for jobs, kwargs, message in cases:
        with pytest.raises(ValueError, match=message):
            hs.train_together(jobs, **kwargs)


def test_one_job_is_its_run_and_a_bad_member_list_is_the_runs_error() -> None:
    task = toy_task()
    with pytest.raises(ValueError, match="at least one member"):
        hs.train_together([hs.ArrayJob(hs.ArrayTrainer(task, **F64), [])])
    alone = hs.ArrayTrainer(task, **F64).run(members(SGD[:2]))
    (together,) = hs.train_together([hs.ArrayJob(hs.ArrayTrainer(task, **F64), members(SGD[:2]))])
    for got, want in zip(together, alone, strict=True):
        assert_same(got, want, rng=True)


def test_engines_stepped_together_must_share_a_ledger_and_a_transfer() -> None:
    from _offload_toy import Net

    from hfsweep.offload import CpuTransfer, OffloadedArray, OffloadError, ResidentLedger

    arrays = [hs.fuse([Net(16, 0.0).double() for _ in range(2)]) for _ in range(2)]
    link, ledger = CpuTransfer(), ResidentLedger(None)
    shared = [OffloadedArray(a, transfer=link, ledger=ledger, cut="graph") for a in arrays]
    own = OffloadedArray(arrays[1], cut="graph")
    with pytest.raises(OffloadError, match="share one ledger and one transfer"):
        AlternatingArrays.of_engines([shared[0], own])
    with pytest.raises(OffloadError, match="the same engine twice"):
        AlternatingArrays.of_engines([shared[0], shared[0]])
    with pytest.raises(OffloadError, match="at least one array"):
        AlternatingArrays.of_engines([])
    with pytest.raises(OffloadError, match="schedule must be one of"):
        AlternatingArrays.of_engines(shared, schedule="fifo")  # type: ignore[arg-type]
    pair = AlternatingArrays.of_engines(shared, schedule="shifted")
    x = torch.randn(8, 12, dtype=torch.float64)
    losses = pair.step([x, x], [lambda o: o.square().mean()] * 2)
    assert len(losses) == 2 and ledger.resident == 0
    pair.close()
    own.close()
