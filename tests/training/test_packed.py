"""The trainer's checkpoint packing (``hfsweep.training.packed``): a structure of many small tensors
saved as one buffer per dtype and device comes back equal, tensor by tensor."""

from __future__ import annotations

import io
from collections import OrderedDict

import pytest
import torch

from hfsweep.training.packed import pack, unpack


def _saved_and_loaded(obj: object) -> object:
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)  # as the trainer loads it


def _assert_same(a: object, b: object) -> None:
    assert type(a) is type(b) or (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor))
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor)
        assert (a.shape, a.dtype, a.device) == (b.shape, b.dtype, b.device)
        if a.is_sparse:
            assert b.is_sparse and torch.equal(a.to_dense(), b.to_dense())
        else:
            assert torch.equal(a, b)
    elif isinstance(a, dict):
        assert isinstance(b, dict) and list(a) == list(b)
        for k in a:
            _assert_same(a[k], b[k])
    elif isinstance(a, list | tuple):
        assert isinstance(b, list | tuple) and len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            _assert_same(x, y)
    else:
        assert a == b


def test_a_nested_structure_comes_back_equal() -> None:
    weight = torch.randn(4, 3)
    payload = {
        "version": 3,
        "slots": [
            {
                "model": {"w": weight, "b": torch.randn(4), "steps": torch.tensor(7)},
                "optimizer": {"momentum": weight.t(), "step": torch.zeros((), dtype=torch.int64)},
                "history": [{"loss": 0.5}, {"loss": 0.25}],
                "rng": (3, 11),
            },
            None,
        ],
        "ordered": OrderedDict(a=torch.arange(3)),
        "mask": torch.tensor([True, False, True]),
        "half": torch.randn(2, 2, dtype=torch.float16),
        "empty": torch.empty(0, 5),
        "param": torch.nn.Parameter(torch.randn(2)),
        "sparse": torch.eye(3).to_sparse(),  # not packed: saved as it is
        "text": "left alone",
    }
    packed = pack(payload)
    # one buffer per dtype: float32, int64, bool, float16 (the sparse tensor is pickled as its
    # indices and values, which are dense)
    assert sorted(str(b.dtype) for b in packed["buffers"]) == [
        "torch.bool",
        "torch.float16",
        "torch.float32",
        "torch.int64",
    ]
    sparse = payload["sparse"]
    assert isinstance(sparse, torch.Tensor)
    top = sum(
        t.numel() for k, t in payload.items() if isinstance(t, torch.Tensor) and k != "sparse"
    )
    nested = 12 + 4 + 1 + 12 + 1 + 3
    parts = sparse._indices().numel() + sparse._values().numel()
    assert sum(b.numel() for b in packed["buffers"]) == top + nested + parts
    out = unpack(_saved_and_loaded(packed))
    _assert_same(payload, out)
    assert isinstance(out, dict)
    assert out["slots"][0]["rng"] == (3, 11)
    assert type(out["ordered"]) is OrderedDict
    # each tensor is a copy of its own: writing one leaves the others alone
    out["slots"][0]["model"]["w"].zero_()
    assert torch.equal(out["slots"][0]["optimizer"]["momentum"], weight.t())


def test_what_was_not_packed_loads_as_it_is() -> None:
    plain = {"version": 2, "arrays": [{"w": torch.ones(2)}]}
    assert unpack(plain) is plain


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_tensors_are_packed_in_cpu_memory_and_come_back_on_the_cpu() -> None:
    payload = {"cpu": torch.ones(3), "gpu": torch.full((3,), 2.0, device="cuda")}
    packed = pack(payload)
    assert [b.device.type for b in packed["buffers"]] == ["cpu"]
    out = unpack(packed)
    assert out["gpu"].device.type == "cpu" and torch.equal(out["gpu"], torch.full((3,), 2.0))


def test_a_tensor_found_twice_is_stored_once_and_comes_back_as_two() -> None:
    shared = torch.arange(4.0)
    packed = pack({"a": shared, "b": shared, "c": shared.clone()})
    assert [b.numel() for b in packed["buffers"]] == [8]  # "a" and "b" once, "c" its own
    out = unpack(packed)
    assert torch.equal(out["c"], shared)
    assert torch.equal(out["a"], shared) and torch.equal(out["b"], shared)
    out["a"].zero_()
    assert torch.equal(out["b"], shared)
