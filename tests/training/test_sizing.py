"""profile_task and `hfsweep profile`: measured sizes, the choice, the cache, CPU peak memory."""

from __future__ import annotations

import pytest
import torch

import hfsweep as hs
from hfsweep import profiler, tasks
from hfsweep.cli import main
from hfsweep.sizing.task import profile_task
from hfsweep.sizing.timing import _LiveTensorBytes, measure_step


def test_live_tensor_bytes_follows_allocations_and_frees() -> None:
    a = torch.ones(1000)  # 4000 bytes, alive before: counted from the start
    with _LiveTensorBytes([a]) as tracker:
        assert tracker.live == 4000
        a.mul_(2)  # in place: nothing new
        b = a * 2  # +4000
        c = b + 1  # +4000 -> 12000
        del b  # -> 8000
        d = c.view(10, 100)  # a view: nothing new
        e = torch.zeros(500)  # +2000 -> 10000
        del c, d, e
        f = a + 1  # 8000
    assert tracker.peak == 12000
    assert tracker.live == 8000
    del f


def test_profile_task_measures_chooses_and_caches(tmp_path, monkeypatch) -> None:
    cache = profiler.ProfileCache(tmp_path / "profiles.json")
    seen: list[int] = []
    profile = profile_task(
        tasks.digits_mlp,
        {"hidden": 32},
        sizes=[1, 2, 4],
        cache=cache,
        min_seconds=0.05,
        on_measure=lambda m: seen.append(m.size),
    )
    assert seen == [1, 2, 4]
    assert [m.size for m in profile.measurements] == [1, 2, 4]
    best = max(m.samples_per_s for m in profile.measurements)
    chosen = next(m for m in profile.measurements if m.size == profile.chosen)
    assert chosen.samples_per_s >= 0.9 * best
    peaks = [m.peak_bytes for m in profile.measurements]
    assert peaks[0] > 0 and peaks == sorted(peaks)  # more members hold more memory
    assert profile.batch_size == 64 and profile.dtype == "float32"
    assert profile.device.startswith("cpu:")

    # a second profile of the same architecture, batch size, dtype and device is a cache hit;
    # a per-member key (lr, seed, dropout) does not change the architecture
    class Measured(Exception):
        pass

    def measure(*args, **kwargs):
        raise Measured

    monkeypatch.setattr("hfsweep.sizing.timing.measure_step", measure)
    again = profile_task(tasks.digits_mlp, {"hidden": 32, "lr": 0.3, "dropout": 0.2}, cache=cache)
    assert again.measurements == profile.measurements and again.chosen == profile.chosen
    assert f"(cached profile from {cache.path}, measured " in again.reason
    assert again.cached_from == str(cache.path) and again.measured_under is not None
    # sizes the cached profile did not measure, another optimizer: measured anew
    with pytest.raises(Measured):
        profile_task(tasks.digits_mlp, {"hidden": 32}, sizes=[1, 8], cache=cache)
    with pytest.raises(Measured):
        profile_task(tasks.digits_mlp, {"hidden": 32, "optimizer": "adam"}, cache=cache)
    with pytest.raises(Measured):
        profile_task(tasks.digits_mlp, {"hidden": 48}, sizes=[1], cache=cache)
    # another thread count, asked to refresh: measured anew
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(threads + 1)
        with pytest.raises(Measured):
            profile_task(tasks.digits_mlp, {"hidden": 32}, cache=cache)
    finally:
        torch.set_num_threads(threads)
    monkeypatch.setenv("HFSWEEP_PROFILE_REFRESH", "1")  # how a sweep's size: auto refreshes
    with pytest.raises(Measured):
        profile_task(tasks.digits_mlp, {"hidden": 32}, cache=cache)


def test_cpu_peak_memory_counts_parameters_gradients_and_optimizer_state() -> None:
    task = tasks.digits_mlp
    config = {"hidden": 256, "depth": 2, "momentum": 0.9}
    batch = (torch.randn(8, 64), torch.randint(10, (8,)))
    m = measure_step(
        task,
        config,
        4,
        device=torch.device("cpu"),
        dtype=torch.float32,
        batch=batch,
        min_seconds=0.0,
        min_steps=1,
    )
    params = sum(p.numel() for p in task.build_model(task.resolve(config)).parameters()) * 4 * 4
    # weights + gradients + momentum buffers, plus activations and the update's temporaries
    assert 3 * params <= m.peak_bytes < 4 * params


def test_cli_profile_prints_the_table_and_the_choice(tmp_path, capsys) -> None:
    plot = tmp_path / "profile.png"
    code = main(
        [
            "profile",
            "digits_mlp",
            "--set",
            "hidden=32",
            "--sizes",
            "1,2",
            "--seconds",
            "0.05",
            "--plot",
            str(plot),
            "--cache",
            str(tmp_path / "c.json"),
        ]
    )
    out = capsys.readouterr().out
    assert code == 0
    assert "B=1" in out and "B=2" in out and "chosen B = " in out
    assert plot.stat().st_size > 1000
    assert f"measured now; cached in {tmp_path / 'c.json'}" in out


def test_cli_profile_says_where_a_cached_profile_comes_from_and_refresh_measures_again(
    tmp_path, capsys
) -> None:
    """The cache is shared by every process of the machine's user: a profile taken from it is
    named with its file, age and conditions (threads, load, versions) and the way to refresh."""
    cache = tmp_path / "c.json"
    args = ["profile", "digits_mlp", "--set", "hidden=32", "--sizes", "1,2", "--seconds", "0.05"]
    args += ["--no-plot", "--cache", str(cache)]
    assert main(args) == 0
    first = capsys.readouterr().out
    assert "B=1 " in first and "measured now" in first
    assert main(args) == 0
    again = capsys.readouterr().out
    assert "  B=1 " not in again  # nothing measured: no progress lines
    assert f"(cached profile from {cache}, measured " in again
    assert f"{torch.get_num_threads()} threads" in again and "load " in again
    assert "hfsweep profile ... --refresh" in again
    assert main([*args, "--refresh"]) == 0
    refreshed = capsys.readouterr().out
    assert "  B=1 " in refreshed and "cached profile" not in refreshed


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["profile", "mnist"], "'mnist' is not a ready task"),
        (["profile", "digits_mlp", "--set", "hiden=3"], "'hiden' is not known"),
        (["profile", "digits_mlp", "--set", "hidden"], "write KEY=VALUE"),
        (["profile", "digits_mlp", "--dtype", "int8"], "not a floating torch dtype"),
        (["profile", "no_such_module_x:task"], "importing module 'no_such_module_x' failed"),
    ],
)
def test_cli_profile_bad_input_exits_2(argv, message, capsys) -> None:
    assert main(argv) == 2
    assert message in capsys.readouterr().err


def test_load_task_from_a_file(tmp_path) -> None:
    from hfsweep.config.entry import load_task

    path = tmp_path / "mytask.py"
    path.write_text("from hfsweep.tasks import digits_cnn\nmy = digits_cnn\nnot_task = 3\n")
    assert load_task(f"{path}:my") is tasks.digits_cnn
    with pytest.raises(hs.TaskError, match=r"is a int, not an hfsweep\.Task"):
        load_task(f"{path}:not_task")
    with pytest.raises(hs.TaskError, match="has no attribute 'nope'"):
        load_task(f"{path}:nope")
    assert load_task("hfsweep.tasks:digits_mlp") is tasks.digits_mlp


def test_cli_profile_takes_a_sweep_file(tmp_path, capsys) -> None:
    sweep = tmp_path / "sweep.yaml"
    sweep.write_text(
        "task: digits_mlp\n"
        "config: {hidden: 16}\n"
        "search_space: {lr: {type: float, low: 0.01, high: 0.1, log: true}, depth: 1}\n"
        "budget: {trials: 4, epochs: 1}\n"
        "metric: val_accuracy\nmode: max\nfusion: {device: cpu}\n"
    )
    code = main(
        ["profile", str(sweep), "--sizes", "1,2", "--seconds", "0.05", "--no-plot", "--no-cache"]
    )
    out = capsys.readouterr().out
    assert code == 0 and "on cpu (float32)" in out and "chosen B = " in out
    bad = tmp_path / "bad.yaml"
    bad.write_text("task: digits_mlp\n")
    assert main(["profile", str(bad)]) == 2
    assert "search_space" in capsys.readouterr().err


class _FakeClock:
    """A clock that advances by the given step durations as steps run (no real timing)."""

    def __init__(self, durations: list[float]) -> None:
        self.now = 0.0
        self.durations = iter(durations)

    def __call__(self) -> float:
        return self.now

    def step(self) -> None:
        self.now += next(self.durations)


def test_time_steps_stops_early_once_the_times_settle() -> None:
    """Steady steps of 10 ms: settled after a fifth of min_seconds (0.2 s of 1 s), not 1 s."""
    from hfsweep.sizing.task import time_steps

    clock = _FakeClock([0.01] * 1000)
    samples = time_steps(clock.step, lambda: None, min_seconds=1.0, min_steps=3, clock=clock)
    assert len(samples) == 20 and clock.now == pytest.approx(0.2)
    assert all(s == pytest.approx(0.01) for s in samples)


def test_time_steps_uses_all_of_min_seconds_while_the_times_scatter() -> None:
    """Interrupted steps (every other one 3x longer) never settle: timed for min_seconds."""
    from hfsweep.sizing.task import time_steps

    clock = _FakeClock([0.01, 0.03] * 1000)
    samples = time_steps(clock.step, lambda: None, min_seconds=1.0, min_steps=3, clock=clock)
    assert clock.now == pytest.approx(1.0) and len(samples) == 50


def test_time_steps_times_blocks_and_honours_min_steps() -> None:
    from hfsweep.sizing.task import time_steps

    clock = _FakeClock([0.01] * 1000)
    syncs: list[float] = []
    samples = time_steps(
        clock.step,
        lambda: syncs.append(clock.now),
        min_seconds=0.0,
        min_steps=9,
        block=4,
        clock=clock,
    )
    assert len(samples) == 3 and len(syncs) == 3  # 12 steps: blocks of 4, one sync each
    assert samples == [pytest.approx(0.01)] * 3


def test_settled_needs_a_precise_median() -> None:
    """The median's standard error (from the interquartile range) must be within 2% of it:
    few samples suffice when they agree, scattered ones need many."""
    from hfsweep.sizing.task import settled

    assert not settled([1.0] * 4)
    assert settled([1.0] * 5)
    assert settled([1.0, 1.01, 0.99, 1.02, 0.98, 5.0])  # one interruption: the median holds
    scattered = [1.0, 1.2, 0.8, 1.3, 0.7, 1.0]
    assert not settled(scattered)
    assert not settled(scattered * 50)  # 300 samples: the median is known to 2.2%
    assert settled(scattered * 100)  # 600: to 1.5%


def test_profile_traces_go_to_the_trainers_cache_and_are_replayed() -> None:
    """With the trainer's trace cache, the profile leaves one training-step trace per measured
    size in it, and the trainer's array of the chosen size replays it (trains without tracing
    its training step), with the same results as a trainer that traced for itself."""
    task = tasks.digits_mlp
    config = {"hidden": 16, "epochs": 1, "max_steps": 3}
    key = task.compatibility_key(config)
    traces: dict = {}
    profile = profile_task(task, config, sizes=[1, 2], min_seconds=0.0, traces=traces)
    assert sorted(k[0] for k in traces) == [1, 2]
    members = [hs.Member(f"m{i}", {**config, "seed": i, "lr": 0.01 * (i + 1)}) for i in range(2)]
    shared = hs.ArrayTrainer(task)
    shared._trace_cache = {key: traces}
    before = dict(traces)
    with_profile = shared.run(members)
    # the training step replayed the profile's trace: no new entry, none replaced
    assert traces.keys() == before.keys()
    assert all(traces[k] is v for k, v in before.items())
    alone = hs.ArrayTrainer(task).run(members)
    for a, b in zip(with_profile, alone, strict=True):
        assert a.history == b.history
    assert profile.measurements
