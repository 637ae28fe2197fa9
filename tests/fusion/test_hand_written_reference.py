"""The hand-written references of ``benchmarks/fusion_throughput.py`` compute what the engine does.

``benchmarks/_hand_written.py`` writes B MLPs (one ``baddbmm`` per layer) and B LeNet-style CNNs
(each convolution one convolution over ``B * C`` channels) by hand as one model. The throughput
table reads "hand-written fusion reaches x of ideal, the engine y of it" from their timings,
which means something only if they do the engine's arithmetic: checked here in float64 against
an ``hs.fuse`` array of the same models trained by ``torch.optim.SGD`` (the benchmark's plain
path), outputs first, then every member's parameters after several steps.
"""

from __future__ import annotations

import copy
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch
import torch.nn.functional as F

import hfsweep as hs

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


@pytest.fixture(scope="module")
def bench() -> ModuleType:
    """``benchmarks/fusion_throughput.py`` (its models and batches) with ``_hand_written``."""
    import importlib

    sys.path.insert(0, str(BENCHMARKS))
    try:
        return importlib.import_module("fusion_throughput")
    finally:
        sys.path.remove(str(BENCHMARKS))


@pytest.mark.parametrize("name, size", [("tiny_mlp", 3), ("small_cnn", 1), ("small_cnn", 3)])
def test_the_hand_written_step_trains_each_member_as_the_engine(
    bench: ModuleType, name: str, size: int
) -> None:
    torch.manual_seed(0)
    models = [bench.MODELS[name].build().double() for _ in range(size)]
    x, y = bench._batch(name, 8, torch.device("cpu"))
    x = x.double()
    hand = sys.modules["_hand_written"].hand_written(copy.deepcopy(models), x, y)
    assert hand is not None
    array = hs.fuse(copy.deepcopy(models))
    opt = torch.optim.SGD(array.parameters(), lr=0.01)
    torch.testing.assert_close(hand.forward(), array(x), rtol=1e-7, atol=1e-12)
    for _ in range(5):
        opt.zero_grad(set_to_none=True)
        hs.member_losses(array(x), y).sum().backward()
        opt.step()
        hand.step()
    for i, model in enumerate(models):
        fused, mine = array.member_state_dict(i), hand.member_state(i)
        assert set(mine) == set(fused) == set(model.state_dict())
        for key, value in fused.items():
            torch.testing.assert_close(mine[key], value, rtol=1e-7, atol=1e-12, msg=key)
            assert not torch.equal(value, model.state_dict()[key])  # it trained


def test_each_hand_written_member_trains_as_the_model_alone(bench: ModuleType) -> None:
    """Member 1 of three hand-written CNNs takes the steps its model takes alone with
    ``torch.optim.SGD``: the grouped convolution keeps the members apart."""
    torch.manual_seed(0)
    models = [bench.MODELS["small_cnn"].build().double() for _ in range(3)]
    x, y = bench._batch("small_cnn", 8, torch.device("cpu"))
    x = x.double()
    hand = sys.modules["_hand_written"].hand_written(copy.deepcopy(models), x, y)
    alone = models[1]
    opt = torch.optim.SGD(alone.parameters(), lr=0.01)
    for _ in range(5):
        opt.zero_grad()
        F.cross_entropy(alone(x), y).backward()
        opt.step()
        hand.step()
    for key, value in alone.state_dict().items():
        torch.testing.assert_close(hand.member_state(1)[key], value, rtol=1e-7, atol=1e-12)


def test_no_hand_written_reference_for_other_models(bench: ModuleType) -> None:
    x, y = bench._batch("transformer", 2, torch.device("cpu"))
    models = [bench.MODELS["transformer"].build()]
    assert sys.modules["_hand_written"].hand_written(models, x, y) is None
