"""Replaying a traced forward: the op table and what happens when a replay fails.

Every aten overload that a replayed graph calls through a C binding instead computes exactly what
the overload computes, values and gradients. The test enumerates ``PUBLIC_FUNCTIONS`` itself, so
an entry added to the table without a sample input here fails until one is written.
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.utils._pytree as pytree
from torch import Tensor, nn

import hfsweep as hs
from hfsweep.fusion._graph import PUBLIC_FUNCTIONS

Sample = Callable[[torch.Generator], tuple[Any, ...]]


def _r(g: torch.Generator, *shape: int) -> Tensor:
    return torch.randn(*shape, generator=g, dtype=torch.float64)


def _pos(g: torch.Generator, *shape: int) -> Tensor:
    return torch.rand(*shape, generator=g, dtype=torch.float64) + 0.5


def _mask(g: torch.Generator, *shape: int) -> Tensor:
    return torch.rand(*shape, generator=g) > 0.5


def _ints(g: torch.Generator, high: int, *shape: int) -> Tensor:
    return torch.randint(0, high, shape, generator=g)


# One call of each overload, positional arguments in the overload's order (as a trace records).
SAMPLES: dict[str, Sample] = {
    "aten.abs.default": lambda g: (_r(g, 3, 4),),
    "aten.add.Tensor": lambda g: (_r(g, 3, 4), _r(g, 4)),
    "aten.add_.Tensor": lambda g: (_r(g, 3, 4), _r(g, 3, 4)),
    "aten.addmm.default": lambda g: (_r(g, 5), _r(g, 3, 4), _r(g, 4, 5)),
    "aten.all.dim": lambda g: (_mask(g, 3, 4), 1),
    "aten.baddbmm.default": lambda g: (_r(g, 2, 3, 5), _r(g, 2, 3, 4), _r(g, 2, 4, 5)),
    "aten.bitwise_and.Tensor": lambda g: (_mask(g, 3, 4), _mask(g, 3, 4)),
    "aten.bmm.default": lambda g: (_r(g, 2, 3, 4), _r(g, 2, 4, 5)),
    "aten.cat.default": lambda g: ([_r(g, 2, 3), _r(g, 4, 3)],),
    "aten.clone.default": lambda g: (_r(g, 3, 4),),
    "aten.convolution.default": lambda g: (
        _r(g, 2, 4, 6, 6),
        _r(g, 6, 2, 3, 3),
        _r(g, 6),
        [1, 2],
        [1, 0],
        [1, 1],
        False,
        [0, 0],
        2,
    ),
    "aten.cos.default": lambda g: (_r(g, 3, 4),),
    "aten.detach.default": lambda g: (_r(g, 3, 4),),
    "aten.div.Tensor": lambda g: (_r(g, 3, 4), _pos(g, 3, 4)),
    "aten.embedding.default": lambda g: (_r(g, 7, 3), _ints(g, 7, 2, 5), 0),
    "aten.eq.Scalar": lambda g: (_ints(g, 3, 3, 4), 1),
    "aten.exp.default": lambda g: (_r(g, 3, 4),),
    "aten.expand.default": lambda g: (_r(g, 3, 1), [2, 3, 4]),
    "aten.gather.default": lambda g: (_r(g, 3, 4), 1, _ints(g, 4, 3, 2)),
    "aten.ge.Scalar": lambda g: (_r(g, 3, 4), 0.1),
    "aten.ge.Tensor": lambda g: (_r(g, 3, 4), _r(g, 3, 4)),
    "aten.gt.Scalar": lambda g: (_r(g, 3, 4), -0.2),
    "aten.le.Tensor": lambda g: (_r(g, 3, 4), _r(g, 4)),
    "aten.log.default": lambda g: (_pos(g, 3, 4),),
    "aten.lt.Scalar": lambda g: (_r(g, 3, 4), 0.3),
    "aten.masked_fill.Scalar": lambda g: (_r(g, 3, 4), _mask(g, 3, 4), -1e9),
    "aten.maximum.default": lambda g: (_r(g, 3, 4), _r(g, 3, 4)),
    "aten.mean.dim": lambda g: (_r(g, 3, 4, 5), [0, 2], True),
    "aten.minimum.default": lambda g: (_r(g, 3, 4), _r(g, 3, 4)),
    "aten.mm.default": lambda g: (_r(g, 3, 4), _r(g, 4, 5)),
    "aten.mul.Scalar": lambda g: (_r(g, 3, 4), 0.7),
    "aten.mul.Tensor": lambda g: (_r(g, 3, 4), _r(g, 3, 1)),
    "aten.mul_.Tensor": lambda g: (_r(g, 3, 4), _r(g, 4)),
    "aten.native_batch_norm.default": lambda g: (
        _r(g, 4, 3, 5),
        _r(g, 3),
        _r(g, 3),
        _r(g, 3),
        _pos(g, 3),
        True,
        0.1,
        1e-5,
    ),
    "aten.native_layer_norm.default": lambda g: (_r(g, 2, 3, 4), [4], _r(g, 4), _r(g, 4), 1e-5),
    "aten.neg.default": lambda g: (_r(g, 3, 4),),
    "aten.permute.default": lambda g: (_r(g, 2, 3, 4), [2, 0, 1]),
    "aten.pow.Tensor_Scalar": lambda g: (_pos(g, 3, 4), 1.5),
    "aten.relu.default": lambda g: (_r(g, 3, 4),),
    "aten.rsqrt.default": lambda g: (_pos(g, 3, 4),),
    "aten.rsub.Scalar": lambda g: (_r(g, 3, 4), 1.0),
    "aten.select.int": lambda g: (_r(g, 3, 4), 1, 2),
    "aten.sigmoid.default": lambda g: (_r(g, 3, 4),),
    "aten.sin.default": lambda g: (_r(g, 3, 4),),
    "aten.split.Tensor": lambda g: (_r(g, 7, 3), 3),
    "aten.sqrt.default": lambda g: (_pos(g, 3, 4),),
    "aten.squeeze.dim": lambda g: (_r(g, 3, 1, 4), 1),
    "aten.stack.default": lambda g: ([_r(g, 3, 4), _r(g, 3, 4)], 1),
    "aten.sub.Tensor": lambda g: (_r(g, 3, 4), _r(g, 3, 4)),
    "aten.sum.dim_IntList": lambda g: (_r(g, 3, 4, 5), [1]),
    "aten.t.default": lambda g: (_r(g, 3, 4),),
    "aten.tanh.default": lambda g: (_r(g, 3, 4),),
    "aten.transpose.int": lambda g: (_r(g, 2, 3, 4), 0, 2),
    "aten.tril.default": lambda g: (_r(g, 2, 4, 4), -1),
    "aten.triu.default": lambda g: (_r(g, 4, 5), 1),
    "aten.unbind.int": lambda g: (_r(g, 3, 4), 1),
    "aten.unsqueeze.default": lambda g: (_r(g, 3, 4), 1),
    "aten.view.default": lambda g: (_r(g, 3, 4), [2, 6]),
    "aten.where.self": lambda g: (_mask(g, 3, 4), _r(g, 3, 4), _r(g, 4)),
}

# Arguments an overload writes without saying so in its schema (they take no gradient).
UNDECLARED_WRITES = {"aten.native_batch_norm.default": {3, 4}}  # the running statistics


def _call(
    fn: Callable[..., Any], args: tuple[Any, ...], written: set[int]
) -> tuple[Any, list[Any]]:
    """``fn`` on fresh copies of ``args``; its outputs and the gradients of the float inputs
    that it does not write (the loss is a fixed random projection of the float outputs)."""
    fresh = tuple(
        pytree.tree_map(
            lambda x, k=k: (
                x.detach().clone().requires_grad_(k not in written and x.is_floating_point())
                if isinstance(x, Tensor)
                else x
            ),
            arg,
        )
        for k, arg in enumerate(args)
    )
    out = fn(*fresh)
    if written:
        out = (out, [fresh[k] for k in sorted(written)])  # what it wrote is an output too
    inputs = [x for x in pytree.tree_leaves(fresh) if isinstance(x, Tensor) and x.requires_grad]
    floats = [y for y in pytree.tree_leaves(out) if isinstance(y, Tensor) and y.requires_grad]
    if not (inputs and floats):
        return out, []
    gen = torch.Generator().manual_seed(1)
    loss = sum((y * torch.randn(y.shape, generator=gen, dtype=y.dtype)).sum() for y in floats)
    grads = torch.autograd.grad(loss, inputs, allow_unused=True)
    return out, list(grads)


def _sequences_as_tuples(value: Any) -> Any:
    """A graph only indexes a multi-tensor result, so a list and a tuple are the same to it."""
    if isinstance(value, list | tuple):
        return tuple(_sequences_as_tuples(v) for v in value)
    return value


def _assert_same(actual: Any, expected: Any, what: str) -> None:
    actual, expected = _sequences_as_tuples(actual), _sequences_as_tuples(expected)
    a_leaves, a_spec = pytree.tree_flatten(actual)
    e_leaves, e_spec = pytree.tree_flatten(expected)
    assert a_spec == e_spec, f"{what}: structure {a_spec} != {e_spec}"
    for a, e in zip(a_leaves, e_leaves, strict=True):
        if isinstance(e, Tensor):
            assert isinstance(a, Tensor), f"{what}: {a!r} is not a tensor"
            assert a.shape == e.shape and a.dtype == e.dtype, f"{what}: {a.shape} != {e.shape}"
            assert torch.equal(a, e), f"{what}: values differ by {(a - e).abs().max()}"
        else:
            assert a == e, f"{what}: {a!r} != {e!r}"


@pytest.mark.parametrize("op", sorted(PUBLIC_FUNCTIONS, key=str), ids=str)
def test_replayed_binding_computes_what_the_overload_computes(op: Any) -> None:
    sample = SAMPLES.get(str(op))
    assert sample is not None, f"PUBLIC_FUNCTIONS maps {op}: add a sample call of it to SAMPLES"
    fn = PUBLIC_FUNCTIONS[op]
    written = UNDECLARED_WRITES.get(str(op), set()) | {
        k
        for k, arg in enumerate(op._schema.arguments)
        if arg.alias_info is not None and arg.alias_info.is_write
    }
    for seed in range(3):
        args = sample(torch.Generator().manual_seed(seed))
        expected, expected_grads = _call(op, args, written)
        actual, actual_grads = _call(fn, args, written)
        _assert_same(actual, expected, f"{op} via {fn.__qualname__}, seed {seed}")
        _assert_same(actual_grads, expected_grads, f"gradients of {op}, seed {seed}")


def test_every_sample_names_a_table_entry() -> None:
    """No stale samples: each one tests an entry of the table."""
    assert sorted(SAMPLES) == sorted(str(op) for op in PUBLIC_FUNCTIONS)


def test_no_python_function_is_called_in_place_of_an_overload() -> None:
    """Only torch's generated C bindings stand in for aten overloads: a Python function of the
    same name (``Tensor.index``, ``torch.split``) takes other arguments."""
    import types

    for op, fn in PUBLIC_FUNCTIONS.items():
        assert isinstance(fn, types.BuiltinFunctionType | types.MethodDescriptorType), (op, fn)
        assert fn.__name__ == op.overloadpacket.__name__, (op, fn)


class _NormThenIndex(nn.Module):
    """BatchNorm (which updates buffers while the graph runs), then tensor indexing."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.BatchNorm1d(4)
        self.proj = nn.Linear(4, 4)

    def forward(self, x: Tensor, idx: Tensor) -> Tensor:
        h = self.proj(self.norm(x))
        return h[torch.arange(h.shape[0]), idx]


def _norm_models(size: int) -> list[nn.Module]:
    torch.manual_seed(0)
    return [_NormThenIndex().double() for _ in range(size)]


def test_a_failing_first_replay_falls_back_to_eager_with_a_warning(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An op that fails when the graph is replayed (here: the unrelated ``Tensor.index`` that the
    replay once called for ``aten.index``) costs the trace, not the call: a warning names the
    op and the error, the call runs eagerly, and the BatchNorm statistics that the failed replay
    had already updated are updated once, as alone."""
    monkeypatch.setitem(PUBLIC_FUNCTIONS, torch.ops.aten.index.Tensor, Tensor.index)
    models = _norm_models(2)
    refs = [copy.deepcopy(m) for m in models]
    array = hs.fuse(models)
    g = torch.Generator().manual_seed(3)
    for call in range(2):
        x = torch.randn(6, 4, generator=g, dtype=torch.float64)
        idx = torch.randint(0, 4, (6,), generator=g)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            out = array(x, idx)
        replay = [w for w in caught if "replaying the traced forward" in str(w.message)]
        if call == 0:
            assert len(replay) == 1, [str(w.message) for w in caught]
            text = str(replay[0].message)
            assert "Tensor.index" in text and "TypeError" in text and "eagerly" in text, text
        else:
            assert not replay, "the failed trace is not replayed again"
        assert not array._last_call_traced
        for i, ref in enumerate(refs):
            torch.testing.assert_close(out[i], ref(x, idx), rtol=1e-7, atol=1e-10)
            torch.testing.assert_close(
                array.module.norm.running_mean[i], ref.norm.running_mean, rtol=1e-7, atol=1e-10
            )
            assert int(array.module.norm.num_batches_tracked[i]) == call + 1


def test_tensor_indexing_replays_from_the_trace() -> None:
    """``h[arange, idx]`` (``aten.index.Tensor``) replays: traced, no warning, equal to alone."""
    models = _norm_models(3)
    refs = [copy.deepcopy(m) for m in models]
    array = hs.fuse(models)
    x = torch.randn(5, 4, dtype=torch.float64)
    idx = torch.tensor([0, 3, 1, 2, 3])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = array(x, idx)
    assert array._last_call_traced
    for i, ref in enumerate(refs):
        torch.testing.assert_close(out[i], ref(x, idx), rtol=1e-7, atol=1e-10)


def test_an_error_of_a_trace_that_replayed_before_is_raised_naming_the_op() -> None:
    """Once a trace has replayed, an error is the data's (an index out of range) and eager code
    would raise it too: it is raised, with a note naming the graph's op."""
    array = hs.fuse(_norm_models(2))
    x = torch.randn(5, 4, dtype=torch.float64)
    array(x, torch.zeros(5, dtype=torch.long))
    assert array._last_call_traced
    with pytest.raises((IndexError, RuntimeError)) as info:
        array(x, torch.full((5,), 9))
    assert any("aten.index" in note for note in getattr(info.value, "__notes__", [])), info.value
