"""The compiled path (``hs.fuse(..., compile=True)``): the traced forward and its backward
compiled by inductor train exactly like plain torch modules, dropout masks included, and what
cannot be compiled runs uncompiled with one warning naming the reason."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import Tensor, nn

import hfsweep as hs
from hfsweep.fusion import _tracing
from hfsweep.fusion._compile import CompileFallbackWarning, check_compile, mode_for
from hfsweep.testing import MLP, LeNet, assert_fusion_matches


def _compiled_traces(array: hs.FusedArray) -> int:
    return sum(1 for t in array._traces.values() if getattr(t, "plain", None) is not None)


# Each compiled signature costs inductor seconds to tens of seconds on a 2-core CPU (forward and
# backward, C++ compiled by gcc): the tests compile as few signatures as they can.


@pytest.mark.slow
@pytest.mark.timeout(900)  # compiling on a shared 2-core CPU
def test_compiled_mlp_matches_torch_in_float64() -> None:
    """Forward, backward and three SGD steps in train and eval mode, against B torch MLPs."""
    array = assert_fusion_matches(
        lambda: MLP(d_in=12, hidden=10, d_out=4),
        lambda g: (torch.randn(8, 12, generator=g),),
        size=3,
        steps=3,
        compile=True,
    )
    assert array._compile_seconds > 0  # the compiled graphs ran, not the plain traces
    assert _compiled_traces(array) == 2  # the train-mode and the eval-mode signature


@pytest.mark.slow
@pytest.mark.timeout(900)  # compiling on a shared 2-core CPU
def test_compiled_cnn_with_batchnorm_matches_torch_in_float32() -> None:
    """Convolutions, pooling, BatchNorm statistics and dropout layers (p=0 for the comparison)
    in float32 with the fusion rules' float32 tolerance."""
    array = assert_fusion_matches(
        lambda: LeNet(dropout=0.2),
        lambda g: (torch.randn(6, 1, 8, 8, generator=g),),
        size=2,
        steps=3,
        modes=("train",),
        dtype=torch.float32,
        rtol=1e-4,
        atol=1e-5,
        compile=True,
    )
    assert array._compile_seconds > 0


@pytest.mark.slow
@pytest.mark.timeout(900)  # compiling on a shared 2-core CPU
def test_compiled_transformer_encoder_layer_runs_compiled_and_matches_torch() -> None:
    """A Transformer encoder layer (attention whose output is permuted back, dropout layers of
    p=0 still in the graph, LayerNorm) compiles, with no fallback, and trains as B torch layers.
    Its dropout op's fake kernel once gave the product a layout the real one does not have, and
    the compiled graph's check of it sent every compiled Transformer back to the plain trace."""
    with warnings.catch_warnings():
        warnings.simplefilter("error", CompileFallbackWarning)
        array = assert_fusion_matches(
            lambda: nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True),
            lambda g: (torch.randn(4, 6, 16, generator=g),),
            size=2,
            steps=2,
            modes=("train",),
            dtype=torch.float32,
            rtol=1e-4,
            atol=1e-5,
            compile=True,
        )
    assert array._compile_seconds > 0
    assert _compiled_traces(array) >= 1  # every signature it ran compiled (no fallback)


class _DropoutNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(6, 16)
        self.drop = nn.Dropout(0.3)
        self.fc2 = nn.Linear(16, 3)

    def forward(self, x: Tensor) -> Tensor:
        # a dropout layer and a functional dropout call: both per-member streams
        h = torch.nn.functional.dropout(self.drop(self.fc1(x).relu()), 0.2, self.training)
        return self.fc2(h)


@pytest.mark.slow
@pytest.mark.timeout(900)  # compiling on a shared 2-core CPU
def test_dropout_masks_and_optimizer_steps_match_the_uncompiled_array() -> None:
    """Per-member dropout streams under compile: masks bit for bit (float64 outputs, gradients
    and AdamW steps equal to 1e-12), call counters advanced alike, members with their own p."""
    torch.manual_seed(0)
    models = [_DropoutNet().double() for _ in range(4)]
    arrays = [hs.fuse(copy.deepcopy(models), compile=c) for c in (False, True)]
    opts = []
    for a in arrays:
        a.set_dropout({"drop": [0.0, 0.1, 0.3, 0.5]})
        for i in range(4):
            a.manual_seed(i, 100 + i)
        opts.append(hs.optim.AdamW(a, lr=[1e-2, 2e-2, 3e-2, 4e-2], weight_decay=0.01))
    gen = torch.Generator().manual_seed(1)
    for _ in range(4):
        x = torch.randn(5, 6, generator=gen, dtype=torch.float64)
        outs = []
        for a, opt in zip(arrays, opts, strict=True):
            out = a(x)
            out.square().sum().backward()
            outs.append(out.detach())
            grads = [p.grad.clone() for p in a.parameters()]
            opt.step()
            opt.zero_grad()
            a._last_grads = grads  # type: ignore[attr-defined]
        torch.testing.assert_close(outs[1], outs[0], rtol=1e-12, atol=1e-12)
        for g1, g0 in zip(arrays[1]._last_grads, arrays[0]._last_grads, strict=True):  # type: ignore[attr-defined]
            torch.testing.assert_close(g1, g0, rtol=1e-12, atol=1e-12)
    for (n, p1), p0 in zip(arrays[1].named_parameters(), arrays[0].parameters(), strict=True):
        torch.testing.assert_close(p1, p0, rtol=1e-12, atol=1e-12, msg=n)
    assert arrays[1].rng_state(2) == arrays[0].rng_state(2)
    assert arrays[1].rng_state(2)["drop"][1] == 4
    assert _compiled_traces(arrays[1]) == 1


def test_a_compile_failure_falls_back_to_the_trace_with_one_warning(monkeypatch) -> None:
    def broken(graph: torch.fx.GraphModule, mode: str, state: object):  # type: ignore[no-untyped-def]
        def call(*args: Tensor) -> None:
            raise RuntimeError("inductor could not lower op foo\nmore detail")

        return call

    monkeypatch.setattr(_tracing, "compile_graph", broken)
    torch.manual_seed(0)
    models = [nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 2)) for _ in range(3)]
    plain = hs.fuse(copy.deepcopy(models))
    array = hs.fuse(models, compile=True)
    x = torch.randn(5, 4)
    with pytest.warns(CompileFallbackWarning, match="inductor could not lower op foo"):
        out = array(x)
    torch.testing.assert_close(out, plain(x))  # BatchNorm statistics updated once, not twice
    for b1, b0 in zip(array.buffers(), plain.buffers(), strict=True):
        torch.testing.assert_close(b1, b0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        torch.testing.assert_close(array(x), plain(x))  # no second warning
    assert _compiled_traces(array) == 0


class _Branching(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(3, 3)

    def forward(self, x: Tensor) -> Tensor:
        h = self.fc(x)
        return h * 2 if bool(x.sum() > 0) else h  # a branch on a value: not traceable


def test_an_untraceable_forward_runs_uncompiled_with_a_warning_naming_why() -> None:
    array = hs.fuse([_Branching() for _ in range(2)], compile=True)
    with pytest.warns(CompileFallbackWarning, match="cannot be traced"):
        out = array(torch.ones(2, 3))
    assert out.shape == (2, 2, 3)
    assert array._compile_seconds == 0


def test_compile_arguments_are_checked() -> None:
    models = [nn.Linear(2, 2) for _ in range(2)]
    with pytest.raises(ValueError, match=r"trace=False"):
        hs.fuse(models, trace=False, compile=True)
    with pytest.raises(ValueError, match=r"compile='fast' is not valid.*reduce-overhead"):
        hs.fuse(models, compile="fast")
    assert check_compile("max-autotune") == "max-autotune"
    assert hs.fuse(models, trace=False, compile=False).size == 2


def test_true_means_cuda_graphs_on_cuda_and_the_default_mode_elsewhere() -> None:
    assert mode_for(True, torch.device("cuda", 0)) == "reduce-overhead"
    assert mode_for(True, torch.device("cpu")) == "default"
    assert mode_for("max-autotune", torch.device("cpu")) == "max-autotune"
    assert mode_for(False, torch.device("cuda")) is None


@pytest.mark.gpu
def test_cuda_graphs_match_the_uncompiled_array_on_cuda() -> None:
    """``compile=True`` on CUDA (``mode="reduce-overhead"``): forward, backward and several
    fused SGD steps equal the uncompiled array's (float32, rtol 1e-4)."""
    torch.manual_seed(0)
    models = [MLP(d_in=12, hidden=32, d_out=4).cuda() for _ in range(4)]
    arrays = [hs.fuse(copy.deepcopy(models), compile=c) for c in (False, True)]
    opts = [hs.optim.SGD(a, lr=[0.1, 0.05, 0.02, 0.01], momentum=0.9) for a in arrays]
    gen = torch.Generator().manual_seed(2)
    for _ in range(5):
        x = torch.randn(16, 12, generator=gen).cuda()
        outs = []
        for a, opt in zip(arrays, opts, strict=True):
            out = a(x)
            out.square().mean().backward()
            outs.append(out.detach().clone())
            opt.step()
            opt.zero_grad()
        torch.testing.assert_close(outs[1], outs[0], rtol=1e-4, atol=1e-5)
    for p1, p0 in zip(arrays[1].parameters(), arrays[0].parameters(), strict=True):
        torch.testing.assert_close(p1, p0, rtol=1e-4, atol=1e-5)
    assert arrays[1]._compile_seconds > 0


def test_a_fallback_names_the_error_dynamo_stood_in_front_of() -> None:
    """A compiled graph that fails at run time can reach the caller as dynamo's "Attempt to trace
    generator" (raised while torch formats the first error): the warning names the first."""
    from torch._dynamo.exc import Unsupported

    from hfsweep.fusion._compile import compile_error

    try:
        try:
            raise AssertionError("expected size 4==4, stride 16==128 at dim=1\nError in op: x")
        except AssertionError:
            raise Unsupported("Attempt to trace generator\n  Explanation: ...") from None
    except Unsupported as exc:
        assert exc.__context__ is not None  # `from None` hides it from the report, not here
        text = compile_error(exc)
    assert text == (
        "AssertionError: expected size 4==4, stride 16==128 at dim=1; torch.compile then raised "
        "Unsupported: Attempt to trace generator"
    )
    assert compile_error(ValueError("inductor could not lower op foo\nmore")) == (
        "ValueError: inductor could not lower op foo"
    )


class _CachedKeys(nn.Module):
    """Keys concatenated to an empty cache, as Hugging Face's key-value cache does, then viewed
    as the attention's matmul views them."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)

    def forward(self, x: Tensor) -> Tensor:
        keys = self.proj(x).view(x.shape[0], x.shape[1], 2, 4).transpose(1, 2)
        keys = torch.cat([torch.tensor([]), keys], dim=-2)  # eager skips the 1-d empty tensor
        return keys.transpose(-1, -2).reshape(-1, 4, x.shape[1])


def test_the_graph_compiled_drops_skipped_cat_inputs_and_keeps_the_eager_layout() -> None:
    """What the compiled path hands inductor: the trace with the concatenation of one real
    tensor written as the contiguous copy eager ``cat`` made; same values, same strides, and
    the trace the uncompiled path replays left as it was."""
    from hfsweep.fusion._compile import _CATS, _without_skipped_cat_inputs

    torch.manual_seed(0)
    array = hs.fuse([_CachedKeys() for _ in range(2)])
    x = torch.randn(3, 5, 8)
    expected = array(x)
    (trace,) = array._traces.values()
    graph = trace.graph.__self__
    rewritten = _without_skipped_cat_inputs(graph)
    assert rewritten is not graph
    cats = [n for n in rewritten.graph.nodes if n.op == "call_function" and n.target in _CATS]
    assert not cats
    assert any(n.op == "call_function" and n.target in _CATS for n in graph.graph.nodes)
    state = list(array._state())
    with torch.no_grad():
        out_graph, out_rewritten = graph(*state, x), rewritten(*state, x)
    for a, b in zip(out_graph, out_rewritten, strict=True):
        assert torch.equal(a, b) and a.stride() == b.stride()
    assert torch.equal(out_rewritten[0], expected)
