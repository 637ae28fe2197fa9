"""One call of :meth:`ArrayTrainer.run <hfsweep.training.trainer.ArrayTrainer.run>`: the arrays
it trains one after another (more than one after an out-of-memory split or a compaction), each
member's evaluations, ends and refills, and the checkpoint written at every evaluation.

The run's loop is a generator (:meth:`ArrayRun.steps`): alone it never yields
(:meth:`ArrayRun.execute` drains it), and under :func:`~hfsweep.training.train_together` it yields each training step's
forward, loss and backward as a :class:`StepRequest` to the driver, which steps several runs'
requests together (their offloaded shards alternating) and sends each its ``[B]`` losses back,
or throws the step's out-of-memory error in. Everything else (data, evaluation, refill,
checkpoints) stays in the run's own loop, so a run trains the same either way."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Generator, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

from .._io import append_lines, atomic_save
from .._usercode import CHECKPOINT, OPTIMIZER_STEP, Phase, describe
from ..fusion import FusedArray
from ..offload import OffloadedArray
from ._compiled import log_compiled
from ._evaluation import endings, record_evaluations, validation_sums
from ._frozen import share_frozen_storage
from ._offload_auto import split_for_offload
from ._threads import Threads
from .checkpoint import (
    _DELIVERED,
    DamagedCheckpointError,
    SavedStateError,
    _encode_record,
    _read_run,
    _result_record,
    _rng_state,
    _run_payload,
    _set_rng_state,
    _write_member,
)
from .live import LiveArray, _build_live
from .packed import pack
from .results import Evaluation, Member, MemberResult, RefillHook, ReportHook
from .spec import ArrayState, TrialSpec, _SlotState, key_difference
from .step import (
    _batches,
    _choose_compaction,
    _set_member_dropout,
    _StepCounts,
    _StepTimer,
    add_losses,
    backward,
    update,
)
from .task import TaskError, fork_rng, optimizer_values, schedule_args

if TYPE_CHECKING:
    from .base import TrainerBase

_log = logging.getLogger("hfsweep.trainer")


@dataclass
class StepRequest:
    """One training step a run hands to its driver: the forward, loss and backward of
    ``live``'s array on the batch ``(x, y)``; the driver sends back the ``[B]`` losses."""

    run: ArrayRun
    live: LiveArray
    x: Any
    y: Any


#: what :meth:`ArrayRun.steps` yields, is sent, and returns
_Steps = Generator[StepRequest, Tensor, list[MemberResult]]


def _drain(steps: Generator[StepRequest, Tensor, Any]) -> Any:
    """Run ``steps`` of a run alone to its end (it steps its arrays itself: it never yields)."""
    try:
        request = next(steps)
    except StopIteration as done:
        return done.value
    steps.close()
    raise RuntimeError(f"a run trained alone handed its step out: {request!r}")


class ArrayRun:
    r"""One call of :meth:`ArrayTrainer.run`: a queue of arrays (more than one after an OOM split).

    The trainer's extension point: a trainer that trains its arrays differently sets its own
    subclass as :attr:`ArrayTrainer.run_class <hfsweep.training.ArrayTrainer.run_class>` (as
    :class:`hfsweep.parallel.DataParallelTrainer` does, on one worker's shards). A subclass may
    override these methods and keeps their meaning: ``_stream`` (the batches), ``_backward``
    (a step's forward, loss and backward), ``_validation_sums``, ``_at_boundary`` (at each
    evaluation boundary), ``_out_of_memory``, ``_compact_size``, ``_report``, ``_next_member``
    (refill), ``_writes_files``, ``_save_checkpoint`` and ``_deliver`` (results to
    ``on_finish``); the arrays it trains are :class:`~hfsweep.training.live.LiveArray`."""

    def __init__(
        self,
        trainer: TrainerBase,
        report: ReportHook | None,
        refill: RefillHook | None,
        on_finish: Callable[[MemberResult], None] | None,
    ) -> None:
        self.t = trainer
        self.task = trainer.task
        self.report = report
        self.refill = refill
        self.on_finish = on_finish
        self.results: dict[str, MemberResult] = {}
        self.order: list[str] = []
        self.key: str | None = None
        self.queue: list[ArrayState] = []
        self.pending: list[str] = []  # finished, on_finish not yet called
        self.delivered: set[str] = set()
        self.user_rng: dict[str, Any] = {}
        #: the checkpoint the saved states of the queue were read from, until the next one
        #: is written: a state that does not fit its model makes that file damaged
        self._read_from: Path | None = None
        #: measured seconds per training step by array size (this run's key), for compaction
        self.step_seconds: dict[int, float] = {}
        #: set by a driver training several runs together (:func:`~hfsweep.training.
        #: train_together`): the offload engine of each array built, sharing the driver's
        #: ledger and transfer; the run then yields its steps to the driver
        self.engine_for: Callable[[FusedArray], OffloadedArray] | None = None
        #: on the CPU, the intra-op thread count, chosen again at every boundary (``_threads``)
        self.threads: Threads | None = None

    # ------------------------------------------------------------------ entry
    def execute(
        self, members: Sequence[Member], resume: bool, start_step: int = 0
    ) -> list[MemberResult]:
        """Train ``members`` alone (see :meth:`ArrayTrainer.run`); one result per member."""
        results: list[MemberResult] = _drain(self.steps(members, resume, start_step))
        return results

    def steps(self, members: Sequence[Member], resume: bool, start_step: int = 0) -> _Steps:
        """:meth:`execute` as a generator: it yields a :class:`StepRequest` at each training
        step where a driver set :attr:`engine_for`, and returns the results."""
        ckpt = self._checkpoint_path()
        with fork_rng():
            self.user_rng = _rng_state()
            if resume and ckpt is not None and ckpt.exists():
                with Phase(CHECKPOINT):
                    self._load_checkpoint(ckpt, members)
            else:
                if not members:
                    raise ValueError("run() needs at least one member")
                ids = [m.id for m in members]
                dup = sorted({i for i in ids if ids.count(i) > 1})
                if dup:
                    raise ValueError(f"member id {dup[0]!r} appears twice; ids must be unique")
                slots = [self._new_slot(m, start_step) for m in members]
                spe = self.t.steps_per_epoch(slots[0].config)
                self.queue = [ArrayState(list(slots), *divmod(start_step, spe))]
            self._deliver()
            while self.queue:
                reshaped = yield from self._train(self.queue[0])
                if reshaped is None:
                    self.queue.pop(0)
                else:
                    self.queue[0:1] = reshaped
                    del reshaped
                    if self.t.device.type == "cuda":
                        torch.cuda.empty_cache()
                self._save_checkpoint(None)
                self._deliver()
            _set_rng_state(self.user_rng)
        return [self.results[i] for i in self.order]

    def _deliver(self) -> None:
        """Call ``on_finish`` for members whose end is saved in the checkpoint, then record
        that they were told. After a crash between the two, a member is told again: the hook
        is called at least once per member, so it must tolerate a repeat."""
        if not self.pending:
            return
        with self._user_rng_scope():
            for member_id in self.pending:
                result = self.results[member_id]
                if self.on_finish is not None:
                    self.on_finish(result)
                if not self.t.keep_states:
                    result.state = None
                self.delivered.add(member_id)
        d = self.t.checkpoint_dir
        if d is not None:
            with Phase(CHECKPOINT):
                append_lines(
                    d / _DELIVERED,
                    [_encode_record(_result_record(self.results[i])) for i in self.pending],
                )
        self.pending.clear()

    @contextmanager
    def _user_rng_scope(self) -> Iterator[None]:
        """Run user hooks on the caller's random generators, not on the trainer's per-epoch
        seeding (their draws then differ with the caller's seed, as they should)."""
        mine = _rng_state()
        _set_rng_state(self.user_rng)
        try:
            yield
        finally:
            self.user_rng = _rng_state()
            _set_rng_state(mine)

    # ------------------------------------------------------------------ slots
    def _position(self, state: ArrayState, member: Member | None = None) -> int:
        """``state``'s place in the data stream in steps (``epoch * steps_per_epoch + batch``);
        the steps per epoch from a member of it, or from ``member`` when it has none."""
        live = next((s.config for s in state.slots if s is not None), None)
        if live is None:
            assert member is not None
            live = self.task.resolve(member.config)
        return state.epoch * self.t.steps_per_epoch(live) + state.batch

    def _new_slot(self, member: Member, start: int) -> _SlotState:
        """A slot for ``member``, whose first step is at ``start`` in the data stream."""
        config = self.task.resolve(member.config)
        key = self.task.compatibility_key(config)
        if self.key is None:
            self.key = key
        elif key != self.key:
            raise TaskError(
                f"member {member.id!r} cannot join this array: its shared config "
                f"{key_difference(self.key, key)} differs from the array's"
            )
        if member.id in self.results or any(
            s is not None and s.member.id == member.id for a in self.queue for s in a.slots
        ):
            raise ValueError(f"member id {member.id!r} was already trained or is training")
        self.order.append(member.id)
        spec = TrialSpec.of(member, config, self.t.steps_per_epoch(config), start)
        return _SlotState(spec)

    # ------------------------------------------------------------------ one array
    def _train(self, state: ArrayState) -> Generator[StepRequest, Tensor, list[ArrayState] | None]:
        """Train ``state`` until no member is left. Returns the arrays to train instead, with
        every member's current state, when it must change shape: two halves after an
        out-of-memory error, or a compact array once at most half of the slots are busy and no
        refill came."""
        parts = split_for_offload(self.t, self.key or "", state)  # offload="auto" chose arrays
        if parts is not None:  # that fit over one offloaded array
            return parts
        started = time.perf_counter()
        built = self._new_models(state)
        models_s = time.perf_counter() - started
        live_slots = [s for s in state.slots if s is not None]
        if not live_slots:
            return None
        ref = live_slots[0].config
        spe = self.t.steps_per_epoch(ref)
        eval_every = self.t.eval_every or spe
        started = time.perf_counter()
        try:
            live = self._build(state, built)
        except SavedStateError as exc:
            if self._read_from is None:  # states held in memory: hfsweep's own error
                raise
            raise DamagedCheckpointError(self._read_from, str(exc)) from exc
        build_s = models_s + time.perf_counter() - started
        timer = _StepTimer(self.t.device, live.array, self.t._loss, self.t._update)
        _log.info("training an array of %d members (%d steps per epoch)", len(state.slots), spe)
        counts = _StepCounts(state.slots, eval_every)
        try:
            return (
                yield from self._train_steps(state, live, counts, timer, ref, eval_every, build_s)
            )
        finally:
            counts.flush(state.slots, eval_every)  # whatever ends the steps: counts up to date
            live.close()
            if self.t.compile is not False:
                log_compiled(live.array, timer.left_out())

    def _train_steps(
        self,
        state: ArrayState,
        live: LiveArray,
        counts: _StepCounts,
        timer: _StepTimer,
        ref: Mapping[str, Any],
        eval_every: int,
        build_s: float,
    ) -> Generator[StepRequest, Tensor, list[ArrayState] | None]:
        """The training steps of :meth:`_train` (``ref``: a member's config), until no member
        is left or the array must change shape."""
        spe = self.t.steps_per_epoch(ref)
        array, opt = live.array, live.opt
        seen_nonfinite = len(opt.nonfinite_members)
        buffers = array._forward_buffers()  # not the frozen parameters all members share
        backup = [b.detach().clone() for b in buffers]
        stream = self._stream(ref, state)
        training = any(s is not None for s in state.slots)  # slots end only in the due branch
        while training:
            with Phase("drawing a training batch"):
                epoch, index, batch = next(stream)
                x, y = self.t._to_device(batch)
            if backup:
                # forward updates buffers (BatchNorm statistics, dropout call counts): keep
                # their values so that a step failed by out-of-memory can be replayed exactly
                torch._foreach_copy_(backup, buffers)
            out_of_memory = ""
            place = live.step_place
            if place is not None:  # offloaded: where this step's optimizer step runs
                place.begin(live.clip is not None)
            try:
                losses = yield from self._step(live, x, y)
            except torch.OutOfMemoryError as exc:
                out_of_memory = describe(exc, limit=300)
            if out_of_memory:
                # outside the except block, so the failed step's graph is already freed
                opt.zero_grad(set_to_none=True)
                if backup:
                    torch._foreach_copy_(buffers, backup)
                if self.t.device.type == "cuda":
                    torch.cuda.empty_cache()
                counts.flush(state.slots, eval_every)
                if place is not None and not place.replayable:
                    self._unreplayable(live, out_of_memory)
                    return None
                return self._out_of_memory(live, out_of_memory)
            with Phase(OPTIMIZER_STEP):
                update(opt, live.sched, stepped=place is not None and place.on_device)
            if place is not None:
                place.end()
            state.epoch, state.batch = epoch, index + 1
            if state.batch >= spe:
                state.epoch, state.batch = epoch + 1, 0
            add_losses(live.loss_sum, losses)
            # the slots' step counts are brought up to date only when one of them is due (or
            # a member failed): no loop over the members at every step
            counts.pending += 1
            failed = opt.nonfinite_members[seen_nonfinite:]
            seen_nonfinite = len(opt.nonfinite_members)
            due = counts.flush(state.slots, eval_every) if counts.due() or failed else []
            for i in failed:
                slot = state.slots[i]
                if slot is not None:
                    self._finish(live, i, "failed", "non-finite gradients")
                    due = [j for j in due if j != i]
            timer.step()
            if due or failed:
                self.step_seconds[len(state.slots)] = timer.pause()
                if due:
                    self._evaluate(live, due, spe)
                if self.refill is not None and len(self.queue) == 1:
                    # (arrays waiting after an out-of-memory split go first)
                    self._refill(live)
                    live.refresh()
                busy = sum(s is not None for s in state.slots)
                if 0 < busy <= len(state.slots) // 2:
                    # most slots are idle and nobody is waiting for them: go on with a smaller
                    # array if the steps it saves outweigh rebuilding it
                    size = self._compact_size(state, array, busy, build_s)
                    if size is not None:
                        return [self._compacted(live, size)]
                self._save_checkpoint(live)
                self._deliver()
                self._at_boundary()
                if self.threads is not None:
                    self.threads.revisit()
                counts.plan(state.slots, eval_every)  # members ended or joined
                training = any(s is not None for s in state.slots)
                timer.resume()
        return None

    def _step(self, live: LiveArray, x: Any, y: Any) -> Generator[StepRequest, Tensor, Tensor]:
        """Forward and backward of one training step: :meth:`_backward` here, or, with a
        driver (:attr:`engine_for`), handed to it as a :class:`StepRequest`; the ``[B]``
        losses either way (the driver throws a failed step's out-of-memory error in)."""
        if self.engine_for is None:
            return self._backward(live, x, y)
        losses = yield StepRequest(self, live, x, y)
        return losses

    def _backward(self, live: LiveArray, x: Any, y: Any) -> Tensor:
        """Forward and backward of one training step on the batch ``(x, y)``; the ``[B]``
        losses (a data-parallel worker reduces its shard's with the others')."""
        smoothing = live.smoothing if live.smoothes else None
        return backward(
            self.task, live.array, x, y, smoothing, live.clip, self.t._loss, live.forward
        )

    def _at_boundary(self) -> None:
        """Called at every evaluation boundary once the checkpoint is written and the ended
        members are delivered: where a data-parallel run may stop to be resized."""

    def _out_of_memory(self, live: LiveArray, error: str) -> list[ArrayState] | None:
        """The arrays to go on with after a training step ran out of memory: two halves while
        two members or more train; one member alone if idle slots kept it company; and when a
        member runs out of memory alone, it fails (its config needs more memory than the
        device has: the other trials are not affected)."""
        busy = [i for i, s in enumerate(live.state.slots) if s is not None]
        if len(busy) > 1:
            return live.split()
        if len(live.state.slots) > 1:
            return [self._compacted(live, 1)]
        why = f"out of memory on {self.t.device} training alone in an array: {error}"
        self._finish(live, busy[0], "failed", why)
        return None

    def _unreplayable(self, live: LiveArray, error: str) -> None:
        """A training step ran out of memory after the device step had updated some of its
        shards on the host: it cannot be replayed exactly, so the array's members fail with
        the reason (and what to change) instead of splitting and replaying it."""
        why = (
            f"out of memory on {self.t.device} after the device optimizer step had updated some "
            "shards (offload_step: device cannot replay such a step exactly; give offload_step "
            f"host, or a smaller fusion.device_memory): {error}"
        )
        for i, slot in enumerate(live.state.slots):
            if slot is not None:
                self._finish(live, i, "failed", why)

    def _compact_size(
        self, state: ArrayState, array: FusedArray, busy: int, build_s: float
    ) -> int | None:
        """The size to rebuild the array at with ``busy`` members, or ``None`` to keep it.

        The rebuild costs what this array's build took plus the traces the new size lacks in
        the shared cache (both measured); it saves, at each step still to come (at most the
        largest budget left among the busy members), the difference in step time.
        """
        size = len(state.slots)
        remaining = max(s.budget - s.steps for s in state.slots if s is not None)
        return _choose_compaction(
            size,
            busy,
            remaining,
            self.step_seconds,
            lambda b: build_s + array._retrace_seconds(b),
        )

    def _compacted(self, live: LiveArray, size: int) -> ArrayState:
        """The busy members' current states in an array of ``size`` slots (idle ones last)."""
        return live.compacted(size)

    def _build(self, state: ArrayState, built: Mapping[int, nn.Module]) -> LiveArray:
        """The live array of ``state`` (``built``: the new members' models, by slot)."""
        return _build_live(self.t, self.key or "", state, built, self.engine_for)

    def _new_models(self, state: ArrayState) -> dict[int, nn.Module]:
        """The models of the members that start training in ``state`` (no saved state), by
        slot, each built from its config (its seeded initialisation); with ``share_frozen``,
        each one's frozen tensors equal to the first one's share its storage as soon as it is
        built (:mod:`._frozen`), so the build holds one backbone, not one per member. A member whose
        ``model(config)`` raises fails alone: its config is one the model rejects, which says
        nothing about the others (see :meth:`_member_model`)."""
        built: dict[int, nn.Module] = {}
        first: nn.Module | None = None
        for i, s in enumerate(state.slots):
            if s is not None and s.saved is None:
                model = self._member_model(s)
                if model is None:
                    state.slots[i] = None
                    continue
                if first is None:
                    first = model
                elif self.t.share_frozen:  # one backbone alive while the members are built
                    share_frozen_storage(model, first)
                built[i] = model
        return built

    def _member_model(self, slot: _SlotState) -> nn.Module | None:
        """A new member's model, or ``None`` after ending the member as failed because
        ``model(config)`` raised (the error is its result's ``error``)."""
        try:
            return self.task.build_model(slot.config).to(self.t.dtype)
        except Exception as exc:
            error = f"the task's model(config) raised {describe(exc)}"
            _log.warning("member %s failed before training: %s", slot.member.id, error)
            self.results[slot.member.id] = MemberResult(
                id=slot.member.id,
                config=dict(slot.config),
                status="failed",
                steps=slot.steps,
                history=slot.history,
                error=error,
            )
            self.pending.append(slot.member.id)
            return None

    def _stream(self, config: Mapping[str, Any], state: ArrayState) -> Iterator[Any]:
        """Batches of the shared training data from the array's position, forever, each epoch
        in the order fixed by ``(data_seed, epoch)``."""
        train, _ = self.t._dataset(config)
        spe = self.t.steps_per_epoch(config)
        data_seed = int(config["data_seed"])
        return _batches(self.task.name, train, spe, data_seed, state.epoch, state.batch)

    # ------------------------------------------------------------------ evaluation
    def _evaluate(self, live: LiveArray, due: list[int], spe: int) -> None:
        """Evaluate the members in slots ``due`` (see :mod:`._evaluation`), report them and end
        those whose results or the report hook's decisions end."""
        _, val = self.t._dataset(live.state.slots[due[0]].config)  # type: ignore[union-attr]
        live.array.eval()
        with torch.no_grad(), Phase("drawing a validation batch"):
            sums, count = self._validation_sums(live, val)
        live.array.train()
        if count == 0:
            raise TaskError(f"task {self.task.name!r}: the validation data yielded no batch")
        evaluations = record_evaluations(live.state, due, spe, sums, count, live.loss_sum)
        for i, status, error in endings(due, evaluations, self._report(evaluations)):
            self._finish(live, i, status, error)

    def _validation_sums(self, live: LiveArray, val: Any) -> tuple[dict[str, Tensor], int]:
        """Each validation metric summed over the samples of ``val`` (``[B]`` float64 per
        name), and the number of samples."""
        return validation_sums(self.task, val, self.t._to_device, live.forward)

    def _report(self, evaluations: list[Evaluation]) -> Mapping[str, bool]:
        """The report hook's decisions on ``evaluations`` (``{}`` without a hook)."""
        if self.report is None:
            return {}
        with self._user_rng_scope():
            return self.report(evaluations) or {}

    def _next_member(self) -> Member | None:
        """The refill hook's next member, or ``None``."""
        assert self.refill is not None
        with self._user_rng_scope():
            return self.refill()

    def _writes_files(self) -> bool:
        """Whether this run writes the checkpoint's files (a data-parallel array's first worker
        does, the others only read them)."""
        return self.t.checkpoint_dir is not None

    # ------------------------------------------------------------------ finishing and refill
    def _finish(self, live: LiveArray, i: int, status: str, error: str | None) -> None:
        s = live.state.slots[i]
        assert s is not None
        wanted = self.t.final_states == "all" or (
            self.t.final_states == "completed" and status == "completed"
        )
        member_state = live.member_state(i) if wanted else None
        result = MemberResult(
            id=s.member.id,
            config=dict(s.config),
            status=status,
            steps=s.steps,
            history=s.history,
            state=member_state,  # for on_finish; dropped after it unless keep_states
            error=error,
            start_step=s.spec.start,
        )
        self.results[s.member.id] = result
        d = self.t.checkpoint_dir
        writes = d is not None and self._writes_files() and self.t.keep_states
        if writes and member_state is not None:
            assert d is not None
            # the checkpoint holds the state only until on_finish has been called
            _write_member(d, result, member_state)
        live.opt.set_active(i, False)
        live.state.slots[i] = None
        self.pending.append(s.member.id)
        _log.info("member %s %s after %d steps", s.member.id, status, s.steps)

    def _refill(self, live: LiveArray) -> None:
        """Fill the free slots with members from the refill hook while it gives any."""
        assert self.refill is not None
        state, array, opt, sched = live.state, live.array, live.opt, live.sched
        for i, s in enumerate(state.slots):
            if s is not None:
                continue
            model = None
            while model is None:  # a member whose model(config) raises fails alone
                member = self._next_member()
                if member is None:
                    return
                slot = self._new_slot(member, self._position(state, member))
                model = self._member_model(slot)
            array.load_member(i, model)
            if slot.config["dropout"] is not None:
                _set_member_dropout(array, i, float(slot.config["dropout"]))
            array.manual_seed(i, slot.spec.seed)
            opt.reset_member(i, **optimizer_values(slot.config))
            if sched is not None:
                spe = self.t.steps_per_epoch(slot.config)
                sched.reset_member(i, **schedule_args(slot.config, slot.budget, spe))
            live.smoothing[i] = float(slot.config["label_smoothing"])
            live.loss_sum[i] = 0.0
            state.slots[i] = slot
            _log.info("member %s joined the array in slot %d", slot.member.id, i)

    # ------------------------------------------------------------------ checkpoints
    def _checkpoint_path(self) -> Path | None:
        d = self.t.checkpoint_dir
        return None if d is None else d / "array.pt"

    def _save_checkpoint(self, running: LiveArray | None) -> None:
        """Write every array of the queue (the running one from its live tensors) atomically."""
        path = self._checkpoint_path()
        if path is None:
            return
        arrays = [
            (a, running.snapshot() if n == 0 and running is not None else a.slots)
            for n, a in enumerate(self.queue)
        ]
        undelivered = [self.results[i] for i in self.pending]
        payload = _run_payload(self._settings(), self.key, self.order, undelivered, arrays)
        with Phase(CHECKPOINT):
            atomic_save(pack(payload), path)
        self._read_from = None  # the states saved from now on are this run's

    def _settings(self) -> dict[str, Any]:
        """What must not change between a run and its resume."""
        return {"task": self.task.name, "dtype": str(self.t.dtype), "eval_every": self.t.eval_every}

    def _load_checkpoint(self, path: Path, members: Sequence[Member]) -> None:
        """Take up the run saved at ``path`` (see :func:`._read_run`); ``members`` it does not
        know yet join its last array, in free slots first."""
        d = self.t.checkpoint_dir
        assert d is not None
        saved = _read_run(path, self._settings(), d, self.t.keep_states)
        self._read_from = path
        self.key, self.order, self.queue = saved.key, saved.order, saved.queue
        self.results, self.delivered, self.pending = saved.results, saved.delivered, saved.pending
        known = set(self.order)
        fresh = [m for m in members if m.id not in known]
        if fresh:
            if not self.queue:
                self.queue = [ArrayState([])]
            slots = self.queue[-1].slots
            for m in fresh:
                # a free slot first: the array keeps its size
                free = next((i for i, s in enumerate(slots) if s is None), None)
                slot = self._new_slot(m, self._position(self.queue[-1], m))
                if free is None:
                    slots.append(slot)
                else:
                    slots[free] = slot
        _log.info(
            "resumed from %s: %d finished, %d in training",
            path,
            len(self.results),
            sum(s is not None for a in self.queue for s in a.slots),
        )
