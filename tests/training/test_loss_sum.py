"""The trainer's running sum of the losses (``step.add_losses``): one operator per step, and the
same float64 values as converting the losses first (issue 21's fixed per-step costs)."""

from __future__ import annotations

import pytest
import torch

from hfsweep.testing._op_counts import OpCounter
from hfsweep.training.step import add_losses


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
def test_the_running_sum_is_one_operator_and_exact(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(0)
    loss_sum = torch.zeros(5, dtype=torch.float64)
    expected = torch.zeros(5, dtype=torch.float64)
    for _ in range(4):
        losses = (torch.rand(5, generator=gen) * 3).to(dtype).requires_grad_()
        with OpCounter() as counter:
            add_losses(loss_sum, losses)
        assert dict(counter.ops) == {"add_": 1}  # was detach, _to_copy and add_
        assert counter.bytes == 0  # the copy of the losses in float64 is gone
        expected += losses.detach().to(torch.float64)
    assert torch.equal(loss_sum, expected)
    assert not loss_sum.requires_grad
