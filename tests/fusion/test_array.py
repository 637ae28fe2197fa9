"""FusedArray behaviour: shapes, layout, member export and refill, modes, dtype moves, state dicts,
and forward code that cannot be replayed from a trace."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import hfsweep as hs
from hfsweep.testing import MLP, LeNet, LSTMClassifier, TransformerClassifier

B = 4


def mlp_models(size: int = B, **kw) -> list[nn.Module]:
    return [MLP(d_in=6, hidden=8, d_out=3, **kw) for _ in range(size)]


def test_size_and_output_shapes() -> None:
    array = hs.fuse(mlp_models())
    assert array.size == B
    assert array(torch.randn(5, 6)).shape == (B, 5, 3)
    assert array(torch.randn(B, 5, 6), shared=False).shape == (B, 5, 3)


def test_every_parameter_and_buffer_has_the_member_dimension_first() -> None:
    array = hs.fuse([LeNet() for _ in range(3)])
    single = LeNet()
    shapes = {k: v.shape for k, v in single.state_dict().items()}
    for name, t in array.module.state_dict().items():
        if name.rsplit(".", 1)[-1] in ("member_p", "member_seed", "member_calls"):
            assert t.shape == (3,), name  # per-member dropout settings
            continue
        assert t.shape == (3, *shapes[name]), name
    assert all(p.shape[0] == 3 for p in array.parameters())


def test_shared_false_rejects_inputs_without_member_dimension() -> None:
    array = hs.fuse(mlp_models())
    with pytest.raises(hs.FusionError, match=r"shared=False.*size 4.*\(5, 6\)"):
        array(torch.randn(5, 6), shared=False)


def test_fuse_copies_and_never_changes_the_models_passed_in() -> None:
    models = mlp_models()
    before = [copy.deepcopy(m.state_dict()) for m in models]
    array = hs.fuse(models)
    opt = torch.optim.SGD(array.parameters(), lr=0.1)
    hs.member_losses(array(torch.randn(5, 6)), torch.randint(0, 3, (5,))).sum().backward()
    opt.step()
    for m, sd in zip(models, before, strict=True):
        for k, v in m.state_dict().items():
            assert torch.equal(v, sd[k])


def test_member_is_an_independent_copy_of_the_original_class() -> None:
    models = mlp_models()
    array = hs.fuse(models)
    m = array.member(2)
    assert type(m) is MLP
    x = torch.randn(5, 6)
    expected = array(x)[2].detach()
    torch.testing.assert_close(m(x), expected)
    with torch.no_grad():
        for p in array.parameters():
            p.add_(1.0)
    torch.testing.assert_close(m(x), expected)  # exporting copied, did not alias
    assert array.member(-1)(x).shape == (5, 3)
    with pytest.raises(IndexError, match="out of range"):
        array.member(B)


def test_member_state_dict_has_exactly_the_models_keys() -> None:
    array = hs.fuse([LeNet(dropout=0.2) for _ in range(3)])
    assert array.member(0).state_dict().keys() == LeNet().state_dict().keys()


class _TiedBatchNormNet(nn.Module):
    """Tied input and output weights, BatchNorm, a non-persistent buffer and dropout."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(7, 5)
        self.bn = nn.BatchNorm1d(5)
        self.drop = nn.Dropout(0.3)
        self.out = nn.Linear(5, 7)
        self.out.weight = self.emb.weight
        self.register_buffer("scratch", torch.ones(2), persistent=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.out(self.drop(self.bn(self.emb(tokens))))


class _ExtraStateNet(nn.Module):
    """Extra state in its state dict: member state dicts go through member(i)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 2)
        self.drop = nn.Dropout(0.2)
        self.calls = 0

    def get_extra_state(self) -> dict:
        return {"calls": self.calls}

    def set_extra_state(self, state: dict) -> None:
        self.calls = state["calls"]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.lin(x))


@pytest.mark.parametrize(
    "make", [_TiedBatchNormNet, _ExtraStateNet, LeNet], ids=["tied-bn", "extra-state", "lenet"]
)
def test_member_state_dict_equals_the_members_state_dict(make) -> None:
    """The state dict read from the stacked tensors is member(i).state_dict(): keys, order,
    values, tying and metadata; it loads into a fresh model and is a copy."""
    torch.manual_seed(0)
    array = hs.fuse([make() for _ in range(3)])
    x = torch.randint(0, 7, (6,)) if make is _TiedBatchNormNet else torch.randn(6, 3)
    if make is LeNet:
        x = torch.randn(6, 1, 8, 8)
    array(x).sum().backward()  # BatchNorm statistics and dropout counters move
    for i in range(3):
        expected = array.member(i).state_dict()
        got = array.member_state_dict(i)
        assert list(got) == list(expected)
        for k, want in expected.items():
            if isinstance(want, torch.Tensor):
                assert torch.equal(got[k], want) and got[k].dtype == want.dtype, k
            else:
                assert got[k] == want, k  # extra state
        assert got._metadata == expected._metadata
        make().load_state_dict(got)
    tied = array.member_state_dict(1)
    if make is _TiedBatchNormNet:
        assert tied["emb.weight"] is tied["out.weight"]
    before = {k: v.clone() for k, v in tied.items() if isinstance(v, torch.Tensor)}
    with torch.no_grad():
        for p in array.parameters():
            p.add_(1.0)
    assert all(torch.equal(tied[k], before[k]) for k in before)  # copies, not views


def _input_of(make) -> torch.Tensor:
    return torch.randn(4, 1, 8, 8) if make is LeNet else torch.randn(4, 3)


@pytest.mark.parametrize(
    "make", [_TiedBatchNormNet, _ExtraStateNet, LeNet], ids=["tied-bn", "extra-state", "lenet"]
)
def test_load_member_state_dict_writes_one_slot(make) -> None:
    """Loading a model's state dict into slot 1 makes member(1) that model (tied weights and
    buffers included) and leaves the other slots and the dropout settings alone."""
    torch.manual_seed(0)
    array = hs.fuse([make() for _ in range(3)])
    donor = make()
    if make is LeNet:
        donor(torch.randn(4, 1, 8, 8))  # BatchNorm statistics away from their defaults
    array(torch.randint(0, 7, (4,)) if make is _TiedBatchNormNet else _input_of(make))
    others = [array.member_state_dict(i) for i in (0, 2)]
    settings = {k: v.clone() for k, v in array.state_dict().items() if "member_" in k}
    array.load_member_state_dict(1, donor.state_dict())
    got = array.member(1).state_dict()
    for k, want in donor.state_dict().items():
        if isinstance(want, torch.Tensor):
            assert torch.equal(got[k], want), k
    for i, before in zip((0, 2), others, strict=True):
        after = array.member_state_dict(i)
        assert all(
            torch.equal(after[k], v) for k, v in before.items() if isinstance(v, torch.Tensor)
        )
    assert all(torch.equal(array.state_dict()[k], v) for k, v in settings.items())


def test_load_member_state_dict_rejects_other_keys_and_shapes() -> None:
    array = hs.fuse(mlp_models(2))
    good = MLP(d_in=6, hidden=8, d_out=3).state_dict()
    with pytest.raises(KeyError, match="missing"):
        array.load_member_state_dict(0, {k: v for k, v in good.items() if k != "head.bias"})
    with pytest.raises(ValueError, match="shape"):
        array.load_member_state_dict(0, {**good, "head.bias": torch.zeros(4)})


def test_member_keeps_train_mode_and_requires_grad() -> None:
    models = mlp_models()
    for m in models:
        m.layers[0].weight.requires_grad_(False)
    array = hs.fuse(models)
    array.eval()
    m = array.member(1)
    assert not m.training
    assert not m.layers[0].weight.requires_grad and m.head.weight.requires_grad


def test_load_member_refills_one_slot_and_leaves_the_others() -> None:
    array = hs.fuse(mlp_models())
    x = torch.randn(5, 6)
    before = array(x).detach()
    newcomer = MLP(d_in=6, hidden=8, d_out=3)
    array.load_member(1, newcomer)
    after = array(x).detach()
    torch.testing.assert_close(after[1], newcomer(x))
    for i in (0, 2, 3):
        assert torch.equal(after[i], before[i])


def test_load_member_restarts_batchnorm_statistics_of_that_slot() -> None:
    torch.manual_seed(1)
    models = [LeNet() for _ in range(2)]
    array = hs.fuse(models)
    for _ in range(3):
        array(torch.randn(4, 1, 8, 8))
    fresh = LeNet()
    array.load_member(0, fresh)
    bufs = dict(array.module.named_buffers())
    assert bufs["bn1.num_batches_tracked"].tolist() == [0, 3]
    torch.testing.assert_close(bufs["bn1.running_mean"][0], fresh.bn1.running_mean)


def test_load_member_casts_to_the_arrays_dtype() -> None:
    array = hs.fuse(mlp_models()).double()
    newcomer = MLP(d_in=6, hidden=8, d_out=3)
    array.load_member(0, newcomer)
    x = torch.randn(5, 6, dtype=torch.float64)
    torch.testing.assert_close(array(x)[0], newcomer.double()(x))


def test_load_member_rejects_another_architecture() -> None:
    array = hs.fuse(mlp_models())
    with pytest.raises(hs.FusionError, match=r"layers\.0\.weight.*\(16, 6\)"):
        array.load_member(0, MLP(d_in=6, hidden=16, d_out=3))


def test_train_eval_propagate_and_select_separate_traces() -> None:
    array = hs.fuse([LeNet() for _ in range(2)])
    array.eval()
    assert all(not m.training for m in array.module.modules())
    x = torch.randn(3, 1, 8, 8)
    out_eval = array(x)
    array.train()
    assert all(m.training for m in array.module.modules())
    out_train = array(x)
    assert not torch.allclose(out_eval, out_train)  # batch statistics vs running statistics
    assert len(array._traces) == 2


def test_new_batch_size_traces_again_and_stays_exact() -> None:
    models = mlp_models()
    refs = [copy.deepcopy(m) for m in models]
    array = hs.fuse(models)
    for n in (5, 3, 5):
        x = torch.randn(n, 6)
        out = array(x)
        for i, r in enumerate(refs):
            torch.testing.assert_close(out[i], r(x))
    assert len(array._traces) == 2


def test_to_dtype_moves_everything_and_retraces() -> None:
    array = hs.fuse([LeNet() for _ in range(2)])
    array(torch.randn(3, 1, 8, 8))
    array.double()
    assert all(p.dtype == torch.float64 for p in array.parameters())
    assert array(torch.randn(3, 1, 8, 8, dtype=torch.float64)).dtype == torch.float64
    assert array.member(0).fc1.weight.dtype == torch.float64


def test_state_dict_round_trip_between_arrays() -> None:
    a = hs.fuse([LeNet(dropout=0.1) for _ in range(3)])
    b = hs.fuse([LeNet(dropout=0.4) for _ in range(3)])
    x = torch.randn(3, 1, 8, 8)
    a(x)  # move BatchNorm statistics away from their initial values
    b.load_state_dict(a.state_dict())
    a.eval()
    b.eval()
    torch.testing.assert_close(a(x), b(x))
    assert b.dropout == a.dropout


def test_tensor_keyword_arguments_and_non_tensor_outputs() -> None:
    class Attn(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.mha = nn.MultiheadAttention(8, 2, batch_first=True)

        def forward(self, x, mask=None):
            return self.mha(x, x, x, key_padding_mask=mask, need_weights=False)

    models = [Attn() for _ in range(3)]
    refs = [copy.deepcopy(m) for m in models]
    array = hs.fuse(models)
    x = torch.randn(2, 5, 8)
    mask = torch.tensor([[False] * 5, [False, False, False, True, True]])
    out, weights = array(x, mask=mask)
    assert weights is None
    for i, r in enumerate(refs):
        torch.testing.assert_close(out[i], r(x, mask=mask)[0])


@pytest.mark.parametrize("trace", [True, False], ids=["traced", "eager"])
@pytest.mark.parametrize(
    "wrap",
    [lambda t: (t,), lambda t: [t], lambda t: {"logits": t}],
    ids=["tuple", "list", "dict"],
)
def test_one_tensor_in_a_container_comes_back_in_it(wrap, trace) -> None:
    """Only a bare tensor comes back bare: a model's ``(out,)`` is not unwrapped."""

    class Wrapped(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(3, 2)

        def forward(self, x):
            return wrap(self.fc(x))

    array = hs.fuse([Wrapped() for _ in range(2)], trace=trace)
    x = torch.randn(4, 3)
    for _ in range(2):  # the first call traces, the second replays
        out = array(x)
        assert type(out) is type(wrap(x))
        (value,) = out.values() if isinstance(out, dict) else out
        assert value.shape == (2, 4, 2)


def test_lstm_initial_state_as_a_nested_argument() -> None:
    models = [nn.LSTM(3, 4) for _ in range(2)]
    refs = [copy.deepcopy(m) for m in models]
    array = hs.fuse(models)
    x, h0, c0 = torch.randn(5, 2, 3), torch.randn(1, 2, 4), torch.randn(1, 2, 4)
    out, (h, c) = array(x, (h0, c0))
    for i, r in enumerate(refs):
        ro, (rh, rc) = r(x, (h0, c0))
        torch.testing.assert_close(out[i], ro)
        torch.testing.assert_close(h[i], rh)
        torch.testing.assert_close(c[i], rc)


def test_model_without_parameters() -> None:
    array = hs.fuse([nn.ReLU() for _ in range(3)])
    x = torch.randn(4, 2)
    assert torch.equal(array(x), F.relu(x).expand(3, 4, 2))


class DataDependent(nn.Module):
    """Branches on the value of a shared input: a trace would freeze one branch."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(3, 2)

    def forward(self, x):
        if x.sum() > 0:
            x = x * 2
        return self.fc(x)


def test_forward_that_branches_on_values_runs_eagerly_and_exactly() -> None:
    models = [DataDependent() for _ in range(3)]
    refs = [copy.deepcopy(m) for m in models]
    array = hs.fuse(models)
    for sign in (1.0, -1.0, 1.0):
        x = sign * torch.rand(4, 3)
        out = array(x)
        assert not array._last_call_traced
        for i, r in enumerate(refs):
            torch.testing.assert_close(out[i], r(x))


class NoGradInside(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(3, 3)
        self.b = nn.Linear(3, 2)

    def forward(self, x):
        with torch.no_grad():
            h = self.a(x)
        return self.b(h)


def test_forward_that_switches_grad_mode_runs_eagerly_with_right_gradients() -> None:
    models = [NoGradInside() for _ in range(2)]
    refs = [copy.deepcopy(m) for m in models]
    array = hs.fuse(models)
    x = torch.randn(4, 3)
    array(x).sum().backward()
    assert not array._last_call_traced
    assert array.module.a.weight.grad is None
    for i, r in enumerate(refs):
        r(x).sum().backward()
        torch.testing.assert_close(array.module.b.weight.grad[i], r.b.weight.grad)


class Counter(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(3, 2)
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        return self.fc(x) * self.calls


def test_forward_that_changes_python_attributes_warns_and_runs_eagerly() -> None:
    models = [Counter() for _ in range(2)]
    refs = [copy.deepcopy(m) for m in models]
    array = hs.fuse(models)
    x = torch.randn(4, 3)
    with pytest.warns(UserWarning, match="runs eagerly"):
        array(x)
    for r in refs:
        r(x)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = array(x)
    for i, r in enumerate(refs):
        torch.testing.assert_close(out[i], r(x))


def test_changing_a_setting_of_the_template_selects_a_new_trace() -> None:
    models = [nn.Sequential(nn.Linear(3, 3), nn.LeakyReLU(0.1)) for _ in range(2)]
    array = hs.fuse(models)
    x = -torch.ones(2, 3)
    first = array(x).detach()
    array.module[1].negative_slope = 0.5
    second = array(x).detach()
    assert not torch.allclose(first, second)


def test_trace_false_never_traces() -> None:
    array = hs.fuse(mlp_models(), trace=False)
    array(torch.randn(2, 6))
    assert not array._last_call_traced and not array._traces


def test_unhashable_argument_runs_eagerly() -> None:
    class TakesList(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(3, 2)

        def forward(self, x, scales):
            return self.fc(x) * scales[0]

    array = hs.fuse([TakesList() for _ in range(2)])
    out = array(torch.randn(4, 3), [2.0])
    assert out.shape == (2, 4, 2)


def test_error_inside_forward_names_the_submodule() -> None:
    array = hs.fuse([LSTMClassifier() for _ in range(2)])
    with pytest.raises(Exception) as info:
        array(torch.randn(3, 5))  # floats where token ids belong
    text = str(info.value) + "".join(getattr(info.value, "__notes__", []))
    assert "embed" in text


def test_repr_and_size_of_transformer_array() -> None:
    array = hs.fuse([TransformerClassifier() for _ in range(2)])
    assert "size=2" in repr(array)


def test_pickled_array_keeps_its_fused_layers(tmp_path) -> None:
    """torch.save of a whole array (or a hand-off to another process) must not lose fusion."""
    import subprocess
    import sys

    torch.manual_seed(3)
    array = hs.fuse([LeNet(dropout=p) for p in (0.1, 0.2, 0.3)])
    array.module.bn1.momentum = None
    for m in array.module.modules():
        if isinstance(m, nn.BatchNorm2d):
            m.momentum = None
    path = tmp_path / "array.pt"
    torch.save(array, path)
    code = (
        "import torch, sys; a = torch.load(sys.argv[1], weights_only=False); "
        "print(type(a.module.bn1).__qualname__, a.dropout['drop']); "
        "x = torch.randn(4, 1, 8, 8); a(x); print(a.module.bn1.num_batches_tracked.tolist())"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, str(path)], capture_output=True, text=True, check=True
    ).stdout
    assert out.splitlines()[0].startswith("FusedBatchNorm2d [0.1")
    assert out.splitlines()[1] == "[1, 1, 1]"


def test_deepcopy_gives_an_independent_working_array() -> None:
    array = hs.fuse(mlp_models())
    x = torch.randn(3, 6)
    twin = copy.deepcopy(array)
    torch.testing.assert_close(twin(x), array(x))
    with torch.no_grad():
        for p in twin.parameters():
            p.zero_()
    assert not torch.equal(twin(x), array(x))


def test_arrays_of_one_architecture_share_traces() -> None:
    """A trace cache shared by arrays of one architecture (as the trainer shares it) is used
    by an array of the same size instead of tracing again, and gives the same outputs."""

    def make(seed: int) -> nn.Module:
        torch.manual_seed(seed)
        return nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Dropout(0.2), nn.Linear(5, 3))

    cache: dict = {}
    x = torch.randn(7, 6)
    first = hs.fuse([make(i) for i in range(3)])
    first._share_traces(cache)
    first(x)
    assert len(cache) == 1
    second = hs.fuse([make(i + 10) for i in range(3)])
    second._share_traces(cache)
    alone = hs.fuse([make(i + 10) for i in range(3)])  # its own traces only
    out = second(x)
    assert len(cache) == 1  # found in the shared cache, not traced again
    assert list(second._traces.values()) == list(cache.values())
    torch.testing.assert_close(out, alone(x), rtol=0, atol=0)
    hs.fuse([make(0) for _ in range(2)])._share_traces(cache)  # another size: another entry
    smaller = hs.fuse([make(0) for _ in range(2)])
    smaller._share_traces(cache)
    smaller(x)
    assert len(cache) == 2


def test_arrays_whose_first_members_differ_in_dropout_share_traces() -> None:
    """Dropout p is per-member data of the array (member_p), so it is not part of the trace
    key: an array whose first member has another p replays the cached trace and matches an
    array that traced for itself, in training mode (masks) and in eval mode."""

    def make(seed: int, p: float) -> nn.Module:
        torch.manual_seed(seed)
        return nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Dropout(p), nn.Linear(5, 3))

    cache: dict = {}
    x = torch.randn(7, 6)
    first = hs.fuse([make(i, 0.1 * (i + 1)) for i in range(3)])
    first._share_traces(cache)
    first(x)
    first.eval()
    first(x)
    assert len(cache) == 2
    models = [make(i + 10, 0.4 - 0.1 * i) for i in range(3)]
    second = hs.fuse(models)
    second._share_traces(cache)
    alone = hs.fuse(models)
    for i in range(3):
        alone.set_rng_state(i, second.rng_state(i))  # the same dropout streams
    for mode in ("train", "eval"):
        getattr(second, mode)()
        getattr(alone, mode)()
        torch.testing.assert_close(second(x), alone(x), rtol=0, atol=0)
    assert len(cache) == 2


def test_retrace_seconds_counts_the_signatures_missing_at_another_size() -> None:
    """What another size would trace again: every signature this array used, until an array
    of that size has traced them into the shared cache."""
    cache: dict = {}
    x = torch.randn(5, 6)
    array = hs.fuse(mlp_models(3, dropout=0.2))
    array._share_traces(cache)
    array(x)
    array.eval()
    array(x[:2])
    own = array._retrace_seconds(3)
    assert own == 0.0  # its own signatures are in the shared cache
    missing = array._retrace_seconds(2)
    assert missing > 0.0 and missing == sum(t.seconds for t in array._traces.values())
    smaller = hs.fuse(mlp_models(2, dropout=0.2))
    smaller._share_traces(cache)
    smaller.eval()
    smaller(x[:2])  # one of the two signatures
    assert 0.0 < array._retrace_seconds(2) < missing
    smaller.train()
    smaller(x)
    assert array._retrace_seconds(2) == 0.0


def test_deepcopy_follows_the_copys_own_mode() -> None:
    """A copy's eval() is seen by its trace key (the copy reads its own modules' settings)."""
    torch.manual_seed(0)
    array = hs.fuse(mlp_models(dropout=0.5))
    twin = copy.deepcopy(array)
    x = torch.randn(4, 6)
    twin(x)  # a training-mode trace
    twin.eval()
    array.eval()
    torch.testing.assert_close(twin(x), array(x), rtol=0, atol=0)


def test_deferred_tracing_runs_eagerly_until_the_kth_call_with_the_same_results() -> None:
    """With _defer_tracing(3) the first signature is traced at once; a later one runs eagerly
    twice and is traced at its third call; outputs and gradients equal those of an array that
    traced every signature at its first call. A trace another array left in the shared cache
    is used at once."""
    torch.manual_seed(0)
    models = mlp_models(3, dropout=0.3)
    cache: dict = {}
    deferred, eager_first = hs.fuse(models), hs.fuse(models)
    reference = hs.fuse(models)
    for i in range(3):
        deferred.set_rng_state(i, reference.rng_state(i))
    deferred._share_traces(cache)
    deferred._defer_tracing(3)
    first = torch.randn(2, 6)
    deferred(first)  # the first signature: traced at once
    reference(first)
    assert deferred._last_call_traced
    x = torch.randn(5, 6)
    traced = []
    for _ in range(4):
        out, want = deferred(x), reference(x)
        traced.append(deferred._last_call_traced)
        out.square().sum().backward()
        want.square().sum().backward()
        torch.testing.assert_close(out, want, rtol=0, atol=0)
        for p, q in zip(deferred.parameters(), reference.parameters(), strict=True):
            torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=0)
    assert traced == [False, False, True, True]
    eager_first._share_traces(cache)
    eager_first._defer_tracing(3)
    eager_first(x)
    assert eager_first._last_call_traced  # found in the shared cache
