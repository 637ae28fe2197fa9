"""Profiles and their cache: what was measured and chosen for one kind of array on one kind of
device (:class:`Profile`), kept in a JSON file (:class:`ProfileCache`) under :func:`cache_key`
(the architecture's :func:`signature`, batch size, dtype, hardware, threads, torch and hfsweep
versions), with when and under what load it was measured (shown whenever it is reused)."""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import logging
import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .. import _version
from .._io import new_temporary
from ..offload import OffloadChoice
from ._provenance import describe_cached
from ._units import _MIB, _check_budget, _check_int, _fmt_bytes, _fmt_rate
from .compiled import CompileChoice
from .device import describe_device
from .model import Measurement, MemoryModel, _check_measurements, _fits

__all__ = ["Profile", "ProfileCache", "cache_key", "signature"]

_log = logging.getLogger("hfsweep.profiler")

_FORMAT = 1  # version of the JSON layout written by Profile.to_dict and ProfileCache

# Dropout's probability is a per-member setting of a fused array (it varies between the trials of
# one array), and it changes neither shapes nor cost, so it is left out of an architecture's
# signature: trials that differ only in dropout share one profile.
_DROPOUT_TYPES: tuple[type[nn.Module], ...] = (
    nn.Dropout,
    nn.Dropout1d,
    nn.Dropout2d,
    nn.Dropout3d,
    nn.AlphaDropout,
    nn.FeatureAlphaDropout,
)


def _dtype_name(dtype: torch.dtype | str) -> str:
    if isinstance(dtype, torch.dtype):
        return str(dtype).removeprefix("torch.")
    if isinstance(dtype, str) and dtype.strip():
        return dtype.strip().removeprefix("torch.")
    raise ValueError(f"dtype must be a torch.dtype or a non-empty string, got {dtype!r}")


def signature(model: nn.Module) -> str:
    """A short stable hash of ``model``'s architecture, independent of its parameter values.

    It covers the module tree (paths and classes), each module's ``extra_repr()`` (where layers
    keep hyperparameters such as kernel sizes, strides and widths), and every parameter and buffer:
    name, shape, dtype, whether it trains, and which tensors are shared (tied weights change the
    memory of an array). Two independently initialised models of one architecture have the same
    signature; changing a width, a kernel size or a dtype changes it. Dropout probabilities are
    left out: they are per-member settings of a fused array and change neither shapes nor cost.
    Returns 16 hex digits of a SHA-256.
    """
    if not isinstance(model, nn.Module):
        raise ValueError(f"signature() needs a torch.nn.Module, got {type(model).__name__}")
    lines: list[str] = []
    first_seen: dict[int, str] = {}

    def tensor_line(kind: str, path: str, tensor: torch.Tensor | None) -> str:
        if tensor is None:
            return f"{kind} {path} None"
        owner = first_seen.setdefault(id(tensor), path)
        if owner != path:
            return f"{kind} {path} shares {owner}"
        grad = f" grad={tensor.requires_grad}" if kind == "param" else ""
        return f"{kind} {path} {tuple(tensor.shape)} {tensor.dtype!s}{grad}"

    for path, module in model.named_modules(remove_duplicate=False):
        cls = type(module)
        if isinstance(module, _DROPOUT_TYPES):
            extra = f"inplace={getattr(module, 'inplace', False)}"
        else:
            extra = module.extra_repr()
        lines.append(f"module {path} {cls.__module__}.{cls.__qualname__} ({extra})")
        prefix = f"{path}." if path else ""
        for name, param in module._parameters.items():
            lines.append(tensor_line("param", prefix + name, param))
        for name, buffer in module._buffers.items():
            lines.append(tensor_line("buffer", prefix + name, buffer))
    return hashlib.sha256("\n".join(lines).encode("utf-8")).hexdigest()[:16]


def cache_key(
    model_signature: str,
    batch_size: int,
    dtype: torch.dtype | str,
    device: str | torch.device,
) -> str:
    """The key under which a profile is cached: everything that changes its answer and can be
    named (the machine's load cannot: it is recorded with the profile and shown on reuse).

    Architecture (``model_signature``), batch size and dtype; the hardware, by name, not index:
    for CUDA the GPU's name and memory and the CUDA version torch was built with, for the CPU
    its model name, the cores this process may use and torch's intra-op threads
    (``torch.get_num_threads()``, which ``OMP_NUM_THREADS`` and ``torch.set_num_threads`` set);
    and the versions of torch and hfsweep, whose kernels and fused steps change time and memory.
    ``dtype`` is a ``torch.dtype`` or a string (``"float32"`` and ``"torch.float32"`` are the
    same; other strings, such as an autocast mode, are kept as given).
    """
    if not isinstance(model_signature, str) or not model_signature:
        raise ValueError(f"model_signature must be a non-empty string, got {model_signature!r}")
    batch_size = _check_int("batch_size", batch_size, 1)
    hardware = describe_device(device)
    if torch.device(device).type == "cpu":
        hardware = f"{hardware}|threads={torch.get_num_threads()}"
    elif torch.device(device).type == "cuda":
        hardware = f"{hardware}|cuda={torch.version.cuda}"
    return (
        f"{model_signature}|batch={batch_size}|{_dtype_name(dtype)}|{hardware}"
        f"|torch={torch.__version__}|hfsweep={_version.__version__}"
    )


@dataclass(frozen=True)
class Profile:
    """Everything measured and decided about one kind of array on one device.

    ``chosen`` is the array size to use and ``reason`` says why in one sentence. ``key`` is the
    :func:`cache_key`; ``device`` describes the hardware. ``measurements`` may be given as any
    sequence and is stored as a tuple sorted by size. ``compile`` is the profiler's choice
    between the eager and the compiled fused step, where it was asked to choose.
    """

    key: str
    device: str
    batch_size: int
    dtype: str
    measurements: tuple[Measurement, ...]
    memory: MemoryModel
    budget_bytes: float
    chosen: int
    reason: str
    #: eager or compiled (``fusion: {compile: auto}``), measured at ``chosen``; ``None``: not asked
    compile: CompileChoice | None = None
    #: offloaded or split (``offload: auto``, :func:`~hfsweep.sizing.offloading.profile_offload`)
    offload: OffloadChoice | None = None
    #: when it was measured (seconds since the epoch) and under what: versions, hardware,
    #: threads, the machine's load, the process (:func:`~hfsweep.sizing._provenance.conditions`)
    measured_at: float | None = None
    measured_under: Mapping[str, str] | None = None
    #: the cache file a profile read back from a cache came from; ``None``: measured here
    #: (not part of what the profile is: equal profiles may come from two files)
    cached_from: str | None = dataclasses.field(default=None, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "measurements", tuple(_check_measurements(self.measurements)))
        _check_int("Profile.batch_size", self.batch_size, 1)
        _check_int("Profile.chosen", self.chosen, 1)
        _check_budget(self.budget_bytes)
        if not isinstance(self.memory, MemoryModel):
            raise ValueError(f"Profile.memory must be a MemoryModel, got {self.memory!r}")
        for name in ("key", "device", "dtype", "reason"):
            if not isinstance(getattr(self, name), str):
                raise ValueError(f"Profile.{name} must be a string, got {getattr(self, name)!r}")

    def provenance(self) -> str:
        """Where a cached profile comes from, as one sentence: the cache file, its age, what it
        was measured under, how to measure again; ``""`` for a profile measured here."""
        if self.cached_from is None:
            return ""
        return describe_cached(self.cached_from, self.measured_at, self.measured_under)

    def table(self) -> str:
        """The measurements as a plain-text table; ``*`` marks the chosen size's row."""
        single = next((m for m in self.measurements if m.size == 1), None)
        header = (
            "", "B", "step ms", "member-samples/s", "speed-up vs B=1", "peak MiB", "predicted MiB",
            "fits",
        )  # fmt: skip
        rows: list[tuple[str, ...]] = [header]
        for m in self.measurements:
            speedup = (
                f"{m.samples_per_s / single.samples_per_s:.2f}x"
                if single is not None and single.samples_per_s > 0
                else "-"
            )
            rows.append(
                (
                    "*" if m.size == self.chosen else "",
                    str(m.size),
                    f"{m.step_s * 1e3:.2f}",
                    _fmt_rate(m.samples_per_s),
                    speedup,
                    f"{m.peak_bytes / _MIB:.1f}",
                    f"{self.memory.predict(m.size) / _MIB:.1f}",
                    "yes" if _fits(m, self.budget_bytes) else "no",
                )
            )
        widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
        lines = [
            "  ".join(
                cell.ljust(w) if i == 0 else cell.rjust(w)
                for i, (cell, w) in enumerate(zip(row, widths, strict=True))
            ).rstrip()
            for row in rows
        ]
        lines.insert(1, "-" * len(lines[0]))
        lines.append(
            f"budget {_fmt_bytes(self.budget_bytes)}; memory model "
            f"{_fmt_bytes(self.memory.base_bytes)} + {_fmt_bytes(self.memory.per_member_bytes)} x B"
        )
        lines.append(f"* chosen B={self.chosen}: {self.reason}")
        if self.compile is not None:
            lines.append(f"* {self.compile.reason}")
        if self.offload is not None:
            lines.append(f"* {self.offload.reason}")
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-safe dict (plain numbers, strings, lists) that :meth:`from_dict` reads back."""
        return {
            "format": _FORMAT,
            "key": self.key,
            "device": self.device,
            "batch_size": self.batch_size,
            "dtype": self.dtype,
            "measurements": [
                {
                    "size": m.size,
                    "samples_per_s": m.samples_per_s,
                    "peak_bytes": m.peak_bytes,
                    "step_s": m.step_s,
                }
                for m in self.measurements
            ],
            "memory": {
                "base_bytes": self.memory.base_bytes,
                "per_member_bytes": self.memory.per_member_bytes,
            },
            "budget_bytes": self.budget_bytes,
            "chosen": self.chosen,
            "reason": self.reason,
            **({"compile": self.compile.to_dict()} if self.compile is not None else {}),
            **({"offload": self.offload.to_dict()} if self.offload is not None else {}),
            **({"measured_at": self.measured_at} if self.measured_at is not None else {}),
            **(
                {"measured_under": dict(self.measured_under)}
                if self.measured_under is not None
                else {}
            ),
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Profile:
        """The profile :meth:`to_dict` wrote; ValueError naming what is missing or malformed."""
        if not isinstance(d, dict):
            raise ValueError(f"a profile must be a dict, got {type(d).__name__}")
        if d.get("format", _FORMAT) != _FORMAT:
            raise ValueError(f"profile format {d.get('format')!r} is not supported (valid: 1)")
        try:
            return cls(
                key=d["key"],
                device=d["device"],
                batch_size=d["batch_size"],
                dtype=d["dtype"],
                measurements=tuple(
                    Measurement(
                        size=m["size"],
                        samples_per_s=m["samples_per_s"],
                        peak_bytes=m["peak_bytes"],
                        step_s=m["step_s"],
                    )
                    for m in d["measurements"]
                ),
                memory=MemoryModel(
                    base_bytes=d["memory"]["base_bytes"],
                    per_member_bytes=d["memory"]["per_member_bytes"],
                ),
                budget_bytes=d["budget_bytes"],
                chosen=d["chosen"],
                reason=d["reason"],
                compile=CompileChoice.from_dict(d["compile"]) if d.get("compile") else None,
                offload=OffloadChoice.from_dict(d["offload"]) if d.get("offload") else None,
                measured_at=_measured_at(d.get("measured_at")),
                measured_under=_measured_under(d.get("measured_under")),
            )
        except KeyError as exc:
            raise ValueError(f"profile is missing the field {exc.args[0]!r}") from exc
        except TypeError as exc:
            raise ValueError(f"profile is malformed: {exc}") from exc


def _measured_at(value: Any) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"profile measured_at must be a number of seconds, got {value!r}")
    return float(value)


def _measured_under(value: Any) -> dict[str, str] | None:
    if value is None:
        return None
    if not isinstance(value, dict):
        raise ValueError(f"profile measured_under must be a mapping, got {value!r}")
    return {str(k): str(v) for k, v in value.items()}


def _default_cache_path() -> Path:
    explicit = os.environ.get("HFSWEEP_CACHE_DIR")
    if explicit:
        return Path(explicit).expanduser() / "profiles.json"
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "hfsweep" / "profiles.json"


class ProfileCache:
    """Profiles kept in one JSON file, keyed by :func:`cache_key`.

    The default file is ``$HFSWEEP_CACHE_DIR/profiles.json``, else
    ``$XDG_CACHE_HOME/hfsweep/profiles.json``, else ``~/.cache/hfsweep/profiles.json``. The cache
    only saves time, so it never stops a sweep: a corrupt or unreadable file (or entry) reads as
    empty with a logged warning, and a failed write is logged and skipped. Writes go to a
    temporary file in the same folder that replaces the old file in one ``os.replace``, so a crash
    leaves the old file or the new one, never half of one; where ``fcntl`` exists, a lock file
    keeps processes that write at once from losing each other's entries.
    """

    def __init__(self, path: str | os.PathLike[str] | None = None) -> None:
        self.path = Path(path) if path is not None else _default_cache_path()

    def __repr__(self) -> str:
        return f"ProfileCache({str(self.path)!r})"

    def _read(self) -> dict[str, Any]:
        """The file's ``{key: profile dict}``; empty (with a warning) if it cannot be read."""
        try:
            text = self.path.read_text(encoding="utf-8")
        except FileNotFoundError:
            return {}
        except (OSError, UnicodeDecodeError) as exc:
            _log.warning(
                "cannot read the profile cache %s (%s); treating it as empty", self.path, exc
            )
            return {}
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            _log.warning(
                "the profile cache %s is not valid JSON (%s); treating it as empty", self.path, exc
            )
            return {}
        if (
            not isinstance(data, dict)
            or data.get("format") != _FORMAT
            or not isinstance(data.get("profiles"), dict)
        ):
            _log.warning(
                "the profile cache %s does not hold hfsweep profiles (format %s); treating it as "
                "empty",
                self.path,
                _FORMAT,
            )
            return {}
        profiles: dict[str, Any] = data["profiles"]
        return profiles

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        """An exclusive lock on ``<path>.lock`` where ``fcntl`` exists; nothing elsewhere."""
        try:
            import fcntl
        except ImportError:  # Windows: writes stay atomic, concurrent writers may drop an entry
            yield
            return
        with open(self.path.with_name(self.path.name + ".lock"), "a") as lock:
            fcntl.flock(lock.fileno(), fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(lock.fileno(), fcntl.LOCK_UN)

    def get(self, key: str) -> Profile | None:
        """The profile stored under ``key``, or None (also for an entry that cannot be read)."""
        entry = self._read().get(key)
        if entry is None:
            return None
        try:
            return dataclasses.replace(Profile.from_dict(entry), cached_from=str(self.path))
        except ValueError as exc:
            _log.warning("ignoring the unreadable profile %r in %s: %s", key, self.path, exc)
            return None

    def put(self, profile: Profile) -> None:
        """Store ``profile`` under its key, replacing an older one; the file is written atomically."""
        if not isinstance(profile, Profile):
            raise ValueError(f"put() needs a Profile, got {type(profile).__name__}")
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with self._locked():
                profiles = self._read()
                profiles[profile.key] = profile.to_dict()
                _replace_file(
                    self.path,
                    json.dumps({"format": _FORMAT, "profiles": profiles}, indent=1, sort_keys=True),
                )
        except OSError as exc:
            _log.warning("could not write the profile cache %s (%s); not cached", self.path, exc)


def _replace_file(path: Path, text: str) -> None:
    """Write ``text`` to a temporary file beside ``path`` and put it in ``path``'s place in one
    ``os.replace`` (a crash leaves the old file or the new one, never half of one); the
    temporary file is removed if that fails, and the ``OSError`` raised."""
    fd, tmp_name = new_temporary(path.parent, path.name + ".", ".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp_name, path)
    except OSError:
        with contextlib.suppress(OSError):
            os.unlink(tmp_name)
        raise
