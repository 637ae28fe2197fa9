"""The sweep engine's part that ends it: stopping every unfinished trial after a failure,
publishing ``trials.csv`` and ``best.json``, keeping the best trials' weights and building the
:class:`~hfsweep.core.result.SweepResult` (see :mod:`hfsweep.core._parts`).
"""

from __future__ import annotations

import functools
import logging
import sys
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from .._compat import trial_for
from .._io import atomic_save
from .._usercode import describe, phase_of
from ._rundir import member_id
from .status import Status

if TYPE_CHECKING:
    import optuna


from ..elastic.policy import ElasticPolicy
from ._parts import _Parts
from .result import StatusCounts, SweepResult, TrainingError, _Failed

__all__: list[str] = []

_log = logging.getLogger("hfsweep.sweep")

#: completed trials whose model state_dict is kept in checkpoints/
_KEEP_BEST = 3
#: seconds between rewrites of trials.csv and best.json while a sweep runs (each rewrite reads
#: the whole study, so rewriting after every trial would cost O(trials^2) over a sweep); the
#: journal and the ledger's log get a line at every trial end, and both files are rewritten at
#: the end
_PUBLISH_EVERY_S = 5.0
#: ...and at least this many times as long as the last rewrite took, so that rewriting them
#: (which grows with the trials) takes at most 1/_PUBLISH_SHARE of a long sweep's time
_PUBLISH_SHARE = 20


class _Outcome(_Parts):
    """Stopping on a failure, publishing results, the best trials and the sweep's result."""

    def _stop(self, failed: _Failed) -> TrainingError:
        """End the sweep after ``failed``: every trial still running (the failed array's, the
        other arrays', those waiting in a pool) is told ``FAIL`` with the reason in its user
        attr ``error``, the unfinished arrays are dropped (their trials have ended), and the
        error to raise is returned. Code that raises in one array's training step would raise
        in every array's, so the sweep does not go on to fail the rest one by one."""
        from optuna.trial import TrialState

        exc = failed.exc
        phase = phase_of(exc)
        cause = describe(exc)
        raised = "raised" + (f" in {phase} of task {self.task.name!r}" if phase else "")
        _log.error("%s %s: %s", failed.where, raised, cause, exc_info=exc)
        hit: list[int] = []
        others = 0
        with self._journal_held():
            running = self.study.get_trials(deepcopy=False, states=(TrialState.RUNNING,))
            assert self.drivers is not None
            for t in sorted(filter(self.drivers.owns, running), key=lambda t: t.number):
                mine = failed.array is not None and t.user_attrs.get("array") == failed.array
                if mine:
                    hit.append(t.number)
                    error = f"{failed.where} {raised}: {cause}"
                else:
                    others += 1
                    error = f"stopped unfinished: {failed.where} {raised}: {cause}"
                trial = self.live.pop(t.number, None) or trial_for(self.study, t)
                trial.set_user_attr("status", "failed")
                trial.set_user_attr("error", error[:1000])
                self.ledger.end(member_id(t.number), Status.FAILED)
                self.study.tell(trial, state=TrialState.FAIL)
                self.tracking.trial_ended(
                    t.number,
                    Status.FAILED,
                    None,
                    error[:1000],
                    info=functools.partial(self._trial_info, t.number, t.user_attrs.get("array")),
                )
                self.reported.pop(t.number, None)
                sampled = self.sampled.pop(t.number, None)
                try:
                    self.source.tell(t.number, sampled or dict(t.params), "failed", None)
                except Exception as searcher_exc:  # the sweep is stopping for another reason
                    _log.warning(
                        "the searcher could not be told of trial %d: %s", t.number, searcher_exc
                    )
                self.progress.finished(Status.FAILED)
            for a in self.arrays:
                if not a.done:  # every trial it held has ended
                    a.done = True
                    self.dir.remove_array(a.index)
            self._save_state()
        trials = f" (trial{'s' if len(hit) > 1 else ''} {', '.join(map(str, hit))})" if hit else ""
        told = []
        if hit:
            told.append(f"its {len(hit)} trial{'s' if len(hit) > 1 else ''}")
        if others:
            other = " other" if hit else ""
            told.append(
                f"{'the ' if not hit else ''}{others}{other} unfinished trial" + "s" * (others > 1)
            )
        marked = (
            f"{' and '.join(told)} {'are' if len(hit) + others > 1 else 'is'} marked failed with "
            "this error (user attr 'error'); no trial is left running"
            if told
            else "no trial was running"
        )
        resume = f"hfsweep run {self.sc.source} --resume" if self.sc.source else "resume=True"
        return TrainingError(
            f"training stopped: {failed.where}{trials} {raised}: {cause}. Code that fails in "
            f"one array fails in the next, so the sweep stopped: {marked}. Fix the task, then "
            f"start a new sweep or continue this one ({resume}; the failed trials count "
            f"towards budget.trials). The traceback is in {self.dir.log}."
        )

    def _publish(self, force: bool = False) -> None:
        """Rewrite trials.csv and best.json from the study, at most every
        ``_PUBLISH_EVERY_S`` seconds (and ``_PUBLISH_SHARE`` times the last rewrite's time)
        unless ``force``."""
        now = time.perf_counter()
        wait = max(_PUBLISH_EVERY_S, _PUBLISH_SHARE * self._publish_s)
        if not force and now - self._published < wait:
            return
        self._published = now
        self.dir.write_trials(self.study.get_trials(deepcopy=False))
        self.dir.write_best(self._best_record(self._best_trial()))
        self._publish_s = time.perf_counter() - now

    def _publish_last(self) -> None:
        """The last :meth:`_publish` of a run. While an error stops the sweep, a storage that
        is not answering (the likely error) leaves the files as they are, and the error that
        stopped the sweep is the one raised: resuming writes them again."""
        from ..storage.database import StorageUnavailable

        stopping = sys.exc_info()[1] is not None
        try:
            self._publish(force=True)
        except StorageUnavailable as exc:
            if not stopping:
                raise
            _log.warning("trials.csv and best.json are not updated: %s", exc)

    def _keep_checkpoint(self, number: int, value: float, model: Mapping[str, Any]) -> None:
        """Keep trial ``number``'s weights if it is among the best completed trials."""
        others = [b for b in self.best if b[1] != number]  # on_finish may come twice
        ranked = sorted([*others, (value, number)], key=lambda b: self._rank(*b))
        keep, drop = ranked[:_KEEP_BEST], ranked[_KEEP_BEST:]
        if (value, number) in keep:
            atomic_save(dict(model), self.dir.checkpoint(number))
        for _, n in drop:
            if n != number:
                self.dir.checkpoint(n).unlink(missing_ok=True)
        self.best = keep

    def _rank(self, value: float | None, number: int) -> tuple[float, int]:
        """Sort key of a completed trial: best value first, then lower trial number."""
        sign = 1.0 if self.sc.mode == "max" else -1.0
        return (-sign * float(value or 0.0), number)

    def _improves(self, value: float, number: int) -> bool:
        """Whether completed trial ``number`` ranks before the best shown so far."""
        shown = self.progress.best
        return shown is None or self._rank(value, number) < self._rank(*shown)

    def _ranked(self) -> list[optuna.trial.FrozenTrial]:
        """The completed trials, best first."""
        from optuna.trial import TrialState

        done = self.study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
        return sorted(done, key=lambda t: self._rank(t.value, t.number))

    def _best_trial(self) -> optuna.trial.FrozenTrial | None:
        ranked = self._ranked()
        return ranked[0] if ranked else None

    def _best_record(self, best: optuna.trial.FrozenTrial | None) -> dict[str, Any] | None:
        if best is None:
            return None
        config = self.task.resolve(self.sc.trial_config(self._params(best)))
        ckpt = self.dir.checkpoint(best.number)
        return {
            "number": best.number,
            "metric": self.sc.metric,
            "value": best.value,
            "params": best.params,
            "config": config,
            "checkpoint": str(ckpt) if ckpt.exists() else None,
        }

    def _params(self, t: optuna.trial.FrozenTrial) -> dict[str, Any]:
        """The sampled config of a finished trial (its params plus the space's fixed values)."""
        import optuna

        return self.sc.space.sample(optuna.trial.FixedTrial(t.params))

    def _result(self) -> SweepResult:
        trials = self.study.get_trials(deepcopy=False)
        # a trial waiting in a pool is RUNNING in the study; one enqueued and not yet asked
        # (Optuna's WAITING) has not started and is not counted
        shown = [*(s for s in Status if s.final), Status.RUNNING]
        counts = StatusCounts(dict.fromkeys(shown, 0))
        for t in trials:
            status = Status.of_trial_state(t.state)
            if status in counts:
                counts[status] += 1
        top = self._ranked()
        best = top[0] if top else None
        record = self._best_record(best)
        ckpt = self.dir.checkpoint(best.number) if best is not None else None
        return SweepResult(
            run_dir=self.dir.path,
            study=self.study,
            metric=self.sc.metric,
            mode=self.sc.mode,
            best_trial=best,
            best_value=best.value if best is not None else None,
            best_params=dict(best.params) if best is not None else {},
            best_config=record["config"] if record is not None else {},
            counts=counts,
            wall_s=self._wall_s(),
            arrays=len(self.arrays),
            best_checkpoint=ckpt if ckpt is not None and ckpt.exists() else None,
            top=top,
            elastic=self._elastic_totals(),
        )

    def _elastic_totals(self) -> dict[str, Any] | None:
        """The elastic policy's wait and idle totals as the sweep ends, also written to
        ``elastic.json``; None without elastic arrays."""
        policy = getattr(self.executor, "policy", None)
        if not isinstance(policy, ElasticPolicy):
            return None
        totals = policy.totals()
        try:
            self.dir.write_elastic(totals)
        except OSError as exc:
            _log.warning("elastic.json was not written: %s", exc)
        return totals
