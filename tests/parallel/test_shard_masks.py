"""A data-parallel worker's random draws are its rows of the global batch's: dropout layers,
functional dropout and ``torch.randn_like`` in forward code, traced or eager, and a trace made
for one shard is not replayed for another of the same shape."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import hfsweep as hs
from hfsweep.nn._shard import batch_shard, global_shape


class Noisy(nn.Module):
    """A dropout layer, a functional dropout and Gaussian noise, all drawn in forward."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(6, 8)
        self.drop = nn.Dropout(0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.dropout(self.drop(self.lin(x)), 0.3, self.training)
        return h + 0.1 * torch.randn_like(h)


@pytest.mark.parametrize("trace", [True, False])
def test_each_shard_draws_its_rows_of_the_whole_batch(trace: bool) -> None:
    torch.manual_seed(0)
    array = hs.fuse([Noisy().double(), Noisy().double()], trace=trace)
    for i in range(2):
        array.manual_seed(i, 100 + i)
    x = torch.randn(10, 6, dtype=torch.float64)
    start = [array.rng_state(i) for i in range(2)]
    for _ in range(3):  # a trace is made at the first call of a signature and replayed after
        whole = array(x).detach()
        shards = []
        for offset, rows in ((0, 5), (5, 5)):  # one input shape, two shards: two trace keys
            after_whole = [array.rng_state(i) for i in range(2)]
            for i in range(2):
                array.set_rng_state(i, start[i])
            with batch_shard(offset, rows, 10):
                shards.append(array(x[offset : offset + rows]).detach())
            assert [array.rng_state(i) for i in range(2)] == after_whole  # streams advance alike
        together = torch.cat(shards, dim=1)
        # the same masks and noise; the matmuls of 5 and 10 rows may round apart
        torch.testing.assert_close(together, whole, rtol=1e-12, atol=1e-14)
        start = [array.rng_state(i) for i in range(2)]
    # without the shard, the second half's rows draw the first rows' masks: not the whole's
    for i in range(2):
        array.set_rng_state(i, start[i])
    whole = array(x).detach()
    for i in range(2):
        array.set_rng_state(i, start[i])
    assert not torch.allclose(array(x[5:]).detach(), whole[:, 5:])


def test_a_draw_whose_first_dimension_is_not_the_shard_is_drawn_as_it_is() -> None:
    with batch_shard(4, 3, 10):
        assert global_shape((3, 8)) == ((10, 8), 4, 3)
        assert global_shape((2, 3, 8), dim=1) == ((2, 10, 8), 4, 3)
        assert global_shape((7, 3, 8)) is None  # [T, N, H]: dimension 0 is not the batch
    assert global_shape((3, 8)) is None  # no shard open
    with pytest.raises(ValueError, match="does not fit"), batch_shard(8, 3, 10):
        pass
