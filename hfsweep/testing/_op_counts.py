"""Counting what a training step dispatches: ATen operators, bytes of new tensors, host reads.

These counts do not depend on the device or on how busy it is, so they measure the fixed cost
of a fused step where timings cannot: on a GPU small models are bound by kernel launches, one
per operator, and every read of a tensor's value into Python stalls the host until the device
has caught up. ``tests/training/test_op_counts.py`` and ``benchmarks/op_counts.py`` use them.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import TracebackType
from typing import Any

import torch
from torch import Tensor
from torch.overrides import TorchFunctionMode

from .._compat import OpOverload, TorchDispatchMode, pytree

__all__ = ["HOST_READ_METHODS", "SYNC_OPS", "OpCounter", "count_ops"]

#: ATen operators that read a tensor's values on the host: a scalar into Python (``.item()``,
#: ``bool()``, ``float()``, ``int()`` all end in ``_local_scalar_dense``), a comparison answered
#: with a Python bool, and the operators whose output shape depends on the values (the host must
#: wait for them to know how much to allocate). Each is a synchronisation on an accelerator.
SYNC_OPS = frozenset(
    {
        "_local_scalar_dense",
        "equal",
        "is_nonzero",
        "nonzero",
        "masked_select",
        "unique_dim",
        "_unique",
        "_unique2",
        "unique_consecutive",
    }
)

#: ``Tensor`` methods that read values to the host without dispatching an ATen operator on a
#: CPU tensor (``.tolist()`` reads the memory directly), seen at the ``__torch_function__`` level
HOST_READ_METHODS = frozenset({"tolist", "numpy", "__array__", "__dlpack__"})

_COPIES = frozenset({"_to_copy", "copy_", "_copy_from", "_copy_from_and_resize", "to"})


def _tensors(tree: Any) -> list[Tensor]:
    return [t for t in pytree.tree_leaves(tree) if isinstance(t, Tensor)]


def _storage_key(t: Tensor) -> tuple[str, int] | None:
    """Identifies ``t``'s memory (``None`` where it has none to compare: meta, fake)."""
    if t.device.type == "meta":
        return None
    try:
        return (str(t.device), t.untyped_storage().data_ptr())
    except (RuntimeError, NotImplementedError):
        return None


def _device_to_host(name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """Whether a copy operator moves a tensor from another device to the CPU."""
    if name not in _COPIES:
        return False
    if name == "copy_" and len(args) >= 2:
        dst, src = args[0], args[1]
        return (
            isinstance(dst, Tensor)
            and isinstance(src, Tensor)
            and dst.device.type == "cpu"
            and src.device.type != "cpu"
        )
    src = args[0] if args and isinstance(args[0], Tensor) else None
    if src is None or src.device.type == "cpu":
        return False
    device = kwargs.get("device")
    if device is None:
        device = next((a for a in args[1:] if isinstance(a, (torch.device, str))), None)
    return device is not None and torch.device(device).type == "cpu"


class _HostMethods(TorchFunctionMode):
    """Notes the ``Tensor`` methods of :data:`HOST_READ_METHODS` into ``reads``."""

    def __init__(self, reads: list[str]) -> None:
        super().__init__()
        self.reads = reads

    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        name = getattr(func, "__name__", "")
        if name in HOST_READ_METHODS:
            self.reads.append(name)
        return func(*args, **(kwargs or {}))


class OpCounter(TorchDispatchMode):
    """A context that counts what runs inside it, below autograd (the backward pass's operators
    included):

    * ``ops``: the ATen operators dispatched, by name (``sum(ops.values())`` is the count);
    * ``bytes``: the bytes of the new tensors they created (outputs whose memory is not one of
      their inputs': views and in-place results are not counted), what a step allocates;
    * ``host_reads``: the reads of a tensor's values into Python (:data:`SYNC_OPS`, copies from
      another device to the CPU, and the methods of :data:`HOST_READ_METHODS`), in order.
    """

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()
        self.bytes = 0
        self.host_reads: list[str] = []
        self._methods = _HostMethods(self.host_reads)

    @property
    def total(self) -> int:
        """The number of operators dispatched."""
        return sum(self.ops.values())

    def __enter__(self) -> OpCounter:
        self._methods.__enter__()
        try:
            super().__enter__()
        except BaseException:
            self._methods.__exit__(None, None, None)
            raise
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        try:
            super().__exit__(exc_type, exc, tb)
        finally:
            self._methods.__exit__(exc_type, exc, tb)

    def __torch_dispatch__(
        self,
        func: OpOverload,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__
        self.ops[name] += 1
        if name in SYNC_OPS:
            self.host_reads.append(name)
        elif _device_to_host(name, args, kwargs):
            self.host_reads.append(f"{name} to cpu")
        out = func(*args, **kwargs)
        inputs = {_storage_key(t) for t in _tensors((args, kwargs))}
        seen: set[tuple[str, int] | None] = set()
        for t in _tensors(out):
            key = _storage_key(t)
            if key is None:
                self.bytes += t.numel() * t.element_size()
            elif key not in inputs and key not in seen:
                seen.add(key)
                self.bytes += t.untyped_storage().nbytes()
        return out


@contextmanager
def count_ops() -> Iterator[OpCounter]:
    """``with count_ops() as c: ...``, then ``c.total``, ``c.ops``, ``c.bytes``,
    ``c.host_reads``."""
    counter = OpCounter()
    with counter:
        yield counter
