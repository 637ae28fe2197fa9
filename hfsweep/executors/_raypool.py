"""The Ray backend's actors: reused across arrays, each in resources reserved for it, as many
at once as the cluster holds now.

An array's thread asks :meth:`ActorPool.acquire` for an actor. It gets an idle one at once; or,
while the cluster has room for more actors than exist (:meth:`ActorPool.width`), it reserves
one array's resources (a placement group) and starts an actor there. Every wait is short and
repeated, so a thread that waits for a reservation also sees an actor that has meanwhile become
idle (it takes that one and gives its reservation back), and a closed pool (Ctrl-C, an error
elsewhere) is noticed within :data:`_POLL_S`, whatever state the cluster is in.

:meth:`ActorPool.width` is the allocator's seam: how many arrays train at once, re-decided on
every call from the cluster's resources now (nodes lost or joined) and ``ray.max_concurrent``.

With ``capacity`` above one (``fusion.alternate``: offloaded arrays trained together on one
device), an actor trains up to that many arrays at once. An array still gets an actor of its
own while the cluster has room for one; it shares a busy actor only when it has none, the
least loaded first. An actor whose array failed takes no new array and is killed once its
last array has left it.
"""

from __future__ import annotations

import contextlib
import logging
import math
import threading
import time
from collections.abc import Callable
from typing import Any

from ._errors import ExecutorError, Stopped

__all__ = ["ActorPool"]

_log = logging.getLogger("hfsweep.ray")
#: seconds one wait of an acquiring thread lasts (Ray's placement wait takes whole seconds)
_POLL_S = 1
#: seconds the cluster's resources are cached for :meth:`ActorPool.width`
_RESOURCES_TTL_S = 1.0


class ActorPool:
    """Actors of one array's ``bundle`` of resources (see the module docstring).

    ``make_actor(group)`` starts an actor in the placement group ``group``; ``place_wait_s`` is
    how long a reservation may stay unplaced while the cluster's total says it fits (other work
    holds the resources, or no single node has them) before the pool goes on with the actors it
    has, or, having none, gives up with an :class:`ExecutorError`. ``most`` caps the actors
    (``ray.max_concurrent``); ``capacity`` is the most arrays one actor trains at once.
    """

    def __init__(
        self,
        bundle: dict[str, float],
        make_actor: Callable[[Any], Any],
        *,
        most: int | None,
        place_wait_s: Callable[[], float],
        capacity: int = 1,
    ) -> None:
        self.bundle = bundle
        self.capacity = capacity
        self._make_actor = make_actor
        self._most = most
        self._place_wait_s = place_wait_s
        self._cond = threading.Condition()
        self._idle: list[Any] = []
        self._load: dict[Any, int] = {}  # busy actor -> the arrays it trains now
        self._retired: set[Any] = set()  # busy actors that take no new array
        self._groups: dict[Any, Any] = {}  # actor -> the placement group reserved for it
        self._where: dict[Any, str] = {}  # actor -> its host, process and node
        self._actors = 0  # actors started (idle, busy or starting)
        self._pending = 0  # reservations not yet placed
        self._closed = False
        #: after a reservation stayed unplaced: (actors then, the cluster's fit then)
        self._capped: tuple[int, int] | None = None
        self._fit_cache: tuple[float, int] = (-math.inf, 0)

    # ------------------------------------------------------------------ width
    def fit(self) -> int:
        """How many bundles the cluster's alive nodes hold in all (cached for a second)."""
        import ray

        at, fit = self._fit_cache
        if time.monotonic() - at < _RESOURCES_TTL_S:
            return fit
        try:
            resources = ray.cluster_resources()
        except Exception:  # Ray is shutting down: the last answer
            return fit
        fits = [float(resources.get(k, 0.0)) / v for k, v in self.bundle.items() if v]
        fit = math.floor(min(fits) + 1e-9) if fits else 0
        self._fit_cache = (time.monotonic(), fit)
        return fit

    def width(self) -> int:
        """Arrays to train at once now: as many as the cluster's resources hold (at least one:
        arrays wait for a node rather than end), at most ``most``, and no more than the actors
        there are after a reservation could not be placed, until the cluster grows."""
        fit = self.fit()
        with self._cond:
            if self._capped is not None:
                actors, fit_then = self._capped
                if fit > fit_then:  # a node joined: try again
                    self._capped = None
                else:
                    fit = min(fit, actors)
        return max(1, min(fit, self._most or fit))

    # ------------------------------------------------------------------ actors
    def acquire(self, ready: Callable[[Any], Any]) -> Any:
        """An idle actor, or a new one in resources reserved for it; ``ready(actor)`` is an
        object ref a new actor answers once started. Raises :class:`Stopped` once closed."""
        group: Any = None
        since = time.monotonic()
        try:
            while True:
                room = self.width() if group is None else 0
                with self._cond:
                    if self._closed:
                        raise Stopped
                    if self._idle:
                        actor = self._idle.pop()
                        self._load[actor] = 1
                        return actor  # a reservation of ours is given back below
                    reserve = group is None and self._actors + self._pending < room
                    if reserve:
                        self._pending += 1
                    elif group is None:
                        shared = self._least_loaded()
                        if shared is not None:
                            self._load[shared] += 1
                            return shared
                if reserve:
                    group = self._reserve()
                    since = time.monotonic()
                if group is None:
                    with self._cond:
                        self._cond.wait(_POLL_S)
                    continue
                if group.wait(timeout_seconds=_POLL_S):
                    placed, group = group, None
                    return self._start(placed, ready)
                if time.monotonic() - since >= self._place_wait_s():
                    unplaced, group = group, None
                    self._unplaced(unplaced)
        finally:
            if group is not None:
                self._give_back(group)

    def _least_loaded(self) -> Any:
        """A busy actor with room for one more array (the least loaded) that has started, or
        ``None``; called holding the lock."""
        open_ = [
            (n, i, a)
            for i, (a, n) in enumerate(self._load.items())
            if n < self.capacity and a not in self._retired and a in self._where
        ]
        return min(open_)[2] if open_ else None

    def _reserve(self) -> Any:
        from ray.util.placement_group import placement_group

        try:
            return placement_group([dict(self.bundle)])
        except BaseException:
            with self._cond:
                self._pending -= 1
            raise

    def _give_back(self, group: Any) -> None:
        """Remove a reservation no actor uses."""
        from ray.util.placement_group import remove_placement_group

        with contextlib.suppress(Exception):  # the cluster may be gone
            remove_placement_group(group)
        with self._cond:
            self._pending -= 1
            self._cond.notify_all()

    def _start(self, group: Any, ready: Callable[[Any], Any]) -> Any:
        """An actor in the placed ``group``, once it answers ``ready``."""
        import ray
        from ray.exceptions import RayActorError

        with self._cond:
            self._pending -= 1
            self._actors += 1
        try:
            actor = self._make_actor(group)
        except BaseException:
            with self._cond:
                self._pending += 1  # given back as a reservation no actor uses
                self._actors -= 1
            self._give_back(group)
            raise
        with self._cond:
            self._groups[actor] = group
            self._load[actor] = 1
        try:
            ref = ready(actor)
            while not ray.wait([ref], timeout=_POLL_S)[0]:
                if self._closed:
                    raise Stopped
            where = ray.get(ref)
        except RayActorError as exc:
            self.release(actor, dead=True)
            if self._closed:
                raise Stopped from None
            raise ExecutorError(
                "a Ray worker could not start (is hfsweep, and the module defining the "
                f"task, importable on every node?): {exc}"
            ) from exc
        except BaseException:
            self.release(actor, dead=True)
            raise
        _log.info("Ray worker ready: %s", where)
        with self._cond:
            self._where[actor] = str(where)
        return actor

    def where(self, actor: Any) -> str:
        """``actor``'s host, process, device and node, as it said when it started."""
        with self._cond:
            return self._where.get(actor, "?")

    def _unplaced(self, group: Any) -> None:
        """A reservation stayed unplaced for ``place_wait_s``: give it back and go on with the
        actors there are, or give up when there is none."""
        self._give_back(group)
        with self._cond:
            actors = self._actors
            self._capped = (actors, self.fit())
        if actors == 0:
            raise ExecutorError(
                f"Ray could not place an array's actor ({self._describe()}) within "
                f"{self._place_wait_s():g} s: the cluster has no node for it now, other work "
                "holds its resources, or no single node has that much; lower ray.cpus_per_array "
                "or ray.gpus_per_array, or free or add nodes"
            )
        _log.warning(
            "Ray could not place another array's actor within %g s; going on with up to %d "
            "array(s) at once (more when nodes join)",
            self._place_wait_s(),
            self.width(),
        )

    def _describe(self) -> str:
        return f"{self.bundle.get('CPU', 0.0):g} CPUs, {self.bundle.get('GPU', 0.0):g} GPUs"

    def release(self, actor: Any, *, dead: bool = False) -> None:
        """``actor`` is done with one of its arrays: idle again once it trains none, or killed
        (``dead``: its process died, or it is in a state no other array may inherit; an actor
        still training other arrays takes no new one and is killed when the last leaves)."""
        with self._cond:
            left = self._load.get(actor, 1) - 1
            if dead:
                self._retired.add(actor)
            if left > 0:
                self._load[actor] = left
            else:
                self._load.pop(actor, None)
                if actor in self._retired or self._closed:
                    self._retired.discard(actor)
                    self._actors -= 1
                    self._kill(actor)
                else:
                    self._idle.append(actor)
            self._cond.notify_all()

    def _kill(self, actor: Any) -> None:
        """Kill ``actor`` and free the resources reserved for it."""
        import ray
        from ray.util.placement_group import remove_placement_group

        with contextlib.suppress(Exception):  # the cluster may be gone (Ctrl-C reaches it)
            ray.kill(actor, no_restart=True)
        self._where.pop(actor, None)
        group = self._groups.pop(actor, None)
        if group is not None:
            with contextlib.suppress(Exception):
                remove_placement_group(group)

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        """Kill every actor; threads waiting in :meth:`acquire` raise :class:`Stopped` within
        a second, and give their reservations back."""
        with self._cond:
            self._closed = True
            actors = [*self._idle, *self._load]
            self._idle.clear()
            self._cond.notify_all()
        for actor in actors:
            self._kill(actor)
