"""Pooling with the members next to the channels (``hfsweep/fusion/_graph_pool.py``).

Exact against B independent models (float64, members with different weights; forward, backward
and SGD steps through ``assert_fusion_matches``, Adam steps side by side) for the pooling options
the rewrite covers, and for the layouts it leaves to ``vmap``'s path; and the fused step of a
convolution-pooling network dispatches no copy around the pools.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from _side_by_side import SideBySide, classification_steps, trained
from torch import Tensor, nn

import hfsweep as hs
from hfsweep.testing import assert_fusion_matches
from hfsweep.testing._op_counts import OpCounter

_aten = torch.ops.aten


class _PoolNet(nn.Module):
    """conv -> relu -> ``pool`` -> conv (the members go back next to the channels) ->
    ``pool`` -> flatten -> Linear (members first)."""

    def __init__(self, pool: Callable[[Tensor], Tensor], flat: int, transpose: bool = False):
        super().__init__()
        self.pool = pool
        self.transpose = transpose
        self.conv1 = nn.Conv2d(2, 3, 3, padding=1)
        self.conv2 = nn.Conv2d(3, 4, 3, padding=1)
        self.fc = nn.Linear(flat, 5)

    def forward(self, x: Tensor) -> Tensor:
        x = torch.relu(self.conv1(x))
        x = self.pool(x.transpose(2, 3) if self.transpose else x)
        x = self.pool(torch.relu(self.conv2(x)))
        return self.fc(x.flatten(1))


def _max_values(**kw: Any) -> Callable[[Tensor], Tensor]:
    def pool(x: Tensor) -> Tensor:
        out = F.max_pool2d(x, **kw)
        return out[0] if isinstance(out, tuple) else out

    return pool


#: name -> (pool, flattened size after two pools of a 9 x 9 input)
POOLS: dict[str, tuple[Callable[[Tensor], Tensor], int]] = {
    "max-k2": (_max_values(kernel_size=2), 4 * 2 * 2),
    "max-k3-s2-p1": (_max_values(kernel_size=3, stride=2, padding=1), 4 * 3 * 3),
    "max-k2-ceil": (_max_values(kernel_size=2, ceil_mode=True), 4 * 3 * 3),
    "max-k2-dilation2": (_max_values(kernel_size=2, stride=1, dilation=2), 4 * 5 * 5),
    "max-indices": (_max_values(kernel_size=2, return_indices=True), 4 * 2 * 2),
    "avg-k2": (lambda x: F.avg_pool2d(x, 2), 4 * 2 * 2),
    "avg-k3-p1-ceil-nopad": (
        lambda x: F.avg_pool2d(x, 3, 2, 1, ceil_mode=True, count_include_pad=False),
        4 * 3 * 3,
    ),
}


def _inputs(g: torch.Generator) -> tuple[Tensor]:
    return (torch.randn(3, 2, 9, 9, generator=g),)


def _traced_targets(array: Any) -> list[Any]:
    """The call targets of the array's traced forward graphs."""
    targets = []
    for entry in array._traces.values():
        fn = getattr(entry, "plain", None) or getattr(entry, "graph", None)
        graph = getattr(fn, "__self__", None)
        assert graph is not None, "the array's forward was not traced"
        targets += [n.target for n in graph.graph.nodes]
    return targets


@pytest.mark.parametrize("size", [1, 3])
@pytest.mark.parametrize("name", sorted(POOLS))
def test_pooling_matches_independent_models(name: str, size: int) -> None:
    pool, flat = POOLS[name]
    array = assert_fusion_matches(lambda: _PoolNet(pool, flat), _inputs, size=size, steps=3)
    if size > 1:  # rewritten: no copy before either pool
        assert _aten._unsafe_view.default not in _traced_targets(array)


def test_pooling_matches_with_one_input_per_member() -> None:
    pool, flat = POOLS["max-k3-s2-p1"]
    assert_fusion_matches(lambda: _PoolNet(pool, flat), _inputs, size=3, steps=3, shared=False)


def test_the_indices_are_those_of_each_member() -> None:
    torch.manual_seed(0)
    models = [nn.Conv2d(2, 3, 3) for _ in range(3)]
    refs = copy.deepcopy(models)

    class Indices(nn.Module):
        def __init__(self, conv: nn.Module) -> None:
            super().__init__()
            self.conv = conv

        def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
            return F.max_pool2d(self.conv(x), 3, 2, 1, ceil_mode=True, return_indices=True)

    array = hs.fuse([Indices(m) for m in models])
    x = torch.randn(2, 2, 9, 9)
    for _ in range(2):  # traced on the first call, replayed on the second
        values, indices = array(x)
        for i, r in enumerate(refs):
            want = F.max_pool2d(r(x), 3, 2, 1, ceil_mode=True, return_indices=True)
            torch.testing.assert_close(values[i], want[0], rtol=0, atol=0)
            assert torch.equal(indices[i], want[1])


def test_a_layout_the_rewrite_does_not_cover_keeps_vmaps_path() -> None:
    """A transposed input is not contiguous as ``[N, B, C, H, W]``: ``vmap``'s copy stays."""
    pool, _ = POOLS["max-k2"]
    array = assert_fusion_matches(
        lambda: _PoolNet(pool, 4 * 2 * 2, transpose=True), _inputs, size=3, steps=3
    )
    targets = _traced_targets(array)
    traces = len(array._traces)  # train and eval
    # per trace: the copy before the first pool and the one folding its output for conv2;
    # the second pool, of conv2's output, is rewritten
    assert targets.count(_aten._unsafe_view.default) == 2 * traces
    assert targets.count(_aten.max_pool2d_with_indices.default) == 2 * traces


def test_an_input_written_in_place_later_keeps_vmaps_path() -> None:
    """A pool's input written in place after the pool (legal without autograd): the rewrite
    would make the pool read a view of it, so it keeps vmap's copy."""

    class Later(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv = nn.Conv2d(2, 3, 3)

        def forward(self, x: Tensor) -> Tensor:
            y = self.conv(x)
            pooled = F.max_pool2d(y, 2)
            return pooled.sum((1, 2, 3)) + y.relu_().sum((1, 2, 3))

    torch.manual_seed(0)
    models = [Later().double() for _ in range(3)]
    refs = copy.deepcopy(models)
    array = hs.fuse(models)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for _ in range(2):  # traced, then replayed
            x = torch.randn(2, 2, 9, 9, generator=gen, dtype=torch.float64)
            out = array(x)
            for i, r in enumerate(refs):
                torch.testing.assert_close(out[i], r(x), rtol=1e-12, atol=1e-12)
    assert _aten._unsafe_view.default in _traced_targets(array)


def test_adam_steps_match_torch() -> None:
    pool, flat = POOLS["max-k3-s2-p1"]
    models = []
    for i in range(3):
        torch.manual_seed(i)
        models.append(_PoolNet(pool, flat).double())
    refs = [copy.deepcopy(m) for m in models]
    lrs = [0.01 * (i + 1) for i in range(3)]
    array = hs.fuse(models)
    run = SideBySide(
        array,
        hs.optim.Adam(array, lr=lrs),
        refs,
        [
            torch.optim.Adam(trained(r), lr=lr, foreach=False)
            for r, lr in zip(refs, lrs, strict=True)
        ],
    )
    classification_steps(run, torch.Generator().manual_seed(3), (4, 2, 9, 9), 5, steps=5)
    run.assert_states()
    assert _aten._unsafe_view.default not in _traced_targets(array)


class _ConvPool(nn.Module):
    """conv -> pool -> conv -> pool -> conv: every pool's output read by a convolution."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(2, 3, 3, padding=1)
        self.conv2 = nn.Conv2d(3, 4, 3, padding=1)
        self.conv3 = nn.Conv2d(4, 2, 1)

    def forward(self, x: Tensor) -> Tensor:
        x = F.max_pool2d(torch.relu(self.conv1(x)), 2)
        return self.conv3(F.max_pool2d(self.conv2(x), 2))


@pytest.mark.parametrize("size", [2, 8])
def test_a_fused_conv_pool_step_dispatches_no_copy_around_the_pools(size: int) -> None:
    torch.manual_seed(0)
    array = hs.fuse([_ConvPool() for _ in range(size)])
    x = torch.randn(2, 2, 8, 8)
    for _ in range(2):  # traced on the first call
        array(x).sum().backward()
    with OpCounter() as c:
        array(x).sum().backward()
    assert c.ops["max_pool2d_with_indices"] == 2
    assert c.ops["max_pool2d_with_indices_backward"] == 2
    assert not {"clone", "_unsafe_view"} & set(c.ops), c.ops
    assert c.ops["permute"] == 2  # the array's output, members first, and its backward
