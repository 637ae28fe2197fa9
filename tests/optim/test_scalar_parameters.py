"""Scalar parameters (a learned temperature, ``weight_norm(dim=None)``'s magnitude) stack to
``[B]`` tensors: the fused optimizers, clipping and loss scaling handle them per member."""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import Tensor, nn

import hfsweep as hs

B = 3


class _Tempered(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 3)
        self.temperature = nn.Parameter(torch.rand(()) + 0.5)

    def forward(self, x: Tensor) -> Tensor:
        return self.linear(x) / self.temperature


def test_scalar_parameter_steps_clips_and_scales_as_torch() -> None:
    torch.manual_seed(0)
    models = [_Tempered().double() for _ in range(B)]
    refs = [copy.deepcopy(m) for m in models]
    array = hs.fuse(models)
    lrs = [0.1, 0.03, 0.01]
    opt = hs.optim.Adam(array, lr=lrs)
    scaler = hs.optim.GradScaler(B, init_scale=8.0)
    ref_opts = [
        torch.optim.Adam(r.parameters(), lr=lr, foreach=False)
        for r, lr in zip(refs, lrs, strict=True)
    ]
    ref_scalers = [torch.amp.GradScaler("cpu", init_scale=8.0) for _ in range(B)]
    gen = torch.Generator().manual_seed(1)
    for _ in range(4):
        x = torch.randn(5, 4, generator=gen, dtype=torch.float64)
        y = torch.randint(0, 3, (5,), generator=gen)
        opt.zero_grad()
        scaler.scale(hs.member_losses(array(x), y)).sum().backward()
        scaler.unscale_(opt)
        norms = hs.optim.clip_grad_norm_(array, 0.5)
        scaler.step(opt)
        scaler.update()
        for i, (r, o, s) in enumerate(zip(refs, ref_opts, ref_scalers, strict=True)):
            o.zero_grad()
            s.scale(F.cross_entropy(r(x), y)).backward()
            s.unscale_(o)
            expected = torch.nn.utils.clip_grad_norm_(r.parameters(), 0.5)
            s.step(o)
            s.update()
            torch.testing.assert_close(norms[i], expected, rtol=1e-10, atol=0)
    for i, r in enumerate(refs):
        assert array.module.temperature.shape == (B,)
        for (name, p), q in zip(r.named_parameters(), array.member(i).parameters(), strict=True):
            torch.testing.assert_close(q, p, rtol=1e-7, atol=1e-10, msg=name)
