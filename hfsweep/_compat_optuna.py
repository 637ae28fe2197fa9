"""Optuna's private classes that hfsweep's retrying storage needs, apart from
:mod:`hfsweep._compat` so that importing the fusion core does not import Optuna (see there).

``BaseHeartbeat`` is the interface of a storage with heartbeats, which a storage wrapping one
implements; ``FrozenStudy`` is what ``BaseStorage.get_all_studies`` returns. Neither is exported
by Optuna's public modules (optuna >= 4.0).
"""

from optuna.storages._heartbeat import BaseHeartbeat
from optuna.study._frozen import FrozenStudy

__all__ = ["BaseHeartbeat", "FrozenStudy"]
