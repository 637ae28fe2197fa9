"""The same conformance checks on a CUDA device (skipped where none is present)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import hfsweep as hs
from hfsweep.testing import (
    MLP,
    LeNet,
    LSTMClassifier,
    SmallResNet,
    TransformerClassifier,
    assert_fusion_matches,
)

pytestmark = pytest.mark.gpu

MODELS = {
    "MLP": (lambda: MLP(d_in=12, hidden=10, d_out=4), lambda g: (torch.randn(8, 12, generator=g),)),
    "LeNet": (lambda: LeNet(dropout=0.2), lambda g: (torch.randn(6, 1, 8, 8, generator=g),)),
    "SmallResNet": (SmallResNet, lambda g: (torch.randn(4, 3, 8, 8, generator=g),)),
    "TransformerClassifier": (
        lambda: TransformerClassifier(dropout=0.1),
        lambda g: (torch.randint(0, 50, (4, 7), generator=g),),
    ),
    "LSTMClassifier": (LSTMClassifier, lambda g: (torch.randint(0, 50, (4, 7), generator=g),)),
}


@pytest.mark.parametrize("name", sorted(MODELS))
def test_model_matches_on_cuda_float64(name: str) -> None:
    make_model, make_input = MODELS[name]
    assert_fusion_matches(make_model, make_input, size=3, steps=3, device="cuda")


@pytest.mark.parametrize("name", sorted(MODELS))
def test_model_matches_on_cuda_float32(name: str) -> None:
    make_model, make_input = MODELS[name]
    assert_fusion_matches(
        make_model,
        make_input,
        size=4,
        steps=3,
        device="cuda",
        dtype=torch.float32,
        rtol=1e-4,
        atol=1e-5,
    )


def test_member_export_and_refill_on_cuda() -> None:
    array = hs.fuse([LeNet().cuda() for _ in range(3)])
    x = torch.randn(5, 1, 8, 8, device="cuda")
    array.eval()
    m = array.member(1)
    assert next(m.parameters()).device.type == "cuda"
    torch.testing.assert_close(m(x), array(x)[1])
    newcomer = LeNet().eval()  # on the CPU: load_member moves it
    array.load_member(0, newcomer)
    torch.testing.assert_close(array(x)[0].cpu(), newcomer(x.cpu()), rtol=1e-4, atol=1e-5)


def test_bf16_autocast_forward_and_backward_run() -> None:
    array = hs.fuse([SmallResNet().cuda() for _ in range(4)])
    x = torch.randn(8, 3, 16, 16, device="cuda")
    y = torch.randint(0, 10, (8,), device="cuda")
    with torch.autocast("cuda", dtype=torch.bfloat16):
        losses = hs.member_losses(array(x), y)
    losses.float().sum().backward()
    assert all(torch.isfinite(p.grad).all() for p in array.parameters())


def test_optimizer_and_scheduler_follow_the_array_to_cuda() -> None:
    array = hs.fuse([LeNet() for _ in range(3)])
    opt = hs.optim.AdamW(array, lr=[1e-3, 2e-3, 3e-3])
    sched = hs.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=[5, 10, 20])
    array.cuda()
    x = torch.randn(4, 1, 8, 8, device="cuda")
    y = torch.randint(0, 10, (4,), device="cuda")
    for _ in range(3):
        opt.zero_grad()
        losses = hs.member_losses(array(x), y)
        opt.deactivate_nonfinite(losses)
        losses.sum().backward()
        hs.optim.clip_grad_norm_(array, 1.0)
        opt.step()
        sched.step()
    assert opt.param_groups[0]["lr"].device.type == "cuda"
    assert opt.nonfinite_members == []


class _ScaledDropout(nn.Module):
    def __init__(self, p: float, kind: type[nn.Module]) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.linspace(0.5, 1.5, 5))
        self.drop = kind(p)

    def forward(self, x):
        return self.drop(x * self.scale)


def _dropout_streams_agree(device: str) -> None:
    """Member 1's masks on ``device`` equal its masks on the CPU, alone or in an array of 3."""
    for kind in (nn.Dropout, nn.Dropout2d):
        models = [_ScaledDropout(p, kind) for p in (0.1, 0.5, 0.3)]
        on_cpu = hs.fuse([copy.deepcopy(models[1])])
        array = hs.fuse([copy.deepcopy(m).to(device) for m in models])
        alone = hs.fuse([copy.deepcopy(models[1]).to(device)])
        on_cpu.manual_seed(0, 2024)
        array.manual_seed(1, 2024)
        alone.manual_seed(0, 2024)
        for dtype in (torch.float32, torch.bfloat16, torch.float32):
            x = torch.randn(8, 4, 5, 5).to(dtype)
            expected = on_cpu(x)[0]
            for out in (array(x.to(device))[1], alone(x.to(device))[0]):
                assert out.device.type == torch.device(device).type
                assert torch.equal(out.cpu() == 0, expected == 0), (kind, dtype)
                torch.testing.assert_close(out.cpu(), expected)
        assert array.rng_state(1) == alone.rng_state(0) == on_cpu.rng_state(0)


def test_dropout_streams_are_the_same_on_cuda_and_cpu() -> None:
    _dropout_streams_agree("cuda")
