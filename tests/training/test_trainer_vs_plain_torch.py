"""Each member of an array trained by ``hs.ArrayTrainer`` against the same trial written as a plain
PyTorch loop in this file: ``torch.optim``, torch's own LR schedulers and clipping, the data
order of docs/reproducing.md, float64, several epochs, with a member stopped early and its slot
refilled mid-epoch by a new trial.

The only hfsweep piece the plain loop uses is, for dropout, an array of one member
(``hs.fuse([model])``): hfsweep's masks come from the member's own stream, which a plain
``nn.Dropout`` does not draw.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import hfsweep as hs
from hfsweep.tasks import TensorBatches

EPOCHS = 3
BATCH = 40  # 160 training samples: 4 steps per epoch


def model(config: Mapping[str, Any]) -> nn.Module:
    return nn.Sequential(nn.Linear(12, 16), nn.Tanh(), nn.Dropout(0.0), nn.Linear(16, 4))


def data(config: Mapping[str, Any]) -> tuple[TensorBatches, TensorBatches]:
    gen = torch.Generator().manual_seed(config["data_seed"])
    x = torch.randn(200, 12, generator=gen)
    y = (x @ torch.randn(12, 4, generator=gen)).argmax(1)
    return (
        TensorBatches(x[:160], y[:160], BATCH, shuffle=True),
        TensorBatches(x[160:], y[160:], 16, shuffle=False),
    )


TASK = hs.Task(model=model, data=data, defaults={"epochs": EPOCHS})

# optimizer settings -> four trials: three start the array, the fourth refills the first's slot
CASES: dict[str, list[dict[str, Any]]] = {
    "sgd-cosine-clip-smoothing": [
        {"lr": 0.1, "momentum": 0.9, "weight_decay": 1e-3, "grad_clip": 0.5},
        {"lr": 0.3, "momentum": 0.5, "dampening": 0.1, "label_smoothing": 0.1},
        {"lr": 0.05, "weight_decay": 1e-2, "eta_min": 0.01},
        {"lr": 0.2, "momentum": 0.8, "grad_clip": 1.0, "label_smoothing": 0.05},
    ],
    "adam-step": [
        {"lr": 0.01, "beta1": 0.8, "step_size": 1, "gamma": 0.5},
        {"lr": 0.003, "beta2": 0.99, "eps": 1e-6, "weight_decay": 1e-3},
        {"lr": 0.02, "grad_clip": 0.3},
        {"lr": 0.005, "gamma": 0.9},
    ],
    "adamw-exponential": [
        {"lr": 0.01, "weight_decay": 0.1, "gamma": 0.7},
        {"lr": 0.02, "beta1": 0.5, "gamma": 0.9},
        {"lr": 0.005, "label_smoothing": 0.2},
        {"lr": 0.01, "weight_decay": 0.0},
    ],
    "rmsprop": [
        {"lr": 0.01, "alpha": 0.9, "momentum": 0.5},
        {"lr": 0.003, "weight_decay": 1e-3},
        {"lr": 0.005, "eps": 1e-5, "grad_clip": 0.5},
        {"lr": 0.002, "momentum": 0.9},
    ],
    "adagrad": [
        {"lr": 0.1, "lr_decay": 0.01},
        {"lr": 0.05, "weight_decay": 1e-3},
        {"lr": 0.2, "eps": 1e-6},
        {"lr": 0.1, "grad_clip": 0.2},
    ],
    "sgd-dropout": [
        {"lr": 0.1, "momentum": 0.9, "dropout": 0.2},
        {"lr": 0.2, "dropout": 0.5},
        {"lr": 0.05, "momentum": 0.5, "dropout": 0.0},
        {"lr": 0.1, "dropout": 0.3},
    ],
}
SHARED = {
    "sgd-cosine-clip-smoothing": {"optimizer": "sgd", "lr_schedule": "cosine"},
    "adam-step": {"optimizer": "adam", "lr_schedule": "step"},
    "adamw-exponential": {"optimizer": "adamw", "lr_schedule": "exponential"},
    "rmsprop": {"optimizer": "rmsprop"},
    "adagrad": {"optimizer": "adagrad"},
    "sgd-dropout": {"optimizer": "sgd"},
}


def _torch_optimizer(net: nn.Module, c: Mapping[str, Any]) -> torch.optim.Optimizer:
    params, name = net.parameters(), c["optimizer"]
    if name == "sgd":
        return torch.optim.SGD(
            params,
            lr=c["lr"],
            momentum=c["momentum"],
            dampening=c["dampening"],
            weight_decay=c["weight_decay"],
        )
    if name in ("adam", "adamw"):
        cls = torch.optim.Adam if name == "adam" else torch.optim.AdamW
        return cls(
            params,
            lr=c["lr"],
            betas=(c["beta1"], c["beta2"]),
            eps=c["eps"],
            weight_decay=c["weight_decay"],
        )
    if name == "rmsprop":
        return torch.optim.RMSprop(
            params,
            lr=c["lr"],
            alpha=c["alpha"],
            eps=c["eps"],
            weight_decay=c["weight_decay"],
            momentum=c["momentum"],
        )
    assert name == "adagrad"
    return torch.optim.Adagrad(
        params, lr=c["lr"], lr_decay=c["lr_decay"], weight_decay=c["weight_decay"], eps=c["eps"]
    )


def _torch_schedule(opt: torch.optim.Optimizer, c: Mapping[str, Any], budget: int, spe: int):
    name = c["lr_schedule"]
    if name == "cosine":
        return torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=budget, eta_min=c["eta_min"])
    if name == "step":
        return torch.optim.lr_scheduler.StepLR(opt, c["step_size"] * spe, gamma=c["gamma"])
    if name == "exponential":
        return torch.optim.lr_scheduler.StepLR(opt, spe, gamma=c["gamma"])
    return None


def plain_run(
    config: Mapping[str, Any], *, start: int, evaluations: int | None
) -> tuple[list[dict[str, float]], dict[str, torch.Tensor]]:
    """The trial alone: its history (train_loss, val_loss, val_accuracy per evaluation) and
    final weights, starting at step ``start`` of the shared data stream and stopping after
    ``evaluations`` evaluations (``None``: its whole budget)."""
    c = TASK.resolve(config)
    torch.manual_seed(c["data_seed"])
    train, val = data(c)
    torch.manual_seed(c["seed"])
    net = model(c).double()
    if c["dropout"]:
        for m in net.modules():
            if isinstance(m, nn.Dropout):
                m.p = c["dropout"]
        # an array of one draws hfsweep's dropout masks; otherwise it is the plain module
        array = hs.fuse([net])
        array.manual_seed(0, c["seed"])

        def forward(x: torch.Tensor) -> torch.Tensor:
            return array(x)[0]

        trained: nn.Module = array
    else:
        forward, trained = net, net
    opt = _torch_optimizer(trained, c)
    spe = len(train)
    budget = c["epochs"] * spe
    sched = _torch_schedule(opt, c, budget, spe)
    history: list[dict[str, float]] = []
    losses: list[float] = []
    step, position = 0, start
    while step < budget:
        epoch, skip = divmod(position, spe)
        torch.manual_seed((c["data_seed"] * 1_000_003 + epoch * 7919 + 1) % 2**63)
        for k, (x, y) in enumerate(train):
            if k < skip:
                continue
            logits = forward(x.double())
            loss = F.cross_entropy(logits, y, label_smoothing=c["label_smoothing"])
            opt.zero_grad()
            loss.backward()
            if c["grad_clip"] is not None:
                torch.nn.utils.clip_grad_norm_(trained.parameters(), c["grad_clip"])
            opt.step()
            if sched is not None:
                sched.step()
            losses.append(loss.item())
            step, position = step + 1, position + 1
            if step % spe == 0 or step == budget:
                history.append(_evaluate(trained, forward, val, sum(losses) / len(losses)))
                losses = []
                if len(history) == evaluations or step == budget:
                    weights = (
                        dict(array.member_state_dict(0)) if trained is not net else net.state_dict()
                    )
                    return history, weights
    raise AssertionError("unreachable")


def _evaluate(
    trained: nn.Module, forward: Any, val: TensorBatches, train_loss: float
) -> dict[str, float]:
    trained.eval()
    total_loss = total_correct = 0.0
    n = 0
    with torch.no_grad():
        for x, y in val:
            logits = forward(x.double())
            total_loss += F.cross_entropy(logits, y).item() * len(y)
            total_correct += (logits.argmax(1) == y).double().sum().item()
            n += len(y)
    trained.train()
    return {"train_loss": train_loss, "val_loss": total_loss / n, "val_accuracy": total_correct / n}


@pytest.mark.parametrize("case", sorted(CASES))
def test_each_member_trains_as_its_plain_pytorch_loop(case: str) -> None:
    configs = [{**SHARED[case], **c, "seed": 10 + k} for k, c in enumerate(CASES[case])]
    members = [hs.Member(f"t{k}", c) for k, c in enumerate(configs[:3])]
    waiting = [hs.Member("t3", configs[3])]

    def report(evaluations: list[hs.Evaluation]) -> dict[str, bool]:
        return {e.member: e.member != "t0" for e in evaluations}  # t0 stops at its first

    trainer = hs.ArrayTrainer(TASK, dtype=torch.float64)
    results = {
        r.id: r
        for r in trainer.run(
            members, report=report, refill=lambda: waiting.pop() if waiting else None
        )
    }
    assert results["t0"].status == "stopped" and len(results["t0"].history) == 1
    assert {results[t].status for t in ("t1", "t2", "t3")} == {"completed"}

    spe = 160 // BATCH
    starts = {"t0": 0, "t1": 0, "t2": 0, "t3": spe}  # t3 joined when t0 stopped, after epoch 0
    assert {m: r.start_step for m, r in results.items()} == starts
    for k, member_id in enumerate(("t0", "t1", "t2", "t3")):
        got = results[member_id]
        expected, weights = plain_run(
            configs[k], start=starts[member_id], evaluations=1 if member_id == "t0" else None
        )
        assert len(got.history) == len(expected), member_id
        for mine, theirs in zip(expected, got.history, strict=True):
            for key, value in mine.items():
                assert theirs[key] == pytest.approx(value, rel=1e-7, abs=1e-12), (member_id, key)
        assert got.state is not None
        for name, tensor in weights.items():
            torch.testing.assert_close(got.state["model"][name], tensor, rtol=1e-7, atol=1e-12)


def test_a_refilled_member_retrains_alone_from_its_start_step() -> None:
    """``run(start_step=...)`` puts a lone member where a refilled one joined its array: the
    same data, so the same history (``MemberResult.start_step`` says where)."""
    configs = [{"optimizer": "sgd", "lr": lr, "momentum": 0.9, "seed": k} for k, lr in
               enumerate([0.1, 0.2, 0.05])]  # fmt: skip
    waiting = [hs.Member("late", configs[2])]
    trainer = hs.ArrayTrainer(TASK, dtype=torch.float64)
    results = trainer.run(
        [hs.Member("a", configs[0]), hs.Member("b", configs[1])],
        report=lambda evals: {e.member: e.member != "a" for e in evals},
        refill=lambda: waiting.pop() if waiting else None,
    )
    late = next(r for r in results if r.id == "late")
    assert late.start_step == 160 // BATCH
    alone = hs.ArrayTrainer(TASK, dtype=torch.float64).run(
        [hs.Member("late", configs[2])], start_step=late.start_step
    )[0]
    assert alone.start_step == late.start_step
    assert len(alone.history) == len(late.history) == EPOCHS
    for mine, theirs in zip(alone.history, late.history, strict=True):
        assert mine == pytest.approx(theirs, rel=1e-9)
    with pytest.raises(ValueError, match="start_step must be an int >= 0, got -1"):
        trainer.run([hs.Member("x", configs[0])], start_step=-1)
