"""The CPU allocator setting the trainer makes: what it sets, when it stays out of the way."""

from __future__ import annotations

import platform
import subprocess
import sys
from typing import Any

import pytest

from hfsweep import _malloc

_GLIBC = sys.platform.startswith("linux") and platform.libc_ver()[0] == "glibc"


class _FakeLibc:
    def __init__(self, result: int = 1) -> None:
        self.calls: list[tuple[int, int]] = []
        self.result = result

    def mallopt(self, param: int, value: int) -> int:
        self.calls.append((param, value))
        return self.result


@pytest.fixture
def fresh(monkeypatch: pytest.MonkeyPatch) -> _FakeLibc:
    """A process in which nothing has been decided yet, glibc's ``mallopt`` recorded."""
    libc = _FakeLibc()
    monkeypatch.setattr(_malloc, "_applied", None)
    monkeypatch.setattr(_malloc.ctypes, "CDLL", lambda name: libc)
    monkeypatch.setattr(_malloc.platform, "libc_ver", lambda: ("glibc", "2.36"))
    monkeypatch.setattr(_malloc.sys, "platform", "linux")
    for name in ("HFSWEEP_MALLOC", "GLIBC_TUNABLES", "LD_PRELOAD"):
        monkeypatch.delenv(name, raising=False)
    for name in ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_"):
        monkeypatch.delenv(name, raising=False)
    return libc


def test_sets_both_thresholds_once(fresh: _FakeLibc) -> None:
    assert _malloc.retain_freed_memory() is True
    assert _malloc.retain_freed_memory() is True
    assert fresh.calls == [(-3, _malloc.MMAP_THRESHOLD), (-1, _malloc.TRIM_THRESHOLD)]


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("HFSWEEP_MALLOC", "system"),
        ("HFSWEEP_MALLOC", " System "),
        ("GLIBC_TUNABLES", "glibc.malloc.trim_threshold=0"),
        ("GLIBC_TUNABLES", "glibc.malloc.mmap_threshold=65536"),
        ("MALLOC_MMAP_THRESHOLD_", "65536"),
        ("MALLOC_TRIM_THRESHOLD_", "0"),
        ("LD_PRELOAD", "/usr/lib/x86_64-linux-gnu/libjemalloc.so.2"),
        ("LD_PRELOAD", "libtcmalloc_minimal.so.4"),
    ],
)
def test_leaves_the_users_choice_alone(
    fresh: _FakeLibc, monkeypatch: pytest.MonkeyPatch, name: str, value: str
) -> None:
    monkeypatch.setenv(name, value)
    assert _malloc.retain_freed_memory() is False
    assert fresh.calls == []


def test_unrelated_tunables_do_not_count(fresh: _FakeLibc, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GLIBC_TUNABLES", "glibc.cpu.hwcaps=-AVX512F")
    monkeypatch.setenv("HFSWEEP_MALLOC", "")
    assert _malloc.retain_freed_memory() is True


def test_only_glibc(fresh: _FakeLibc, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_malloc.platform, "libc_ver", lambda: ("", ""))
    assert _malloc.retain_freed_memory() is False
    assert fresh.calls == []


def test_a_refused_setting_reports_false(fresh: _FakeLibc) -> None:
    fresh.result = 0
    assert _malloc.retain_freed_memory() is False


def test_no_mallopt_reports_false(monkeypatch: pytest.MonkeyPatch, fresh: _FakeLibc) -> None:
    def no_libc(name: Any) -> Any:
        raise OSError("no C library")

    monkeypatch.setattr(_malloc.ctypes, "CDLL", no_libc)
    assert _malloc.retain_freed_memory() is False


@pytest.mark.skipif(not _GLIBC, reason="glibc only")
def test_real_glibc_accepts_the_thresholds() -> None:
    """In a fresh interpreter (the first call decides for the whole process)."""
    code = "from hfsweep._malloc import retain_freed_memory as r; print(r())"
    env = {"PATH": "/usr/bin:/bin"}
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env
    )
    assert out.stdout.strip() == "True"
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=True,
        env={**env, "HFSWEEP_MALLOC": "system"},
    )
    assert out.stdout.strip() == "False"


def test_the_trainer_sets_it_before_training_on_the_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    from hfsweep import trainer
    from hfsweep.tasks import digits_mlp

    seen: list[bool] = []
    monkeypatch.setattr(trainer, "retain_freed_memory", lambda: seen.append(True) or True)
    t = trainer.ArrayTrainer(digits_mlp, checkpoint_dir=None)
    members = [trainer.Member(id="a", config={"epochs": 1, "hidden": 8})]
    results = t.run(members)
    assert seen == [True] and results[0].status == "completed"
