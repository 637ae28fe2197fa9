"""Fused optimizers: one optimizer for a whole array, every hyperparameter per member.

``hs.optim.SGD``, ``Adam``, ``AdamW``, ``RMSprop`` and ``Adagrad`` take the arguments of their
``torch.optim`` namesakes; each numeric hyperparameter is a scalar (all members) or one value per
member. Member i steps exactly as ``torch.optim`` would step ``array.member(i)``.
"""

from ._algorithms import SGD, Adagrad, Adam, AdamW, RMSprop
from ._base import FusedOptimizer

__all__ = ["SGD", "Adagrad", "Adam", "AdamW", "FusedOptimizer", "RMSprop"]
