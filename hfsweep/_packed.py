"""Many small tensors saved as a few: the trainer's checkpoints.

``torch.save`` writes each tensor's storage as a record of its own, and its pickler calls a
Python hook for every object. A checkpoint of a 32-member array of a small MLP holds about 200
tensors (every member's weights, optimizer state and schedule) among 3,000 other objects
(histories, configs); ``benchmarks/sweep_phases.py`` times the trainer's checkpoints.
:func:`pack` pickles the structure at C speed, copying its dense tensors into one flat buffer per
dtype on the way, in CPU memory (a checkpoint of a GPU array needs no second copy on the GPU);
:func:`unpack` rebuilds it with a copy of each tensor, of its shape and dtype, on the CPU, where
the trainer loads its checkpoints anyway. Plain tensors come back (a ``Parameter`` as a tensor
without grad); a tensor found twice (tied weights) is stored twice and comes back as two, and
tensors that shared storage come back separate.
"""

from __future__ import annotations

import io
import math
import pickle
from typing import Any

import torch
from torch import Tensor

__all__ = ["pack", "unpack"]

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

    def persistent_id(self, obj: Any) -> Any:
        if type(obj) not in _DENSE or obj.layout != torch.strided or obj.is_quantized:
            return None
        index = self.index.setdefault(obj.dtype, len(self.parts))
        if index == len(self.parts):
            self.parts.append([])
            self.sizes.append(0)
        offset = self.sizes[index]
        self.parts[index].append(obj.detach().reshape(-1).cpu())
        self.sizes[index] += obj.numel()
        return (index, offset, tuple(obj.shape))


class _Unpacker(pickle.Unpickler):
    def __init__(self, data: bytes, buffers: list[Tensor]) -> None:
        super().__init__(io.BytesIO(data))
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


def unpack(payload: Any) -> Any:
    """The structure :func:`pack` packed; anything else as it is, so files written without
    packing still load."""
    if not (isinstance(payload, dict) and payload.get(_MARK) == 1):
        return payload
    return _Unpacker(payload["tree"], payload["buffers"]).load()
