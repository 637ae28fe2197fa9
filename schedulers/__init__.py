"""Trial schedulers: decide from intermediate results which trials of a sweep go on training.

Importable as ``hfsweep.schedulers``. One extension point, :class:`TrialScheduler`: the engine
hands it every trial evaluated at one moment (all members of an array at one step) as
:class:`Report`\\ s and gets one :class:`Decision` per trial. Decisions are joint: all values of
a call are recorded before any is decided, so members of one array compete as a group and the
order of the reports never matters. Ready schedulers: :class:`FIFOScheduler` (stops nothing),
:class:`ASHAScheduler`, :class:`HyperbandScheduler` (asynchronous), :class:`MedianStoppingScheduler`,
and :class:`OptunaPruner` for any Optuna pruner; :func:`make_scheduler` builds them by name.
Optuna is imported only when an :class:`OptunaPruner` is built.

:func:`encode_float`/:func:`decode_float` write a non-finite value as strict JSON and read it
back, for the schedulers' and the sweep ledger's saved reports.
"""

from ._asha import ASHAScheduler, HyperbandScheduler
from ._base import STATUSES, Decision, Report, TrialScheduler, decode_float, encode_float
from ._factory import SCHEDULER_NAMES, make_scheduler
from ._fifo import FIFOScheduler
from ._median import MedianStoppingScheduler
from ._optuna import PRUNER_NAMES, OptunaPruner

__all__ = [
    "PRUNER_NAMES",
    "SCHEDULER_NAMES",
    "STATUSES",
    "ASHAScheduler",
    "Decision",
    "FIFOScheduler",
    "HyperbandScheduler",
    "MedianStoppingScheduler",
    "OptunaPruner",
    "Report",
    "TrialScheduler",
    "decode_float",
    "encode_float",
    "make_scheduler",
]
