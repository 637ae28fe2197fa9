"""Parametrized modules (``torch.nn.utils.parametrizations``) fuse and train as they do alone.

A parametrization computes a tensor from stacked originals (``parametrizations.weight.original0``
and ``original1`` for weight norm), so an array stacks the originals per member. Spectral norm's
power iteration also updates ``_u``/``_v`` buffers per member in training mode.
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils import parametrizations

import hfsweep as hs
from hfsweep.testing import assert_fusion_matches


def _weight_norm_mlp() -> nn.Module:
    return nn.Sequential(
        parametrizations.weight_norm(nn.Linear(5, 4)),
        nn.Tanh(),
        parametrizations.weight_norm(nn.Linear(4, 3), dim=None),
    )


def _weight_norm_conv() -> nn.Module:
    return nn.Sequential(
        parametrizations.weight_norm(nn.Conv2d(2, 3, 3)),
        nn.Tanh(),
        nn.Flatten(),
        nn.Linear(12, 3),
    )


def _weight_norm_conv_negative_dim() -> nn.Module:
    layer = parametrizations.weight_norm(nn.Conv2d(2, 3, 3), dim=-3)  # input channels
    return nn.Sequential(layer, nn.Tanh(), nn.Flatten(), nn.Linear(12, 3))


def _orthogonal() -> nn.Module:
    return nn.Sequential(parametrizations.orthogonal(nn.Linear(5, 5)), nn.Tanh(), nn.Linear(5, 3))


def _householder() -> nn.Module:
    layer = parametrizations.orthogonal(nn.Linear(5, 4), orthogonal_map="householder")
    return nn.Sequential(layer, nn.Tanh(), nn.Linear(4, 3))


def _spectral_norm() -> nn.Module:
    return nn.Sequential(
        parametrizations.spectral_norm(nn.Linear(5, 4), n_power_iterations=2),
        nn.Tanh(),
        nn.Linear(4, 3),
    )


def _vectors(g: torch.Generator) -> tuple[torch.Tensor]:
    return (torch.randn(6, 5, generator=g),)


def _images(g: torch.Generator) -> tuple[torch.Tensor]:
    return (torch.randn(4, 2, 4, 4, generator=g),)


MODELS: dict[str, tuple[Callable[[], nn.Module], Callable[[torch.Generator], tuple]]] = {
    "weight_norm": (_weight_norm_mlp, _vectors),
    "weight_norm-conv": (_weight_norm_conv, _images),
    "weight_norm-conv-negative-dim": (_weight_norm_conv_negative_dim, _images),
    "orthogonal": (_orthogonal, _vectors),
    "orthogonal-householder": (_householder, _vectors),
    "spectral_norm": (_spectral_norm, _vectors),
}


@pytest.mark.parametrize("trace", [True, False])
@pytest.mark.parametrize("name", sorted(MODELS))
def test_parametrized_model_matches_separate_models(name: str, trace: bool) -> None:
    """Forward, backward and three SGD steps in train and eval mode, buffers (spectral norm's
    singular vectors) included, rtol 1e-7 in float64; ``member(i)`` loads back."""
    make_model, make_input = MODELS[name]
    with warnings.catch_warnings():
        # vmap's loop over members for an op without a batching rule warns of a performance drop
        warnings.filterwarnings("error", message=".*performance drop")
        array = assert_fusion_matches(make_model, make_input, size=3, steps=3, trace=trace)
    assert array._last_call_traced == trace


@pytest.mark.parametrize("name", ["weight_norm", "spectral_norm", "orthogonal"])
def test_parametrized_model_with_fused_adam_matches_torch_adam(name: str) -> None:
    """Five Adam steps with one learning rate per member against torch.optim.Adam on each model
    alone; then each exported member reproduces its model, outputs and originals."""
    make_model, make_input = MODELS[name]
    lrs = [0.05, 0.01, 0.002]
    models = []
    for i in range(len(lrs)):
        torch.manual_seed(i)
        models.append(make_model().double())
    refs = [copy.deepcopy(m) for m in models]
    array = hs.fuse(models)
    opt = hs.optim.Adam(array, lr=lrs, weight_decay=0.01)
    ref_opts = [
        torch.optim.Adam(r.parameters(), lr=lr, weight_decay=0.01, foreach=False)
        for r, lr in zip(refs, lrs, strict=True)
    ]
    g = torch.Generator().manual_seed(5)
    for _ in range(5):
        (x,) = make_input(g)
        x = x.double()
        target = torch.randn(x.shape[0], 3, generator=g, dtype=torch.float64)
        losses = F.mse_loss(array(x), target.expand(len(lrs), *target.shape), reduction="none")
        opt.zero_grad()
        losses.mean(dim=(1, 2)).sum().backward()
        opt.step()
        for ref, ref_opt in zip(refs, ref_opts, strict=True):
            ref_opt.zero_grad()
            F.mse_loss(ref(x), target).backward()
            ref_opt.step()
    stacked = dict(array.module.state_dict())
    (x,) = make_input(g)
    x = x.double()
    array.eval()
    out = array(x)
    for i, ref in enumerate(refs):
        ref.eval()
        for key, value in ref.state_dict().items():
            torch.testing.assert_close(stacked[key][i], value, rtol=1e-7, atol=1e-10, msg=key)
        exported = array.member(i)
        fresh = make_model().double()
        fresh.load_state_dict(exported.state_dict())
        fresh.eval()
        with torch.no_grad():
            torch.testing.assert_close(out[i], ref(x), rtol=1e-7, atol=1e-10)
            torch.testing.assert_close(fresh(x), ref(x), rtol=1e-7, atol=1e-10)
    assert any(key.startswith("0.parametrizations.weight.original") for key in stacked), stacked


def test_different_parametrizations_are_named() -> None:
    a = nn.Sequential(parametrizations.weight_norm(nn.Linear(4, 4)))
    b = nn.Sequential(parametrizations.orthogonal(nn.Linear(4, 4)))
    with pytest.raises(
        hs.FusionError,
        match=r"submodule '0\.parametrizations\.weight' has parameters \['original0', "
        r"'original1'\] in member 0 but \['original'\] in member 1",
    ):
        hs.fuse([a, b])
    c = nn.Sequential(parametrizations.spectral_norm(nn.Linear(4, 4)))
    d = nn.Sequential(parametrizations.spectral_norm(nn.Linear(4, 4), eps=1e-6))
    with pytest.raises(
        hs.FusionError,
        match=r"submodule '0\.parametrizations\.weight\.0': attribute 'eps' is 1e-12 in member 0 "
        r"but 1e-06 in member 1",
    ):
        hs.fuse([c, d])


def test_parametrized_and_plain_class_differences_name_both() -> None:
    """A parametrized module's class is its original class: the message names each side's
    class and parametrized tensors instead of two identical-looking class names."""
    a = nn.Sequential(parametrizations.weight_norm(nn.Linear(4, 4)))
    b = nn.Sequential(nn.Linear(4, 4))
    parametrizations.weight_norm(b[0])
    hs.fuse([a, b])  # same class, same parametrization
    c = nn.Sequential(nn.Bilinear(4, 4, 4))
    c[0].weight = nn.Parameter(torch.randn(4, 4))  # same parameter shape as Linear(4, 4)
    del c[0].bias
    c[0].register_parameter("bias", nn.Parameter(torch.randn(4)))
    parametrizations.weight_norm(c[0])
    with pytest.raises(
        hs.FusionError,
        match=r"submodule '0' is Linear with parametrized \['weight'\] in member 0 but "
        r"Bilinear with parametrized \['weight'\] in member 1",
    ):
        hs.fuse([a, c])


@pytest.mark.parametrize("legacy", ["weight_norm", "spectral_norm"])
def test_hook_based_reparametrizations_point_to_the_parametrization(legacy: str) -> None:
    def make() -> nn.Module:
        with pytest.warns(FutureWarning) if legacy == "weight_norm" else _nothing():
            layer = getattr(nn.utils, legacy)(nn.Linear(4, 4))
        return nn.Sequential(layer, nn.Tanh())

    with pytest.raises(
        hs.FusionError,
        match=rf"submodule '0' \(Linear\) uses torch\.nn\.utils\.{legacy} on 'weight'.*"
        rf"Use torch\.nn\.utils\.parametrizations\.{legacy} instead",
    ):
        hs.fuse([make(), make()])


class _nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *args: object) -> None:
        return None
