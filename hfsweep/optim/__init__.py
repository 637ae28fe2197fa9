"""Fused optimizers: one optimizer for a whole array, every hyperparameter per member.

``hs.optim.SGD``, ``Adam``, ``AdamW``, ``RMSprop`` and ``Adagrad`` take the arguments of their
``torch.optim`` namesakes; each numeric hyperparameter is a scalar (all members) or one value per
member. Member i steps exactly as ``torch.optim`` would step ``array.member(i)``.
``clip_grad_norm_``/``clip_grad_value_`` clip each member by its own norm, and ``GradScaler``
keeps one AMP loss scale per member, so an overflow in one member skips only that member's step.
``hs.optim.lr_scheduler`` has torch's schedulers with per-member arguments.

:class:`CompiledUpdate` (an optimizer's update compiled) and :func:`inactive_rows` (the rows of
members that sit out a step) are what the trainer and the offload engine's device step share
with the optimizers.
"""

from . import lr_scheduler
from ._algorithms import SGD, Adagrad, Adam, AdamW, RMSprop
from ._amp import GradScaler
from ._base import FusedOptimizer, inactive_rows
from ._clip import clip_grad_norm_, clip_grad_value_
from ._compiled import CompiledUpdate

__all__ = [
    "SGD",
    "Adagrad",
    "Adam",
    "AdamW",
    "CompiledUpdate",
    "FusedOptimizer",
    "GradScaler",
    "RMSprop",
    "clip_grad_norm_",
    "clip_grad_value_",
    "inactive_rows",
    "lr_scheduler",
]
