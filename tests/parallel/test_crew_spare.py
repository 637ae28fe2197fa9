"""The workers a Ray data-parallel array starts ahead of a grow (``_Crew.ahead``) follow its
resize request: started when a grow is asked, ended when the allocator withdraws or changes
it (its re-plan gave the resources to another array), so they never hold resources the plan
gave elsewhere. Ray is stood in for: segments are named groups, their ends recorded."""

from __future__ import annotations

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
