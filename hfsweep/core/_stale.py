"""A ledger older than its study: finished trials of this driver it does not list as ended.

The ledger is saved before the study hears of a trial's end (:meth:`_Hooks._on_finish`), so a
crash there leaves the ledger ahead, which a resume handles. It can fall behind all the same:
a sweep stopping after a task error tells every unfinished trial ``FAIL`` and saves the ledger
once after (killed in between, the study holds ends the ledger lacks); a power cut can keep the
journal's last lines and lose the ledger's (both are flushed to disk in groups); and a user can
restore an older copy of ``state.json`` and ``state.jsonl`` (a backup) while the study, in
another file or a database, went on.

A resume checks that every finished trial of this driver in the study is in the ledger's
``ended``. One that is not is rebuilt from the study (its end told to the scheduler, its value
ranked among the kept checkpoints) when nothing the scheduler decided from is missing with it;
otherwise (its reports to a scheduler that ranks trials by them, or the array it trained in,
are not in the ledger) the resume is refused: a scheduler without those reports would decide
differently from the sweep so far, and a new array would take the number of one that exists.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

from ._rundir import member_id
from .status import Status

if TYPE_CHECKING:
    import optuna

    from .ledger import Ledger

__all__: list[str] = []


def unended(
    ledger: Ledger,
    trials: Iterable[optuna.trial.FrozenTrial],
    owns: Callable[[optuna.trial.FrozenTrial], bool],
) -> list[optuna.trial.FrozenTrial]:
    """The finished trials among ``trials`` that ``owns`` (this driver's) and that ``ledger``
    does not list as ended, by number."""
    missing = []
    for t in trials:
        status = Status.of_trial_state(t.state)
        if status.final and owns(t) and member_id(t.number) not in ledger.ended:
            missing.append(t)
    return sorted(missing, key=lambda t: t.number)


def lost_with_them(
    ledger: Ledger,
    missing: Iterable[optuna.trial.FrozenTrial],
    *,
    ranks_reports: bool,
    by_steps: bool,
) -> dict[int, str]:
    """What the ledger lost with each trial of ``missing`` that its end alone cannot restore:
    trial number -> what. ``ranks_reports``: the scheduler decides from the values reported
    (its record of them is in the ledger, not the study); ``by_steps``: the budget's resource
    is the trainer's step (the study's step of a report is the step the ledger logs its decision
    under; in epochs, several evaluations can share one study step, so they are counted)."""
    decided: dict[str, set[int]] = {}
    for key in ledger.decisions:
        member, _, step = key.rpartition("@")
        decided.setdefault(member, set()).add(int(step))
    lost: dict[int, str] = {}
    for t in missing:
        steps = decided.get(member_id(t.number), set())
        reported = set(t.intermediate_values)
        if ranks_reports and (not reported <= steps if by_steps else len(reported) > len(steps)):
            lost[t.number] = (
                f"its reports at steps {_steps(reported - steps if by_steps else reported)} "
                "(the scheduler's record of them)"
            )
    return lost


def unrecorded_arrays(
    ledger: Ledger,
    trials: Iterable[optuna.trial.FrozenTrial],
    owns: Callable[[optuna.trial.FrozenTrial], bool],
    checkpointed: Callable[[int], bool],
) -> tuple[dict[int, list[optuna.trial.FrozenTrial]], str | None]:
    """The arrays this driver's trials name (user attr ``array``) that ``ledger`` lacks:
    ``(index -> its trials, by number; why they cannot be rebuilt, or None)``. They can be
    rebuilt, as finished arrays, when every trial they held has finished and they follow the
    ledger's arrays without a gap (a new array takes the next number). An array whose trials
    are all running and that has no checkpoint (``checkpointed(index)``) is left out: the
    engine named them for an array and stopped before it saved it (they start again, the
    number is taken again); one with a checkpoint trained, and cannot be rebuilt."""
    from optuna.trial import TrialState

    known = {a.index for a in ledger.arrays}
    named: dict[int, list[optuna.trial.FrozenTrial]] = {}
    for t in trials:
        index = _array(t)
        # a trial the ledger ended had its array saved before: one it does not know is another
        # driver's, named before this driver adopted the trial
        if index is None or index in known or member_id(t.number) in ledger.ended:
            continue
        # a finished one trained to its end here ("steps"), in an array of this driver's
        trained = t.state == TrialState.RUNNING or "steps" in t.user_attrs
        if trained and owns(t):
            named.setdefault(index, []).append(t)
    arrays: dict[int, list[optuna.trial.FrozenTrial]] = {}
    for index, held in sorted(named.items()):
        running = [t.number for t in held if t.state == TrialState.RUNNING]
        if len(running) == len(held) and not checkpointed(index):
            continue
        if running:
            return arrays, (
                f"array {index}, which holds {describe_missing(sorted(running))} in training"
            )
        arrays[index] = sorted(held, key=lambda t: t.number)
    expected = list(range(len(ledger.arrays), len(ledger.arrays) + len(arrays)))
    numbered = sorted(known) == list(range(len(ledger.arrays)))  # as the engine numbers them
    if arrays and (sorted(arrays) != expected or not numbered):
        gap = sorted(set(range(len(ledger.arrays), max(arrays, default=0) + 1)) - set(arrays))
        return arrays, f"array {gap[0] if gap else min(arrays)}, whose trials it cannot tell"
    return arrays, None


def rank_best(
    best: list[tuple[float, int]],
    missing: Iterable[optuna.trial.FrozenTrial],
    *,
    has_checkpoint: Callable[[int], bool],
    rank: Callable[[float, int], tuple[float, int]],
    keep: int,
) -> tuple[list[tuple[float, int]], list[int]]:
    """The kept best trials with the completed ones of ``missing`` whose checkpoint exists
    ranked in: ``(the ``keep`` best, the numbers dropped from them)``, as
    :meth:`_Outcome._keep_checkpoint` would have kept them."""
    from optuna.trial import TrialState

    ranked = {n: (v, n) for v, n in best}
    for t in missing:
        if t.state == TrialState.COMPLETE and t.value is not None and has_checkpoint(t.number):
            ranked[t.number] = (float(t.value), t.number)
    ordered = sorted(ranked.values(), key=lambda b: rank(*b))
    return ordered[:keep], [n for _, n in ordered[keep:]]


def describe_missing(numbers: Iterable[int]) -> str:
    """``trial 3`` or ``trials 2, 3``."""
    shown = list(numbers)
    return f"trial{'s' if len(shown) > 1 else ''} {', '.join(map(str, shown))}"


def _array(t: optuna.trial.FrozenTrial) -> int | None:
    array = t.user_attrs.get("array")
    return array if isinstance(array, int) else None


def _steps(steps: Iterable[int]) -> str:
    shown = sorted(steps)
    return ", ".join(map(str, shown[:5])) + (", ..." if len(shown) > 5 else "")
