"""The live array: a fused array in training with its optimizer, schedule and per-member
tensors (:class:`LiveArray`), how it is built from slots, and the snapshots of its members'
states that go on in other arrays (two halves after an out-of-memory error, a smaller one once
most slots are idle) or into a checkpoint."""

from __future__ import annotations

import copy
import logging
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

from .._usercode import Phase
from ..fusion import FusedArray, fuse
from ..offload import OffloadedArray
from ..optim import FusedOptimizer
from ..optim.lr_scheduler import FusedLRScheduler
from ._frozen import share_frozen_storage
from ._offload_auto import offload_mode
from ._offload_step import _StepPlace
from .checkpoint import SavedStateError, _member_state
from .spec import ArrayState, _SlotState
from .step import _set_member_dropout, any_smoothing
from .task import make_optimizer, make_schedule

if TYPE_CHECKING:
    from .base import TrainerBase

_log = logging.getLogger("hfsweep.trainer")
#: an array traces a call signature at its 16th call. A trace pays for itself after 30-100
#: calls of a small model (measured on CPU, digits MLP, B = 4..64: a trace takes 40-160 ms, an
#: eager call 1-4 ms longer than a replay), so signatures an array calls a few times (an
#: epoch's shorter last batch, evaluation) stay eager, while the every-step signature loses
#: only its first 15 replays
_TRACE_AFTER_CALLS = 16


@dataclass
class LiveArray:
    """An array in training: its slots and data position (``state``), the fused model, optimizer
    and schedule, and the per-member values every step reads: label smoothing, the training
    loss summed since each member's last evaluation (float64) and the gradient clipping norms."""

    state: ArrayState
    array: FusedArray
    opt: FusedOptimizer
    sched: FusedLRScheduler | None
    smoothing: Tensor
    loss_sum: Tensor
    clip: Tensor | None = None
    smoothes: bool = False  #: whether any member smoothes labels (else the loss skips the term)
    #: the offload engine running ``array`` shard by shard (``offload: host``), else ``None``
    engine: OffloadedArray | None = None
    #: whether the engine's transfer is its own (closed with it), not a driver's that several
    #: arrays trained together share (:func:`~hfsweep.training.train_together`)
    owns_transfer: bool = True
    #: where the offloaded array's optimizer step runs (``offload_step``), else ``None``
    step_place: _StepPlace | None = None

    def forward(self, x: Any) -> Any:
        """Every member's output on the shared input ``x``: the array's call, or its offload
        engine's (same values)."""
        return self.array(x) if self.engine is None else self.engine(x)

    def close(self) -> None:
        """Release the offload engine's compute-side state and threads (after training)."""
        if self.engine is not None:
            _close_engine(self.engine, owns_transfer=self.owns_transfer)

    def refresh(self) -> None:
        """Read the per-member settings of the slots again, after members joined."""
        self.clip = _clip_values(self.state)
        self.smoothes = any_smoothing(s.config for s in self.state.slots if s is not None)

    def member_state(self, i: int) -> dict[str, Any]:
        """Slot ``i``'s model, optimizer, schedule and dropout stream, on the CPU."""
        return _member_state(self.array, self.opt, self.sched, i)

    def snapshot(self) -> list[_SlotState | None]:
        """Every slot with its member's current state saved, to go on in another array."""
        sums = self.loss_sum.tolist()
        shared: dict[str, Tensor] = {}  # the frozen tensors every member shares, kept once
        out: list[_SlotState | None] = []
        for i, s in enumerate(self.state.slots):
            if s is None:
                out.append(None)
                continue
            out.append(
                _SlotState(
                    spec=s.spec,
                    steps=s.steps,
                    history=list(s.history),
                    since=s.since,
                    loss_sum=sums[i],
                    saved=_member_state(self.array, self.opt, self.sched, i, shared),
                )
            )
        return out

    def split(self) -> list[ArrayState]:
        """Two arrays holding every member's current state, at the same data position."""
        state = self.state
        live = [s for s in self.snapshot() if s is not None]
        half = (len(live) + 1) // 2
        halves = [
            ArrayState(list(part), state.epoch, state.batch) for part in (live[:half], live[half:])
        ]
        _log.warning(
            "out of memory with an array of %d: going on as arrays of %d and %d members",
            len(state.slots),
            half,
            len(live) - half,
        )
        return halves

    def compacted(self, size: int) -> ArrayState:
        """The busy members' current states in an array of ``size`` slots (idle ones last)."""
        busy = [s for s in self.snapshot() if s is not None]
        _log.info(
            "%d of %d slots left busy: going on as an array of %d",
            len(busy),
            len(self.state.slots),
            size,
        )
        idle: list[_SlotState | None] = [None] * (size - len(busy))
        return ArrayState([*busy, *idle], self.state.epoch, self.state.batch)


def _close_engine(engine: OffloadedArray, *, owns_transfer: bool) -> None:
    """Release ``engine``'s compute-side state, and stop its transfer where it is its own (a
    driver's transfer, shared by the arrays trained together, goes on: the driver closes it)."""
    if owns_transfer:
        engine.close()
    else:
        engine._release()


def _build_live(
    t: TrainerBase,
    key: str,
    state: ArrayState,
    built: Mapping[int, nn.Module],
    engine_for: Callable[[FusedArray], OffloadedArray] | None = None,
) -> LiveArray:
    """The live array of ``state``'s slots on ``t``'s device: new members' models from
    ``built``, restored members' weights, optimizer and schedule state and dropout streams from
    their saved state; idle slots are filled with copies and kept inactive. An offloaded
    array's engine is ``engine_for(array)`` where given (a driver's, sharing its ledger and
    transfer with the arrays trained together), else one of its own."""
    live = [s for s in state.slots if s is not None]
    filler = live[0]
    models = _models(t, state, filler, built)
    offload = offload_mode(t, key, filler.config, len(state.slots))
    with Phase("fusing the members' models"):
        if offload == "host":  # stays in host storage: the engine keeps it there
            array = fuse(models, trace=t.trace, share_frozen=t.share_frozen)
        else:
            array = fuse(models, trace=t.trace, share_frozen=t.share_frozen, compile=t.compile).to(
                t.device
            )
    for i, s in enumerate(state.slots):
        if s is not None and s.saved is not None:
            _restoring(s, "model", array.load_member_state_dict, i, s.saved["model"])
    array._share_traces(t._trace_cache.setdefault(key, {}))
    array._defer_tracing(_TRACE_AFTER_CALLS)
    configs = [(s or filler).config for s in state.slots]
    for i, c in enumerate(configs):
        if c["dropout"] is not None:
            _set_member_dropout(array, i, float(c["dropout"]))
    spe = t.steps_per_epoch(filler.config)
    opt = make_optimizer(array, configs)
    if t._update is not None:
        opt._compiled = t._update  # one for all the trainer's arrays: one fallback, one timer
    budgets = [(s or filler).budget for s in state.slots]
    sched = make_schedule(opt, configs, budgets, spe)
    for i, s in enumerate(state.slots):
        if s is None:
            opt.set_active(i, False)
            continue
        if s.saved is None:
            array.manual_seed(i, s.spec.seed)
            continue
        _restoring(s, "optimizer", opt.load_member_state_dict, i, s.saved["optimizer"])
        if sched is not None and s.saved.get("scheduler") is not None:
            _restoring(s, "schedule", sched.load_member_state_dict, i, s.saved["scheduler"])
        _restoring(s, "dropout stream", array.set_rng_state, i, s.saved["rng"])
        s.saved = None
    array.train()
    engine = None
    place = None
    if offload == "host":
        if engine_for is not None:
            engine = engine_for(array)
        else:
            engine = OffloadedArray(array, device=t.device, budget_bytes=t.device_memory)
        try:
            place = _StepPlace(
                t.offload_step,
                engine,
                opt,
                t._offload_steps.get((key, len(state.slots))),
                lambda mode: t._offload_steps.__setitem__((key, len(state.slots)), mode),
            )
            place.prepare()
        except BaseException:
            # no LiveArray holds the engine yet, so nothing else would close it: its transfer's
            # threads or streams, and what it holds on the compute side, go with the error
            _close_engine(engine, owns_transfer=engine_for is None)
            raise
        _log.info(
            "offload: host, %d shards of at most %d bytes, %d tensors kept once for all members",
            len(engine.shards),
            max(s.nbytes for s in engine.shards),
            len(array.shared_frozen),
        )
    smoothing = torch.tensor(
        [s.config["label_smoothing"] if s else 0.0 for s in state.slots],
        dtype=t.dtype,
        device=t.device,
    )
    loss_sum = torch.tensor(
        [s.loss_sum if s else 0.0 for s in state.slots], dtype=torch.float64, device=t.device
    )
    result = LiveArray(
        state,
        array,
        opt,
        sched,
        smoothing,
        loss_sum,
        engine=engine,
        owns_transfer=engine_for is None,
        step_place=place,
    )
    result.refresh()
    return result


def _restoring(slot: _SlotState, what: str, load: Callable[..., object], *args: Any) -> None:
    """``load(*args)``: ``slot``'s saved ``what`` into the array; a state that does not fit it
    (other shapes or keys than the member's model has) raises :class:`SavedStateError`."""
    try:
        load(*args)
    except (RuntimeError, KeyError, ValueError, TypeError, IndexError, AttributeError) as exc:
        lines = str(exc).strip().splitlines()
        raise SavedStateError(
            f"the saved {what} of member {slot.member.id!r} does not fit its model "
            f"({type(exc).__name__}: {lines[0][:300] if lines else '-'})"
        ) from exc


def _models(
    t: TrainerBase, state: ArrayState, filler: _SlotState, built: Mapping[int, nn.Module]
) -> list[nn.Module]:
    """One model per slot to fuse: a new member's from ``built``. Slots whose weights
    come from a saved state (loaded into the array afterwards) and idle slots
    (``filler``'s config) get copies of one model per ``dropout`` value and values of the
    task's other model settings (``lora_alpha``, ``lora_dropout``, its ``per_member`` keys:
    what besides weights differs between members' models and is not in their state dicts;
    ``None`` keeps the model's own ``p``): a rebuilt array does not initialise models it
    overwrites (a copy costs a fraction of an initialisation). With ``share_frozen``, each
    model's frozen tensors equal to the first model's share its storage as soon as it is made
    (:mod:`._frozen`)."""
    shared: dict[Any, nn.Module] = {}
    models: list[nn.Module] = []
    settings = t.task.model_settings
    for i, s in enumerate(state.slots):
        config = (s or filler).config
        if i in built:
            models.append(built[i])
            continue
        same = (config["dropout"], *(repr(config.get(k)) for k in settings))
        model = shared.get(same)
        if model is None:
            with Phase("the task's model(config)"):
                model = t.task.build_model(config).to(t.dtype)
            shared[same] = model
        else:
            model = copy.deepcopy(model)
        if models and t.share_frozen:  # one backbone alive, not one per slot
            share_frozen_storage(model, models[0])
        models.append(model)
    return models


def _clip_values(state: ArrayState) -> Tensor | None:
    """Each slot's gradient clipping norm (inf for none), or ``None`` when no member clips."""
    values = [s.config["grad_clip"] if s else None for s in state.slots]
    if all(v is None for v in values):
        return None
    return torch.tensor([math.inf if v is None else float(v) for v in values], dtype=torch.float64)
