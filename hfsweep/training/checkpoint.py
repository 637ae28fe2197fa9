"""The trainer's files: a member's state, a slot and a result as plain records, a run's
``array.pt`` (written and read back whole), the log of members whose ``on_finish`` was called,
the final states of members that ended, and the random generators' state; written atomically
and read back as plain data only (see ``packed``)."""

from __future__ import annotations

import base64
import os
import pickle
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import quote

import torch
from torch import Tensor

from .._io import atomic_save, read_lines
from .packed import UnsafeFileError
from .packed import load as load_packed
from .packed import loads as loads_plain
from .results import Member, MemberResult
from .spec import ArrayState, TrialSpec, _SlotState

if TYPE_CHECKING:
    from ..fusion import FusedArray
    from ..optim import FusedOptimizer
    from ..optim.lr_scheduler import FusedLRScheduler

#: the layout of ``array.pt``; a checkpoint of another version is refused, not misread
_CHECKPOINT_VERSION = 3


def _member_state(
    array: FusedArray,
    opt: FusedOptimizer,
    sched: FusedLRScheduler | None,
    i: int,
    shared: dict[str, Tensor] | None = None,
) -> dict[str, Any]:
    """Slot ``i``'s model, optimizer, schedule and dropout stream, on the CPU.

    ``shared`` collects the tensors every member holds as one (``array.shared_frozen``, a frozen
    backbone): the states of several members taken with the same dict hold the same tensor
    object there, which a checkpoint stores once (:func:`~hfsweep.training.packed.pack`) instead
    of once per member."""
    model = dict(array.member_state_dict(i, device="cpu"))
    if shared is not None:
        for name in array.shared_frozen:
            mine = model.get(name)
            if mine is None:
                continue
            one = shared.setdefault(name, mine)
            if one is not mine:  # every entry of this member tied to it, too
                model = {k: one if v is mine else v for k, v in model.items()}
    optimizer = _to_cpu(opt.member_state_dict(i))
    scheduler = sched.member_state_dict(i) if sched is not None else None
    return {
        "model": model,
        "optimizer": optimizer,
        "scheduler": scheduler,
        "rng": array.rng_state(i),
    }


def _to_cpu(obj: Any) -> Any:
    if isinstance(obj, Tensor):
        return obj.detach().cpu()
    if isinstance(obj, dict):
        return {k: _to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return type(obj)(_to_cpu(v) for v in obj)
    return obj


def _slot_dict(s: _SlotState | None) -> dict[str, Any] | None:
    if s is None:
        return None
    return {
        "id": s.member.id,
        "config": dict(s.member.config),
        "resolved": s.config,
        "budget": s.budget,
        "steps": s.steps,
        "history": s.history,
        "since": s.since,
        "loss_sum": s.loss_sum,
        "saved": s.saved,
        "start": s.spec.start,
    }


def _slot_from_dict(d: dict[str, Any] | None) -> _SlotState | None:
    if d is None:
        return None
    spec = TrialSpec(
        member=Member(d["id"], d["config"]),
        config=d["resolved"],
        budget=d["budget"],
        start=d.get("start"),  # None: a checkpoint written before it was recorded
    )
    return _SlotState(
        spec=spec,
        steps=d["steps"],
        history=d["history"],
        since=d["since"],
        loss_sum=d["loss_sum"],
        saved=d["saved"],
    )


def _checked(path: Path, payload: Mapping[str, Any], settings: Mapping[str, Any]) -> None:
    """Refuse a checkpoint of another layout version, or one written with other settings than
    ``settings`` (what must not change between a run and its resume)."""
    if payload.get("version") != _CHECKPOINT_VERSION:
        raise CheckpointVersionError(
            f"{path}: checkpoint version {payload.get('version')!r} is not "
            f"{_CHECKPOINT_VERSION}; it was written by another hfsweep version"
        )
    saved = payload.get("settings", {})
    for name, value in settings.items():
        if saved.get(name) != value:
            raise ValueError(
                f"{path}: the checkpoint was written with {name}={saved.get(name)!r}, this "
                f"trainer has {name}={value!r}; resume with the same task and settings, or "
                "use another checkpoint_dir"
            )


class DamagedCheckpointError(ValueError):
    """An array's ``array.pt`` that cannot be read back as the trainer wrote it: cut short,
    emptied, overwritten with other bytes (a pickle the safe loader cannot read), or a torch
    file that is not this array's checkpoint (other keys, another compatibility key, states that do not fit
    its models). ``path`` is the file, ``reason`` what is wrong with it. A sweep sets such a
    file aside (:func:`set_aside`) and trains the array's members again instead of stopping."""

    def __init__(self, path: str | os.PathLike[str], reason: str) -> None:
        super().__init__(f"{os.fspath(path)} is damaged: {reason}")
        self.path = Path(path)
        self.reason = reason

    def __reduce__(self) -> tuple[Any, ...]:  # a Ray worker's error reaches the driver whole
        return (type(self), (self.path, self.reason))


class CheckpointVersionError(ValueError):
    """A checkpoint of another layout version than this hfsweep writes: refused, not misread
    (nor taken for a damaged one)."""


class SavedStateError(ValueError):
    """A member's saved state (model, optimizer, schedule or dropout stream) that does not fit
    the array it is loaded into: of other shapes or keys than the member's model has. From a
    checkpoint read back from disk, the trainer makes it a :class:`DamagedCheckpointError`."""


def read_payload(path: Path, key: str | None = None) -> dict[str, Any]:
    """The contents of the array checkpoint ``path`` (see :func:`_run_payload`), checked to be
    whole: every field of the layout this version writes, of the right type. With ``key``, the
    checkpoint must be of that compatibility key (an array's own). Raises
    :class:`DamagedCheckpointError` for a file that is not; :class:`CheckpointVersionError` for
    one of another layout version; an error opening it (a permission denied), and the safe
    loader's refusal of a file that names a type it does not build
    (:class:`~hfsweep.training.packed.UnsafeFileError`), pass through."""
    with open(path, "rb") as f:  # a file that cannot be opened at all is not a damaged one
        if not f.read(1):
            raise DamagedCheckpointError(path, "it is empty (0 bytes)")
    try:
        payload = load_packed(path)
    except PermissionError:
        raise
    except Exception as exc:  # a cut or overwritten file fails in one of many ways
        if isinstance(exc, UnsafeFileError):
            if exc.needs is not None:  # a type the file names: planted, or the user's own
                raise
            why = str(exc).removeprefix(f"{path}: not loaded: ")
        else:
            lines = str(exc).strip().splitlines()
            why = f"{type(exc).__name__}: {lines[0].split('. ')[0] if lines else '-'}"
        raise DamagedCheckpointError(path, f"it cannot be loaded ({why[:300]})") from None
    if isinstance(payload, Mapping) and payload.get("version", _CHECKPOINT_VERSION) != (
        _CHECKPOINT_VERSION
    ):
        raise CheckpointVersionError(
            f"{path}: checkpoint version {payload.get('version')!r} is not "
            f"{_CHECKPOINT_VERSION}; it was written by another hfsweep version"
        )
    problem = _layout_problem(payload)
    if problem is not None:
        raise DamagedCheckpointError(path, problem)
    if key is not None and payload["key"] is not None and payload["key"] != key:
        raise DamagedCheckpointError(
            path, f"it holds an array of {payload['key']}, not of this array's {key}"
        )
    return dict(payload)


def _layout_problem(payload: Any) -> str | None:
    """What in ``payload`` is not the layout of an ``array.pt`` of this version, or ``None``."""
    if not isinstance(payload, Mapping):
        return f"it holds a {type(payload).__name__}, not an array checkpoint"
    fields = ("version", "settings", "key", "order", "undelivered", "arrays")
    missing = [k for k in fields if k not in payload]
    if missing:
        return f"it lacks {', '.join(missing)}: it is not an array checkpoint"
    order = payload["order"]
    if not isinstance(order, list) or not all(isinstance(i, str) for i in order):
        return "its member order is not a list of ids"
    if not isinstance(payload["settings"], Mapping) or not isinstance(
        payload["undelivered"], Mapping
    ):
        return "its settings or undelivered results are not mappings"
    for member, record in payload["undelivered"].items():
        if not isinstance(record, Mapping) or not record.keys() >= _RESULT_FIELDS:
            return f"the result of {member!r} lacks fields"
    if not isinstance(payload["arrays"], list):
        return "its arrays are not a list"
    for array in payload["arrays"]:
        if not isinstance(array, Mapping) or not {"epoch", "batch", "slots"} <= array.keys():
            return "an array lacks its data position or slots"
        if not isinstance(array["slots"], list):
            return "an array's slots are not a list"
        for slot in array["slots"]:
            problem = _slot_problem(slot, set(order))
            if problem is not None:
                return problem
    return None


#: the fields of a result record and of a slot record (see _result_record, _slot_dict)
_RESULT_FIELDS = {"id", "config", "status", "steps", "history", "error", "state"}
_SLOT_FIELDS = {"id", "config", "resolved", "budget", "steps", "history", "since", "loss_sum"}


def _slot_problem(slot: Any, order: set[str]) -> str | None:
    if slot is None:
        return None
    if not isinstance(slot, Mapping) or not _SLOT_FIELDS | {"saved"} <= slot.keys():
        return "a slot lacks fields"
    if slot["id"] not in order:
        return f"slot {slot['id']!r} is not in its member order"
    saved = slot["saved"]
    if saved is None:
        return None
    if not isinstance(saved, Mapping) or not {"model", "optimizer", "rng"} <= saved.keys():
        return f"the saved state of {slot['id']!r} lacks its model, optimizer or rng"
    model = saved["model"]
    if not isinstance(model, Mapping) or not all(
        isinstance(k, str) and isinstance(v, Tensor) for k, v in model.items()
    ):
        return f"the saved model of {slot['id']!r} is not a state_dict of tensors"
    return None


def set_aside(path: Path, name: Path | None = None) -> Path:
    """Move the damaged file ``path`` out of the way, to ``<name>.damaged-<UTC time>`` (``name``
    defaults to ``path`` itself); returns where it went. Kept for a look, never read again."""
    stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%S.%fZ")
    target = Path(f"{name if name is not None else path}.damaged-{stamp}")
    target.parent.mkdir(parents=True, exist_ok=True)
    os.replace(path, target)
    return target


#: ``ArrayTrainer(final_states=)``: whose final state a result carries
_FINAL_STATES = ("all", "completed", "none")
#: one line per member whose on_finish was called: its result without the state
_DELIVERED = "delivered.log"


def _result_record(result: MemberResult) -> dict[str, Any]:
    """``result`` without its state."""
    return {
        "id": result.id,
        "config": result.config,
        "status": result.status,
        "steps": result.steps,
        "history": result.history,
        "error": result.error,
        "start_step": result.start_step,
    }


def _result_from_record(record: Mapping[str, Any], state: dict[str, Any] | None) -> MemberResult:
    return MemberResult(
        record["id"],
        record["config"],
        record["status"],
        record["steps"],
        record["history"],
        state,
        record["error"],
        record.get("start_step"),
    )


def _encode_record(record: dict[str, Any]) -> str:
    """One line: the record pickled (configs may hold any Python value), in base64."""
    return base64.b64encode(pickle.dumps(record, protocol=pickle.HIGHEST_PROTOCOL)).decode()


def _read_delivered(path: Path) -> list[dict[str, Any]]:
    """The records of the delivered log; a line a crash cut short is skipped (its member was
    not recorded as delivered, so it is delivered again)."""
    records = []
    for line in read_lines(path):
        try:
            record = loads_plain(base64.b64decode(line, validate=True), path)
        except UnsafeFileError:
            raise
        except Exception:  # a cut line fails in one of several ways
            continue
        if isinstance(record, dict) and "id" in record:
            records.append(record)
    return records


def _run_payload(
    settings: Mapping[str, Any],
    key: str | None,
    order: Sequence[str],
    undelivered: Sequence[MemberResult],
    arrays: Sequence[tuple[ArrayState, Sequence[_SlotState | None]]],
) -> dict[str, Any]:
    """The contents of ``array.pt``: a run's ``settings``, compatibility ``key`` and member
    ``order``, the results of members that ended but whose ``on_finish`` was not called yet (a
    resume calls it, with the state), and each queued array's data position with its slots
    (``arrays``: the array and its slots' current states)."""
    return {
        "version": _CHECKPOINT_VERSION,
        "settings": dict(settings),
        "key": key,
        "order": list(order),
        "undelivered": {r.id: {**_result_record(r), "state": r.state} for r in undelivered},
        "arrays": [
            {"epoch": a.epoch, "batch": a.batch, "slots": [_slot_dict(s) for s in slots]}
            for a, slots in arrays
        ],
    }


@dataclass
class _SavedRun:
    """A run as :func:`_read_run` reads it back from its checkpoint directory."""

    key: str | None
    order: list[str]
    results: dict[str, MemberResult]  #: every member that ended, by id
    delivered: set[str]  #: those whose ``on_finish`` was called
    pending: list[str]  #: those whose ``on_finish`` is still to be called
    queue: list[ArrayState]


def _read_run(
    path: Path, settings: Mapping[str, Any], directory: Path, keep_states: bool
) -> _SavedRun:
    """The run saved in ``path`` (``array.pt`` in ``directory``), refused if it was written with
    other ``settings``; with ``keep_states``, delivered members' results carry their saved final
    states."""
    payload = read_payload(path)
    _checked(path, payload, settings)
    results: dict[str, MemberResult] = {}
    delivered: set[str] = set()
    for record in _read_delivered(directory / _DELIVERED):
        member_id = record["id"]
        state = _read_member_state(directory, member_id) if keep_states else None
        results[member_id] = _result_from_record(record, state)
        delivered.add(member_id)
    pending = []
    for member_id, record in payload["undelivered"].items():
        if member_id not in delivered:
            results[member_id] = _result_from_record(record, record["state"])
            pending.append(member_id)
    queue = [
        ArrayState([_slot_from_dict(d) for d in a["slots"]], a["epoch"], a["batch"])
        for a in payload["arrays"]
    ]
    return _SavedRun(payload["key"], list(payload["order"]), results, delivered, pending, queue)


def _write_member(directory: Path, result: MemberResult, state: dict[str, Any]) -> None:
    """The final state of a member that ended, for a resume to give back (``keep_states``)."""
    atomic_save(dict(state), directory / "members" / f"{_safe(result.id)}.pt")


def _read_member_state(directory: Path, member_id: str) -> dict[str, Any] | None:
    """The saved final state of a member, ``None`` if it ended without one (``final_states``)."""
    path = directory / "members" / f"{_safe(member_id)}.pt"
    if not path.exists():
        return None
    return dict(load_packed(path))


def _safe(member_id: str) -> str:
    """A file name for ``member_id``, one-to-one (percent-encoding)."""
    return quote(member_id, safe="-_.") or "%"


def _rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["cpu"])
    if "cuda" in state:
        torch.cuda.set_rng_state_all(state["cuda"])
