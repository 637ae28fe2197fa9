"""Names a sweep file's own checks need, kept here so that checking a file imports no torch:
the ready tasks (defined in :mod:`hfsweep.tasks`, which imports torch) and the values of the
``fusion.offload`` settings (used by :mod:`hfsweep.offload`, likewise)."""

from __future__ import annotations

__all__ = ["OFFLOAD_MODES", "OFFLOAD_STEPS", "READY_TASKS"]

#: the ready tasks' names, sorted (``hfsweep.tasks.TASKS``'s keys: a test keeps them equal)
READY_TASKS = ("cifar_resnet", "digits_cnn", "digits_mlp", "text_lora", "token_transformer")

#: the values ``offload`` takes
OFFLOAD_MODES = ("none", "host", "auto")

#: where an offloaded array's optimizer step runs (``offload_step``): ``host`` (the fused CPU
#: step on the host tensors, the default), ``device`` (each shard on the compute device after
#: its backward), ``auto`` (both measured on the array's first steps, the faster kept)
OFFLOAD_STEPS = ("host", "device", "auto")
