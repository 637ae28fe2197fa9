"""How every array of a sweep trains: :class:`ArraySettings`, built and checked once.

A sweep file's ``fusion:`` section and the Ray Tune plugin's ``Fusion(...)`` describe the same
thing: the device and dtype of the arrays, how often they evaluate, whether they share frozen
tensors, compile, or keep their state in host memory. :func:`array_settings` reads those values
from either source and checks them with one set of rules; its errors name the value as the
source spells it (``fusion.offload`` for a sweep file, ``Fusion(offload=...)`` for the plugin).
The result is frozen and is what every executor, Ray worker and :class:`~hfsweep.ArrayTrainer`
of the sweep is built from.

``size`` (how many members per array) is not here: it is the packer's, decided per
compatibility key before an array exists.
"""

from __future__ import annotations

import dataclasses
import difflib
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from ._checks import is_int
from ._names import OFFLOAD_MODES, OFFLOAD_STEPS

if TYPE_CHECKING:
    import torch

__all__ = ["ARRAY_KEYS", "ArraySettings", "SettingsError", "Source", "array_settings"]

#: the dtypes arrays train in
_DTYPES = ("float32", "float64", "bfloat16")
_DEVICE = re.compile(r"^(auto|cpu|cuda(:[0-9]+)?)$")
#: the most offloaded arrays trained at once on one device
_MAX_ALTERNATE = 64


@dataclass(frozen=True)
class ArraySettings:
    """How the arrays of one sweep train (a sweep file's ``fusion:`` keys, ``size`` aside).

    ``device``: ``auto`` (CUDA where the process sees a GPU), ``cpu``, ``cuda`` or ``cuda:N``;
    ``dtype``: ``float32``, ``float64`` or ``bfloat16``; ``eval_every``: steps between a
    member's evaluations (``None``: once per epoch); ``share_frozen``: frozen tensors every
    member holds identically kept once per array (``share_frozen`` of :func:`hfsweep.fuse`);
    ``compile``: ``True`` compiles each array's traced forward, backward and loss with
    ``torch.compile``, ``"auto"`` lets the profiler time both and keep the faster; ``offload``:
    ``none``, ``host`` (an array's state in host memory, streamed through the device shard by
    shard) or ``auto`` (``host`` only where the array does not fit the device), with
    ``device_memory`` bytes for it on the device (``None``: a CUDA device's free memory);
    ``alternate``: offloaded arrays trained at once on a device, their shards alternating;
    ``offload_step``: where an offloaded array's optimizer steps (``host``, ``device`` or
    ``auto``). Build it with :func:`array_settings`, which checks every rule.
    """

    device: str = "auto"
    dtype: str = "float32"
    eval_every: int | None = None
    share_frozen: bool = True
    compile: bool | Literal["auto"] = False
    offload: str = "none"
    device_memory: int | None = None
    alternate: int = 1
    offload_step: str = "host"

    def torch_dtype(self) -> torch.dtype:
        """:attr:`dtype` as a ``torch.dtype``."""
        from ._devices import DTYPES

        return DTYPES[self.dtype]

    def resolved_device(self) -> str:
        """:attr:`device` in this process (``auto``: ``cuda`` where torch sees a GPU)."""
        from ._devices import resolve_device

        return resolve_device(self.device)

    def to_dict(self) -> dict[str, Any]:
        """Every setting by its name (a sweep file's ``fusion:`` keys)."""
        return dataclasses.asdict(self)


#: the settings' names: the array-level keys of a sweep file's ``fusion:`` and of ``Fusion(...)``
ARRAY_KEYS: tuple[str, ...] = tuple(f.name for f in dataclasses.fields(ArraySettings))


@dataclass(frozen=True)
class Source:
    """Where settings come from, for their errors: ``"yaml"`` (a sweep file's ``fusion:``
    section: ``fusion.offload``, ``offload: host``) or ``"Fusion"`` (the Tune plugin's
    arguments: ``Fusion(offload=...)``, ``offload='host'``)."""

    kind: Literal["yaml", "Fusion"]

    def name(self, key: str) -> str:
        """How this source names setting ``key``."""
        return f"fusion.{key}" if self.kind == "yaml" else f"Fusion({key}=...)"

    def boolean(self, value: bool) -> str:
        """How this source writes ``value``: ``true`` in YAML, ``True`` in Python."""
        return str(value).lower() if self.kind == "yaml" else str(value)

    def give(self, key: str, value: Any) -> str:
        """How a user of this source writes ``key`` set to ``value``."""
        if self.kind == "yaml":
            shown = str(value).lower() if isinstance(value, bool) else value
            return f"{key}: {'null' if shown is None else shown}"
        return f"{key}={value!r}"


YAML = Source("yaml")
FUSION = Source("Fusion")


class SettingsError(ValueError):
    """A setting that breaks a rule: ``key`` is its name, ``problem`` what is wrong and what
    would be valid, ``source`` where it came from; the message names it as the source does."""

    def __init__(self, key: str, problem: str, source: Source) -> None:
        self.key = key
        self.problem = problem
        self.source = source
        super().__init__(f"{source.name(key)}: {problem}")


def array_settings(values: Mapping[str, Any], source: Source) -> ArraySettings:
    """The settings ``values`` give (a key left out takes its default), checked against every
    rule once; raises :class:`SettingsError` naming the first bad value as ``source`` spells it,
    and an unknown key is one too."""
    for key in values:
        if key not in ARRAY_KEYS:
            raise SettingsError(
                key, f"not an array setting; the settings are {', '.join(ARRAY_KEYS)}", source
            )
    v = {**ArraySettings().to_dict(), **values}

    def bad(key: str, problem: str) -> SettingsError:
        return SettingsError(key, problem, source)

    def choice(key: str, valid: tuple[str, ...]) -> str:
        value = v[key]
        if not isinstance(value, str) or value not in valid:
            close = (
                difflib.get_close_matches(value, valid, n=1, cutoff=0.6)
                if isinstance(value, str)
                else []
            )
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise bad(key, f"{value!r} is not valid{hint}; give one of: {', '.join(valid)}")
        return value

    def integer(key: str, high: int | None = None, unit: str = "") -> int:
        value = v[key]
        if not is_int(value) or value < 1:
            kind = f"{value!r} ({type(value).__name__}) is not an integer"
            problem = f"{kind} >= 1" if high is None else f"{kind} from 1 to {high:,}"
            if isinstance(value, float) and source.kind == "yaml":
                problem += (
                    "; a number with a point or an exponent (2.5, 1e3) is a float in YAML: write "
                    "a whole number such as 64"
                )
            raise bad(key, problem)
        if high is not None and value > high:
            raise bad(
                key,
                f"{value:,} is more than {high:,} {unit}, the most a sweep may give (a larger "
                f"value is a typo: no sweep would finish it); give at most {high:,}",
            )
        return int(value)

    give = source.give
    device = v["device"]
    if not isinstance(device, str) or not _DEVICE.match(device):
        raise bad("device", f"{device!r} is not a device; give auto, cpu, cuda or cuda:N")
    dtype = choice("dtype", _DTYPES)
    every = None if v["eval_every"] is None else integer("eval_every")
    share = v["share_frozen"]
    if not isinstance(share, bool):
        raise bad(
            "share_frozen",
            f"{share!r} ({type(share).__name__}) is not {source.boolean(True)} or "
            f"{source.boolean(False)} (keep frozen tensors every member holds identically once)",
        )
    compile = v["compile"]
    if not (isinstance(compile, bool) or compile == "auto"):
        raise bad(
            "compile",
            f"{compile!r} is not valid; give {source.boolean(True)} (torch.compile the fused "
            f"step), {source.boolean(False)} or {'auto' if source.kind == 'yaml' else repr('auto')} "
            "(the profiler times both and keeps the faster)",
        )
    offload = choice("offload", OFFLOAD_MODES)
    if offload != "none" and compile is not False:
        raise bad(
            "compile",
            f"{compile!r} together with {give('offload', offload)} is not supported yet (an "
            f"offloaded array runs its shards uncompiled); give {give('compile', False)}, or "
            f"{give('offload', 'none')}",
        )
    memory = v["device_memory"]
    if memory is not None:
        if offload == "none":
            raise bad(
                "device_memory",
                f"{memory!r} is the offload engine's budget on the device; it needs "
                f"{give('offload', 'host')} or auto (or remove it)",
            )
        memory = integer("device_memory")
    alternate = integer("alternate", _MAX_ALTERNATE, "arrays")
    if alternate > 1 and offload != "host":
        raise bad(
            "alternate",
            f"{alternate} trains that many offloaded arrays at once, their shards in turn; "
            f"it needs {give('offload', 'host')} (got {give('offload', offload)}); give "
            f"{give('alternate', 1)}, or {give('offload', 'host')}",
        )
    step = choice("offload_step", OFFLOAD_STEPS)
    if step != "host" and offload == "none":
        raise bad(
            "offload_step",
            f"{step!r} says where an offloaded array's optimizer steps; it needs "
            f"{give('offload', 'host')} or auto (got {give('offload', 'none')}); give "
            f"{give('offload_step', 'host')}, or offload",
        )
    if step != "host" and alternate > 1:
        raise bad(
            "offload_step",
            f"{step!r} is not supported with {give('alternate', alternate)} yet (arrays "
            f"trained together step on the host); give {give('offload_step', 'host')}, or "
            f"{give('alternate', 1)}",
        )
    return ArraySettings(
        device=device,
        dtype=dtype,
        eval_every=every,
        share_frozen=share,
        compile=compile,
        offload=offload,
        device_memory=memory,
        alternate=alternate,
        offload_step=step,
    )
