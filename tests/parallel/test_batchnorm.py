"""BatchNorm in a data-parallel array normalises with each worker's shard statistics (what
``DistributedDataParallel`` without ``SyncBatchNorm`` does) and keeps running statistics that
are the row-weighted mean of the workers' updates, the same on every worker. Checked against
plain PyTorch doing exactly that, shard by shard, and shown to differ from one worker."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from _dp_tasks import make_task

import hfsweep as hs
from hfsweep.parallel import shard_bounds, train_data_parallel
from hfsweep.training.step import _batches


def _plain_two_workers(config: dict, steps: int) -> dict[str, torch.Tensor]:
    """One member trained by plain PyTorch as a 2-worker array trains it: per step, each
    shard's forward from the same running statistics, the loss ``sum_r rows_r / rows * loss_r``
    and running statistics ``sum_r rows_r / rows * stats_r``; SGD."""
    task = make_task()
    config = task.resolve(config)
    model = task.build_model(config).double()
    bn = model.net[1]
    opt = torch.optim.SGD(model.parameters(), lr=config["lr"], momentum=config["momentum"])
    train, _ = task.build_data(config)
    stream = _batches(task.name, train, len(train), config["data_seed"], 0, 0)
    for _ in range(steps):
        _, _, (x, y) = next(stream)
        x = x.double()
        before = (bn.running_mean.clone(), bn.running_var.clone(), bn.num_batches_tracked.clone())
        loss = torch.zeros((), dtype=torch.float64)
        mean, var = torch.zeros_like(before[0]), torch.zeros_like(before[1])
        for rank in range(2):
            start, stop = shard_bounds(len(y), 2, rank)
            # fresh tensors (autograd saved the previous shard's)
            bn.running_mean, bn.running_var = before[0].clone(), before[1].clone()
            bn.num_batches_tracked = before[2].clone()
            weight = (stop - start) / len(y)
            loss = loss + weight * F.cross_entropy(model(x[start:stop]), y[start:stop])
            mean += weight * bn.running_mean
            var += weight * bn.running_var
        bn.running_mean, bn.running_var = mean, var
        opt.zero_grad()
        loss.backward()
        opt.step()
    return {k: v.detach() for k, v in model.state_dict().items()}


@pytest.mark.slow
def test_batchnorm_uses_shard_statistics_and_row_weighted_running_statistics(
    tmp_path: Path,
) -> None:
    config = {"bn": True, "lr": 0.1, "momentum": 0.9, "max_steps": 4, "seed": 3}
    members = [hs.Member("bn", config)]
    got = train_data_parallel(
        make_task(),
        members,
        workers=2,
        checkpoint_dir=tmp_path / "dp",
        dtype=torch.float64,
        eval_every=2,
        timeout_s=60,
    )
    expected = _plain_two_workers(config, 4)
    state = got[0].state
    assert state is not None
    for name, value in expected.items():
        torch.testing.assert_close(state["model"][name], value, rtol=1e-7, atol=1e-10, msg=name)
    one = hs.ArrayTrainer(make_task(), dtype=torch.float64, eval_every=2).run(members)[0].state
    assert one is not None
    # the documented difference: one worker normalises with the whole batch's statistics
    assert not torch.allclose(one["model"]["net.1.running_var"], expected["net.1.running_var"])
    assert not torch.allclose(one["model"]["net.0.weight"], expected["net.0.weight"])
