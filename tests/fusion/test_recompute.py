"""A fused array honours the model's own activation checkpointing (``torch.utils.checkpoint``
with ``use_reentrant=False``; Hugging Face's ``gradient_checkpointing_enable``): the regions the
model checkpoints are recomputed in the backward for all members at once, exactly (float64,
rtol 1e-7, forward, gradients, several optimizer steps; the same dropout masks; BatchNorm
statistics updated once), and what they compute inside is not saved for the backward. Forms that
cannot be honoured are refused, naming the submodule."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.utils.checkpoint as torch_checkpoint
from _tiny_hf import BERT, GPT2, NO_DROPOUT, VOCAB
from torch import Tensor, nn

import hfsweep as hs
from hfsweep import FusionError
from hfsweep.testing import assert_fusion_matches


class Block(nn.Module):
    def __init__(self, norm: bool = False, p: float = 0.0) -> None:
        super().__init__()
        self.a = nn.Linear(6, 20)
        self.norm = nn.BatchNorm1d(20) if norm else nn.Identity()
        self.drop = nn.Dropout(p)
        self.b = nn.Linear(20, 6)

    def forward(self, x: Tensor) -> Tensor:
        h = self.drop(torch.tanh(self.norm(self.a(x))))
        return x + self.b(torch.nn.functional.dropout(h, 0.25, self.training) if self.p2 else h)

    p2 = False


class Net(nn.Module):
    """Three residual blocks, each checkpointed when ``checkpointed``."""

    def __init__(self, checkpointed: bool, norm: bool = False, p: float = 0.0) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([Block(norm, p) for _ in range(3)])
        self.checkpointed = checkpointed

    def forward(self, x: Tensor) -> Tensor:
        for block in self.blocks:
            if self.checkpointed:
                x = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False)
            else:
                x = block(x)
        return x


def _x(g: torch.Generator) -> tuple[Tensor]:
    return (torch.randn(16, 6, generator=g, dtype=torch.float64),)


def _train_side_by_side(
    array: hs.FusedArray,
    refs: list[nn.Module],
    make_input: Callable[[torch.Generator], tuple[Any, ...]],
    loss: Callable[[Any], Tensor],
    steps: int = 3,
    lr: float = 0.05,
) -> None:
    """``steps`` SGD steps of ``array`` and of each reference alone on the same inputs, comparing
    outputs, gradients, weights and buffers (float64, rtol 1e-7) after each."""
    g = torch.Generator().manual_seed(0)
    opt = hs.optim.SGD(array, lr=lr)
    ref_opts = [torch.optim.SGD([p for p in r.parameters() if p.requires_grad], lr=lr) for r in refs]
    for step in range(steps):
        args = make_input(g)
        opt.zero_grad()
        out = array(*args)
        loss(out).sum().backward()
        opt.step()
        for i, (r, o) in enumerate(zip(refs, ref_opts, strict=True)):
            o.zero_grad()
            expected = r(*args)
            loss(expected.unsqueeze(0)).sum().backward()
            torch.testing.assert_close(out[i], expected, rtol=1e-7, atol=1e-10)
            o.step()
            mine = array.member_state_dict(i)
            for name, value in r.state_dict().items():
                torch.testing.assert_close(
                    mine[name], value, rtol=1e-7, atol=1e-10, msg=f"step {step} member {i} {name}"
                )


def _square(out: Tensor) -> Tensor:
    return out.pow(2).flatten(1).mean(1)


@pytest.mark.parametrize("trace", [True, False])
def test_checkpointed_members_train_as_alone(trace: bool) -> None:
    """Against each checkpointed model alone (torch's own checkpoint): outputs, gradients,
    three SGD steps, train and eval."""
    assert_fusion_matches(lambda: Net(True), _x, size=3, steps=3, trace=trace)


@pytest.mark.parametrize("trace", [True, False])
def test_batchnorm_statistics_are_updated_once(trace: bool) -> None:
    """BatchNorm inside a checkpointed region: the statistics move once per step, as in the
    model without checkpointing (torch's own checkpoint moves them again when it recomputes)."""
    torch.manual_seed(3)
    refs = [Net(False, norm=True).double() for _ in range(3)]
    models = copy.deepcopy(refs)
    for m in models:
        m.checkpointed = True
    array = hs.fuse(models, trace=trace)
    _train_side_by_side(array, refs, _x, _square)
