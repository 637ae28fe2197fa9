"""Timestamps of a data-parallel array's resize, from every process it runs in, for
``benchmarks/resize_pause.py``.

Importing this module with ``HFSWEEP_RESIZE_PROBE`` set to a file wraps the functions a resize
passes through (in the driver: the launch, the wait for the placement group; in each worker
actor: its start, the ``torch.distributed`` process group's init, the checkpoint's load and
write, the array's build, the first optimizer step of each launch) so that each appends one JSON line
``{"event", "t", "pid", ...}`` (``time.time()``, one clock for every process of this machine)
to that file. The worker actors import it because the task they unpickle, and the actor class
(:class:`ProbeWorker`), are defined here. Nothing is timed without the variable.
"""

from __future__ import annotations

import functools
import json
import os
import time
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

import hfsweep as hs
from hfsweep.parallel import _ray as parallel_ray
from hfsweep.parallel import _run as parallel_run
from hfsweep.tasks import TensorBatches
from hfsweep.training import run as training_run

ENV = "HFSWEEP_RESIZE_PROBE"
#: seconds every optimizer step but the first of each launch sleeps
DELAY_ENV = "HFSWEEP_RESIZE_PROBE_DELAY_S"

_state: dict[str, Any] = {"first_step": True, "rank": None}


def record(event: str, **fields: Any) -> None:
    """Append ``event`` with this process's time and pid (and rank, once known)."""
    path = os.environ.get(ENV)
    if not path:
        return
    line = {"event": event, "t": time.time(), "pid": os.getpid(), "rank": _state["rank"]}
    line.update(fields)
    with open(path, "a") as f:
        f.write(json.dumps(line) + "\n")


def _timed(
    owner: Any, name: str, event: str, fields: Callable[..., dict[str, Any]] | None = None
) -> None:
    """Wrap ``owner.name`` so that it records ``event_start`` (with ``fields(*args)``) and
    ``event_end``."""
    inner = getattr(owner, name)
    if getattr(inner, "_probed", False):
        return

    @functools.wraps(inner)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        record(f"{event}_start", **(fields(*args) if fields is not None else {}))
        try:
            out = inner(*args, **kwargs)
        except BaseException as exc:
            record(f"{event}_end", raised=type(exc).__name__)
            raise
        record(f"{event}_end")
        return out

    wrapper._probed = True  # type: ignore[attr-defined]
    setattr(owner, name, wrapper)


def _install() -> None:
    if not os.environ.get(ENV):
        return
    # the driver's side of a launch
    _timed(parallel_ray, "_launch", "launch", lambda job, *_: {"workers": job.workers})
    _timed(parallel_ray, "_place", "place")
    # a worker's side
    train_worker = parallel_ray.train_worker
    if not getattr(train_worker, "_probed", False):

        @functools.wraps(train_worker)
        def timed_train(rank: int, *args: Any, **kwargs: Any) -> Any:
            _state["rank"], _state["first_step"] = rank, True
            record("train_start")
            try:
                return train_worker(rank, *args, **kwargs)
            finally:
                record("train_end")

        timed_train._probed = True  # type: ignore[attr-defined]
        parallel_ray.train_worker = timed_train
    _timed(torch.distributed, "init_process_group", "pg_init")
    _timed(training_run.ArrayRun, "_load_checkpoint", "load")
    _timed(training_run.ArrayRun, "_build", "build")
    _timed(parallel_run._DataParallelRun, "_save_checkpoint", "checkpoint")
    _timed(parallel_run._DataParallelRun, "_at_boundary", "boundary")
    update = training_run.update
    delay_s = float(os.environ.get(DELAY_ENV) or 0.0)
    if not getattr(update, "_probed", False):

        @functools.wraps(update)
        def timed_update(*args: Any, **kwargs: Any) -> Any:
            out = update(*args, **kwargs)
            if _state["first_step"]:
                _state["first_step"] = False
                record("first_step")
            elif delay_s:  # the step time of a larger model, without its CPU time
                time.sleep(delay_s)
            return out

        timed_update._probed = True  # type: ignore[attr-defined]
        training_run.update = timed_update
    if parallel_ray._Worker is not ProbeWorker:
        parallel_ray._Worker = ProbeWorker  # type: ignore[misc]


class ProbeWorker(parallel_ray._Worker):
    """The launcher's worker actor, recording when its process is up (hfsweep and torch
    imported) and when it answers the rendezvous."""

    def __init__(self) -> None:
        record("actor_up")

    def rendezvous(self) -> str:
        out = super().rendezvous()
        record("rendezvous")
        return out


# ---------------------------------------------------------------------- the array trained
class Net(nn.Module):
    """A small MLP: 32 inputs, ``width`` hidden, 4 classes."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(32, width), nn.Tanh(), nn.Linear(width, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def model(config: Mapping[str, Any]) -> nn.Module:
    return Net(int(config["width"]))


def data(config: Mapping[str, Any]) -> tuple[TensorBatches, TensorBatches]:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(2048, 32, generator=gen)
    y = (x @ torch.randn(32, 4, generator=gen)).argmax(1)
    b = int(config["batch_size"])
    return TensorBatches(x[:1792], y[:1792], b, shuffle=True), TensorBatches(
        x[1792:], y[1792:], 128, shuffle=False
    )


def make_task() -> hs.Task:
    return hs.Task(
        name="resize_probe",
        model=model,
        data=data,
        defaults={"batch_size": 64, "epochs": 40, "width": 64},
    )


_install()
