"""``hs.Task``: a training task described once, from which hfsweep trains any trial's config.

A trial's config is a flat mapping of names to values. hfsweep knows which names it can vary
*inside* one fused array (the per-member keys: optimizer and schedule hyperparameters, dropout,
label smoothing, gradient clipping, seed, budget) and treats every other name as part of the
*compatibility key*: the values that build the model or the data, which all members of one array
share. ``Task.defaults`` doubles as the task's schema: a config may only use hfsweep's own keys,
the task's defaults and the task's extra per-member keys, so a typo is an error, not a silently
ignored value.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import json
import logging
import math
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from hfsweep._checks import in_range, is_finite, is_int

from .. import optim as hs_optim
from ..optim import lr_scheduler as hs_sched

__all__ = [
    "BASE_DEFAULTS",
    "LORA_PER_MEMBER_KEYS",
    "OPTIMIZERS",
    "PER_MEMBER_KEYS",
    "SCHEDULES",
    "Task",
    "TaskError",
    "fork_rng",
    "manual_seed",
]

_log = logging.getLogger("hfsweep.task")

Config = Mapping[str, Any]
#: ``loss(outputs [B, N, ...], target) -> [B]``: each member's mean loss over the batch
LossFn = Callable[[Tensor, Tensor], Tensor]
#: ``metric(outputs [B, N, ...], target) -> [B]``: each member's mean over the batch
MetricFn = Callable[[Tensor, Tensor], Tensor]


class TaskError(ValueError):
    """A task or a trial config is not valid; the message names the key, the value and what
    would be valid."""


#: optimizer name -> (hs.optim class, the per-member config keys that feed it)
OPTIMIZERS: dict[str, tuple[type[hs_optim.FusedOptimizer], tuple[str, ...]]] = {
    "sgd": (hs_optim.SGD, ("lr", "momentum", "dampening", "weight_decay")),
    "adam": (hs_optim.Adam, ("lr", "beta1", "beta2", "eps", "weight_decay")),
    "adamw": (hs_optim.AdamW, ("lr", "beta1", "beta2", "eps", "weight_decay")),
    "rmsprop": (hs_optim.RMSprop, ("lr", "alpha", "eps", "weight_decay", "momentum")),
    "adagrad": (hs_optim.Adagrad, ("lr", "lr_decay", "weight_decay", "eps")),
}

#: schedule name -> the per-member config keys it reads (it steps once per optimizer step)
SCHEDULES: dict[str, tuple[str, ...]] = {
    "constant": (),
    "cosine": ("eta_min",),
    "step": ("step_size", "gamma"),
    "exponential": ("gamma",),
}

#: hfsweep's own config keys and their defaults; a task's ``defaults`` may override them
BASE_DEFAULTS: dict[str, Any] = {
    "optimizer": "sgd",
    "lr": 0.01,
    "lr_schedule": "constant",
    "seed": 0,
    "data_seed": 0,
    "dropout": None,
    "label_smoothing": 0.0,
    "grad_clip": None,
    "epochs": 1,
    "max_steps": None,
}

#: default arguments of each schedule
_SCHEDULE_DEFAULTS: dict[str, dict[str, Any]] = {
    "constant": {},
    "cosine": {"eta_min": 0.0},
    "step": {"step_size": 1, "gamma": 0.1},
    "exponential": {"gamma": 0.9},
}
#: valid ranges of the numeric per-member keys: (low, high, low open, high open)
_RANGES: dict[str, tuple[float, float, bool, bool]] = {
    "lr": (0.0, math.inf, False, True),
    "momentum": (0.0, math.inf, False, True),
    "dampening": (0.0, math.inf, False, True),
    "weight_decay": (0.0, math.inf, False, True),
    "beta1": (0.0, 1.0, False, True),
    "beta2": (0.0, 1.0, False, True),
    "eps": (0.0, math.inf, False, True),
    "alpha": (0.0, math.inf, False, True),
    "lr_decay": (0.0, math.inf, False, True),
    "eta_min": (0.0, math.inf, False, True),
    "gamma": (0.0, 1.0, True, False),
    "label_smoothing": (0.0, 1.0, False, False),
    "dropout": (0.0, 1.0, False, False),
    "grad_clip": (0.0, math.inf, True, True),
}

_OPTIMIZER_KEYS = sorted({k for _, keys in OPTIMIZERS.values() for k in keys})
_SCHEDULE_KEYS = sorted({k for keys in SCHEDULES.values() for k in keys})
_OPTIMIZER_KEY_SET = frozenset(_OPTIMIZER_KEYS)
_SCHEDULE_KEY_SET = frozenset(_SCHEDULE_KEYS)
#: keys that may differ between the members of one array
PER_MEMBER_KEYS: frozenset[str] = frozenset(
    [
        *_OPTIMIZER_KEYS,
        *_SCHEDULE_KEYS,
        "seed",
        "dropout",
        "label_smoothing",
        "grad_clip",
        "epochs",
        "max_steps",
    ]
)
#: peft LoRA settings that may differ inside one array (the fused array keeps each member's
#: ``lora_alpha`` scale and ``lora_dropout`` probability, see ``hfsweep.fusion._peft``): per
#: member when a task's ``defaults`` name them, so a LoRA sweep over them packs into one array
#: while the rank, the target modules and the rest of the adapter stay in the compatibility key
LORA_PER_MEMBER_KEYS: frozenset[str] = frozenset({"lora_alpha", "lora_dropout"})
#: valid ranges of the LoRA keys (as :data:`_RANGES`), checked when a config has them
_LORA_RANGES: dict[str, tuple[float, float, bool, bool]] = {
    "lora_alpha": (0.0, math.inf, True, True),
    "lora_dropout": (0.0, 1.0, False, True),
}
_LOSSES = ("cross_entropy", "sequence_cross_entropy", "mse")
_METRICS = ("accuracy",)


@dataclass(frozen=True)
class Task:
    """How to train one trial from its config.

    ``model(config)`` builds a fresh ``nn.Module`` (hfsweep seeds torch with ``config["seed"]``
    first, so the initialisation is the trial's own). ``data(config)`` returns ``(train, val)``,
    two re-iterable collections of ``(input, target)`` batches; ``batch_size`` and anything else
    that shapes them are ordinary config keys and therefore part of the compatibility key. The
    data must not depend on per-member keys: hfsweep checks what ``data`` reads. The trainer
    seeds torch's global generator with ``(data_seed, epoch)`` before each epoch, so a shuffling
    ``DataLoader`` replays the same order after a resume.

    ``loss`` is ``"cross_entropy"`` (class indices, classes in dimension 1 of the model's output
    as for ``F.cross_entropy``; honours the per-member ``label_smoothing``),
    ``"sequence_cross_entropy"`` (classes in the last dimension, as a language model's
    ``[N, T, vocab]``), ``"mse"``, or
    a callable ``(outputs [B, N, ...], target) -> [B]``. ``metrics`` are computed on the
    validation data next to its loss: names from ``("accuracy",)`` or ``{name: callable}`` with
    the loss's signature (a per-member batch mean); by default accuracy for the cross-entropy
    losses and nothing else for the others. ``defaults`` lists every config key the task
    understands beyond hfsweep's own (:data:`BASE_DEFAULTS`) with its default value, and may
    override hfsweep's defaults (a default hyperparameter applies to whichever optimizer or
    schedule takes it; the others ignore it). ``per_member`` names extra keys that may differ inside one
    array because they only change the initial values of the model (e.g. an init scale), or
    settings the fused array keeps per member. ``lora_alpha`` and ``lora_dropout``
    (:data:`LORA_PER_MEMBER_KEYS`, for a model wrapped with peft's LoRA) are per member whenever
    ``defaults`` names them.
    ``steps_per_epoch`` is needed only when the training data has no ``len()``.
    """

    model: Callable[[Config], nn.Module]
    data: Callable[[Config], tuple[Iterable[Any], Iterable[Any]]]
    loss: str | LossFn = "cross_entropy"
    metrics: Sequence[str] | Mapping[str, MetricFn] | None = None
    defaults: Mapping[str, Any] = field(default_factory=dict)
    per_member: Sequence[str] = ()
    name: str = "task"
    steps_per_epoch: int | None = None

    def __post_init__(self) -> None:
        if not callable(self.model) or not callable(self.data):
            raise TaskError(f"task {self.name!r}: model and data must be callables of the config")
        if isinstance(self.loss, str) and self.loss not in _LOSSES:
            raise TaskError(
                f"task {self.name!r}: loss {self.loss!r} is not one of {list(_LOSSES)} or a callable"
            )
        if isinstance(self.metrics, str) or isinstance(self.per_member, str):
            raise TaskError(
                f"task {self.name!r}: metrics and per_member take a list of names, not a string"
            )
        shared = sorted({"optimizer", "lr_schedule", "data_seed"} & set(self.per_member))
        if shared:
            raise TaskError(
                f"task {self.name!r}: per_member may not name {shared[0]!r}: it changes the "
                "optimizer, the schedule or the data, which all members of an array share"
            )
        if self.metrics is None:
            classes = self.loss in ("cross_entropy", "sequence_cross_entropy")
            object.__setattr__(self, "metrics", ("accuracy",) if classes else ())
        if not isinstance(self.metrics, Mapping):
            assert self.metrics is not None
            for m in self.metrics:
                if m not in _METRICS:
                    raise TaskError(
                        f"task {self.name!r}: metric {m!r} is not one of {list(_METRICS)}; pass "
                        "{name: callable} for your own"
                    )
        if self.steps_per_epoch is not None and self.steps_per_epoch < 1:
            raise TaskError(
                f"task {self.name!r}: steps_per_epoch must be >= 1, got {self.steps_per_epoch}"
            )

    # ------------------------------------------------------------------ configs
    @functools.cached_property
    def per_member_keys(self) -> frozenset[str]:
        """Config keys that may differ between the members of one array: hfsweep's own, the
        LoRA settings the task's ``defaults`` name, and the task's ``per_member``. Built once
        (the task is frozen): it is asked for each key of each config split."""
        lora = LORA_PER_MEMBER_KEYS.intersection(self.defaults)
        return PER_MEMBER_KEYS | lora | frozenset(self.per_member)

    @property
    def model_settings(self) -> tuple[str, ...]:
        """Per-member keys that ``model(config)`` reads and the array takes from each member's
        model, beyond hfsweep's own (``lora_alpha``, ``lora_dropout``, the task's
        ``per_member``): members that differ in them need models built from their own
        configs."""
        return tuple(sorted(self.per_member_keys - PER_MEMBER_KEYS))

    @property
    def metric_names(self) -> list[str]:
        """Names of the values each evaluation reports."""
        names = self.metrics.keys() if isinstance(self.metrics, Mapping) else self.metrics or ()
        return ["train_loss", "val_loss", *(f"val_{n}" for n in names)]

    @property
    def known_keys(self) -> list[str]:
        """Every config key this task understands, sorted: hfsweep's own, every optimizer's
        and schedule's hyperparameters, the task's defaults and its extra per-member keys."""
        return list(self._known_sorted)

    @functools.cached_property
    def _known_sorted(self) -> tuple[str, ...]:
        # sorted once per task: checking each key of a large space against a fresh sort made
        # the check quadratic in the number of keys
        return tuple(sorted(self._known_set))

    @functools.cached_property
    def _known_set(self) -> frozenset[str]:
        """:attr:`known_keys` as a set, built once (the task is frozen)."""
        return frozenset(
            {*BASE_DEFAULTS, *self.defaults, *self.per_member, *_OPTIMIZER_KEYS, *_SCHEDULE_KEYS}
        )

    def knows(self, key: object) -> bool:
        """Whether ``key`` is one of :attr:`known_keys` (in constant time)."""
        try:
            return key in self._known_set
        except TypeError:  # an unhashable key is no config key
            return False

    def resolve(self, config: Config) -> dict[str, Any]:
        """``config`` completed with the defaults and checked: unknown keys, bad optimizer or
        schedule names, keys the chosen optimizer does not take, out-of-range values."""
        known = {**BASE_DEFAULTS, **self.defaults}
        unknown = [key for key in config if not self.knows(key)]
        if unknown:
            first = min(unknown, key=str)
            raise TaskError(
                f"config key {first!r} is not known to task {self.name!r}; known keys are "
                f"{self.known_keys}"
            )
        name = {**known, **config}["optimizer"]
        if name not in OPTIMIZERS:
            raise TaskError(f"config optimizer={name!r} is not one of {sorted(OPTIMIZERS)}")
        takes = OPTIMIZERS[name][1]
        _check_taken(config, _OPTIMIZER_KEYS, takes, f"a hyperparameter of optimizer {name!r}")
        schedule = {**known, **config}["lr_schedule"]
        if schedule not in SCHEDULES:
            raise TaskError(f"config lr_schedule={schedule!r} is not one of {sorted(SCHEDULES)}")
        uses = SCHEDULES[schedule]
        _check_taken(config, _SCHEDULE_KEYS, uses, f"an argument of lr_schedule {schedule!r}")
        # defaults of hyperparameters the chosen optimizer or schedule does not take are dropped,
        # so that resolving a resolved config gives it back unchanged
        out = {**optimizer_defaults(name), **_SCHEDULE_DEFAULTS[schedule], **known, **config}
        out = {
            k: v
            for k, v in out.items()
            if (k not in _OPTIMIZER_KEY_SET or k in takes)
            and (k not in _SCHEDULE_KEY_SET or k in uses)
        }
        for key, (low, high, low_open, high_open) in _RANGES.items():
            if (
                key in out
                and (key != "dropout" or out[key] is not None)
                and (key != "grad_clip" or out[key] is not None)
            ):
                _check_number(out, key, low=low, high=high, strict=low_open, high_open=high_open)
        for key, (low, high, low_open, high_open) in _LORA_RANGES.items():
            if key in out and key in self.per_member_keys:
                _check_number(out, key, low=low, high=high, strict=low_open, high_open=high_open)
        for key, low in (("seed", 0), ("data_seed", 0), ("step_size", 1)):
            if key in out:
                _check_int(out, key, low=low)
        if out["max_steps"] is None:
            _check_int(out, "epochs", low=1)
        else:
            _check_int(out, "max_steps", low=1)
        if out["label_smoothing"] and self.loss not in ("cross_entropy", "sequence_cross_entropy"):
            raise TaskError(
                f"config label_smoothing={out['label_smoothing']!r}: task {self.name!r} has loss "
                f"{getattr(self.loss, '__name__', self.loss)!r}; label smoothing needs "
                "'cross_entropy' or 'sequence_cross_entropy'"
            )
        return out

    def compatibility_key(self, config: Config) -> str:
        """The values that must be equal for two trials to share an array, as canonical JSON."""
        resolved = self.resolve(config)
        per_member = self.per_member_keys
        shared = {k: v for k, v in resolved.items() if k not in per_member}
        return json.dumps(shared, sort_keys=True, default=repr)

    def split(self, config: Config) -> tuple[dict[str, Any], str]:
        """``(per-member values, compatibility key)`` of ``config``."""
        resolved = self.resolve(config)
        per_member = self.per_member_keys
        member = {k: v for k, v in resolved.items() if k in per_member}
        return member, self.compatibility_key(resolved)

    # ------------------------------------------------------------------ building
    def build_model(self, config: Config) -> nn.Module:
        """A fresh model for ``config``, initialised from torch seeded with ``config["seed"]``
        (the global generator is left as it was)."""
        with fork_rng():
            manual_seed(int(config["seed"]))
            model = self.model(config)
        if not isinstance(model, nn.Module):
            raise TaskError(
                f"task {self.name!r}: model(config) returned {type(model).__name__}, not an "
                "nn.Module"
            )
        return model

    def build_data(self, config: Config) -> tuple[Iterable[Any], Iterable[Any]]:
        """``(train, val)`` for ``config``; refuses data that reads per-member keys."""
        recorder = _Recorder(config)
        with fork_rng():
            manual_seed(int(config["data_seed"]))
            data = self.data(recorder)
        read = sorted(recorder.read & self.per_member_keys)
        if read and recorder.read >= set(config):
            _log.warning(
                "task %r: data(config) read every config key (a copy of the config?), so hfsweep "
                "cannot check that the data ignores per-member keys",
                self.name,
            )
        elif read:
            raise TaskError(
                f"task {self.name!r}: data(config) read {read[0]!r}, a per-member key that may "
                "differ inside one array; the data may depend only on shared keys (batch_size, "
                "data_seed, ...)"
            )
        if not (isinstance(data, tuple | list) and len(data) == 2):
            raise TaskError(
                f"task {self.name!r}: data(config) must return (train, val), got "
                f"{type(data).__name__}"
            )
        return data[0], data[1]

    def member_loss(self, outputs: Tensor, target: Tensor, smoothing: Tensor | None) -> Tensor:
        """Each member's training loss ``[B]``; ``smoothing`` is the ``[B]`` label smoothing."""
        if callable(self.loss):
            return self._per_member(self.loss(outputs, target), outputs, "loss")
        if self.loss == "mse":
            if outputs.shape[1:] != target.shape:
                raise TaskError(
                    f"task {self.name!r}: loss 'mse' needs a target shaped like one member's "
                    f"output {tuple(outputs.shape[1:])}, got {tuple(target.shape)}"
                )
            diff = (outputs - target.to(outputs.dtype)).square()
            return diff.reshape(diff.shape[0], -1).mean(1)
        if not isinstance(target, Tensor) or target.is_floating_point() or target.is_complex():
            got = str(target.dtype) if isinstance(target, Tensor) else type(target).__name__
            raise TaskError(
                f"task {self.name!r}: loss {self.loss!r} takes class indices (an integer "
                f"tensor) as targets; the data's targets are {got} (class probabilities or "
                "regression targets need loss 'mse' or a loss of your own)"
            )
        logits, labels = self._class_layout(outputs, target)
        return _cross_entropy(logits, labels, smoothing)

    def member_metrics(self, outputs: Tensor, target: Tensor) -> dict[str, Tensor]:
        """Each member's validation loss and metrics on one batch, ``{name: [B]}``."""
        values = {"val_loss": self.member_loss(outputs, target, None)}
        if isinstance(self.metrics, Mapping):
            for name, fn in self.metrics.items():
                values[f"val_{name}"] = self._per_member(fn(outputs, target), outputs, name)
        elif self.metrics:
            logits, labels = self._class_layout(outputs, target)
            for name in self.metrics:
                values[f"val_{name}"] = _accuracy(logits, labels)
        return values

    def _per_member(self, value: object, outputs: Tensor, name: str) -> Tensor:
        """``value``, the ``[B]`` result of the task's own loss or metric ``name``, or a
        :class:`TaskError` saying what it returned instead: a value of another shape would
        broadcast silently (a scalar gives every member the same number)."""
        size = outputs.shape[0]
        if not isinstance(value, Tensor) or value.shape != (size,):
            got = (
                f"a tensor of shape {tuple(value.shape)}"
                if isinstance(value, Tensor)
                else type(value).__name__
            )
            what = "loss" if name == "loss" else f"metric {name!r}"
            raise TaskError(
                f"task {self.name!r}: its {what} returned {got}; it must return one value per "
                f"member, a tensor of shape ({size},) for an array of {size} (outputs are "
                f"{tuple(outputs.shape)}: members first, then one member's output)"
            )
        return value

    def _class_layout(self, outputs: Tensor, target: Tensor) -> tuple[Tensor, Tensor]:
        """``([B, M, C] logits, [M] labels)``: classes in dimension 1 of a model's output for
        ``cross_entropy`` (torch's convention), in the last dimension for
        ``sequence_cross_entropy`` (a language model's ``[N, T, vocab]``)."""
        if self.loss == "cross_entropy" and outputs.dim() > 3:
            outputs = outputs.movedim(2, -1)
        return outputs.reshape(outputs.shape[0], -1, outputs.shape[-1]), target.reshape(-1)


def fork_rng() -> contextlib.AbstractContextManager[None]:
    """``torch.random.fork_rng`` over the CPU and every CUDA device in use: ``manual_seed``
    reseeds all of them, so all of them are restored."""
    cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
    devices = list(range(torch.cuda.device_count())) if cuda else []
    return torch.random.fork_rng(devices=devices)


def manual_seed(seed: int) -> None:
    """``torch.manual_seed(seed)``, minus its cost on a machine with no accelerator.

    There, ``torch.manual_seed`` still queues a lazy seeding call for CUDA, XPU and MTIA, each
    capturing the caller's stack (about 0.25 ms a call; a sweep seeds once per model built and
    per epoch). With no accelerator those generators can never be used, so seeding the CPU
    generator alone draws the same numbers.
    """
    if torch.accelerator.is_available():
        torch.manual_seed(seed)
    else:
        torch.random.default_generator.manual_seed(seed)


# ---------------------------------------------------------------------- optimizers, schedules
def optimizer_defaults(name: str) -> dict[str, float]:
    """The default value of each per-member hyperparameter of optimizer ``name``."""
    return dict(_optimizer_defaults(name))


@functools.cache
def _optimizer_defaults(name: str) -> tuple[tuple[str, float], ...]:
    # read from the signature once per optimizer: every config a sweep resolves needs them,
    # and inspect.signature was a large part of resolving one
    cls, keys = OPTIMIZERS[name]
    params = inspect.signature(cls.__init__).parameters
    values: list[tuple[str, float]] = []
    for key in keys:
        if key in ("beta1", "beta2"):
            values.append((key, float(params["betas"].default[key == "beta2"])))
        else:
            values.append((key, float(params[key].default)))
    return tuple(values)


def make_optimizer(array: nn.Module, configs: Sequence[Config]) -> hs_optim.FusedOptimizer:
    """The hs.optim optimizer of ``configs[0]["optimizer"]`` with one value per member (resolved
    configs, which hold every hyperparameter of the optimizer)."""
    cls, keys = OPTIMIZERS[configs[0]["optimizer"]]
    kwargs: dict[str, Any] = {k: [float(c[k]) for c in configs] for k in keys}
    if "beta1" in kwargs:
        kwargs["betas"] = (kwargs.pop("beta1"), kwargs.pop("beta2"))
    # the trained parameters only: frozen ones get no state, and those every member shares are
    # not parameters of the array (so a member's optimizer state is indexed the same either way)
    return cls([p for p in array.parameters() if p.requires_grad], **kwargs)


def optimizer_values(config: Config) -> dict[str, float]:
    """Member hyperparameters of a resolved config under hs.optim's names."""
    _, keys = OPTIMIZERS[config["optimizer"]]
    return {k: float(config[k]) for k in keys}


def make_schedule(
    optimizer: hs_optim.FusedOptimizer,
    configs: Sequence[Config],
    budgets: Sequence[int],
    steps_per_epoch: int,
) -> hs_sched.FusedLRScheduler | None:
    """The per-step schedule of ``configs[0]["lr_schedule"]`` (``None`` for constant)."""
    args = [schedule_args(c, b, steps_per_epoch) for c, b in zip(configs, budgets, strict=True)]
    name = configs[0]["lr_schedule"]
    if name == "constant":
        return None
    per_member = {k: [a[k] for a in args] for k in args[0]}
    if name == "cosine":
        return hs_sched.CosineAnnealingLR(optimizer, **per_member)
    return hs_sched.StepLR(optimizer, **per_member)


def schedule_args(config: Config, budget: int, steps_per_epoch: int) -> dict[str, Any]:
    """Member arguments of its schedule, in optimizer steps: cosine anneals over the member's
    whole budget; ``step`` decays by ``gamma`` every ``step_size`` epochs; ``exponential``
    decays by ``gamma`` once per epoch (a staircase, as torch's per-epoch ExponentialLR)."""
    name = config["lr_schedule"]
    if name == "cosine":
        return {"T_max": budget, "eta_min": float(config["eta_min"])}
    if name == "step":
        return {"step_size": config["step_size"] * steps_per_epoch, "gamma": float(config["gamma"])}
    if name == "exponential":
        return {"step_size": steps_per_epoch, "gamma": float(config["gamma"])}
    return {}


# ---------------------------------------------------------------------- losses and metrics
def _cross_entropy(logits: Tensor, labels: Tensor, smoothing: Tensor | None) -> Tensor:
    """``F.cross_entropy`` of ``[B, M, C]`` logits and ``[M]`` class indices with per-member
    label smoothing, ``[B]``.

    Smoothing ``e`` mixes the one-hot target with the uniform distribution, exactly as torch's
    ``label_smoothing``: ``(1 - e) * nll + e * mean over classes of -log p``.
    """
    size = logits.shape[0]
    if size == 1 and smoothing is None:
        # one member: torch's own loss on a view, as the member trains alone (squeeze's backward
        # is a view; the gather below adds a zero-filled scatter and a mean to every step)
        return F.cross_entropy(logits.squeeze(0), labels).unsqueeze(0)
    logp = F.log_softmax(logits, dim=-1)
    index = labels.reshape(1, -1, 1).expand(size, -1, 1)
    nll = -logp.gather(-1, index).squeeze(-1).mean(1)
    if smoothing is None:
        return nll
    uniform = -logp.mean(-1).mean(1)
    e = smoothing.to(nll.dtype)
    # a member without smoothing gets its nll exactly, even where a log-probability is -inf
    # (0 * inf would be NaN): its loss does not depend on whether others in the array smooth
    return torch.where(e > 0, (1 - e) * nll + e * uniform, nll)


def _accuracy(logits: Tensor, labels: Tensor) -> Tensor:
    return (logits.argmax(-1) == labels.unsqueeze(0)).to(torch.float64).mean(1)


# ---------------------------------------------------------------------- checks
def _check_number(
    config: Mapping[str, Any],
    key: str,
    *,
    low: float,
    high: float = math.inf,
    strict: bool = False,
    high_open: bool = False,
) -> None:
    value = config[key]
    ok = is_finite(value) and in_range(value, low, high, low_open=strict, high_open=high_open)
    if not ok:
        bound = f"{'>' if strict else '>='} {low}"
        if high < math.inf:
            bound += f" and {'<' if high_open else '<='} {high}"
        raise TaskError(f"config {key}={value!r} must be a finite number {bound}")


def _check_taken(
    config: Mapping[str, Any], keys: Iterable[str], takes: Collection[str], what: str
) -> None:
    """Refuse a key of ``keys`` (an optimizer's or a schedule's, of any) that ``config`` sets but
    the chosen one does not take (``takes``; ``what`` the chosen one's role, in the message)."""
    for key in keys:
        if key in config and key not in takes:
            raise TaskError(f"config key {key!r} is not {what}; it takes {list(takes) or 'none'}")


def _check_int(config: Mapping[str, Any], key: str, *, low: int) -> None:
    value = config[key]
    if not is_int(value) or value < low:
        raise TaskError(f"config {key}={value!r} must be an integer >= {low}")


class _Recorder(Mapping[str, Any]):
    """A read-only view of a config that remembers which keys were read."""

    def __init__(self, config: Config) -> None:
        self._config = config
        self.read: set[str] = set()

    def __getitem__(self, key: str) -> Any:
        self.read.add(key)
        return self._config[key]

    def __contains__(self, key: object) -> bool:
        return key in self._config

    def __iter__(self) -> Iterator[str]:
        return iter(self._config)

    def __len__(self) -> int:
        return len(self._config)
