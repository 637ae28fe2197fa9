"""The mailbox that carries the driver's answer to each array report back to its trainable.

A Tune function trainable only talks to the driver through ``tune.report``; the answer to a
report (which members go on, which new members join) has to come back another way. One named
Ray actor per sweep holds answers by report token: the driver posts the answer while it processes
the report (before Tune lets the trainable continue), the trainable takes it right after
``tune.report`` returns. The driver creates the actor (an actor created by a trainable would die
with it) and recreates it under the same name after ``Tuner.restore``. The driver ends it once
the search is finished and Tune has ended every array trial it started, so a finished sweep
leaves no process behind; an interrupted one keeps its hub until the restored experiment
finishes or Ray shuts down (``Tuner.restore`` in the same Ray session reuses it by name).
"""

from __future__ import annotations

import time
from typing import Any

__all__ = ["HubLink", "await_answer", "connect", "ensure_hub"]

#: how long a trainable waits for the hub to exist, and for an answer to its report
_CONNECT_TIMEOUT_S = 120.0
_ANSWER_TIMEOUT_S = 600.0


def _mailbox_class() -> type:
    """The actor's class (plain Python). Defined in a function so that Ray ships it by value:
    the actor's process then imports neither hfsweep nor torch and starts in a moment."""

    class Mailbox:
        """Answers by report token."""

        def __init__(self) -> None:
            self._box: dict[str, Any] = {}

        def post(self, token: str, message: Any) -> None:
            """Leave ``message`` for the report ``token``."""
            self._box[token] = message

        def take(self, token: str) -> Any:
            """The message for ``token`` (removed), or ``None`` if it has not come yet."""
            return self._box.pop(token, None)

    return Mailbox


def ensure_hub(name: str) -> Any:
    """The hub actor called ``name``, created from this (the driver's) process if absent, on
    the driver's node. Does not wait for it to start: the first post does.

    It needs no CPU, so Ray would place it on any node; on a worker node it would die with that
    node (a node lost mid-sweep) and take the whole experiment with it, although Tune's
    ``FailureConfig`` retries the arrays that trained there. On the driver's node it lives as
    long as the driver does."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    actor_class: Any = ray.remote(num_cpus=0, max_restarts=0)(_mailbox_class())
    here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
    return actor_class.options(name=name, get_if_exists=True, scheduling_strategy=here).remote()


class HubLink:
    """The driver's side: posts answers, and waits until the hub has each one."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._handle = ensure_hub(name)

    def post(self, token: str, message: dict[str, Any]) -> None:
        """Leave ``message`` for report ``token`` before Tune lets its trainable go on."""
        import ray

        ray.get(self._handle.post.remote(token, message))

    def close(self) -> None:
        """End the hub actor (its process goes with it). Called once the experiment needs no
        answers: a trainable still waiting on it would fail, so only when no array runs."""
        import ray

        ray.kill(self._handle, no_restart=True)


def connect(name: str) -> Any:
    """The trainable's side: the hub actor ``name`` (waits while the driver creates it)."""
    import ray

    deadline = time.monotonic() + _CONNECT_TIMEOUT_S
    while True:
        try:
            return ray.get_actor(name)
        except ValueError:
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"hfsweep: no actor {name!r} carries this array's decisions; the array "
                    "trainable must run under tune.Tuner with the searcher of the same "
                    "hfsweep.schedulers.tune.Fusion (fusion.searcher(...))"
                ) from None
            time.sleep(0.2)


def await_answer(handle: Any, token: str) -> dict[str, Any]:
    """The driver's answer to report ``token`` (it is posted before ``tune.report`` returns;
    waiting covers a driver that is slow to post)."""
    import ray

    deadline = time.monotonic() + _ANSWER_TIMEOUT_S
    pause = 0.005
    while True:
        message = ray.get(handle.take.remote(token))
        if message is not None:
            return dict(message)
        if time.monotonic() > deadline:
            raise RuntimeError(
                f"hfsweep: no answer from the driver to report {token} after "
                f"{_ANSWER_TIMEOUT_S:.0f} s; is the Tune searcher the Fusion's "
                "(fusion.searcher(...))?"
            )
        time.sleep(pause)
        pause = min(pause * 2, 0.2)
