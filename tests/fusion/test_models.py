"""Composite models: a fused array trains each member exactly as the model trains alone."""

from __future__ import annotations

import pytest
import torch

from hfsweep.testing import (
    MLP,
    LeNet,
    LSTMClassifier,
    SmallResNet,
    TiedLanguageModel,
    TransformerClassifier,
    assert_fusion_matches,
)


def images(channels: int, size: int, n: int = 6):
    return lambda g: (torch.randn(n, channels, size, size, generator=g),)


def tokens(n: int = 4, length: int = 7, vocab: int = 50):
    return lambda g: (torch.randint(0, vocab, (n, length), generator=g),)


MODELS = {
    "MLP": (lambda: MLP(d_in=12, hidden=10, d_out=4), lambda g: (torch.randn(8, 12, generator=g),)),
    "LeNet-BN-Dropout": (lambda: LeNet(dropout=0.3), images(1, 8)),
    "SmallResNet": (SmallResNet, images(3, 8, n=4)),
    "TransformerClassifier": (lambda: TransformerClassifier(dropout=0.1), tokens()),
    "LSTMClassifier": (LSTMClassifier, tokens()),
    "TiedLanguageModel": (lambda: TiedLanguageModel(vocab=30), tokens(vocab=30)),
}


@pytest.mark.parametrize("size", [1, 3, 5])
@pytest.mark.parametrize("name", sorted(MODELS))
def test_model_matches_independent_models(name: str, size: int) -> None:
    make_model, make_input = MODELS[name]
    array = assert_fusion_matches(make_model, make_input, size=size, steps=3)
    assert array._last_call_traced, "the default path should replay a trace for this model"


@pytest.mark.parametrize("name", sorted(MODELS))
def test_model_matches_with_one_input_per_member(name: str) -> None:
    make_model, make_input = MODELS[name]
    assert_fusion_matches(make_model, make_input, size=3, steps=2, shared=False)


@pytest.mark.parametrize("name", ["LeNet-BN-Dropout", "TransformerClassifier", "LSTMClassifier"])
def test_model_matches_without_tracing(name: str) -> None:
    make_model, make_input = MODELS[name]
    assert_fusion_matches(make_model, make_input, size=3, steps=2, trace=False)


def test_float32_many_steps_stays_close() -> None:
    """float32 after 100 SGD steps: within rtol 1e-4 of the separate models."""
    assert_fusion_matches(
        lambda: MLP(d_in=12, hidden=16, d_out=4),
        lambda g: (torch.randn(16, 12, generator=g),),
        size=4,
        steps=100,
        dtype=torch.float32,
        rtol=1e-4,
        atol=1e-5,
        modes=("train",),
        lr=0.01,
    )


@pytest.mark.parametrize("name", sorted(MODELS))
@pytest.mark.parametrize("train", [True, False])
def test_no_op_falls_back_to_a_loop_over_members(name: str, train: bool) -> None:
    """vmap warns when an op has no batching rule and it loops over members instead."""
    import warnings

    import hfsweep as hs

    make_model, make_input = MODELS[name]
    array = hs.fuse([make_model() for _ in range(3)], trace=False)
    array.train(train)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*performance drop.*")
        array(*make_input(torch.Generator().manual_seed(0)))
