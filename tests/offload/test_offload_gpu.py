"""The offload engine on a CUDA device (skipped where none is present): pinned host storage, a
side stream for the copies; exact against the array run whole, and the device's peak memory
within the budget for an array whose state is over twice that budget."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import hfsweep as hs
from hfsweep.offload import CudaTransfer, OffloadedArray

pytestmark = pytest.mark.gpu


def test_offloaded_on_cuda_trains_as_the_whole_array_float64() -> None:
    models = [
        nn.Sequential(
            nn.Linear(16, 32),
            nn.BatchNorm1d(32),
            nn.ReLU(),
            nn.Dropout(0.2),
            nn.Linear(32, 32),
            nn.Tanh(),
            nn.Linear(32, 4),
        ).double()
        for _ in range(3)
    ]
    whole = hs.fuse(copy.deepcopy(models)).to("cuda")
    host = hs.fuse(models, share_frozen=False)
    for i in range(3):
        whole.manual_seed(i, i + 1)
        host.manual_seed(i, i + 1)
    engine = OffloadedArray(host, device="cuda")
    assert isinstance(engine.transfer, CudaTransfer) and len(engine.shards) >= 3
    assert all(p.device.type == "cpu" and p.is_pinned() for p in host.parameters())
    opt_w = hs.optim.SGD(whole, lr=[0.1, 0.05, 0.01], momentum=[0.0, 0.5, 0.9])
    opt_h = hs.optim.SGD(host, lr=[0.1, 0.05, 0.01], momentum=[0.0, 0.5, 0.9])
    gen = torch.Generator().manual_seed(0)
    for _ in range(3):
        x = torch.randn(8, 16, generator=gen, dtype=torch.float64).cuda()
        out_w, out_h = whole(x), engine(x)
        torch.testing.assert_close(out_h, out_w, rtol=1e-7, atol=1e-12)
        out_w.square().mean().backward()
        out_h.square().mean().backward()
        for o in (opt_w, opt_h):
            o.step()
            o.zero_grad(set_to_none=True)
    for (name, tw), th in zip(whole.state_dict().items(), host.state_dict().values(), strict=True):
        torch.testing.assert_close(th.cuda(), tw, rtol=1e-7, atol=1e-12, msg=name)


def test_an_array_over_twice_the_budget_trains_within_it_on_cuda() -> None:
    layers, width, size = 8, 1024, 8
    models = [nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)]) for _ in range(size)]
    host = hs.fuse(models, share_frozen=False)
    params = sum(p.numel() * p.element_size() for p in host.parameters())
    state = 4 * params  # weights, gradients, two AdamW moments
    budget = int(0.6 * params)
    assert state >= 2 * budget
    engine = OffloadedArray(host, device="cuda", budget_bytes=budget)
    opt = hs.optim.AdamW(host, lr=[1e-3] * size)
    x = torch.randn(32, width, device="cuda")
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    for _ in range(2):
        engine(x).square().mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    transient = 16 * 2**20  # activations inside one shard's recomputation ([8, 32, 1024] floats)
    assert engine.ledger.peak <= budget
    assert peak <= budget + transient, (peak, budget)
