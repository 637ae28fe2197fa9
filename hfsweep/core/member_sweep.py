"""A sweep over a searcher that keeps no record hfsweep can read: members, arrays, asking,
packing, ends and saving, for a front door that drives the sweep core from outside (the Ray
Tune plugin is one).

``hfsweep run`` (:mod:`hfsweep.core.loop`) owns its Optuna study, so its trials' configs,
values and ends live there. A front door whose searcher is opaque (a Tune searcher:
``suggest(id)`` and ``on_trial_*`` calls, nothing to read back) gets the same sweep from
:class:`MemberSweep`, which adds only what such a searcher cannot hold: a
:class:`~hfsweep.core.members.MemberRecord` per member and an
:class:`~hfsweep.core.members.ArrayRecord` per array. Everything else is the core's, as for
``hfsweep run``:

- the pools, array sizes, the asking loop of a new array and of a refill (at most
  :data:`~hfsweep.core.packer.REFILL_ASKS` asks per refill) and the requeue of members an array
  never started are the :class:`~hfsweep.core.packer.Packer`'s;
- the decision log, how each member ended (once: :meth:`~hfsweep.core.ledger.Ledger.settle`,
  the rule ``hfsweep run`` ends its trials by) and each key's array size are the
  :class:`~hfsweep.core.ledger.Ledger`'s (:attr:`MemberSweep.ledger`), kept in memory and saved
  through :meth:`MemberSweep.state_dict` by the front door;
- turning an array's report into per-member decisions and ends, refill and the end of an
  array are :class:`~hfsweep.core.array_reports.ArrayReports`' (this class's base).

What differs from ``hfsweep run``, and why: the front door asks for one array at a time and
again later (Tune asks its searcher so), so an array smaller than its size starts only when
nothing more can be asked or nothing runs (``partial`` of
:meth:`~hfsweep.core.packer.Packer.next_array`), where the engine starts one as soon as the
searcher has no trial to give; and the front door's own scheduler decides (the ledger logs its
decisions, :meth:`~hfsweep.core.ledger.Ledger.log`).

A front door subclasses :class:`MemberSweep` and supplies, in its own API's terms: drawing one
member config (:meth:`MemberSweep._draw`), deciding on an array's fresh evaluations
(``_decide``, ``_at_budget``), telling its searcher of an evaluation and of an end (``_heard``,
``_told``) and the form its scheduler and searcher see an evaluation in (``_result``).

Member statuses are :class:`~hfsweep.core.status.Status`: ``WAITING`` (asked, waiting in its
key's pool), ``RUNNING`` (in an array), then ``COMPLETED``, ``STOPPED`` or ``FAILED`` (told to
the searcher; final).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import asdict
from typing import Any

from ..training.task import Task
from .array_reports import ArrayReports
from .ledger import Ledger
from .members import ArrayRecord, MemberRecord, agree, counts
from .packer import Packer, Pools
from .status import Status

__all__ = ["MemberSweep"]


class MemberSweep(ArrayReports):
    """Everything a driver knows about one sweep over an opaque searcher (see the module
    docstring).

    ``task`` checks configs and computes compatibility keys; ``members`` is the budget (how many
    member configs are asked in all); ``array_size`` is the array size for every key, or a
    callable ``config -> size`` asked once per key (the profiler); ``refill`` gives freed slots
    new members of the same key.
    """

    #: where the sweep's messages go (a front door names its own logger)
    log = logging.getLogger("hfsweep.sweep")

    def __init__(
        self,
        task: Task,
        *,
        members: int,
        array_size: int | Callable[[Mapping[str, Any]], int],
        refill: bool = True,
    ) -> None:
        self.task = task
        self.budget = members
        self.array_size = array_size
        self.refill = refill
        self.metric: str | None = None
        self.mode: str | None = None
        #: ``post(token, message)``: hands the answer to a report to its array's trainer
        self.post: Callable[[str, dict[str, Any]], None] | None = None
        self._reset()

    def _reset(self) -> None:
        self.members: dict[str, MemberRecord] = {}
        self.arrays: dict[str, ArrayRecord] = {}
        #: the decision log, the members' ends and the array sizes: the sweep core's ledger
        self.ledger = Ledger()
        #: the pools of waiting members (by id), the array size per key, and refill
        self.packer: Packer[str] = Packer(
            ask=self._ask, size=self._size, may_ask=self._can_ask, budget=self.budget
        )
        self.packer.sizes = self.ledger.sizes  # one dict: the packer sizes, the ledger saves
        self.counters: dict[str, int] = {}
        self.asked = 0
        #: the searcher said it has no member config to give, ever again
        self.inner_finished = False
        #: the budget is spent (or the searcher finished) and every member is told
        self.finished = False

    @property
    def decisions(self) -> dict[str, bool]:
        """The decision log (``"<member>@<step>"`` -> go on): the ledger's."""
        return self.ledger.decisions

    def configure(self, metric: str | None, mode: str | None) -> None:
        """Set the metric and mode (a ``None`` leaves the one set before)."""
        if metric:
            self.metric = metric
        if mode:
            if mode not in ("min", "max"):
                raise ValueError(f"mode must be 'min' or 'max', got {mode!r}")
            self.mode = mode

    # ------------------------------------------------------------------ the front door's part
    def _draw(self, member_id: str) -> Mapping[str, Any] | None:
        """One member config from the searcher, asked under ``member_id``; ``None`` when it
        has none now (and :attr:`inner_finished` set when it has none ever again)."""
        raise NotImplementedError

    # ------------------------------------------------------------------ asking and packing
    def start_array(self, array_id: str) -> ArrayRecord | None:
        """A new array ``array_id`` of members asked and packed by key; ``None`` when none
        can start now (and :attr:`finished` set when none ever will: the budget is spent and
        every member is told)."""
        if self.finished:
            return None
        self._require_metric()
        # an array smaller than its size when nothing more can come, or when nothing runs (the
        # searcher waits for results that only a running array can give)
        started = self.packer.next_array(
            array_id, partial=lambda: not self._can_ask() or not self._live_arrays()
        )
        if started is None:
            if not self._can_ask() and not self._live_arrays():
                self.finished = True
                self.log.info("all %d members asked and told: the search is finished", self.asked)
            return None
        key, taken = started
        array = ArrayRecord(id=array_id, key=key, size=self.packer.sizes[key], members=taken)
        self.arrays[array_id] = array
        for mid in taken:
            rec = self.members[mid]
            rec.array, rec.status = array_id, Status.RUNNING
        self.log.info("array %s: %d members (%s)", array_id, len(taken), ", ".join(taken))
        return array

    def _can_ask(self) -> bool:
        return self.asked < self.budget and not self.inner_finished

    def _new_id(self, prefix: str) -> str:
        n = self.counters.get(prefix, 0)
        while f"{prefix}-{n}" in self.members:
            n += 1
        self.counters[prefix] = n + 1
        return f"{prefix}-{n}"

    def _ask(self, prefix: str) -> list[tuple[str, str]] | None:
        """Ask the searcher for one member config (named after ``prefix``, the array it is
        asked for): ``[(key, member id)]`` for the packer to pool, empty if the task rejected
        it (it is told ``FAILED``), ``None`` when the searcher has none now or none ever
        again."""
        member_id = self._new_id(prefix)
        drawn = self._draw(member_id)
        if drawn is None:
            if self.inner_finished:
                self.log.info("the inner searcher is finished after %d members", self.asked)
            return None
        self.asked += 1
        rec = MemberRecord(id=member_id, config=dict(drawn), key="")
        self.members[member_id] = rec
        try:
            rec.key = self.task.compatibility_key(rec.config)
        except (ValueError, TypeError) as exc:
            self.log.warning("member %s failed before training: %s", member_id, exc)
            self._end(rec, Status.FAILED, None, error=f"{type(exc).__name__}: {exc}")
            return []
        return [(rec.key, member_id)]

    def _size(self, key: str, member_id: str) -> int:
        """The array size to ask for ``key``, whose first member is ``member_id``."""
        config = self.members[member_id].config
        return self.array_size(config) if callable(self.array_size) else self.array_size

    def _live_arrays(self) -> list[ArrayRecord]:
        return [a for a in self.arrays.values() if not a.done]

    # ------------------------------------------------------------------ persistence
    def state_dict(self) -> dict[str, Any]:
        """The members, arrays, pools, ledger and counts as plain data (statuses by value);
        the front door adds what it needs to find and check a saved state (its format)."""
        return {
            "metric": self.metric,
            "mode": self.mode,
            "budget": self.budget,
            "asked": self.asked,
            "inner_finished": self.inner_finished,
            "finished": self.finished,
            "members": {m: r.as_dict() for m, r in self.members.items()},
            "arrays": {a: asdict(r) for a, r in self.arrays.items()},
            "pools": self.packer.pools.as_dict(),
            "ledger": self.ledger.state_dict(),
            "counters": dict(self.counters),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict`'s output; the records and the ledger are brought to
        agree (:func:`~hfsweep.core.members.agree`)."""
        self._reset()
        self.configure(state.get("metric"), state.get("mode"))
        self.budget = int(state["budget"])
        self.asked = int(state["asked"])
        self.inner_finished = bool(state["inner_finished"])
        self.finished = bool(state["finished"])
        self.members = {m: MemberRecord.from_dict(r) for m, r in state["members"].items()}
        self.arrays = {a: ArrayRecord(**r) for a, r in state["arrays"].items()}
        self.packer.budget = self.budget
        self.packer.pools = Pools({str(k): [str(m) for m in v] for k, v in state["pools"].items()})
        self.ledger.load_state_dict(state["ledger"])  # its sizes: the packer's dict, in place
        agree(self.members.values(), self.ledger)
        self.counters = {k: int(v) for k, v in state["counters"].items()}

    # ------------------------------------------------------------------ summaries
    def counts(self) -> dict[Status, int]:
        """Members by status, every status listed (a :class:`Status` is equal to its value:
        ``counts()["stopped"]`` works too)."""
        return counts(self.members.values())
