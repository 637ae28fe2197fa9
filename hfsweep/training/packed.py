"""Many small tensors saved as a few, and loaded without running code: the trainer's checkpoints.

``torch.save`` writes each tensor's storage as a record of its own, and its pickler calls a
Python hook for every object. A checkpoint of a 32-member array of a small MLP holds about 200
tensors (every member's weights, optimizer state and schedule) among 3,000 other objects
(histories, configs); ``benchmarks/sweep_phases.py`` times the trainer's checkpoints.
:func:`pack` pickles the structure at C speed, copying its dense tensors into one flat buffer per
dtype on the way, in CPU memory (a checkpoint of a GPU array needs no second copy on the GPU);
:func:`unpack` rebuilds it with a copy of each tensor, of its shape and dtype, on the CPU, where
the trainer loads its checkpoints anyway. Plain tensors come back (a ``Parameter`` as a tensor
without grad); a tensor object found twice (tied weights, or a frozen backbone every member of a
fine-tuning array shares, see :meth:`~hfsweep.training.live.LiveArray.snapshot`) is stored once and
comes back as separate copies (so that writing into one never changes another), and tensors that
shared storage come back separate.

Loading never runs code from the file (a run directory may be shared, or come from someone
else): :func:`load` reads the file with ``torch.load(weights_only=True)`` and unpacks the
structure with an unpickler that builds only plain data (numbers, strings, containers), tensors,
torch's dtypes, devices and sizes, NumPy scalars and arrays, and the types the user allowed with
``torch.serialization.add_safe_globals``. A file that needs anything else (a pickle crafted to
call a function, or a config value of the user's own class) is refused with
:class:`UnsafeFileError`, naming the file and the type; :func:`loads` does the same for a plain
pickle (the trainer's delivered log). :func:`load_inert` reads a pickle another program wrote
(Ray Tune's searcher state) with the same plain data and an inert stand-in for everything else.
"""

from __future__ import annotations

import builtins
import codecs
import collections
import datetime
import decimal
import fractions
import io
import math
import os
import pathlib
import pickle
from typing import Any

import torch
from torch import Tensor

from .._compat import sparse_tensor_rebuilders

__all__ = [
    "Unloaded",
    "UnsafeFileError",
    "load",
    "load_inert",
    "loads",
    "pack",
    "unloaded_in",
    "unpack",
]

#: the key that marks a packed structure
_MARK = "hfsweep_packed"
_DENSE = (Tensor, torch.nn.Parameter)


class _Packer(pickle.Pickler):
    """Pickles a structure, sending each dense tensor to the CPU buffer of its dtype."""

    def __init__(self, file: io.BytesIO) -> None:
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self.index: dict[torch.dtype, int] = {}  # the buffer of each dtype
        self.parts: list[list[Tensor]] = []
        self.sizes: list[int] = []
        #: the record of each tensor object already stored (the structure keeps them alive)
        self.stored: dict[int, tuple[int, int, tuple[int, ...]]] = {}

    def persistent_id(self, obj: Any) -> Any:
        if type(obj) not in _DENSE or obj.layout != torch.strided or obj.is_quantized:
            return None
        known = self.stored.get(id(obj))
        if known is not None:
            return known
        index = self.index.setdefault(obj.dtype, len(self.parts))
        if index == len(self.parts):
            self.parts.append([])
            self.sizes.append(0)
        offset = self.sizes[index]
        self.parts[index].append(obj.detach().reshape(-1).cpu())
        self.sizes[index] += obj.numel()
        record = (index, offset, tuple(obj.shape))
        self.stored[id(obj)] = record
        return record


class UnsafeFileError(pickle.UnpicklingError, ValueError):
    """A checkpoint or log was not loaded: loading it would have called something other than the
    constructors of plain data, tensors and the types allowed with
    ``torch.serialization.add_safe_globals``, which could run code. The message names the
    file and what it needs; ``needs`` is that (``None`` where the file names nothing: it is
    no pickle the loader can read, such as one cut short or overwritten)."""

    needs: str | None = None


def _plain_globals() -> dict[str, Any]:
    """What an unpickler may build from a checkpoint, by the name a pickle gives it: constructors
    of values that run no code of the file's choosing."""
    allowed: list[Any] = [
        *(getattr(builtins, n) for n in ("bool", "bytearray", "bytes", "complex", "dict")),
        *(getattr(builtins, n) for n in ("float", "frozenset", "int", "list", "range", "set")),
        *(getattr(builtins, n) for n in ("slice", "str", "tuple")),
        collections.OrderedDict,
        collections.Counter,
        collections.deque,
        collections.defaultdict,
        datetime.date,
        datetime.datetime,
        datetime.time,
        datetime.timedelta,
        datetime.timezone,
        decimal.Decimal,
        fractions.Fraction,
        pathlib.PurePosixPath,
        pathlib.PureWindowsPath,
        pathlib.PosixPath,
        pathlib.WindowsPath,
        torch.Size,
        torch.device,
        *sparse_tensor_rebuilders(),
    ]
    table = {f"{f.__module__}.{f.__qualname__}": f for f in allowed}
    paths = (pathlib.PurePosixPath, pathlib.PureWindowsPath, pathlib.PosixPath, pathlib.WindowsPath)
    for path in paths:  # as Python < 3.13 names them (3.13 moved them to pathlib._local)
        table[f"pathlib.{path.__name__}"] = path
    table["_codecs.encode"] = codecs.encode  # bytes in protocol 2
    for dtype in list(vars(torch).values()):  # vars(): no lazy imports of torch's modules
        if isinstance(dtype, torch.dtype):
            table[str(dtype)] = dtype  # a dtype pickles as "torch.float32"
    try:
        import numpy as np
    except ImportError:  # pragma: no cover - numpy comes with torch's usual installs
        return table
    core = np._core if hasattr(np, "_core") else np.core  # numpy 2 renamed numpy.core
    for module in ("numpy._core", "numpy.core"):  # files written with numpy 1 or 2
        table[f"{module}.multiarray.scalar"] = core.multiarray.scalar
        table[f"{module}.multiarray._reconstruct"] = core.multiarray._reconstruct
        if hasattr(core.numeric, "_frombuffer"):
            table[f"{module}.numeric._frombuffer"] = core.numeric._frombuffer
    table["numpy.dtype"] = np.dtype
    table["numpy.ndarray"] = np.ndarray
    dtypes = getattr(np, "dtypes", None)  # numpy >= 1.25 pickles dtypes by their class
    for name in dir(dtypes) if dtypes is not None else ():
        cls = getattr(dtypes, name)
        if isinstance(cls, type) and issubclass(cls, np.dtype):
            table[f"numpy.dtypes.{name}"] = cls
    return table


_PLAIN: dict[str, Any] | None = None


def _allowed(module: str, name: str) -> Any:
    """The object ``module.name`` if a checkpoint may build it, else ``None``."""
    global _PLAIN
    if _PLAIN is None:
        _PLAIN = _plain_globals()
    found = _PLAIN.get(f"{module}.{name}")
    if found is not None:
        return found
    for entry in torch.serialization.get_safe_globals():  # the user's own allowances
        obj, spelled = entry if isinstance(entry, tuple) else (entry, None)
        if spelled is None:
            spelled = f"{getattr(obj, '__module__', '')}.{getattr(obj, '__qualname__', '')}"
        if spelled == f"{module}.{name}":
            return obj
    return None


def _refusal(source: str | os.PathLike[str], needs: str) -> UnsafeFileError:
    refusal = UnsafeFileError(
        f"{os.fspath(source)}: not loaded: it needs {needs}, which hfsweep does not load from "
        "a checkpoint (only plain data, tensors, torch dtypes/devices and NumPy values; "
        "anything else could run code from the file). If you trust this file and the type is "
        "yours (a config value), allow it with torch.serialization.add_safe_globals([...]) "
        "before the run or resume."
    )
    refusal.needs = needs
    return refusal


class _Restricted(pickle.Unpickler):
    """An unpickler that builds nothing but :func:`_allowed` objects (the C unpickler; only
    the lookups of globals come here)."""

    def __init__(self, data: bytes, source: str | os.PathLike[str]) -> None:
        super().__init__(io.BytesIO(data))
        self.source = source

    def find_class(self, module: str, name: str) -> Any:
        found = _allowed(module, name)
        if found is None:
            raise _refusal(self.source, f"{module}.{name}")
        return found


class _Unpacker(_Restricted):
    def __init__(self, data: bytes, buffers: list[Tensor], source: str | os.PathLike[str]) -> None:
        super().__init__(data, source)
        self.buffers = buffers

    def persistent_load(self, pid: Any) -> Tensor:
        index, offset, shape = pid
        return self.buffers[index][offset : offset + math.prod(shape)].view(shape).clone()


def pack(obj: Any) -> dict[str, Any]:
    """``obj`` as a small dict for ``torch.save``: its pickle without the dense tensors, and
    one flat CPU buffer per dtype holding them."""
    out = io.BytesIO()
    packer = _Packer(out)
    packer.dump(obj)
    buffers = [torch.cat(part) for part in packer.parts]
    return {_MARK: 1, "tree": out.getvalue(), "buffers": buffers}


def unpack(payload: Any, source: str | os.PathLike[str] = "<packed>") -> Any:
    """The structure :func:`pack` packed; anything else as it is, so files written without
    packing still load. Refuses a structure that needs more than plain data and tensors
    (:class:`UnsafeFileError`, naming ``source``)."""
    if not (isinstance(payload, dict) and payload.get(_MARK) == 1):
        return payload
    return _Unpacker(payload["tree"], payload["buffers"], source).load()


def load(path: str | os.PathLike[str]) -> Any:
    """What ``torch.save`` (of a :func:`pack`-ed structure or not) wrote to ``path``, on the
    CPU, loaded without running code from the file: one that needs more than plain data and
    tensors is refused with :class:`UnsafeFileError`."""
    try:
        payload = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        try:
            unsafe = torch.serialization.get_unsafe_globals_in_checkpoint(path)
        except Exception:  # not a readable checkpoint at all: torch's own message says why
            unsafe = []
        if unsafe:
            raise _refusal(path, ", ".join(unsafe)) from None
        # torch's message: a preamble, its reason, then advice that does not apply here
        parts = [p for p in str(exc).split("\n\n") if p.strip()]
        reason = parts[1].strip() if len(parts) > 2 else str(exc)
        raise UnsafeFileError(f"{os.fspath(path)}: not loaded: {reason}") from None
    return unpack(payload, path)


def loads(data: bytes, source: str | os.PathLike[str]) -> Any:
    """``pickle.loads(data)``, building plain data only: one that needs anything else is
    refused with :class:`UnsafeFileError` naming ``source``."""
    return _Restricted(data, source).load()


class _UnloadedType(type):
    """The metaclass of :class:`Unloaded`: calling a stand-in (a pickle's REDUCE) gives
    another, and setting an item on one (SETITEMS) does nothing."""

    def __call__(cls, *args: Any, **kwargs: Any) -> Any:
        return _unloaded(f"{cls.__qualname__}(...)")

    def __setitem__(cls, key: Any, value: Any) -> None:
        pass


class Unloaded(metaclass=_UnloadedType):
    """What :func:`load_inert` puts where a pickle names anything but plain data: a type (so
    that a pickle may instantiate it, NEWOBJ) that stands for the name and does nothing."""

    def __new__(cls, *args: Any, **kwargs: Any) -> Any:  # NEWOBJ
        return _unloaded(f"{cls.__qualname__}()")

    @classmethod
    def __setstate__(cls, state: Any) -> None:  # BUILD
        pass

    @classmethod
    def append(cls, item: Any) -> None:
        """Ignores the item a pickle's APPEND adds: nothing is built."""

    @classmethod
    def extend(cls, items: Any) -> None:
        """Ignores the items a pickle's APPENDS adds: nothing is built."""


def _unloaded(name: str) -> type:
    return _UnloadedType(name, (Unloaded,), {"__qualname__": name, "__module__": __name__})


class _Inert(pickle.Unpickler):
    """Builds the allowed objects, and an :class:`Unloaded` stand-in for anything else: names
    are neither imported nor called."""

    def find_class(self, module: str, name: str) -> Any:
        found = _allowed(module, name)
        return found if found is not None else _unloaded(f"{module}.{name}")


def load_inert(path: str | os.PathLike[str]) -> Any:
    """The pickle file at ``path`` (one written by another program, Ray Tune's searcher state)
    with what is plain data loaded and everything else replaced by :class:`Unloaded` stand-ins:
    no code of the file runs. :func:`unloaded_in` finds the stand-ins in a part of it."""
    with open(path, "rb") as f:
        return _Inert(f).load()


def unloaded_in(obj: Any) -> str | None:
    """The name of an :class:`Unloaded` stand-in inside ``obj`` (containers searched), if any."""
    todo = [obj]
    seen: set[int] = set()
    while todo:
        item = todo.pop()
        if id(item) in seen:
            continue
        seen.add(id(item))
        if isinstance(item, type) and issubclass(item, Unloaded):
            return item.__qualname__
        if isinstance(item, dict):
            todo += [*item.keys(), *item.values()]
        elif isinstance(item, list | tuple | set | frozenset | collections.deque):
            todo += list(item)
    return None
