"""Models that cannot share an array are refused with a message naming the submodule and the fix."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import hfsweep as hs
from hfsweep.testing import MLP, LeNet


def test_empty_and_non_module_inputs() -> None:
    with pytest.raises(hs.FusionError, match="at least one model"):
        hs.fuse([])
    with pytest.raises(hs.FusionError, match=r"member 1 is a str, not a torch\.nn\.Module"):
        hs.fuse([nn.Linear(2, 2), "linear"])  # type: ignore[list-item]


def test_same_object_twice() -> None:
    m = nn.Linear(2, 2)
    with pytest.raises(hs.FusionError, match="same model object"):
        hs.fuse([m, m])


def test_different_classes_name_the_submodule() -> None:
    a = nn.Sequential(nn.Linear(2, 2), nn.ReLU())
    b = nn.Sequential(nn.Linear(2, 2), nn.Tanh())
    with pytest.raises(
        hs.FusionError, match=r"submodule '1' is ReLU in member 0 but Tanh in member 1"
    ):
        hs.fuse([a, b])


def test_different_module_trees() -> None:
    with pytest.raises(hs.FusionError, match=r"different module tree.*missing \['layers\.2'\]"):
        hs.fuse([MLP(depth=3), MLP(depth=2)])


def test_different_shapes_name_the_parameter_and_what_to_do() -> None:
    with pytest.raises(
        hs.FusionError, match=r"'layers\.0\.weight' is \(32, 64\).*\(16, 64\).*different arrays"
    ):
        hs.fuse([MLP(hidden=32), MLP(hidden=16)])


def test_different_dtypes() -> None:
    with pytest.raises(hs.FusionError, match=r"torch\.float32 in member 0 but .*torch\.float64"):
        hs.fuse([nn.Linear(2, 2), nn.Linear(2, 2).double()])


def test_different_non_tensor_settings() -> None:
    with pytest.raises(
        hs.FusionError, match=r"submodule 'bn1': attribute 'eps' is 1e-05 in member 0 but 0\.001"
    ):
        a, b = LeNet(), LeNet()
        b.bn1.eps = 1e-3
        hs.fuse([a, b])
    with pytest.raises(hs.FusionError, match="negative_slope"):
        hs.fuse([nn.LeakyReLU(0.1), nn.LeakyReLU(0.2)])


def test_different_train_modes() -> None:
    a, b = LeNet(), LeNet()
    b.eval()
    with pytest.raises(hs.FusionError, match="attribute 'training' is True in member 0 but False"):
        hs.fuse([a, b])


def test_plain_tensor_attributes_must_match_or_be_buffers() -> None:
    class Scaled(nn.Module):
        def __init__(self, s: float) -> None:
            super().__init__()
            self.fc = nn.Linear(2, 2)
            self.scale = torch.tensor(s)

        def forward(self, x):
            return self.fc(x) * self.scale

    with pytest.raises(hs.FusionError, match=r"'scale'.*Register it as a buffer"):
        hs.fuse([Scaled(1.0), Scaled(2.0)])
    hs.fuse([Scaled(1.0), Scaled(1.0)])  # equal values are fine


def test_hooks_are_refused() -> None:
    a, b = MLP(), MLP()
    a.head.register_forward_hook(lambda *args: None)
    with pytest.raises(hs.FusionError, match=r"submodule 'head' \(Linear\) has forward hooks"):
        hs.fuse([a, b])


def test_lazy_modules_are_refused_until_initialised() -> None:
    with pytest.raises(hs.FusionError, match="not initialised"):
        hs.fuse([nn.LazyLinear(3), nn.LazyLinear(3)])


@pytest.mark.parametrize(
    ("make", "match"),
    [
        (lambda: nn.Embedding(5, 2, max_norm=1.0), "max_norm=1.0"),
        (lambda: nn.Embedding(5, 2, sparse=True), "sparse=True"),
        (lambda: nn.SyncBatchNorm(3), "SyncBatchNorm"),
    ],
)
def test_unsupported_layers_name_the_reason_and_the_alternative(make, match) -> None:
    with pytest.raises(hs.FusionError, match=match):
        hs.fuse([nn.Sequential(make()), nn.Sequential(make())])


def test_missing_batching_rule_becomes_a_fusion_error_naming_the_submodule() -> None:
    class Odd(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(3, 3)

        def forward(self, x):
            return torch.ops.aten.rrelu(self.fc(x), training=True)

    class Outer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.odd = Odd()

        def forward(self, x):
            return self.odd(x)

    array = hs.fuse([Outer(), Outer()])
    with pytest.raises(
        hs.FusionError, match=r"submodule 'odd' \(Odd\) cannot run in a fused array"
    ):
        array(torch.randn(2, 3))


def test_packed_sequences_are_refused_with_an_alternative() -> None:
    from torch.nn.utils.rnn import pack_padded_sequence

    array = hs.fuse([nn.LSTM(2, 3), nn.LSTM(2, 3)])
    packed = pack_padded_sequence(torch.randn(4, 2, 2), [4, 3])
    with pytest.raises(hs.FusionError, match=r"PackedSequence.*pad"):
        array(packed)
