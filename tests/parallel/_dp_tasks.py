"""Small tasks for the data-parallel tests, at module level so that spawned workers can unpickle
them (generated data, batches whose rows do not divide by the workers, dropout, BatchNorm)."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import hfsweep as hs
from hfsweep.tasks import TensorBatches


class Net(nn.Module):
    """A small MLP with dropout (the config's ``dropout``) and optionally BatchNorm."""

    def __init__(self, bn: bool) -> None:
        super().__init__()
        layers: list[nn.Module] = [nn.Linear(12, 16)]
        if bn:
            layers.append(nn.BatchNorm1d(16))
        layers += [nn.Tanh(), nn.Dropout(0.0), nn.Linear(16, 4)]
        self.net = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class KillingBatches(TensorBatches):
    """Training batches whose iteration SIGKILLs the process of worker ``rank`` (of a process
    group of more than one) after ``after`` batches drawn in that process: a worker lost at
    a step the test knows."""

    def __init__(self, *args: Any, rank: int, after: int, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.rank, self.after, self.drawn = rank, after, 0

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        for batch in super().__iter__():
            lost = dist.is_initialized() and dist.get_world_size() > 1
            if lost and dist.get_rank() == self.rank and self.drawn == self.after:
                os.kill(os.getpid(), signal.SIGKILL)
            self.drawn += 1
            yield batch


def model(config: Mapping[str, Any]) -> nn.Module:
    return Net(bool(config["bn"]))


def data(config: Mapping[str, Any]) -> tuple[TensorBatches, TensorBatches]:
    gen = torch.Generator().manual_seed(config["data_seed"])
    x = torch.randn(200, 12, generator=gen)
    w = torch.randn(12, 4, generator=gen)
    y = (x @ w + 0.5 * torch.randn(200, 4, generator=gen)).argmax(1)
    b = config["batch_size"]
    kill = config["kill_after"]
    train: TensorBatches
    if kill is None:
        train = TensorBatches(x[:160], y[:160], b, shuffle=True)
    else:
        train = KillingBatches(x[:160], y[:160], b, shuffle=True, rank=1, after=kill)
    return train, TensorBatches(x[160:], y[160:], 13, shuffle=False)


def make_task() -> hs.Task:
    """31 rows a batch (16 + 15 on two workers), 160 rows an epoch (a last batch of 5: 3 + 2),
    validation batches of 13."""
    return hs.Task(
        name="dp_toy",
        model=model,
        data=data,
        defaults={"batch_size": 31, "epochs": 2, "bn": False, "kill_after": None},
    )


def _world() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


class Recorder:
    """A report hook (and ``on_finish`` hook) that appends one line per evaluation (``eval
    <member> <step> <workers> <pid of the process it ran in: rank 0's>``) or delivered member (``done <member>``) to ``path``, and asks
    for ``resize[step]`` workers at the evaluation of that step (``request_resize``)."""

    def __init__(self, path: str, directory: str, resize: Mapping[int, int] | None = None) -> None:
        self.path, self.directory, self.resize = path, directory, dict(resize or {})

    def __call__(self, evaluations: list[hs.Evaluation]) -> dict[str, bool]:
        from hfsweep.parallel import request_resize

        with open(self.path, "a") as f:
            for e in evaluations:
                f.write(f"eval {e.member} {e.step} {_world()} {os.getpid()}\n")
        step = evaluations[0].step
        if step in self.resize:
            request_resize(self.directory, self.resize[step])
        return {}

    def finished(self, result: hs.MemberResult) -> None:
        with open(self.path, "a") as f:
            f.write(f"done {result.id}\n")

    def lines(self) -> list[list[str]]:
        with open(self.path) as f:
            return [line.split() for line in f]


class Fault:
    """A worker lost at a moment the test chooses, made deterministic by patching the moment's
    own code in the worker's process (never in the test's: it is installed only where a process
    group of more than one worker is up). ``moment`` is

    - ``"allreduce"``: worker ``rank`` enters its ``nth`` gradient all-reduce (a tensor of more
      than one element; one per training step) asynchronously and is SIGKILLed in it, so the
      other worker is inside that all-reduce when its peer dies;
    - ``"hook"``: worker ``rank`` (rank 0, which relays the hooks) sends its ``nth`` relayed
      ``report`` call to the driver and is SIGKILLed while it waits for the answer;
    - ``"checkpoint"``: worker ``rank`` (rank 0, which writes the checkpoint) is SIGKILLed
      half-way through writing its ``nth`` checkpoint (half of the bytes in the temporary file
      that ``atomic_save`` renames when it is complete);
    - ``"hang"``: worker ``rank`` hangs without dying before its ``nth`` gradient all-reduce
      (it sleeps for an hour), so the other worker waits in that all-reduce until the process
      group's timeout.

    It fires once: only while the file ``flag`` exists, which it removes first (the relaunched
    workers find none). ``stamp`` gets ``time.time()`` just before the kill (or the hang)."""

    def __init__(self, moment: str, rank: int, nth: int, flag: str) -> None:
        assert moment in ("allreduce", "hook", "checkpoint", "hang"), moment
        self.moment, self.rank, self.nth, self.flag = moment, rank, nth, flag
        self.seen = 0

    @property
    def stamp(self) -> str:
        return self.flag + ".killed-at"

    def _fires(self) -> bool:
        self.seen += 1
        if self.seen != self.nth or not os.path.exists(self.flag):
            return False
        os.remove(self.flag)
        return True

    def _die(self) -> None:
        with open(self.stamp, "w") as f:
            f.write(repr(time.time()))
        os.kill(os.getpid(), signal.SIGKILL)

    def install(self) -> None:
        """Patch this worker's process for the moment (once per process: the module-level
        names it patches carry a mark, as this module's globals may be a copy per unpickling)."""
        if not (dist.is_initialized() and dist.get_world_size() > 1):
            return
        if dist.get_rank() != self.rank or getattr(os, "_hfsweep_test_fault", False):
            return
        os._hfsweep_test_fault = True  # type: ignore[attr-defined]
        getattr(self, f"_install_{self.moment}")()

    def _install_allreduce(self) -> None:
        plain = dist.all_reduce

        def all_reduce(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            if tensor.numel() > 1 and self._fires():
                kwargs["async_op"] = True
                plain(tensor, *args, **kwargs)  # the peer now waits in this all-reduce
                self._die()
            return plain(tensor, *args, **kwargs)

        dist.all_reduce = all_reduce

    def _install_hang(self) -> None:
        plain = dist.all_reduce

        def all_reduce(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            if tensor.numel() > 1 and self._fires():
                with open(self.stamp, "w") as f:
                    f.write(repr(time.time()))
                time.sleep(3600)  # alive, never entering the all-reduce its peer waits in
            return plain(tensor, *args, **kwargs)

        dist.all_reduce = all_reduce

    def _install_hook(self) -> None:
        from hfsweep.executors import _elastic

        plain = _elastic._Relay.__call__
        fault = self

        class _DyingAnswers:
            """The answer queue of the call that dies: the call is sent, its answer never
            taken."""

            def get(self) -> Any:
                fault._die()

        def call(relay: Any, payload: Any) -> Any:
            if relay.kind == "report" and fault._fires():
                dying = _elastic._Relay(relay.kind, relay.events, _DyingAnswers())
                return plain(dying, payload)
            return plain(relay, payload)

        _elastic._Relay.__call__ = call  # type: ignore[method-assign]

    def _install_checkpoint(self) -> None:
        import io

        from hfsweep import _io
        from hfsweep.training import run

        plain = run.atomic_save

        def atomic_save(obj: Any, path: Any) -> None:
            if not self._fires():
                plain(obj, path)
                return
            buffer = io.BytesIO()
            torch.save(obj, buffer)
            data = buffer.getvalue()

            def half(f: Any) -> None:
                f.write(data[: len(data) // 2])
                f.flush()
                os.fsync(f.fileno())
                self._die()

            _io._atomic(path, "wb", half)

        run.atomic_save = atomic_save


def faulty_data(config: Mapping[str, Any]) -> tuple[TensorBatches, TensorBatches]:
    """:func:`data`, and the config's ``fault`` (``"moment:rank:nth:flag"``, see
    :class:`Fault`) installed in a worker of a process group of more than one."""
    if config.get("fault"):
        moment, rank, nth, flag = str(config["fault"]).split(":", 3)
        _faults.setdefault(flag, Fault(moment, int(rank), int(nth), flag)).install()
    return data(config)


_faults: dict[str, Fault] = {}


def make_faulty_task() -> hs.Task:
    """:func:`make_task` with a ``fault`` (``""``: none; see :func:`faulty_data`)."""
    return hs.Task(
        name="dp_toy",
        model=model,
        data=faulty_data,
        defaults={"batch_size": 31, "epochs": 2, "bn": False, "kill_after": None, "fault": ""},
    )
