"""Data-parallel arrays: k = 2 worker processes (gloo on loopback) train an array exactly as one
worker does (float64, several steps, SGD with momentum and AdamW, dropout, batches whose rows do
not divide by 2), a run resized 1 -> 2 -> 1 at evaluation boundaries equals an unresized one,
and an array whose worker is SIGKILLed goes on from its checkpoint with one worker, to the same
end."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from _dp_tasks import Recorder, make_task

import hfsweep as hs
from hfsweep.parallel import shard_bounds, shard_sizes, take_rows, train_data_parallel

#: float64 exactness (DESIGN.md, fusion rules)
RTOL, ATOL = 1e-7, 1e-10


def _members(optimizer: str) -> list[hs.Member]:
    """Three members with their own hyperparameters, dropout (0 for one), seeds; one clips its
    gradients (the norm of the global gradient, summed across workers first)."""
    base: dict[str, Any] = {"optimizer": optimizer, "epochs": 2}
    if optimizer == "sgd":
        per = [{"lr": 0.1, "momentum": 0.9}, {"lr": 0.05, "momentum": 0.5}, {"lr": 0.2}]
    else:
        per = [{"lr": 0.01, "weight_decay": 0.1}, {"lr": 0.003}, {"lr": 0.02, "beta1": 0.8}]
    extra = [{"dropout": 0.0}, {"dropout": 0.3, "grad_clip": 0.5}, {"dropout": 0.5}]
    return [
        hs.Member(f"{optimizer}{i}", {**base, **p, **e, "seed": 10 + i})
        for i, (p, e) in enumerate(zip(per, extra, strict=True))
    ]


def _close(a: Any, b: Any, where: str, rtol: float = RTOL, atol: float = ATOL) -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor), where
        if a.is_floating_point():
            torch.testing.assert_close(a, b, rtol=rtol, atol=atol, msg=where)
        else:
            assert torch.equal(a, b), where
    elif isinstance(a, dict):
        assert set(a) == set(b), where
        for k in a:
            _close(a[k], b[k], f"{where}.{k}", rtol, atol)
    elif isinstance(a, list | tuple):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            _close(x, y, f"{where}[{i}]", rtol, atol)
    elif isinstance(a, float):
        assert b == pytest.approx(a, rel=rtol, abs=atol), where
    else:
        assert a == b, where


def _same_results(expected: list[hs.MemberResult], got: list[hs.MemberResult]) -> None:
    """Same members, statuses, steps, histories, and final model, optimizer, schedule and
    dropout-stream states, within float64 rounding."""
    assert [r.id for r in got] == [r.id for r in expected]
    for e, g in zip(expected, got, strict=True):
        assert (g.status, g.steps, g.error) == (e.status, e.steps, e.error), e.id
        _close(e.history, g.history, f"{e.id}.history")
        _close(e.state, g.state, f"{e.id}.state")


def _reference(members: list[hs.Member], tmp_path: Path) -> list[hs.MemberResult]:
    """The array on one worker, in this process: the plain trainer."""
    trainer = hs.ArrayTrainer(
        make_task(), dtype=torch.float64, eval_every=3, checkpoint_dir=tmp_path / "reference"
    )
    return trainer.run(members)


def _killed_worker_run(launch: Callable[..., Any], optimizer: str, tmp_path: Path) -> None:
    """Two workers through ``launch`` (the process or the Ray launcher), worker 1 SIGKILLed as it
    draws the 8th batch: the evaluations at steps 3 and 6 come from 2 workers, those at 9 and 12
    from 1, every member ends once, and the results equal the unkilled 1-worker array's."""
    members = [hs.Member(m.id, {**m.config, "kill_after": 7}) for m in _members(optimizer)]
    expected = _reference(members, tmp_path)  # one process: nobody is killed
    directory = tmp_path / "dp"
    recorder = Recorder(str(tmp_path / "log.txt"), str(directory))
    got = launch(
        make_task(),
        members,
        workers=2,
        checkpoint_dir=directory,
        report=recorder,
        on_finish=recorder.finished,
        dtype=torch.float64,
        eval_every=3,
        timeout_s=30,
    )
    _same_results(expected, got)
    lines = recorder.lines()
    first = f"{optimizer}0"
    workers = [(int(line[2]), int(line[3])) for line in lines if line[:2] == ["eval", first]]
    assert workers == [(3, 2), (6, 2), (9, 1), (12, 1)]
    done = sorted(line[1] for line in lines if line[0] == "done")
    assert done == [f"{optimizer}{i}" for i in range(3)]


def test_shards_differ_by_at_most_one_row_and_cover_the_batch() -> None:
    assert shard_sizes(31, 2) == [16, 15]
    assert shard_sizes(5, 2) == [3, 2]
    assert shard_sizes(10, 3) == [4, 3, 3]
    assert shard_sizes(1, 2) == [1, 0]
    assert [shard_bounds(10, 3, r) for r in range(3)] == [(0, 4), (4, 7), (7, 10)]
    x, y = torch.arange(20).view(10, 2), torch.arange(10)
    cut = take_rows({"x": x, "pair": (y, "label")}, 4, 7)
    assert torch.equal(cut["x"], x[4:7]) and torch.equal(cut["pair"][0], y[4:7])
    assert cut["pair"][1] == "label"
    with pytest.raises(ValueError, match="first dimensions differ"):
        take_rows((x, y[:3]), 0, 2)


@pytest.mark.slow
@pytest.mark.parametrize(("optimizer", "batch_size"), [("sgd", 31), ("adamw", 53)])
def test_two_workers_train_the_array_exactly_as_one(
    optimizer: str, batch_size: int, tmp_path: Path
) -> None:
    """Two epochs, evaluated every 3 steps on validation batches of 13 rows (7 + 6 per
    worker). SGD: batches of 31 rows (16 + 15) and a last batch of 5 (3 + 2). AdamW: batches
    of 53 (27 + 26) and a last batch of 1 row, which worker 1 has none of (it adds zero
    gradient and takes rank 0's dropout counters)."""
    members = [hs.Member(m.id, {**m.config, "batch_size": batch_size}) for m in _members(optimizer)]
    expected = _reference(members, tmp_path)
    got = train_data_parallel(
        make_task(),
        members,
        workers=2,
        checkpoint_dir=tmp_path / "dp",
        dtype=torch.float64,
        eval_every=3,
        timeout_s=60,
    )
    assert [r.steps for r in expected] == [-(-160 // batch_size) * 2] * 3
    _same_results(expected, got)


@pytest.mark.slow
@pytest.mark.timeout(1800)  # each worker compiles four shard sizes on a shared 2-core CPU
def test_a_compiled_array_on_two_workers_matches_the_uncompiled_one(tmp_path: Path) -> None:
    """``compile=True`` on a data-parallel array (``ray.elastic`` with ``fusion.compile``): each
    worker compiles its shards' forward and backward, the loss and the optimizer's update, and
    the array ends as the uncompiled one on two workers, within the compiled step's tolerance
    (float32, rtol 1e-4 / atol 1e-5, as tests/fusion/test_compile.py). One epoch of SGD with
    dropout and clipping: batches of 31 rows (16 + 15) and a last one of 5 (3 + 2). Both
    workers' processes ran the loss compiled (its mark, tests/sweep/_compile_marks.py).

    This process compiles an array first, as a driver that profiled would: workers forked from
    a parent that compiled once hung at their first compile, in the compile thread pool they
    inherit without its threads."""
    from sweep._compile_marks import marked, marks

    from hfsweep.testing import MLP

    parent = hs.fuse([MLP(d_in=6, hidden=5, d_out=3) for _ in range(2)], compile=True)
    parent(torch.randn(4, 6)).sum().backward()
    assert parent._compile_seconds > 0
    task = marked(make_task())
    members = [hs.Member(m.id, {**m.config, "epochs": 1}) for m in _members("sgd")]
    runs = {}
    before = marks()
    for compile in (False, True):
        runs[compile] = train_data_parallel(
            task,
            members,
            workers=2,
            checkpoint_dir=tmp_path / str(compile),
            eval_every=3,
            timeout_s=900,  # a worker may wait at a collective while the other compiles
            compile=compile,
        )
    assert len(marks() - before) == 2  # the two workers, and only with compile on
    expected, got = runs[False], runs[True]
    assert [r.id for r in got] == [r.id for r in expected]
    for e, g in zip(expected, got, strict=True):
        assert (g.status, g.steps, g.error) == (e.status, e.steps, e.error), e.id
        _close(e.history, g.history, f"{e.id}.history", rtol=1e-4, atol=1e-5)
        _close(e.state, g.state, f"{e.id}.state", rtol=1e-4, atol=1e-5)


@pytest.mark.slow
def test_an_array_resized_one_two_one_equals_the_unresized_array(tmp_path: Path) -> None:
    """The report hook (rank 0) asks for 2 workers at step 3 and for 1 again at step 9: the
    array stops at those evaluation boundaries and goes on from its checkpoint."""
    members = _members("sgd")
    expected = _reference(members, tmp_path)
    directory = tmp_path / "dp"
    directory.mkdir()
    recorder = Recorder(str(tmp_path / "log.txt"), str(directory), {3: 2, 9: 1})
    got = train_data_parallel(
        make_task(),
        members,
        workers=1,
        checkpoint_dir=directory,
        report=recorder,
        on_finish=recorder.finished,
        dtype=torch.float64,
        eval_every=3,
        timeout_s=60,
    )
    _same_results(expected, got)
    lines = recorder.lines()
    # every evaluation once, on the workers asked for from the boundary after the request
    workers = [(int(line[2]), int(line[3])) for line in lines if line[:2] == ["eval", "sgd0"]]
    assert workers == [(3, 1), (6, 2), (9, 2), (12, 1)]
    assert sorted(line[1] for line in lines if line[0] == "done") == ["sgd0", "sgd1", "sgd2"]
    assert not (directory / "resize.json").exists()


@pytest.mark.slow
def test_a_killed_worker_leaves_the_array_on_fewer_workers_from_its_checkpoint(
    tmp_path: Path,
) -> None:
    """Worker 1 SIGKILLs itself as it draws the 8th batch (step 8; checkpoints at steps 3 and
    6): the array goes on from step 6 on one worker and ends as the unkilled array does."""
    _killed_worker_run(train_data_parallel, "adamw", tmp_path)
