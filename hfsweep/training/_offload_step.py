"""Where an offloaded array's optimizer step runs (``ArrayTrainer(offload_step=...)``,
``fusion.offload_step``): :class:`_StepPlace`.

- ``host`` (the default): the fused optimizer steps the host tensors after the backward.
- ``device``: the engine steps each shard on the compute device right after its backward
  (:meth:`~hfsweep.offload.OffloadedArray.step_on_device`); the host never steps.
- ``auto``: the array's first training steps alternate the two, host first, one of each to
  warm up and then :data:`_MEASURED` of each timed (forward, loss, backward and optimizer step
  together: the device step runs inside the backward); the faster is kept
  (:func:`~hfsweep.offload.choose_step`), logged with both figures on ``hfsweep.trainer`` and
  kept for the trainer's later arrays of the same compatibility key and size. Every step is
  exact either way, so the measured steps are training steps, not extra work. Each step runs
  on its own step's cut (the device step's shards leave room for a shard's optimizer state;
  the host step's do not): the host steps are timed, and once chosen trained, exactly as
  ``host`` cuts them, the device steps as ``device`` does.

Clipping by a member's norm needs every shard's gradients before any shard steps: while a
member that clips trains, the array steps on the host, with a warning under ``device`` (a
sweep's refill may bring such a member in at any step: refusing it then would end the sweep)
and a log line under ``auto``. A step whose device update has begun cannot be replayed after
an out-of-memory error (:attr:`_StepPlace.replayable`): the trainer fails that array's members
instead of splitting it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from ..offload import OffloadedArray, OffloadError, choose_step
from ..optim import FusedOptimizer

__all__: list[str] = []

_log = logging.getLogger("hfsweep.trainer")

#: training steps of each kind ``auto`` times after the warm-up of each
_MEASURED = 2


class _StepPlace:
    """Where one live offloaded array's optimizer step runs, step by step.

    ``mode`` is the trainer's ``offload_step``; ``decided`` (``"host"`` or ``"device"``) an
    earlier array's ``auto`` choice for the same key and size, which this one keeps;
    ``record(choice)`` is called with ``auto``'s choice once made."""

    def __init__(
        self,
        mode: str,
        engine: OffloadedArray,
        opt: FusedOptimizer,
        decided: str | None = None,
        record: Callable[[str], None] | None = None,
    ) -> None:
        self.mode = mode
        self.engine = engine
        self.opt = opt
        self._decided = decided if mode == "auto" else mode
        self._record = record
        #: the seconds of each training step measured so far, by kind
        self._times: dict[str, list[float]] = {"host": [], "device": []}
        self._started = 0.0
        self._kind = "host"
        self._clipped = False

    def prepare(self) -> None:
        """At the array's build: cut the engine's shards for the device step where it may run
        (the engine keeps that cut and the host step's, each step taking its own: see
        :meth:`OffloadedArray.step_on_device`), or, where the engine cannot step on the device
        (a model streamed between its blocks, a budget that cannot hold its cut), refuse
        ``device`` and have ``auto`` step on the host. The engine is left on the cut of the
        step its first training step takes (the device step's under ``device`` or an earlier
        ``auto`` choice of it, else the host step's: what the build logs); :meth:`begin`
        sets each step's."""
        if self.mode == "host":
            return
        try:
            self.engine.step_on_device(self.opt)
        except OffloadError as exc:
            if self.mode == "device":
                raise
            _log.info("offload_step: auto steps on the host: %s", exc)
            self._decided = "host"
        self.engine.step_on_device(self.opt if self._decided == "device" else None)

    @property
    def replayable(self) -> bool:
        """Whether the step under way can be replayed from its start (after an out-of-memory
        error): not once the device step has updated a shard on the host."""
        return not (self.on_device and self.engine.shards_stepped > 0)

    @property
    def on_device(self) -> bool:
        """Whether the step now under way steps on the device (the host must not step)."""
        return self._kind == "device" and self.engine.steps_on_device

    def begin(self, clips: bool) -> None:
        """A training step starts; ``clips``: some member of the array clips its gradients."""
        kind = self._decided
        if not clips:  # auto measures again once no member clips
            self._clipped = False
        if clips and kind != "host":
            if not self._clipped:
                _log.log(
                    logging.WARNING if self.mode == "device" else logging.INFO,
                    "offload_step: %s steps on the host while a member clips its gradients "
                    "(grad_clip), which needs every shard's gradients before any shard steps",
                    self.mode,
                )
            self._clipped = True
            kind = "host"
        elif kind is None:  # auto, measuring: host, device, host, device, ...
            done = len(self._times["host"]) + len(self._times["device"])
            kind = "host" if done % 2 == 0 else "device"
        self._kind = kind
        self.engine.step_on_device(self.opt if kind == "device" else None)
        self._started = time.perf_counter()

    def end(self) -> None:
        """The training step (its optimizer step included) is done."""
        if self._decided is not None or self._clipped:
            return
        self._times[self._kind].append(time.perf_counter() - self._started)
        host, device = self._times["host"], self._times["device"]
        if len(host) == len(device) == _MEASURED + 1:  # the first of each is the warm-up
            mode, why = choose_step(min(host[1:]), min(device[1:]), _MEASURED)
            _log.info("%s", why)
            self._decided = mode
            if self._record is not None:
                self._record(mode)
