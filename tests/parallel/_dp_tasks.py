"""Small tasks for the data-parallel tests, at module level so that spawned workers can unpickle
them (generated data, batches whose rows do not divide by the workers, dropout, BatchNorm)."""

from __future__ import annotations

import os
import signal
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
    <member> <step> <workers>``) or delivered member (``done <member>``) to ``path``, and asks
    for ``resize[step]`` workers at the evaluation of that step (``request_resize``)."""

    def __init__(self, path: str, directory: str, resize: Mapping[int, int] | None = None) -> None:
        self.path, self.directory, self.resize = path, directory, dict(resize or {})

    def __call__(self, evaluations: list[hs.Evaluation]) -> dict[str, bool]:
        from hfsweep.parallel import request_resize

        with open(self.path, "a") as f:
            for e in evaluations:
                f.write(f"eval {e.member} {e.step} {_world()}\n")
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
