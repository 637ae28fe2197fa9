"""Elastic arrays on the Ray backend: an array trained data-parallel on the workers a policy
(the engine's allocator) gives it, its hooks relayed to the driver.

With ``ray.elastic.enabled`` every array of ``hfsweep run`` trains through
:func:`~hfsweep.parallel.train_data_parallel_ray`: k Ray actors in placement groups (those that
go on kept across a resize), k chosen by a :class:`WorkerPolicy` when the array starts and
again before every relaunch (a resize the policy asked for at an evaluation boundary, or
workers lost). Rank 0's actor calls
the engine's hooks; they must run in the driver (it holds the searcher, the scheduler and the
study), so rank 0 gets :class:`_Relay` hooks that put each call in a Ray queue and wait for the
driver's answer, which :func:`run_elastic_array` gives from the thread that called
``run_array``, as :mod:`hfsweep.executors._worker` does for a pooled actor. The driver therefore
sees the same sequence of hook calls as with one worker, and the engine's crash safety holds
unchanged (every array resumes from the checkpoint the trainer writes, whatever its k).

An elastic array is refilled as on one worker (rank 0 asks the driver, every worker gets the
member). A relaunch (a resize, or workers lost) is decided in the driver too: the launcher's
``target`` is relayed like a hook, so the driver can hand back, through ``requeue``, every live
member that the relaunch will not train: one a refill added after the checkpoint the relaunch
resumes from (a worker lost between the refill and the checkpoint written at that evaluation
boundary), which the trainer resumes without. It waits in its key's pool for a refill or a
later array, as with the pooled actors, instead of staying unfinished.

A pause (the policy's plan gives a running array no workers, after a node left) is a resize to
0 workers: the array stops at its next evaluation boundary, its actors and placement group are
given back, and the relayed ``target`` is not answered until the policy gives the array workers
again (:meth:`WorkerPolicy.waiting`, asked every ``_POLL_S``); it then resumes from the
checkpoint written at that boundary.

An array the policy gives no workers when it starts (the allocator leaves its trials waiting:
their workers do more growing the running arrays, or none is free) waits the same way before
its first launch, with no actor, queue or placement group, asking the policy every
``_POLL_S`` until a plan starts it.

The two Ray queues that relay rank 0's hooks live on the driver's node, so a worker node that
is lost takes only its workers with it, never the relay of an array that goes on without them.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

from ..training.results import Evaluation, MemberResult
from ..training.task import Task
from ..training.trainer import ArrayTrainer, Member
from ._errors import Stopped
from .base import ArrayHooks

__all__ = ["WorkerPolicy", "run_elastic_array"]

_log = logging.getLogger("hfsweep.ray")

#: seconds between the driver's looks at the relay queue (and at a stopping executor)
_POLL_S = 0.2


class WorkerPolicy(Protocol):
    """Who decides how many workers each elastic array trains on (the engine's allocator,
    :mod:`hfsweep.elastic.policy`). ``total`` is how many workers the cluster holds now; every
    method may ask other arrays to resize (:func:`~hfsweep.parallel.request_resize`)."""

    def started(
        self,
        folder: str,
        key: str,
        members: int,
        total: int,
        config: Mapping[str, Any] | None = None,
        *,
        resume: bool = False,
    ) -> int:
        """An array of compatibility key ``key`` starts (or, with ``resume``, resumes from its
        checkpoint) in ``folder``: the workers it starts on, or 0: it waits for workers (ask
        :meth:`waiting`). ``config`` is one of its trials' configs (None where not known), from
        which the policy may model the key's scaling."""
        ...

    def admits(self) -> int | None:
        """The most arrays the engine may hold now (``None``: no limit beyond the workers):
        while an array waits for workers, the engine forms no other."""
        ...

    def relaunch(self, folder: str, workers: int, lost: int, total: int) -> int:
        """The array in ``folder`` restarts from its checkpoint (a resize to ``workers``, 0 for
        a pause, or ``lost`` workers lost): the workers it goes on with, or 0 while it is
        paused (its workers given back; :meth:`waiting` says when it goes on)."""
        ...

    def waiting(self, folder: str, total: int) -> int:
        """The paused (or not yet started) array in ``folder`` asks again: the workers it goes
        on with, or 0."""
        ...

    def reported(self, folder: str, evaluations: Sequence[Evaluation], live: int) -> None:
        """The array reported ``evaluations``; ``live`` members go on (fewer: members
        stopped)."""
        ...

    def ended(self, folder: str, total: int) -> None:
        """The array in ``folder`` has ended (or stopped): its workers are free."""
        ...


class _Relay:
    """A hook of rank 0's actor that runs in the driver: the call goes through ``events`` (a
    Ray queue) with an id of its own, the answer comes back through ``answers`` with that id.
    An answer ``_ABORT`` (the driver is stopping, or its hook raised) makes the hook raise,
    which ends the array's workers. An answer with another id is dropped: it answers a call
    whose caller was lost meanwhile (a rank 0 on a node that left while the driver ran its
    hook), and must not be taken as the answer to the next call (the relaunch's, or the new
    rank 0's)."""

    def __init__(self, kind: str, events: Any, answers: Any) -> None:
        self.kind, self.events, self.answers = kind, events, answers

    def __call__(self, payload: Any) -> Any:
        call = uuid.uuid4().hex
        self.events.put((self.kind, payload, call))
        while True:
            answer = self.answers.get()
            if isinstance(answer, str) and answer == _ABORT:
                raise RuntimeError("the driver stopped this data-parallel array")
            answered, value = answer
            if answered == call:
                return value
            _log.info("a relayed %s dropped an answer to a lost caller's call", self.kind)


_ABORT = "hfsweep: abort"


class _Refill(_Relay):
    """The refill hook relayed (it takes no argument)."""

    def __init__(self, events: Any, answers: Any) -> None:
        super().__init__("refill", events, answers)

    def __call__(self) -> Any:  # type: ignore[override]
        return super().__call__(None)


def run_elastic_array(
    task: Task,
    folder: str,
    members: Sequence[Member],
    hooks: ArrayHooks,
    *,
    resume: bool,
    policy: WorkerPolicy,
    total: Callable[[], int],
    closed: Callable[[], bool],
    bundle: dict[str, float],
    threads: int,
    options: dict[str, Any],
) -> None:
    """Train ``members`` in ``folder`` data-parallel on the workers ``policy`` gives (see the
    module docstring); the hooks run in this thread. ``total()`` is the workers the cluster
    holds now; ``closed()`` says the executor is stopping (the array's workers are then ended
    and :class:`Stopped` raised); ``options`` are the trainer's."""
    from ray.util.queue import Empty, Queue

    from ..parallel import COLLECTIVE_TIMEOUT_S, train_data_parallel_ray

    if members:
        config: Mapping[str, Any] | None = members[0].config
        key, live = task.compatibility_key(members[0].config), {m.id for m in members}
    else:
        key, config, held = _checkpointed(folder)
        live = held - set(ArrayTrainer.delivered_results(folder))
    workers = policy.started(folder, key, max(1, len(live)), total(), config=config, resume=resume)
    try:
        while workers == 0:  # no worker for it yet: it waits, holding nothing
            if closed():
                raise Stopped
            time.sleep(_POLL_S)
            workers = policy.waiting(folder, total())
    except BaseException:
        policy.ended(folder, total())
        raise
    _log.info("%s trains data-parallel on %d worker(s)", folder, workers)
    where = _on_this_node()
    events = Queue(actor_options={"num_cpus": 0, **where})
    answers = Queue(actor_options={"num_cpus": 0, **where})
    outcome: dict[str, Any] = {}
    refilled: dict[str, Member] = {}
    heard = _Heard()

    relaunch = _Relay("relaunch", events, answers)

    def target(k: int, lost: int) -> int:
        return int(relaunch((k, lost)))

    def train() -> None:
        try:
            train_data_parallel_ray(
                task,
                members,
                workers=workers,
                checkpoint_dir=folder,
                resume=resume,
                report=_Relay("report", events, answers),
                refill=_Refill(events, answers),
                on_finish=_Relay("finish", events, answers),
                cpus_per_worker=bundle.get("CPU", 1.0),
                gpus_per_worker=bundle.get("GPU", 0.0),
                threads=threads,
                timeout_s=COLLECTIVE_TIMEOUT_S,
                target=target,
                **options,
            )
        except BaseException as exc:  # raised in this thread by the driver's loop below
            outcome["error"] = exc
        finally:
            outcome["done"] = True

    thread = threading.Thread(target=train, name=f"hfsweep-elastic {Path(folder).name}")
    thread.start()
    try:
        while not outcome.get("done"):
            if closed():
                answers.put(_ABORT)
                raise Stopped
            try:
                kind, payload, call = events.get(timeout=_POLL_S)
            except Empty:
                continue
            try:
                if kind == "relaunch":
                    _hand_back_unkept(folder, members, refilled, live, hooks)
                    k, lost = payload
                    answer = policy.relaunch(folder, k, lost, total())
                    while answer == 0:  # paused: its workers are ended, it waits here
                        if closed():
                            raise Stopped
                        time.sleep(_POLL_S)
                        answer = policy.waiting(folder, total())
                else:
                    answer = _answer(kind, payload, hooks, live, refilled, heard)
            except BaseException:
                answers.put(_ABORT)
                raise
            if kind == "report":
                policy.reported(folder, payload, len(live))
            answers.put((call, answer))
        thread.join()
        if "error" in outcome:
            raise outcome["error"]
    finally:
        policy.ended(folder, total())
        thread.join(timeout=30.0)
        for q in (events, answers):
            q.shutdown(force=True)


def _on_this_node() -> dict[str, Any]:
    """Ray actor options that place an actor on the driver's node (hard affinity): the relay
    queues must outlive any worker node. Empty where Ray is not initialised (tests that stand
    in for its queues) or the driver has no node (Ray Client)."""
    import ray

    if not ray.is_initialized():
        return {}
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    try:
        node = ray.get_runtime_context().get_node_id()
    except Exception:  # a driver without a node of its own (Ray Client): Ray's placement
        return {}
    if not node:
        return {}
    return {"scheduling_strategy": NodeAffinitySchedulingStrategy(node_id=node, soft=False)}


def _checkpointed(folder: str) -> tuple[str, Mapping[str, Any] | None, set[str]]:
    """``(compatibility key, a live member's resolved config or None, the members in training)``
    of the checkpoint in ``folder`` that an array resumes from without being given members:
    those in its slots, not the members that ended before it was written (delivered or not:
    a resume delivers the latter), so that the policy counts only the members that train on."""
    from ..training.packed import load as load_packed

    path = Path(folder) / "array.pt"
    if not path.exists():
        return f"resumed {folder}", None, set()
    payload = load_packed(path)
    slots = [
        slot
        for array in payload.get("arrays", [])
        for slot in array.get("slots", [])
        if slot is not None
    ]
    config = next((slot["resolved"] for slot in slots if "resolved" in slot), None)
    key = payload.get("key") or f"resumed {folder}"
    return str(key), config, {str(slot["id"]) for slot in slots}


def _hand_back_unkept(
    folder: str,
    members: Sequence[Member],
    refilled: Mapping[str, Member],
    live: set[str],
    hooks: ArrayHooks,
) -> None:
    """Before a relaunch: the live members that ``refill`` added (``refilled``) and the relaunch
    will not train (beyond its checkpoint, or, before the first checkpoint, beyond the members
    the array started with) go back to the engine through ``hooks.requeue`` and leave
    ``live``. Without a ``requeue`` hook they stay."""
    if hooks.requeue is None:
        return
    kept = ArrayTrainer.checkpointed_members(folder) or {m.id for m in members}
    for member in [m for m in refilled.values() if m.id in live and m.id not in kept]:
        _log.info("%s relaunches without %s (refilled after its checkpoint)", folder, member.id)
        live.discard(member.id)
        hooks.requeue(member)


class _Heard:
    """What the driver's hooks already heard from this array: the decision on every (member,
    step) reported, and the members whose end was told. A rank 0 lost after its call reached
    the driver (mid-hook, or before its checkpoint of that boundary was complete) never took
    the answer; the relaunch resumes from the last complete checkpoint and sends those calls
    again. They are answered from here, not applied twice: a replayed evaluation gets the
    decision taken then (the scheduler is not asked again, the study not told again), a
    replayed end is dropped."""

    def __init__(self) -> None:
        self.decisions: dict[tuple[str, int], bool] = {}
        self.ended: set[str] = set()


def _answer(
    kind: str,
    payload: Any,
    hooks: ArrayHooks,
    live: set[str],
    refilled: dict[str, Member],
    heard: _Heard,
) -> Any:
    """The driver's hook for one relayed call (a call heard before answered from ``heard``);
    ``live`` loses the members that stopped or ended, and gains (as ``refilled`` does) those a
    refill added."""
    if kind == "report":
        fresh = [e for e in payload if (e.member, e.step) not in heard.decisions]
        again = {
            e.member: heard.decisions[(e.member, e.step)]
            for e in payload
            if (e.member, e.step) in heard.decisions
        }
        if again:
            _log.info(
                "a relayed report of %s already heard (its caller was lost before it took the "
                "answer); the decisions taken then stand",
                ", ".join(f"{e.member} at step {e.step}" for e in payload if e.member in again),
            )
        decisions = dict(hooks.report(fresh) or {}) if fresh else {}
        for e in fresh:
            heard.decisions[(e.member, e.step)] = bool(decisions.get(e.member, True))
        decisions = {**{m: go for m, go in again.items() if not go}, **decisions}
        live.difference_update(m for m, go_on in decisions.items() if not go_on)
        return decisions
    if kind == "refill":
        member = hooks.refill()
        if member is not None:
            live.add(member.id)
            refilled[member.id] = member
        return member
    if kind == "finish":
        assert isinstance(payload, MemberResult)
        if payload.id in heard.ended:
            _log.info("a relayed end of %s already told; not told again", payload.id)
            return None
        heard.ended.add(payload.id)
        hooks.on_finish(payload)
        live.discard(payload.id)
        return None
    raise RuntimeError(f"unknown event {kind!r} from a data-parallel array's rank 0")
