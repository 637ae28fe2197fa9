"""Per-member dropout: each member draws its own masks with its own probability, from its own
deterministic stream (seed, call count), independent of the array around it."""

from __future__ import annotations

import copy
import io
import json
import math

import pytest
import torch
from _streams import train_member
from torch import nn

import hfsweep as hs
from hfsweep.nn._dropout import (
    _BLOCK,
    _cpu_columns,
    _keep_threshold,
    _scale,
    dropout_mask_hash,
)
from hfsweep.testing import MLP, LeNet


class Drop(nn.Module):
    def __init__(self, p: float = 0.5, kind: type[nn.Module] = nn.Dropout) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(()))
        self.drop = kind(p)

    def forward(self, x):
        return self.drop(x * self.scale)


def test_each_member_keeps_its_own_probability_by_default() -> None:
    ps = [0.0, 0.25, 0.5, 0.9]
    array = hs.fuse([Drop(p) for p in ps])
    assert array.dropout == {"drop": pytest.approx(ps)}
    out = array(torch.ones(200, 100))
    for i, p in enumerate(ps):
        zero = (out[i] == 0).float().mean().item()
        assert zero == pytest.approx(p, abs=0.02)
        kept = out[i][out[i] != 0]
        torch.testing.assert_close(kept, torch.full_like(kept, 1 / (1 - p)))


def test_masks_are_independent_across_members() -> None:
    array = hs.fuse([Drop(0.5) for _ in range(3)])
    out = array(torch.ones(100, 100))
    masks = (out != 0).float().flatten(1)
    for i in range(3):
        for j in range(i + 1, 3):
            agree = (masks[i] == masks[j]).float().mean().item()
            assert agree == pytest.approx(0.5, abs=0.03)  # independent halves agree half the time


def test_masks_change_from_call_to_call() -> None:
    array = hs.fuse([Drop(0.5) for _ in range(2)])
    x = torch.ones(50, 50)
    assert not torch.equal(array(x), array(x))


def test_probability_one_and_zero() -> None:
    array = hs.fuse([Drop(1.0), Drop(0.0)])
    out = array(torch.ones(10, 10))
    assert torch.equal(out[0], torch.zeros(10, 10))
    assert torch.equal(out[1], torch.ones(10, 10))


def test_dropout2d_drops_whole_channels() -> None:
    array = hs.fuse([Drop(0.5, nn.Dropout2d) for _ in range(2)])
    out = array(torch.ones(8, 16, 4, 4))
    per_channel = out.flatten(3)  # [B, N, C, H*W]
    assert torch.all((per_channel == 0).all(-1) | (per_channel != 0).all(-1))
    assert 0.3 < (out == 0).float().mean().item() < 0.7


def test_eval_mode_is_the_identity() -> None:
    array = hs.fuse([Drop(0.7) for _ in range(2)])
    array.eval()
    x = torch.randn(5, 5)
    torch.testing.assert_close(array(x), x.expand(2, 5, 5))


def test_fuse_argument_overrides_probabilities() -> None:
    array = hs.fuse([LeNet(dropout=0.1) for _ in range(3)], dropout=[0.2, 0.3, 0.4])
    assert array.dropout == {"drop": pytest.approx([0.2, 0.3, 0.4])}
    assert array.member(2).drop.p == pytest.approx(0.4)


def test_per_layer_probabilities_by_path() -> None:
    class Two(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(3, 3)
            self.a = nn.Dropout(0.1)
            self.b = nn.Dropout(0.1)

        def forward(self, x):
            return self.b(self.a(self.fc(x)))

    array = hs.fuse([Two(), Two()], dropout={"b": [0.5, 0.6]})
    assert array.dropout == {"a": pytest.approx([0.1, 0.1]), "b": pytest.approx([0.5, 0.6])}


@pytest.mark.parametrize(
    ("dropout", "match"),
    [
        ([0.1, 0.2], "got 2 values for 3 members"),
        ([0.1, 0.2, 1.5], "1.5 is not a probability"),
        ({"nope": [0.1, 0.1, 0.1]}, r"dropout\['nope'\].*layers are \['drop'\]"),
    ],
)
def test_invalid_dropout_arguments(dropout, match) -> None:
    with pytest.raises(hs.FusionError, match=match):
        hs.fuse([MLP(dropout=0.1) for _ in range(3)], dropout=dropout)


def test_dropout_argument_without_dropout_layers() -> None:
    with pytest.raises(hs.FusionError, match=r"no nn\.Dropout"):
        hs.fuse([nn.Linear(2, 2), nn.Linear(2, 2)], dropout=[0.1, 0.2])


def test_load_member_carries_the_newcomers_probability() -> None:
    array = hs.fuse([MLP(dropout=0.1) for _ in range(2)])
    array.load_member(1, MLP(dropout=0.6))
    assert array.dropout["drop"] == pytest.approx([0.1, 0.6])


# ---------------------------------------------------------------- per-member random streams


class TwoDrops(nn.Module):
    """Two dropout layers of different kinds around a per-element scale (no rounding anywhere)."""

    def __init__(self, p: float = 0.5, kind: type[nn.Module] = nn.Dropout) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.linspace(0.5, 1.5, 6))
        self.a = kind(p)
        self.b = nn.Dropout(p)

    def forward(self, x):
        return self.b(self.a(x) * self.scale)


@pytest.mark.parametrize("trace", [True, False], ids=["traced", "eager"])
@pytest.mark.parametrize("kind", [nn.Dropout, nn.Dropout2d])
@pytest.mark.parametrize("slot", [0, 3])
def test_member_of_an_array_of_five_matches_an_array_of_one(trace, kind, slot) -> None:
    ps = [0.1, 0.3, 0.5, 0.7, 0.2]
    models = [TwoDrops(p, kind) for p in ps]
    alone = hs.fuse([copy.deepcopy(models[slot])], trace=trace)
    array = hs.fuse(models, trace=trace)
    for i in range(5):
        array.manual_seed(i, 1000 + i)
    alone.manual_seed(0, 1000 + slot)
    inputs = [torch.randn(4, 3, 6, 6) for _ in range(4)]
    fused, single = train_member(array, slot, inputs), train_member(alone, 0, inputs)
    for step, ((out, grad), (out1, grad1)) in enumerate(zip(fused, single, strict=True)):
        assert torch.equal(out, out1), f"step {step}"
        assert torch.equal(grad, grad1), f"step {step}"
    dropped = torch.stack([out for out, _ in fused]) == 0
    assert 0 < dropped.float().mean() < 1
    assert (
        array.rng_state(slot)
        == alone.rng_state(0)
        == {"a": [1000 + slot, 4], "b": [1000 + slot, 4]}
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
def test_masks_do_not_depend_on_the_array_in_any_dtype(dtype) -> None:
    models = [Drop(p).to(dtype) for p in (0.2, 0.5, 0.8)]
    alone = hs.fuse([copy.deepcopy(models[1])])
    array = hs.fuse(models)
    array.manual_seed(1, 7)
    alone.manual_seed(0, 7)
    x = torch.randn(16, 32).to(dtype)
    for _ in range(3):
        out = array(x)
        assert torch.equal(out[1], alone(x)[0])
        assert (out[0] == 0).float().mean() == pytest.approx(0.2, abs=0.1)
        assert (out[2] == 0).float().mean() == pytest.approx(0.8, abs=0.1)


def test_mlp_member_trains_like_the_same_trial_alone() -> None:
    """A model that reuses one dropout layer twice per forward, with rounding from Linear."""
    models = [MLP(d_in=6, hidden=16, d_out=3, dropout=p).double() for p in (0.1, 0.4, 0.6)]
    alone = hs.fuse([copy.deepcopy(models[2])])
    array = hs.fuse(models)
    array.manual_seed(2, 42)
    alone.manual_seed(0, 42)
    inputs = [torch.randn(5, 6, dtype=torch.float64) for _ in range(4)]
    for (out, grad), (out1, grad1) in zip(
        train_member(array, 2, inputs), train_member(alone, 0, inputs), strict=True
    ):
        torch.testing.assert_close(out, out1, rtol=1e-7, atol=1e-12)
        torch.testing.assert_close(grad, grad1, rtol=1e-7, atol=1e-12)
    assert array.rng_state(2) == {"drop": [42, 8]}  # two calls per forward


def test_traced_and_eager_draw_the_same_masks() -> None:
    models = [TwoDrops(0.5) for _ in range(3)]
    traced, eager = hs.fuse(models), hs.fuse(models, trace=False)
    for i in range(3):
        traced.manual_seed(i, i)
        eager.manual_seed(i, i)
    x = torch.randn(4, 6, 6)
    for _ in range(3):
        assert torch.equal(traced(x), eager(x))
    assert traced._last_call_traced and not eager._last_call_traced


def test_one_op_draws_every_members_mask_as_each_member_alone() -> None:
    """The batching rule: one call of the op on every member's keys gives each member what the
    op gives it alone, and what the stream definition says (keep where the hash's top 24 bits,
    read as a uniform, are >= p; kept elements scaled by 1 / (1 - p))."""
    op = torch.ops.hfsweep.dropout_multiplier
    seeds = torch.tensor([0, 7, 2**40 + 3, 5])
    calls = torch.tensor([0, 5, 2**33, 1])
    p = torch.tensor([0.0, 0.3, 1.0, 0.5], dtype=torch.float64)
    batched = op(seeds, calls, p, 3, 1000, torch.float64)
    vmapped = torch.func.vmap(lambda s, c, q: op(s, c, q, 3, 1000, torch.float64))(seeds, calls, p)
    assert torch.equal(vmapped, batched)
    for i in range(4):
        uniform = (dropout_mask_hash(seeds[i], calls[i], 3, 1000) >> 8).double() / 2**24
        scale = 0.0 if p[i] == 1 else 1 / (1 - p[i].item())
        expected = (uniform >= p[i]).double() * scale
        assert torch.equal(op(seeds[i], calls[i], p[i], 3, 1000, torch.float64), expected)
        assert torch.equal(batched[i], expected)


@pytest.mark.parametrize(
    ("rows", "numel"),
    [(3, 1000), (100, 5000), (2, 300_000), (1, 0)],
    ids=["one-block", "row-blocks", "column-blocks", "empty"],
)
def test_blocked_masks_equal_the_hash(rows: int, numel: int) -> None:
    """On the CPU the op hashes block by block (rows grouped, long rows split); every element
    is what :func:`dropout_mask_hash` gives it."""
    gen = torch.Generator().manual_seed(rows)
    seeds = torch.randint(0, 2**62, (rows,), generator=gen)
    calls = torch.randint(0, 2**40, (rows,), generator=gen)
    p = torch.rand(rows, generator=gen, dtype=torch.float64)
    out = torch.ops.hfsweep.dropout_multiplier(seeds, calls, p, 5, numel, torch.float64)
    assert out.shape == (rows, numel)
    for i in range(rows):
        uniform = (dropout_mask_hash(seeds[i], calls[i], 5, numel) >> 8).double() / 2**24
        expected = (uniform >= p[i]).double() / (1 - p[i].item())
        assert torch.equal(out[i], expected), i


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
@pytest.mark.parametrize("numel", [700, _BLOCK // 3], ids=["one-block", "row-blocks"])
def test_cpu_multipliers_equal_the_definition_in_every_dtype(
    dtype: torch.dtype, numel: int
) -> None:
    """The CPU op (the hash in NumPy ``uint32``, block by block) gives exactly the multipliers
    of the op's definition in torch's ``int64`` ops, the one the GPU runs: keep where the hash
    reaches the threshold, times ``1 / (1 - p)`` rounded in ``dtype``. The probabilities include
    0 and 1 (whose threshold, ``2**32``, NumPy holds as ``2**32 - 1``) and values whose scale
    rounds differently in each dtype; one within ``2**-26`` of 1, whose threshold is above 32 bits
    while its scale is not 0, and a negative one, whose threshold is below 0."""
    op = torch.ops.hfsweep.dropout_multiplier
    values = [0.0, 1.0, 1 / 3, 0.1, 0.5, 0.9, 0.77, 2**-24, 1 - 2**-26, -0.25]
    seeds = torch.arange(len(values)) * 7919 + 3
    calls = torch.arange(len(values)) * 2**31
    for p_dtype in (torch.float32, torch.float64):
        p = torch.tensor(values, dtype=p_dtype)
        out = op(seeds, calls, p, 11, numel, dtype)
        keep = dropout_mask_hash(seeds, calls, 11, numel) >= _keep_threshold(p).unsqueeze(-1)
        expected = keep * _scale(p, dtype).unsqueeze(-1)
        assert out.dtype == dtype and torch.equal(out, expected)
        # keys of different shapes broadcast: one seed and call count for every probability
        one = op(seeds[2], calls[2], p, 11, numel, dtype)
        keep = dropout_mask_hash(seeds[2], calls[2], 11, numel) >= _keep_threshold(p).unsqueeze(-1)
        assert torch.equal(one, keep * _scale(p, dtype).unsqueeze(-1))
    # the columns behind it: p = 1 - 2**-26 (float64) needs the threshold 2**32, which keeps
    # nothing; NumPy holds 2**32 - 1 and zeroes that member's scale, so the one hash that
    # would pass is dropped as well. A negative p keeps everything.
    p = torch.tensor(values, dtype=torch.float64)
    _, _, threshold, scale = _cpu_columns(seeds, calls, p, 11, dtype)
    assert threshold[8, 0] == 2**32 - 1 and scale[8, 0] == 0 and 1 / (1 - p[8]) > 1e7
    assert threshold[1, 0] == 2**32 - 1 and scale[1, 0] == 0
    assert threshold[9, 0] == 0 and scale[9, 0] == _scale(p[9:], dtype)[0]
    # no members, or no elements: empty, and no work for the other dimension
    assert op(seeds[:0], calls[:0], p[:0], 11, 2**31, dtype).shape == (0, 2**31)
    assert op(seeds, calls, p, 11, 0, dtype).shape == (len(values), 0)


def test_a_traced_forward_records_the_mask_as_one_op() -> None:
    """Under vmap each integer op of the hash would be recorded, and traced, one by one."""
    array = hs.fuse([TwoDrops(0.5) for _ in range(3)])
    array(torch.randn(4, 6, 6))
    (entry,) = array._traces.values()
    targets = [n.target for n in entry.graph.__self__.graph.nodes if n.op == "call_function"]
    assert targets.count(torch.ops.hfsweep.dropout_multiplier.default) == 2  # one per layer
    assert not [t for t in targets if "bitwise" in str(t) or "shift" in str(t)]


def test_default_seeds_come_from_torchs_generator() -> None:
    torch.manual_seed(5)
    a = hs.fuse([MLP(dropout=0.5) for _ in range(4)])
    torch.manual_seed(5)
    b = hs.fuse([MLP(dropout=0.5) for _ in range(4)])
    seeds = [a.rng_state(i)["drop"][0] for i in range(4)]
    assert seeds == [b.rng_state(i)["drop"][0] for i in range(4)]
    assert len(set(seeds)) == 4 and all(0 <= s < 2**63 for s in seeds)
    x = torch.randn(3, 64)
    assert torch.equal(a(x), b(x))


def test_arrays_without_dropout_leave_torchs_generator_alone() -> None:
    models = [nn.Linear(2, 2) for _ in range(2)]
    before = torch.get_rng_state()
    array = hs.fuse(models)
    assert torch.equal(torch.get_rng_state(), before)
    array.manual_seed(1, 3)  # nothing to seed, but the index and seed are still checked
    assert array.rng_state(1) == {}
    array.set_rng_state(1, {})
    with pytest.raises(IndexError):
        array.manual_seed(2, 3)


def test_rng_state_round_trip_resumes_identical_masks() -> None:
    array = hs.fuse([TwoDrops(0.5, nn.Dropout2d) for _ in range(3)])
    x = torch.randn(4, 6, 6)
    for _ in range(2):
        array(x)
    saved = json.loads(json.dumps(array.rng_state(1)))  # plain ints survive JSON
    first = [array(x)[1] for _ in range(3)]
    array.set_rng_state(1, saved)
    again = [array(x)[1] for _ in range(3)]
    for a, b in zip(first, again, strict=True):
        assert torch.equal(a, b)
    # a resumed trial in another slot of another array continues the same stream
    other = hs.fuse([TwoDrops(0.5, nn.Dropout2d) for _ in range(2)])
    with torch.no_grad():
        other.module.scale.copy_(array.module.scale[1])
    other.set_rng_state(0, saved)
    assert torch.equal(other(x)[0], first[0])


def test_layers_keep_separate_streams() -> None:
    array = hs.fuse([TwoDrops(0.5) for _ in range(2)])
    array.set_rng_state(0, {"a": [1, 2], "b": [3, 4]})
    assert array.rng_state(0) == {"a": [1, 2], "b": [3, 4]}
    assert array.rng_state(1)["a"] == array.rng_state(1)["b"]  # default: one seed per member


def test_manual_seed_restarts_the_stream() -> None:
    array = hs.fuse([Drop(0.5) for _ in range(2)])
    x = torch.ones(20, 20)
    array.manual_seed(0, 11)
    start = array(x)[0]
    array(x)
    assert array.rng_state(0) == {"drop": [11, 2]}
    array.manual_seed(0, 11)
    assert array.rng_state(0) == {"drop": [11, 0]}
    assert torch.equal(array(x)[0], start)
    array.manual_seed(-1, 11)  # negative index: the last member
    assert torch.equal(array(x)[1], start)


def test_eval_mode_does_not_advance_the_stream() -> None:
    array = hs.fuse([Drop(0.5) for _ in range(2)])
    array.eval()
    array(torch.ones(3, 3))
    assert [array.rng_state(i)["drop"][1] for i in range(2)] == [0, 0]


def test_layers_and_calls_and_seeds_draw_different_masks() -> None:
    array = hs.fuse([TwoDrops(0.5) for _ in range(2)])
    array.manual_seed(0, 3)
    array.manual_seed(1, 4)
    x = torch.ones(64, 6, 6)
    outs = [array(x) for _ in range(2)]
    masks = {
        "call 0": outs[0][0] != 0,
        "call 1": outs[1][0] != 0,
        "seed 4": outs[0][1] != 0,
    }
    names = list(masks)
    for a in range(len(names)):
        for b in range(a + 1, len(names)):
            agree = (masks[names[a]] == masks[names[b]]).float().mean().item()
            # both layers drop: kept with probability 1/4, agreement 1/4^2 + (3/4)^2 = 5/8
            assert agree == pytest.approx(0.625, abs=0.03), (names[a], names[b])
    seed = torch.tensor(3)
    calls = torch.tensor(0)
    layer_a, layer_b = (dropout_mask_hash(seed, calls, salt, 4096) for salt in (0, 1))
    same_top_bit = ((layer_a >> 31) == (layer_b >> 31)).float().mean().item()
    assert same_top_bit == pytest.approx(0.5, abs=0.04)


@pytest.mark.parametrize("p", [0.1, 0.5, 0.9])
def test_masks_look_random(p) -> None:
    n = 1 << 18
    array = hs.fuse([Drop(p) for _ in range(2)])
    array.manual_seed(0, 123)
    array.manual_seed(1, 124)
    out = array(torch.ones(n // 512, 512))
    for i in range(2):
        keep = (out[i] != 0).flatten().double()
        sd = math.sqrt(p * (1 - p) / n)
        assert abs(keep.mean().item() - (1 - p)) < 5 * sd  # keep rate
        # neighbouring elements (in a row and across rows) are uncorrelated
        for lag in (1, 512):
            corr = torch.corrcoef(torch.stack([keep[:-lag], keep[lag:]]))[0, 1].item()
            assert abs(corr) < 5 / math.sqrt(n), lag
    # the 24-bit uniforms themselves: flat histogram, uncorrelated neighbours
    u = (dropout_mask_hash(torch.tensor(9), torch.tensor(2), 0, n) >> 8).double() / 2**24
    counts = torch.histc(u, bins=64, min=0, max=1)
    chi2 = ((counts - n / 64) ** 2 / (n / 64)).sum().item()
    assert chi2 < 63 + 5 * math.sqrt(2 * 63)
    assert abs(torch.corrcoef(torch.stack([u[:-1], u[1:]]))[0, 1].item()) < 5 / math.sqrt(n)


def test_hash_values_are_32_bit_and_keep_probability_edges_exact() -> None:
    big = torch.tensor(2**63 - 1)
    h = dropout_mask_hash(big, big, 7, 10000)
    assert h.dtype == torch.int64 and h.min() >= 0 and h.max() < 2**32
    with pytest.raises(hs.FusionError, match="4294967296 elements per member is too large"):
        dropout_mask_hash(big, big, 0, 2**32)  # indices must fit 32 bits; raised before any work
    array = hs.fuse([Drop(1.0), Drop(0.0), Drop(0.5)])
    array.manual_seed(0, 2**63 - 1)
    for dtype in (torch.float32, torch.float16, torch.float64):
        array.to(dtype)  # the probabilities follow, the integer streams do not
        assert array.module.drop.member_p.dtype == dtype
        assert array.module.drop.member_seed.dtype == torch.int64
        out = array(torch.ones(100, 100, dtype=dtype))
        assert torch.equal(out[0], torch.zeros(100, 100, dtype=dtype))
        assert torch.equal(out[1], torch.ones(100, 100, dtype=dtype))
        assert (out[2] == 0).float().mean() == pytest.approx(0.5, abs=0.03)


def test_load_member_restarts_the_slots_stream_and_keeps_its_seed() -> None:
    array = hs.fuse([Drop(0.5) for _ in range(2)])
    array.manual_seed(1, 77)
    array(torch.ones(4, 4))
    array.load_member(1, Drop(0.3))
    assert array.rng_state(1) == {"drop": [77, 0]}
    assert array.rng_state(0)["drop"][1] == 1


def test_state_dict_carries_the_streams() -> None:
    a = hs.fuse([TwoDrops(0.5) for _ in range(3)])
    b = hs.fuse([TwoDrops(0.5) for _ in range(3)])
    x = torch.randn(4, 6, 6)
    a(x)
    state = a.state_dict()
    assert {"module.a.member_seed", "module.a.member_calls", "module.b.member_seed"} <= set(state)
    b.load_state_dict(state)
    assert [b.rng_state(i) for i in range(3)] == [a.rng_state(i) for i in range(3)]
    assert torch.equal(a(x), b(x))


def test_pickled_and_copied_arrays_continue_the_same_streams() -> None:
    array = hs.fuse([TwoDrops(0.5) for _ in range(2)])
    x = torch.randn(4, 6, 6)
    array(x)
    twin = copy.deepcopy(array)
    buffer = io.BytesIO()
    torch.save(array, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    expected = array(x)
    assert torch.equal(twin(x), expected)
    assert torch.equal(loaded(x), expected)
    assert twin.rng_state(0) == loaded.rng_state(0) == array.rng_state(0)


@pytest.mark.parametrize(
    ("seed", "error", "match"),
    [
        (-1, ValueError, r"seed must be an int in \[0, 2\*\*63\), got -1"),
        (2**63, ValueError, "got 9223372036854775808"),
        (1.5, TypeError, "got 1.5"),
        (True, TypeError, "got True"),
        ("3", TypeError, "got '3'"),
    ],
)
def test_manual_seed_rejects_bad_seeds(seed, error, match) -> None:
    array = hs.fuse([Drop(0.5) for _ in range(2)])
    with pytest.raises(error, match=match):
        array.manual_seed(0, seed)


def test_stream_methods_check_the_member_index() -> None:
    array = hs.fuse([Drop(0.5) for _ in range(2)])
    with pytest.raises(IndexError, match="member index 2 is out of range"):
        array.manual_seed(2, 0)
    with pytest.raises(IndexError, match="out of range"):
        array.rng_state(-3)
    with pytest.raises(IndexError, match="out of range"):
        array.set_rng_state(5, {"drop": [0, 0]})


@pytest.mark.parametrize(
    ("state", "error", "match"),
    [
        ({}, ValueError, r"missing \['drop'\], unknown \[\]"),
        ({"drop": [1, 2], "x": [1, 2]}, ValueError, r"unknown \['x'\]"),
        ({"drop": [1]}, ValueError, r"'drop' must be \[seed, calls\], got \[1\]"),
        ({"drop": [1, -2]}, ValueError, "calls of 'drop' must be an int"),
        ({"drop": [1.0, 2]}, TypeError, "seed of 'drop' must be an int"),
        ([1, 2], TypeError, "got list"),
    ],
)
def test_set_rng_state_rejects_bad_states(state, error, match) -> None:
    array = hs.fuse([Drop(0.5) for _ in range(2)])
    before = array.rng_state(0)
    with pytest.raises(error, match=match):
        array.set_rng_state(0, state)
    assert array.rng_state(0) == before
