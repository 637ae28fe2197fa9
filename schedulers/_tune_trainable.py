"""The array trainable: one Tune trial trains one fused array, through the local executor
(:class:`hfsweep.executors.LocalExecutor`, which trains it with :class:`hfsweep.ArrayTrainer`).

Its config holds the array's members (under ``config["hfsweep"]``). After each evaluation the
trainer's report hook sends every evaluated member's metrics with ``tune.report`` (one JSON
string under ``"hfsweep"``, next to the array's best current value under the sweep's metric)
and a Tune checkpoint of the trainer's checkpoint directory; it then takes the driver's answer
from the hub: which members go on, and new members for freed slots. Members that joined through
refill and wait for a slot are saved with the checkpoint, so a restored array gets exactly what
the original had. Each evaluation carries the member's own training time since it joined the
array (the driver's per-member ``time_total_s``), saved with the checkpoint too, so a member that
joins late is not older than it is, and a retry or restore does not restart members' clocks.

The checkpoint sent with a report is the trainer's state as of its previous save (the trainer
saves after a report's decisions are applied), so a restored array replays the evaluations of its
last report; the driver answers those from its decision log.

The same checkpoint carries the weights of each member that ended complete (trained to its
budget, or stopped where the driver counts it complete, e.g. at ASHA's ``max_t``): the model's
``state_dict`` of each, saved with ``torch.save`` to ``weights/<member id>.pt`` as it ends, so
every later checkpoint of the array (and the last one, sent with the array's final word) holds
them, readable with ``torch.load(..., weights_only=True)``. Pruned and failed members' weights are
not kept.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import shutil
import tempfile
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from hfsweep._checks import is_finite
from hfsweep._io import atomic_save
from hfsweep.core.status import Status
from hfsweep.executors import ArrayHooks, LocalExecutor
from hfsweep.settings import ArraySettings
from hfsweep.sizing.device import DTYPES, resolve_device
from hfsweep.training import Evaluation, Member, MemberResult
from hfsweep.training.task import Task

from ._tune_format import META, WEIGHTS_DIR, weights_file
from ._tune_hub import await_answer, connect

__all__ = [
    "DTYPES",
    "TrainSpec",
    "make_executor",
    "make_trainable",
    "refusal",
    "with_parameters_refused",
]

#: the file in the trainer's checkpoint directory that holds the channel's own state
_CHANNEL_FILE = "hfsweep_channel.json"
#: the name Tune shows for (and ``Tuner.restore`` checks of) the array trainable
TRAINABLE_NAME = "hfsweep_array"


@dataclass(frozen=True)
class TrainSpec:
    """How a worker trains an array: the task (an :class:`hfsweep.Task`, or a name that
    ``hfsweep`` resolves: a ready task, ``module:attribute``, ``/abs/path.py:attribute``), the
    sweep's array settings (:class:`~hfsweep.settings.ArraySettings`: device,
    ``"auto"`` meaning CUDA when the worker sees a GPU, dtype, evaluation period, shared frozen
    tensors, compile, offload), and whether arrays trace their forwards."""

    task: Task | str
    arrays: ArraySettings = field(default_factory=ArraySettings)
    trace: bool = True

    def load_task(self) -> Task:
        """The task object (loaded in the worker when given by name)."""
        if isinstance(self.task, Task):
            return self.task
        from hfsweep.config.entry import load_task

        return load_task(self.task)

    def torch_device(self) -> torch.device:
        """The device this worker trains on."""
        return torch.device(resolve_device(self.arrays.device))


def make_trainable(spec: TrainSpec) -> Callable[[dict[str, Any]], None]:
    """A Tune function trainable that trains the array in its config as ``spec`` says.

    Wrapped in ``tune.with_parameters(..., name=object)`` it refuses to train (see
    :func:`refusal`): it sends the refusal as its only report, and the driver stops the
    experiment with it before any array trains."""

    def hfsweep_array(config: dict[str, Any], **params: Any) -> None:
        if params:
            _refuse(config, with_parameters_refused(sorted(params)))
            return
        train_array(config, spec)

    hfsweep_array.__name__ = hfsweep_array.__qualname__ = TRAINABLE_NAME
    return hfsweep_array


def train_array(config: Mapping[str, Any], spec: TrainSpec) -> None:
    """Train the array ``config[META]`` describes, resuming from Tune's checkpoint if any."""
    from ray import tune

    meta = config.get(META)
    if not isinstance(meta, Mapping) or "members" not in meta:
        raise ValueError(
            f"the hfsweep array trainable got a config without {META!r} members (keys: "
            f"{sorted(config)}); it trains the trials a Fusion's searcher suggests "
            "(tune.TuneConfig(search_alg=fusion.searcher(...)))"
        )
    task = spec.load_task()
    work = Path(tempfile.mkdtemp(prefix="hfsweep-array-"))
    try:
        checkpoint = tune.get_checkpoint()
        resume = False
        if checkpoint is not None:
            checkpoint.to_directory(str(work))
            resume = (work / "array.pt").exists()
        channel = _Channel(connect(str(meta["hub"])), meta, work, resumed=resume)
        executor = make_executor(spec, task)
        members = [Member(str(m["id"]), dict(m["config"])) for m in meta["members"]]
        with executor:
            hooks = ArrayHooks(
                report=channel.report, refill=channel.refill, on_finish=channel.on_finish
            )
            executor.run_array(work, members, hooks, resume=resume)
        channel.close()
    finally:
        shutil.rmtree(work, ignore_errors=True)


def with_parameters_refused(names: Sequence[str]) -> str:
    """Why the array trainable refuses ``tune.with_parameters(fusion.trainable, ...)`` with
    objects called ``names``, and what to do instead."""
    given = ", ".join(f"{n}=..." for n in names)
    return (
        f"tune.with_parameters(fusion.trainable, {given}) cannot pass objects to a fused "
        "array: an hfsweep task builds each member's model and data from its config alone "
        "(Task.model(config), Task.data(config)), in the worker that trains the array, and "
        "the same task runs under `hfsweep run` and hs.sweep. Load the data inside the task's "
        "data function (it runs in each worker; keep it in a module-level cache to load it "
        "once per worker), put small settings in param_space, and pass fusion.trainable to "
        "tune.Tuner as it is (tune.with_resources(fusion.trainable, ...) is fine)"
    )


def refusal(result: Mapping[str, Any] | None) -> str | None:
    """The refusal an array trainable sent as its report ``result`` (a Tune result), if any:
    the driver raises it, so that the experiment stops before an array trains."""
    raw = (result or {}).get(META)
    if not isinstance(raw, str) or _REFUSED not in raw:
        return None
    try:
        data = json.loads(raw)
    except ValueError:
        return None
    found = data.get(_REFUSED) if isinstance(data, Mapping) else None
    return str(found) if found else None


#: the key of a trainable's refusal in its report's payload (see :func:`refusal`)
_REFUSED = "refused"


def _refuse(config: Mapping[str, Any], message: str) -> None:
    """Send ``message`` as this array's only report, untrained (no checkpoint): the driver
    raises it (:func:`refusal`)."""
    from ray import tune

    meta = config.get(META)
    metric = str(meta.get("metric")) if isinstance(meta, Mapping) else "hfsweep_refused"
    payload = {"token": uuid.uuid4().hex, "evaluations": [], "final": True, _REFUSED: message}
    tune.report({metric: math.nan, META: json.dumps(payload)})


def make_executor(spec: TrainSpec, task: Task) -> LocalExecutor:
    """The executor that trains a trial's array in the worker, as ``spec`` says."""
    return LocalExecutor(
        task,
        arrays=dataclasses.replace(spec.arrays, device=str(spec.torch_device())),
        trace=spec.trace,
        # a stopped member may be one the driver counts complete (at the scheduler's
        # budget): the channel keeps the weights of those and of the completed ones
        final_states="all",
    )


class _Channel:
    """The trainable's side of the conversation with the driver, for one array.

    It keeps the array's training clock (seconds of this array's training, summed over the
    runs of its trainable: a retry or restore goes on from the time saved with the checkpoint)
    and the clock reading at which each member joined, so every evaluation carries the
    member's own training time (``time``): what the driver reports as the member's
    ``time_total_s``. ``clock`` is the time source (``time.monotonic``; tests pass a fake).
    """

    def __init__(
        self,
        hub: Any,
        meta: Mapping[str, Any],
        work: Path,
        *,
        resumed: bool,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.hub = hub
        self.resumed = resumed  # said in the first report only
        self.work = work
        self.metric = str(meta["metric"])
        self.sign = 1.0 if meta["mode"] == "max" else -1.0
        saved = work / _CHANNEL_FILE
        state = json.loads(saved.read_text()) if saved.exists() else {}
        #: how many refill members the driver has handed this array, and those not yet started
        self.consumed = int(state.get("consumed", 0))
        self.queue: list[dict[str, Any]] = list(state.get("queue", []))
        self.ended: list[dict[str, Any]] = []
        #: members the driver stopped and counts complete: their weights are kept
        self.complete: set[str] = {str(m) for m in state.get("complete", [])}
        self.latest: dict[str, float] = {}
        self._clock = clock
        self.start = clock()
        #: the array's training time when this run of the trainable started (0, or the time
        #: saved with the checkpoint it resumes from)
        self.offset = float(state.get("clock", 0.0))
        #: the array clock when each member joined (the array's first members at 0)
        self.joined: dict[str, float] = {
            str(k): float(v) for k, v in state.get("joined", {}).items()
        }
        for m in meta["members"]:
            self.joined.setdefault(str(m["id"]), 0.0)
        #: the array clock when the trainer last saved its checkpoint (right after a report
        #: and its refills), saved with that checkpoint
        self.mark = self.offset

    def now(self) -> float:
        """The array's training time, in seconds (kept through retries and restores)."""
        return self.offset + self._clock() - self.start

    def member_time(self, member: str) -> float:
        """``member``'s own training time: the array's time since the member joined."""
        return max(self.now() - self.joined.setdefault(member, 0.0), 0.0)

    # ------------------------------------------------------------------ trainer hooks
    def report(self, evaluations: list[Evaluation]) -> dict[str, bool]:
        """Send this evaluation's members to the driver; return its decisions."""
        token = uuid.uuid4().hex
        for e in evaluations:
            value = e.metrics.get(self.metric)
            if is_finite(value):
                self.latest[e.member] = float(value)
        payload = {
            "token": token,
            "elapsed": self.now(),
            "evaluations": [
                {
                    "member": e.member,
                    "step": e.step,
                    "epoch": e.epoch,
                    "metrics": e.metrics,
                    "final": e.final,
                    "time": self.member_time(e.member),
                }
                for e in evaluations
            ],
            "ended": self.ended,
            "consumed": self.consumed,
            "queued": len(self.queue),
            "resumed": self.resumed,
        }
        self.resumed = False
        self._send(payload, checkpoint=True)
        self.ended = []
        answer = await_answer(self.hub, token)
        given = list(answer.get("given", []))
        self.queue.extend(given)
        self.consumed += len(given)
        self.complete.update(str(m) for m in answer.get("complete", []))
        self.mark = self.now()  # the trainer saves next (after its refills)
        return {str(k): bool(v) for k, v in answer["go"].items()}

    def refill(self) -> Member | None:
        """A member the driver handed this array for a freed slot, or ``None``. Its clock
        starts now."""
        if not self.queue:
            return None
        m = self.queue.pop(0)
        self.mark = self.now()
        self.joined[str(m["id"])] = self.mark
        return Member(str(m["id"]), dict(m["config"]))

    def on_finish(self, result: MemberResult) -> None:
        """Note how a member ended; it goes with the next report. A complete member's weights
        go to :data:`WEIGHTS_DIR`, so the next checkpoint carries them (the trainer calls
        this at least once per member: a repeat after a resume writes the same file again)."""
        kept = result.status == Status.COMPLETED or (
            result.status == Status.STOPPED and result.id in self.complete
        )
        if kept and result.state is not None:
            atomic_save(result.state["model"], self.work / WEIGHTS_DIR / weights_file(result.id))
        self.ended.append(
            {
                "member": result.id,
                "status": result.status,
                "steps": result.steps,
                "error": result.error,
            }
        )

    def close(self) -> None:
        """The array is done: tell the driver about ends not yet reported and hand back
        members that never got a slot. The report carries the last checkpoint: it holds the
        weights of the members that ended since the previous one."""
        if not self.ended and not self.queue:
            return
        payload = {
            "token": uuid.uuid4().hex,
            "elapsed": self.now(),
            "evaluations": [],
            "ended": self.ended,
            "unused": [m["id"] for m in self.queue],
            "consumed": self.consumed,
            "queued": len(self.queue),
            "final": True,
        }
        self.queue = []  # handed back: the checkpoint must not start them again
        self._send(payload, checkpoint=True)

    # ------------------------------------------------------------------ helpers
    def _send(self, payload: dict[str, Any], *, checkpoint: bool) -> None:
        from ray import tune

        ckpt = None
        if checkpoint and (self.work / "array.pt").exists():
            # the channel's state as of the trainer's last save, saved with it
            state = {
                "consumed": self.consumed,
                "queue": self.queue,
                "clock": self.mark,
                "joined": self.joined,
                "complete": sorted(self.complete),
            }
            tmp = self.work / f".{_CHANNEL_FILE}.tmp"
            tmp.write_text(json.dumps(state))
            os.replace(tmp, self.work / _CHANNEL_FILE)
            ckpt = tune.Checkpoint.from_directory(str(self.work))
        metrics = {self.metric: self._best(), META: json.dumps(payload)}
        tune.report(metrics, checkpoint=ckpt)

    def _best(self) -> float:
        """The array's best current member value (the Tune trial's metric)."""
        values: Sequence[float] = list(self.latest.values())
        if not values:
            return math.nan
        return max(values, key=lambda v: self.sign * v)
