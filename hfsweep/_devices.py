"""The device and dtype names every part of hfsweep reads the same way: the dtypes a sweep
accepts by their YAML name and what the device ``auto`` means. Kept apart from the profiler's
``sizing.device``, which re-exports them, so that the trainer's settings read them without
importing the profiler (which imports the trainer)."""

from __future__ import annotations

import torch

__all__ = ["DTYPES", "resolve_device"]

#: The floating dtypes a sweep, the Tune plugin and a retrained trial accept, by their YAML name.
DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float64": torch.float64,
    "bfloat16": torch.bfloat16,
}


def resolve_device(device: str | torch.device) -> str:
    """``device`` with ``"auto"`` replaced: ``"cuda"`` where torch sees a CUDA device, else ``"cpu"``.

    Any other device (``"cpu"``, ``"cuda:1"``, ``torch.device("cuda", 1)``) comes back as its name;
    whether it exists is for the caller to check, since only the caller can say where the name came
    from (a YAML key, a command-line flag, an argument).
    """
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return str(device)
