"""Shared by the dropout-stream tests: a member's outputs and gradients over a few steps."""

from __future__ import annotations

import torch

import hfsweep as hs


def train_member(
    array: hs.FusedArray, i: int, inputs: list[torch.Tensor]
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Member i's output (the first, for a model returning a tuple) and parameter gradients
    over a few SGD steps of the whole array."""
    opt = torch.optim.SGD(array.parameters(), lr=0.1)
    seen = []
    for x in inputs:
        opt.zero_grad()
        out = array(x)
        out = out[0] if isinstance(out, tuple) else out
        weights = torch.linspace(-1, 1, out[0].numel(), dtype=out.dtype).view(out[0].shape)
        (out * weights).sum().backward()
        grad = torch.cat([p.grad[i].flatten() for p in array.parameters()])
        seen.append((out[i].detach().clone(), grad.clone()))
        opt.step()
    return seen
