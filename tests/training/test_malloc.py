"""The CPU allocator setting the trainer makes: what it sets, for how long (the run), and when it
stays out of the way."""

from __future__ import annotations

import platform
import subprocess
import sys
import threading
from typing import Any

import pytest

from hfsweep import _malloc

_GLIBC = sys.platform.startswith("linux") and platform.libc_ver()[0] == "glibc"


class _FakeLibc:
    def __init__(self, result: int = 1) -> None:
        self.calls: list[tuple[int, int]] = []
        self.trims: list[int] = []
        self.result = result

    def mallopt(self, param: int, value: int) -> int:
        self.calls.append((param, value))
        return self.result

    def malloc_trim(self, pad: int) -> int:
        self.trims.append(pad)
        return 1


RAISE = [(-3, _malloc.MMAP_THRESHOLD), (-1, _malloc.TRIM_THRESHOLD)]
RESTORE = [(-3, _malloc.AFTER_MMAP_THRESHOLD), (-1, _malloc.AFTER_TRIM_THRESHOLD)]


@pytest.fixture
def fresh(monkeypatch: pytest.MonkeyPatch) -> _FakeLibc:
    """A process in which nothing has been decided yet, glibc's ``mallopt`` recorded."""
    libc = _FakeLibc()
    monkeypatch.setattr(_malloc, "_open", 0)
    monkeypatch.setattr(_malloc, "_raised", False)
    monkeypatch.setattr(_malloc, "_pinned", False)
    monkeypatch.setattr(_malloc.ctypes, "CDLL", lambda name: libc)
    monkeypatch.setattr(_malloc.platform, "libc_ver", lambda: ("glibc", "2.36"))
    monkeypatch.setattr(_malloc.sys, "platform", "linux")
    for name in ("HFSWEEP_MALLOC", "GLIBC_TUNABLES", "LD_PRELOAD"):
        monkeypatch.delenv(name, raising=False)
    for name in ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_"):
        monkeypatch.delenv(name, raising=False)
    return libc


def test_raised_for_the_block_then_set_back_and_trimmed(fresh: _FakeLibc) -> None:
    with _malloc.retaining_freed_memory() as raised:
        assert raised is True
        assert fresh.calls == RAISE and fresh.trims == []
    assert fresh.calls == RAISE + RESTORE
    assert fresh.trims == [0]  # the memory kept beyond use goes back to the system
    with _malloc.retaining_freed_memory():  # the next run raises them again
        pass
    assert fresh.calls == (RAISE + RESTORE) * 2


def test_blocks_that_nest_or_overlap_in_threads_raise_and_restore_once(
    fresh: _FakeLibc,
) -> None:
    inside, release = threading.Event(), threading.Event()

    def other_run() -> None:
        with _malloc.retaining_freed_memory():
            inside.set()
            release.wait(10)

    with _malloc.retaining_freed_memory():
        with _malloc.retaining_freed_memory():
            pass
        thread = threading.Thread(target=other_run)
        thread.start()
        assert inside.wait(10)
    assert fresh.calls == RAISE  # the other thread's run still trains
    release.set()
    thread.join(10)
    assert fresh.calls == RAISE + RESTORE and fresh.trims == [0]


def test_for_the_whole_process_it_stays_raised(fresh: _FakeLibc) -> None:
    """``retain_freed_memory`` (the benchmarks') raises them once, and no run ends that."""
    assert _malloc.retain_freed_memory() is True
    with _malloc.retaining_freed_memory() as raised:
        assert raised is True
    assert _malloc.retain_freed_memory() is True
    assert fresh.calls == RAISE and fresh.trims == []


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
    with _malloc.retaining_freed_memory() as raised:
        assert raised is False
    assert _malloc.retain_freed_memory() is False
    assert fresh.calls == [] and fresh.trims == []


def test_unrelated_tunables_do_not_count(fresh: _FakeLibc, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GLIBC_TUNABLES", "glibc.cpu.hwcaps=-AVX512F")
    monkeypatch.setenv("HFSWEEP_MALLOC", "")
    with _malloc.retaining_freed_memory() as raised:
        assert raised is True


def test_only_glibc(fresh: _FakeLibc, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_malloc.platform, "libc_ver", lambda: ("", ""))
    with _malloc.retaining_freed_memory() as raised:
        assert raised is False
    assert fresh.calls == []


def test_a_refused_setting_reports_false_and_is_not_undone(fresh: _FakeLibc) -> None:
    fresh.result = 0
    with _malloc.retaining_freed_memory() as raised:
        assert raised is False
    assert fresh.calls == [(-3, _malloc.MMAP_THRESHOLD)] and fresh.trims == []


def test_no_mallopt_reports_false(monkeypatch: pytest.MonkeyPatch, fresh: _FakeLibc) -> None:
    def no_libc(name: Any) -> Any:
        raise OSError("no C library")

    monkeypatch.setattr(_malloc.ctypes, "CDLL", no_libc)
    with _malloc.retaining_freed_memory() as raised:
        assert raised is False


@pytest.mark.skipif(not _GLIBC, reason="glibc only")
def test_real_glibc_accepts_the_thresholds_and_their_defaults() -> None:
    """In a fresh interpreter: raised in the block, set back and trimmed after it (each
    ``mallopt`` accepted), and left alone with ``HFSWEEP_MALLOC=system``."""
    code = (
        "from hfsweep import _malloc\n"
        "with _malloc.retaining_freed_memory() as raised:\n"
        "    inside = _malloc._raised\n"
        "print(raised, inside, _malloc._raised, _malloc._set(1 << 17, 1 << 17))"
    )
    env = {"PATH": "/usr/bin:/bin"}
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env
    )
    assert out.stdout.split() == ["True", "True", "False", "True"]
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=True,
        env={**env, "HFSWEEP_MALLOC": "system"},
    )
    assert out.stdout.split()[:3] == ["False", "False", "False"]


def test_after_a_run_the_thresholds_are_where_glibcs_adaptive_rule_takes_them() -> None:
    """Not glibc's fixed 128 KiB starting values: those would serve every later tensor over
    128 KiB from fresh pages (glibc cannot turn its adaptive rule back on)."""
    assert _malloc.AFTER_MMAP_THRESHOLD == 32 << 20  # glibc's bound for the adaptive threshold
    assert _malloc.AFTER_TRIM_THRESHOLD == 2 * _malloc.AFTER_MMAP_THRESHOLD  # its rule: twice


_FAULTS_AFTER_A_RUN = """
import resource, torch, hfsweep as hs
from torch import nn
from hfsweep import _malloc
torch.set_num_threads(1)
torch.manual_seed(0)
def mlp():
    return nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(),
                         nn.Linear(32, 10))
array = hs.fuse([mlp() for _ in range(32)])  # activations [32, 64, 32]: 256 KiB each
opt = torch.optim.SGD(array.parameters(), lr=0.01)
x, y = torch.randn(64, 64), torch.randint(0, 10, (64,))
def steps(n):
    for _ in range(n):
        opt.zero_grad(set_to_none=True)
        hs.member_losses(array(x), y).sum().backward()
        opt.step()
with _malloc.retaining_freed_memory() as raised:  # what a trainer's run does
    steps(5)
steps(10)
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
steps(50)
print(raised, (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / 50)
"""


@pytest.mark.skipif(not _GLIBC, reason="glibc only")
def test_an_array_trained_after_a_run_does_not_page_fault_every_step() -> None:
    """A user's own loop after a trainer's run in the same process (and the benchmarks'
    in-process ways): with glibc's fixed defaults set back, each step page-faulted its
    activations in (about 76 minor faults a step here); now almost none. A count, not a time."""
    out = subprocess.run(
        [sys.executable, "-c", _FAULTS_AFTER_A_RUN],
        capture_output=True,
        text=True,
        check=True,
        env={"PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"},
    )
    raised, faults = out.stdout.split()[-2:]
    assert raised == "True"
    assert float(faults) < 8, f"{faults} minor page faults per step"


def test_the_trainer_raises_them_while_it_trains_on_the_cpu(fresh: _FakeLibc) -> None:
    from hfsweep import training as trainer
    from hfsweep.tasks import digits_mlp

    seen: list[list[tuple[int, int]]] = []
    t = trainer.ArrayTrainer(digits_mlp, checkpoint_dir=None)
    members = [trainer.Member(id="a", config={"epochs": 1, "hidden": 8})]
    results = t.run(members, on_finish=lambda r: seen.append(list(fresh.calls)))
    assert results[0].status == "completed"
    assert seen == [RAISE]  # raised while the member trained
    assert fresh.calls == RAISE + RESTORE and fresh.trims == [0]  # and not after the run
