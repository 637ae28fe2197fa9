"""The workers a Ray data-parallel array starts ahead of a grow (``_Crew.ahead``) follow its
resize request: started when a grow is asked, ended when the allocator withdraws or changes
it (its re-plan gave the resources to another array), so they never hold resources the plan
gave elsewhere; a segment interrupted while it starts (Ctrl-C) gives its placement group
back. Ray is stood in for: segments are named groups, their ends recorded."""

from __future__ import annotations

import sys
import types
from pathlib import Path
from typing import Any

import pytest

from hfsweep.parallel import _ray, request_resize


class _Group:
    made = 0

    def __init__(self) -> None:
        _Group.made += 1
        self.id = _Group.made


@pytest.fixture
def ended(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    ends: list[int] = []

    def segment(self: Any, n: int) -> tuple[_Group, list[str]]:
        group = _Group()
        return group, [f"actor-{group.id}-{i}" for i in range(n)]

    monkeypatch.setattr(_ray._Crew, "_segment", segment)
    monkeypatch.setattr(_ray._Crew, "_end", lambda self, seg: ends.append(seg[0].id))
    return ends


def _crew_of_two(folder: Path) -> tuple[Any, Any]:
    crew = _ray._Crew({"GPU": 1.0}, keep=True)
    crew.segments.append(crew._segment(2))
    return crew, types.SimpleNamespace(directory=folder, workers=2)


def test_a_withdrawn_grow_ends_the_workers_started_ahead(tmp_path: Path, ended: list[int]) -> None:
    crew, job = _crew_of_two(tmp_path)
    request_resize(tmp_path, 4)
    crew.ahead(job)
    assert crew.spare is not None and len(crew.spare[1]) == 2
    spare = crew.spare[0].id
    crew.ahead(job)  # the same request: kept
    assert crew.spare is not None and ended == []
    request_resize(tmp_path, 2)  # the allocator re-planned: no grow
    crew.ahead(job)
    assert crew.spare is None and ended == [spare]
    (tmp_path / "resize.json").unlink()
    crew.ahead(job)
    assert crew.spare is None and ended == [spare]


def test_a_changed_grow_restarts_the_workers_ahead_at_its_new_size(
    tmp_path: Path, ended: list[int]
) -> None:
    crew, job = _crew_of_two(tmp_path)
    request_resize(tmp_path, 3)
    crew.ahead(job)
    first = crew.spare[0].id
    request_resize(tmp_path, 4)
    crew.ahead(job)
    assert ended == [first] and crew.spare is not None and len(crew.spare[1]) == 2


class _FakeRay:
    """Ray's calls ``_Crew._segment`` makes, stood in for: placement groups and actors are
    recorded, and making actor number ``interrupt_at`` raises ``KeyboardInterrupt`` (Ctrl-C
    while a segment starts)."""

    def __init__(self, interrupt_at: int) -> None:
        self.interrupt_at = interrupt_at
        self.groups: list[_Group] = []
        self.removed: list[int] = []
        self.actors: list[str] = []
        self.killed: list[str] = []

    def modules(self) -> dict[str, types.ModuleType]:
        ray = types.ModuleType("ray")
        ray.remote = self.remote  # type: ignore[attr-defined]
        ray.kill = self.killed.append  # type: ignore[attr-defined]
        util = types.ModuleType("ray.util")
        groups = types.ModuleType("ray.util.placement_group")
        groups.placement_group = self.placement_group  # type: ignore[attr-defined]
        groups.remove_placement_group = lambda g: self.removed.append(g.id)  # type: ignore[attr-defined]
        strategies = types.ModuleType("ray.util.scheduling_strategies")
        strategies.PlacementGroupSchedulingStrategy = dict  # type: ignore[attr-defined]
        return {
            "ray": ray,
            "ray.util": util,
            "ray.util.placement_group": groups,
            "ray.util.scheduling_strategies": strategies,
        }

    def placement_group(self, bundles: list[dict[str, float]], strategy: str) -> _Group:
        group = _Group()
        self.groups.append(group)
        return group

    def remote(self, cls: type) -> Any:
        fake = self

        class _Options:
            def options(self, **kwargs: Any) -> Any:
                return self

            def remote(self) -> Any:
                if len(fake.actors) == fake.interrupt_at:
                    raise KeyboardInterrupt
                name = f"actor-{len(fake.actors)}"
                fake.actors.append(name)
                return types.SimpleNamespace(warm=types.SimpleNamespace(remote=lambda: None))

        return _Options()


@pytest.mark.parametrize("keep", [True, False])
def test_ctrl_c_while_a_segment_starts_gives_its_placement_group_back(
    monkeypatch: pytest.MonkeyPatch, keep: bool
) -> None:
    fake = _FakeRay(interrupt_at=1)
    for name, module in fake.modules().items():
        monkeypatch.setitem(sys.modules, name, module)
    crew = _ray._Crew({"CPU": 1.0}, keep=keep)
    with pytest.raises(KeyboardInterrupt):
        crew._segment(3)
    assert [g.id for g in fake.groups] == fake.removed  # the one group made is given back
    assert len(fake.killed) == len(fake.actors) == 1  # and the actor made before Ctrl-C ended
    assert crew.segments == [] and crew.spare is None
