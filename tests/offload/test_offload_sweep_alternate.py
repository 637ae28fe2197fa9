"""``fusion: {offload: host, alternate: N}``: ``hfsweep run`` trains N offloaded arrays at once,
their shards alternating (:class:`hfsweep.executors._alternating.AlternatingExecutor`).

Checked here: the option with its YAML path and what is valid; a sweep whose arrays did train
together (two arrays in one alternating step) ending with every trial as it trains alone
(``hs.retrain``) and the arrays' first trials as the one-at-a-time sweep's; and the executor's
contract with the engine, driven directly: hooks in the calling thread, one array's error
ending that array only, ``close()`` stopping the arrays (``Stopped``) and a resume from their
checkpoints ending as an uninterrupted run. The SIGKILL-and-resume of a whole sweep is the
lifecycle test's ``local-alternate`` case (``tests/test_lifecycle.py``).
"""

from __future__ import annotations

import csv
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from sweep._toy import TASK
from test_offload_sweep import BASE as OFFLOAD_SWEEP

import hfsweep as hs
from hfsweep.cli import main
from hfsweep.config import ConfigError, parse_sweep
from hfsweep.executors import ArrayHooks, Stopped
from hfsweep.executors._alternating import AlternatingExecutor
from hfsweep.offload import AlternatingArrays
from hfsweep.settings import YAML, ArraySettings, array_settings

#: test_offload_sweep's sweep, with six trials: three arrays of two
BASE: dict[str, Any] = {**OFFLOAD_SWEEP, "budget": {"trials": 6, "epochs": 1}}


def test_alternate_is_read_and_checked_with_its_yaml_path() -> None:
    assert parse_sweep(BASE).fusion.alternate == 1
    sweep = parse_sweep({**BASE, "fusion": {"offload": "host", "alternate": 3}})
    assert sweep.fusion.alternate == 3 and sweep.fusion.to_dict()["alternate"] == 3
    for offload in ("none", "auto"):
        with pytest.raises(
            ConfigError,
            match=rf"fusion\.alternate: 2 .* needs offload: host \(got offload: {offload}",
        ):
            parse_sweep({**BASE, "fusion": {"offload": offload, "alternate": 2}})
    assert parse_sweep({**BASE, "fusion": {"alternate": 1}}).fusion.alternate == 1
    with pytest.raises(ConfigError, match=r"fusion\.alternate: 0 \(int\) is not an integer"):
        parse_sweep({**BASE, "fusion": {"offload": "host", "alternate": 0}})
    with pytest.raises(ConfigError, match=r"fusion\.alternate: '2' \(str\) is not an integer"):
        parse_sweep({**BASE, "fusion": {"offload": "host", "alternate": "2"}})
    with pytest.raises(ConfigError, match=r"fusion\.alternate: 65 is more than 64 arrays"):
        parse_sweep({**BASE, "fusion": {"offload": "host", "alternate": 65}})


def test_alternate_is_read_for_the_ray_backend_and_refused_with_elastic_arrays() -> None:
    """On ``backend: ray`` each worker alternates its arrays (tests/sweep/test_ray_backend.py);
    elastic arrays, which refuse offload, refuse it with their offload."""
    pytest.importorskip("ray")
    fusion = {"offload": "host", "alternate": 2}
    assert parse_sweep({**BASE, "backend": "ray", "fusion": fusion}).fusion.alternate == 2
    with pytest.raises(ConfigError, match=r"fusion\.offload: 'host' is not supported with ray"):
        parse_sweep(
            {**BASE, "backend": "ray", "fusion": fusion, "ray": {"elastic": {"enabled": True}}}
        )


def _sweep(folder: Path, alternate: int) -> list[dict[str, str]]:
    data = {
        **BASE,
        "fusion": {
            "size": 2,
            "device": "cpu",
            "dtype": "float64",
            "offload": "host",
            "alternate": alternate,
        },
        "output": str(folder / f"run_{alternate}"),
    }
    sweep = folder / f"alternate_{alternate}.yaml"
    sweep.write_text(yaml.safe_dump(data), encoding="utf-8")
    assert main(["run", str(sweep), "--quiet"]) == 0
    with (folder / f"run_{alternate}" / "trials.csv").open(newline="") as f:
        return list(csv.DictReader(f))


def test_hfsweep_run_trains_arrays_together_each_trial_as_alone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    widths: list[int] = []
    of_engines = AlternatingArrays.of_engines.__func__  # type: ignore[attr-defined]

    def recorded(cls: type, engines: Any, **kw: Any) -> Any:
        widths.append(len(engines))
        return of_engines(cls, engines, **kw)

    monkeypatch.setattr(AlternatingArrays, "of_engines", classmethod(recorded))
    together = _sweep(tmp_path, 2)
    assert max(widths) == 2, widths  # two arrays' shards in one step: they trained together
    monkeypatch.undo()
    alone = _sweep(tmp_path, 1)
    assert [t["state"] for t in together] == ["COMPLETE"] * 6
    run = tmp_path / "run_2"
    for n in range(6):
        again = hs.retrain(run, n)
        assert again.matches, again.table()
    # the trials that started the two first arrays, as the one-at-a-time sweep trained them
    for a, b in zip(together[:4], alone[:4], strict=True):
        assert a["params_lr"] == b["params_lr"]
        assert float(a["value"]) == pytest.approx(float(b["value"]), rel=1e-7)


# ---------------------------------------------------------------- the executor, driven directly
def _executor(alternate: int = 2) -> AlternatingExecutor:
    return AlternatingExecutor(
        TASK,
        arrays=ArraySettings(
            device="cpu", dtype="float64", eval_every=2, offload="host", alternate=alternate
        ),
        final_states="all",
    )


def _members(tag: str, n: int = 2) -> list[hs.Member]:
    return [
        hs.Member(f"{tag}{i}", {"lr": 0.05 * (i + 1), "seed": i, "epochs": 2}) for i in range(n)
    ]


class _Array:
    """One array's calls to the executor, in a thread of its own, and what its hooks saw."""

    def __init__(
        self, ex: AlternatingExecutor, folder: Path, members: list[hs.Member], **kw: Any
    ) -> None:
        self.results: list[hs.MemberResult] = []
        self.threads: set[int] = set()
        self.error: BaseException | None = None
        self.reports = 0
        self.fail_at = kw.get("fail_at")
        self.on_report = kw.get("on_report")
        self.resume = kw.get("resume", False)
        self.ex, self.folder, self.members = ex, folder, members
        self.thread = threading.Thread(target=self._run)

    def _report(self, evaluations: Any) -> dict[str, bool]:
        self.threads.add(threading.get_ident())
        self.reports += 1
        if self.reports == self.fail_at:
            raise RuntimeError("the engine's report failed")
        if self.on_report is not None:
            self.on_report(self)
        return {}

    def _finish(self, result: hs.MemberResult) -> None:
        self.threads.add(threading.get_ident())
        self.results.append(result)

    def _run(self) -> None:
        hooks = ArrayHooks(report=self._report, refill=lambda: None, on_finish=self._finish)
        try:
            self.ex.run_array(self.folder, self.members, hooks, resume=self.resume)
        except BaseException as exc:
            self.error = exc


def _both(arrays: list[_Array]) -> None:
    for a in arrays:
        a.thread.start()
    for a in arrays:
        a.thread.join(timeout=120)
        assert not a.thread.is_alive()


def _alone(folder: Path, members: list[hs.Member]) -> dict[str, hs.MemberResult]:
    trainer = hs.ArrayTrainer(TASK, dtype=torch.float64, eval_every=2, checkpoint_dir=folder)
    return {r.id: r for r in trainer.run(members)}


def _same(got: list[hs.MemberResult], want: dict[str, hs.MemberResult]) -> None:
    assert sorted(r.id for r in got) == sorted(want)
    for r in got:
        w = want[r.id]
        assert (r.status, r.steps) == (w.status, w.steps)
        assert len(r.history) == len(w.history)
        for x, y in zip(r.history, w.history, strict=True):
            for k in x:
                assert x[k] == pytest.approx(y[k], rel=1e-7, abs=1e-12), (r.id, k)


def test_one_arrays_error_ends_that_array_only(tmp_path: Path) -> None:
    ex = _executor()
    a = _Array(ex, tmp_path / "a", _members("a"), fail_at=2)
    b = _Array(ex, tmp_path / "b", _members("b"))
    _both([a, b])
    ex.close()
    assert isinstance(a.error, RuntimeError) and "report failed" in str(a.error)
    assert b.error is None
    assert a.threads == {a.thread.ident} and b.threads == {b.thread.ident}  # hooks: own thread
    _same(b.results, _alone(tmp_path / "b_alone", _members("b")))


def test_close_stops_the_arrays_and_they_resume_to_the_same_end(tmp_path: Path) -> None:
    ex = _executor()
    closing = threading.Thread(target=ex.close)

    def close_once(array: _Array) -> None:
        if array.reports == 2 and not closing.is_alive() and closing.ident is None:
            closing.start()  # from another thread, as the engine closes on a failure

    a = _Array(ex, tmp_path / "a", _members("a"), on_report=close_once)
    b = _Array(ex, tmp_path / "b", _members("b"))
    _both([a, b])
    closing.join(timeout=120)
    assert isinstance(a.error, Stopped) and isinstance(b.error, Stopped)
    assert (tmp_path / "a" / "array.pt").exists() and (tmp_path / "b" / "array.pt").exists()
    with pytest.raises(Stopped):  # a closed executor starts nothing
        ex.run_array(
            tmp_path / "c", _members("c"), ArrayHooks(dict, lambda: None, print), resume=False
        )

    again = _executor()
    a2 = _Array(again, tmp_path / "a", [], resume=True)
    b2 = _Array(again, tmp_path / "b", [], resume=True)
    _both([a2, b2])
    again.close()
    assert a2.error is None and b2.error is None
    # they went on from their checkpoints: fewer than the 5 evaluations of a whole run
    assert 0 < a2.reports < 5 and 0 < b2.reports < 5, (a2.reports, b2.reports)
    _same(a.results + a2.results, _alone(tmp_path / "a_alone", _members("a")))
    _same(b.results + b2.results, _alone(tmp_path / "b_alone", _members("b")))


def _timed(record: list[tuple[float, float]], fn: Any) -> Any:
    def timed(*args: Any, **kw: Any) -> Any:
        start = time.monotonic()
        try:
            return fn(*args, **kw)
        finally:
            record.append((start, time.monotonic()))

    return timed


@pytest.mark.parametrize("where", ["engine", "hook"])
def test_a_profile_holds_the_arrays_between_two_steps(
    where: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``array_size`` while two arrays train: asked from another thread (the engine's loop
    sizing a new key) or from inside a hook call (the engine sizing one as it answers), the
    profile runs while no alternating step does, and the arrays then go on to the ends they
    have alone."""
    import hfsweep.sizing.task as sizing

    steps: list[tuple[float, float]] = []
    profiles: list[tuple[float, float]] = []
    monkeypatch.setattr(AlternatingArrays, "step", _timed(steps, AlternatingArrays.step))
    monkeypatch.setattr(sizing, "profile_task", _timed(profiles, sizing.profile_task))
    ex = _executor()
    sized: list[tuple[int, str]] = []
    asking: list[threading.Thread] = []

    def size() -> None:
        sized.append(ex.array_size({"lr": 0.1, "seed": 0, "epochs": 2}))

    def size_once(array: _Array) -> None:
        if array.reports == 2 and not asking:
            asking.append(threading.Thread(target=size))
            if where == "engine":
                asking[0].start()
            else:
                asking[0].run()  # in this hook call

    a = _Array(ex, tmp_path / "a", _members("a"), on_report=size_once)
    b = _Array(ex, tmp_path / "b", _members("b"))
    _both([a, b])
    if where == "engine":
        asking[0].join(timeout=120)
    ex.close()
    assert a.error is None and b.error is None
    assert len(sized) == 1 and sized[0][0] >= 1
    ((start, end),) = profiles
    assert not [s for s in steps if s[0] < end and start < s[1]]  # no step during the profile
    assert [s for s in steps if s[1] <= start] and [s for s in steps if s[0] >= end]
    _same(a.results, _alone(tmp_path / "a_alone", _members("a")))
    _same(b.results, _alone(tmp_path / "b_alone", _members("b")))


def test_the_executor_refuses_what_it_cannot_alternate() -> None:
    with pytest.raises(ValueError, match=r"needs offload='host', got offload='none'"):
        AlternatingExecutor(TASK, arrays=ArraySettings(device="cpu", alternate=2))
    with pytest.raises(ValueError, match=r"fusion\.alternate: 0 \(int\) is not an integer from 1"):
        array_settings({"alternate": 0, "offload": "host"}, YAML)
    assert _executor(3).slots == 3


def test_the_data_cache_keeps_one_dataset_per_array_trained_at_once() -> None:
    from hfsweep.training import DataCache

    built: list[int] = []
    task = hs.Task(
        name="counted",
        model=TASK.model,
        data=lambda config: built.append(config["batch_size"]) or TASK.data(config),
        defaults={**TASK.defaults},
    )
    cache = DataCache(entries=2)
    small, large = (task.resolve({"batch_size": b}) for b in (8, 16))
    for config in (small, large, small, large, small):
        cache.get(task, config)
    assert built == [8, 16]  # two keys at once: each built once
    one = DataCache()
    for config in (small, large, small):
        one.get(task, config)
    assert built == [8, 16, 8, 16, 8]  # one entry: each switch rebuilds
