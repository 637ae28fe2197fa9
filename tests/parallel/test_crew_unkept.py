"""A Ray worker actor that could not leave its process group (``destroy_process_group``
raised) is not kept across a resize: it says so (:meth:`_Worker.train`), and the crew ends its
segment and keeps the others, so the next launch starts a fresh actor in its place instead of
failing, a launch later, as a confusing worker error. Ray, ``torch.distributed`` and the
trainer are stood in for."""

from __future__ import annotations

import sys
import types
from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist

from hfsweep.parallel import _launch, _ray
from hfsweep.parallel._run import ResizeRequested


def _job(folder: Path, workers: int) -> Any:
    return types.SimpleNamespace(
        directory=folder,
        workers=workers,
        backend="gloo",
        task=None,
        members=[],
        report=None,
        refill=None,
        on_finish=None,
        resume=False,
    )


class _Resizing:
    """The data-parallel trainer, stood in for: its run ends in a resize to 3."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def run(self, *args: Any, **kwargs: Any) -> Any:
        raise ResizeRequested(3)


@pytest.mark.parametrize("leaves", [True, False])
def test_a_worker_that_cannot_leave_its_process_group_says_it_cannot_train_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, leaves: bool
) -> None:
    group = {"up": False}

    def init(*args: Any, **kwargs: Any) -> None:
        group["up"] = True

    def destroy() -> None:
        if not leaves:
            raise RuntimeError("stand-in: the process group would not shut down")
        group["up"] = False

    monkeypatch.setattr(dist, "init_process_group", init)
    monkeypatch.setattr(dist, "destroy_process_group", destroy)
    monkeypatch.setattr(dist, "is_initialized", lambda: group["up"])
    monkeypatch.setattr(_launch, "DataParallelTrainer", _Resizing)
    got = _ray._Worker().train(1, "127.0.0.1:1", _job(tmp_path, 4), 1, 10.0, {})
    assert got == (("resize", None), leaves)


class _Actor:
    """A worker actor stood in for: ``train`` answers ``("resize", 3)`` and whether it left
    its process group (``reusable``)."""

    def __init__(self, name: str, reusable: bool = True) -> None:
        self.name = name
        outcome = (("resize", 3), reusable)
        self.rendezvous = types.SimpleNamespace(remote=lambda: "127.0.0.1:1")
        self.train = types.SimpleNamespace(remote=lambda rank, *args: outcome)


def _fake_ray() -> dict[str, types.ModuleType]:
    """``ray`` and ``ray.exceptions`` as ``_train_on`` uses them: a ref is its value."""
    ray = types.ModuleType("ray")
    ray.get = lambda ref: ref  # type: ignore[attr-defined]
    ray.wait = lambda pending, num_returns, timeout: (pending[:1], pending[1:])  # type: ignore[attr-defined]
    exceptions = types.ModuleType("ray.exceptions")

    class RayActorError(Exception):
        pass

    exceptions.RayActorError = RayActorError  # type: ignore[attr-defined]
    return {"ray": ray, "ray.exceptions": exceptions}


def test_a_resize_ends_the_segment_of_an_actor_that_cannot_train_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name, module in _fake_ray().items():
        monkeypatch.setitem(sys.modules, name, module)
    ended: list[str] = []
    monkeypatch.setattr(_ray._Crew, "_end", lambda self, seg: ended.append(seg[0].id))
    crew = _ray._Crew({"CPU": 1.0}, keep=True)
    # ranks 0, 1 in segment "a", ranks 2, 3 in "b"; rank 1 did not leave its process group
    a, b = types.SimpleNamespace(id="a"), types.SimpleNamespace(id="b")
    crew.segments = [
        (a, [_Actor("a0"), _Actor("a1", reusable=False)]),
        (b, [_Actor("b0"), _Actor("b1")]),
    ]
    crew.placed = {"a", "b"}  # both placed: nothing waits
    outcome = _ray._launch(_job(tmp_path, 4), crew, 1, 10.0, 10.0, {})
    assert outcome == ("resize", 3)
    # "a" is ended whole; "b" goes on (the resize to 3 keeps both its actors, the next launch
    # starts one fresh actor beside them)
    assert ended == ["a"]
    assert [a.name for a in crew.actors] == ["b0", "b1"]
