"""The array trainer under the name users import it by: :class:`ArrayTrainer` trains the members
of one fused array, each on its own budget, and :class:`Member`, :class:`Evaluation` and
:class:`MemberResult` are what it takes and gives back. The code lives in
:mod:`hfsweep.training`."""

from .training import ArrayTrainer, Evaluation, Member, MemberResult, RefillHook, ReportHook

__all__ = ["ArrayTrainer", "Evaluation", "Member", "MemberResult", "RefillHook", "ReportHook"]
