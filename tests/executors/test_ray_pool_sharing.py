"""The Ray backend's actor pool with ``capacity`` above one (``fusion.alternate``): an array gets
an actor of its own while the cluster has room for one, shares the least loaded busy actor only
when it has none, and an actor whose array failed takes no new array and is killed once its
last array has left it. Ray itself is stood in for: the pool's reservations and actor starts
are replaced, so what is checked is the pool's own bookkeeping."""

from __future__ import annotations

from typing import Any

import pytest

from hfsweep.executors._errors import Stopped
from hfsweep.executors._raypool import ActorPool


class _Pool(ActorPool):
    """An :class:`ActorPool` whose cluster holds ``fit`` bundles, whose reservations place at
    once and whose actors are names, their kills recorded."""

    def __init__(self, fit: int, capacity: int, most: int | None = None) -> None:
        self.made = 0
        super().__init__(
            {"CPU": 1.0},
            lambda group: f"actor-{self._next()}",
            most=most,
            place_wait_s=lambda: 0.0,
            capacity=capacity,
        )
        self._fit = fit
        self.killed: list[str] = []

    def _next(self) -> int:
        self.made += 1
        return self.made

    def fit(self) -> int:
        return self._fit

    def _reserve(self) -> Any:
        class _Placed:
            def wait(self, timeout_seconds: float) -> bool:
                return True

        return _Placed()

    def _start(self, group: Any, ready: Any) -> Any:
        with self._cond:
            self._pending -= 1
            self._actors += 1
        actor = self._make_actor(group)
        with self._cond:
            self._load[actor] = 1
            self._where[actor] = actor  # started
        return actor

    def _give_back(self, group: Any) -> None:
        with self._cond:
            self._pending -= 1

    def _kill(self, actor: Any) -> None:
        self.killed.append(actor)


def _acquire(pool: ActorPool) -> Any:
    return pool.acquire(lambda actor: None)


def test_arrays_get_actors_of_their_own_before_they_share_one() -> None:
    pool = _Pool(fit=2, capacity=2)
    a, b = _acquire(pool), _acquire(pool)
    assert a != b  # room for two actors: one each
    c = _acquire(pool)
    assert c in (a, b) and pool.made == 2  # no room for a third: shares one
    d = _acquire(pool)
    assert {c, d} == {a, b}  # the least loaded: each actor now trains two
    pool.release(c)
    assert _acquire(pool) == c  # the freed place, on the actor that had it
    pool.release(a)
    pool.release(a)
    assert pool.killed == [] and _acquire(pool) == a  # idle again, then taken first


def test_a_full_pool_waits_and_a_closed_one_stops_the_waiting() -> None:
    import threading

    pool = _Pool(fit=1, capacity=2)
    a, b = _acquire(pool), _acquire(pool)
    assert a == b
    got: list[Any] = []

    def wait() -> None:
        try:
            got.append(_acquire(pool))
        except Stopped:
            got.append("stopped")

    waiting = threading.Thread(target=wait)
    waiting.start()
    waiting.join(timeout=0.3)
    assert waiting.is_alive()  # both places of the one actor taken
    pool.release(a)
    waiting.join(timeout=5)
    assert got == [a]
    pool.close()
    assert pool.killed == [a]


def test_an_actor_whose_array_failed_takes_no_new_array_and_dies_with_its_last() -> None:
    pool = _Pool(fit=1, capacity=2)
    a, b = _acquire(pool), _acquire(pool)
    assert a == b
    pool.release(a, dead=True)  # one of its arrays failed: the other goes on
    assert pool.killed == []
    pool.release(a)  # its last array left it
    assert pool.killed == [a]
    c = _acquire(pool)
    assert c != a and pool.made == 2  # a new actor in its place


@pytest.mark.parametrize("capacity", [1, 3])
def test_the_actors_never_exceed_the_cluster_nor_max_concurrent(capacity: int) -> None:
    pool = _Pool(fit=4, capacity=capacity, most=2)
    held = [_acquire(pool) for _ in range(2 * capacity)]
    assert pool.made == 2
    assert all(held.count(actor) == capacity for actor in set(held))
