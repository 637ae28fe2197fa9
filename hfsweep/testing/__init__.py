"""Helpers to prove that a fused array trains exactly like its members would alone."""

from ._conformance import assert_fusion_matches, assert_trees_close
from ._models import (
    MLP,
    LeNet,
    LSTMClassifier,
    SmallResNet,
    TiedLanguageModel,
    TransformerClassifier,
)

__all__ = [
    "MLP",
    "LSTMClassifier",
    "LeNet",
    "SmallResNet",
    "TiedLanguageModel",
    "TransformerClassifier",
    "assert_fusion_matches",
    "assert_trees_close",
]
