"""A driver storm (issue 45): three ``hfsweep run --resume`` drivers share one study, each in a
run directory of its own; a seeded RNG SIGKILLs a random one of them at random moments and
each killed driver is resumed at once, until all of them exit 0. The first start of one driver
(the others start once it is dead) kills itself just after Optuna created a trial for it
(before hfsweep wrote anything else about it: the window in which, before the fix, a trial was left with no
params and no owner, RUNNING for good).

The test (tests/sweep/test_driver_storm.py) runs small storms; bigger ones run from the
repository root as::

    python -m tests.sweep._storm --trials 120 --seed 7 [--storage URL] [--kills 12]

(``--storage`` defaults to a ``journal://`` file in a temporary folder). It prints what it did
and exits 1 when the study it ends with breaks a promise (see ``_check``)."""

from __future__ import annotations

import argparse
import random
import signal
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from .test_two_drivers import _check, _Driver, _finished

KILLER = Path(__file__).resolve().parent / "_kill_after_create.py"
DRIVERS = 3
#: seconds between looks at the drivers and the study
POLL_S = 0.2
#: seconds a storm may take, all of it, before it is called hung
STORM_S = 900.0
#: the default grace period, not the two-driver tests' 3 s: a killed driver's trials are
#: adopted at once all the same (its pid is gone on this host), while a live driver's heartbeat
#: can be held up for longer than 3 s on a loaded machine, and for 30 s where a process killed
#: holding the journal's lock leaves it to go stale; a driver that started during such a wait
#: takes a live one whose last beat is older than the grace period for gone
ENV = {"HFSWEEP_DRIVER_GRACE_S": "60"}


@dataclass
class Storm:
    """What a storm did."""

    seed: int
    trials: int
    #: ``(driver, finished trials when killed, how)``, ``how`` "random" or "after create N"
    kills: list[tuple[str, int, str]] = field(default_factory=list)
    starts: int = 0
    seconds: float = 0.0

    def __str__(self) -> str:
        told = ", ".join(f"{d}@{n} ({how})" for d, n, how in self.kills)
        return (
            f"seed {self.seed}: {self.trials} trials, {DRIVERS} drivers, {self.starts} starts, "
            f"{len(self.kills)} kills [{told}], {self.seconds:.0f} s"
        )


def storm(folder: Path, storage: str, *, trials: int, seed: int, kills: int) -> Storm:
    """Run a storm of ``kills`` random SIGKILLs (and one kill just after a create) over a
    study of ``trials`` trials in ``storage``, the run directories under ``folder``; check the
    study it ends with (``_check``: the whole budget finished, none running, none told
    twice, none trained by two drivers at once). Every process it started is ended, by its
    pid, whatever happens."""
    rng = random.Random(seed)
    report = Storm(seed=seed, trials=trials)
    drivers = [_Driver(folder / f"d{i}", storage, trials=trials) for i in range(DRIVERS)]
    # finished-trial counts at which a random running driver is killed, after a random pause
    moments = sorted(rng.randint(1, max(1, trials - 3)) for _ in range(kills))
    pauses = [rng.uniform(0.0, 1.5) for _ in moments]
    # which driver kills itself just after its storage created its nth trial, on its first
    # start (left to that kill: no random one hits it before)
    cut, nth = rng.randrange(DRIVERS), rng.randint(1, 4)
    cutting = True
    began = time.monotonic()
    try:
        # The cutting driver starts first and the others once it has died: its first array
        # (fusion size 4 >= nth) creates its nth trial for certain. Started together, the others
        # could take the whole budget while it was still importing on a loaded machine, and
        # the storm would miss the window it exists to hit.
        drivers[cut].start(launcher=(str(KILLER), str(nth)), **ENV)
        report.starts += 1
        _died_after_create(drivers[cut], nth)
        for i, d in enumerate(drivers):
            if i != cut:
                d.start(**ENV)
                report.starts += 1
        while True:
            if time.monotonic() - began > STORM_S:
                pytest.fail(f"storm still running after {STORM_S} s: {report}")
            done = 0
            for i, d in enumerate(drivers):
                assert d.proc is not None
                code = d.proc.poll()
                if code is None:
                    continue
                if code == -signal.SIGKILL:  # the kill after a create: resume it
                    d.kills.append(time.time())  # an upper bound of its death
                    d.proc.communicate(timeout=60)
                    report.kills.append((f"d{i}", _finished(storage), f"after create {nth}"))
                    cutting = False
                    d.start(**ENV)
                    report.starts += 1
                    continue
                if code != 0:
                    _out, err = d.proc.communicate(timeout=60)
                    pytest.fail(f"d{i} exited {code}: {report}\n{err[-5000:]}")
                done += 1
            if done == DRIVERS:
                break
            if moments and _finished(storage) >= moments[0]:
                time.sleep(pauses.pop(0))
                at = moments.pop(0)
                alive = [
                    i
                    for i, d in enumerate(drivers)
                    if d.proc and d.proc.poll() is None and not (cutting and i == cut)
                ]
                if alive:
                    i = rng.choice(alive)
                    if drivers[i].kill():
                        report.kills.append((f"d{i}", at, "random"))
                        drivers[i].start(**ENV)
                        report.starts += 1
                continue
            time.sleep(POLL_S)
        for d in drivers:
            d.finished(timeout=60)
        report.seconds = time.monotonic() - began
        print(report, flush=True)  # what led to the study checked next
        _check(storage, *drivers, void=True, trials=trials, kills=len(report.kills))
        return report
    finally:
        for d in drivers:
            if d.proc is not None and d.proc.poll() is None:
                d.proc.kill()  # by its pid
                d.proc.communicate(timeout=60)


def _died_after_create(driver: _Driver, nth: int) -> None:
    """Wait until ``driver``, started to kill itself after its ``nth`` create, has done so."""
    assert driver.proc is not None
    deadline = time.monotonic() + STORM_S / 3
    while (code := driver.proc.poll()) is None:
        if time.monotonic() > deadline:
            pytest.fail(f"{driver.folder.name} did not create {nth} trials in {STORM_S / 3:.0f} s")
        time.sleep(POLL_S)
    if code != -signal.SIGKILL:
        _out, err = driver.proc.communicate(timeout=60)
        pytest.fail(
            f"{driver.folder.name} exited {code} before its {nth}th create killed it:\n{err[-5000:]}"
        )


def main(argv: list[str] | None = None) -> int:
    """``python -m tests.sweep._storm``: one storm, its report printed."""
    parser = argparse.ArgumentParser(
        description="Three hfsweep drivers on one study, SIGKILLed and resumed at random."
    )
    parser.add_argument("--trials", type=int, default=120)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--kills", type=int, default=None, help="default: trials // 10")
    parser.add_argument("--storage", default=None, help="default: a journal:// file")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="hfsweep-storm-") as tmp:
        folder = Path(tmp)
        storage = args.storage
        if storage is None:
            (folder / "shared").mkdir()
            storage = f"journal://{folder / 'shared' / 'study.log'}"
        kills = args.kills if args.kills is not None else max(1, args.trials // 10)
        try:
            report = storm(folder, storage, trials=args.trials, seed=args.seed, kills=kills)
        except (AssertionError, pytest.fail.Exception) as exc:
            print(f"storm FAILED (seed {args.seed}, {args.trials} trials): {exc}")
            return 1
    print(f"storm passed: {report}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
