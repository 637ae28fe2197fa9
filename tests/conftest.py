from __future__ import annotations

import logging
import os
import signal
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from _ready import SERVER_START_S, start_with_retries

#: the tests that start a local Ray (nodeid prefixes): under xdist (``-n``) they run on one
#: worker, one after another, and first (see :func:`pytest_xdist_make_scheduler`). Two Rays of
#: 2 CPUs at once would starve each other on a 2-core machine, a module's Ray (and its Tune
#: experiment) would start again on each worker its tests were spread over, and run last they
#: would leave one worker busy while the other idles.
RAY_TESTS = (
    "tests/sweep/test_ray_backend.py::",
    "tests/tune/test_tune_ray.py::",
    # the LoRA task through the Tune plugin, on the shared Ray
    "tests/tune/test_tune_lora.py::",
    # RunConfig(stop=...) and tune.with_parameters under a Fusion, on the shared Ray
    "tests/tune/test_tune_stop.py::",
    # Fusion's compile and offload in Tune runs, on the shared Ray
    "tests/tune/test_tune_array_settings.py::",
    # experiment trackers on the driver of a sweep with backend: ray, on the shared Ray
    "tests/tracking/test_ray.py::",
    # a three-node Ray cluster on loopback (ray.cluster_utils.Cluster) per test
    "tests/sweep/test_ray_cluster.py::",
    # the Tune plugin on such a cluster, a worker node removed mid-experiment
    "tests/tune/test_tune_cluster.py::",
    # `hfsweep run` with backend: ray in subprocesses, each with a local Ray of its own
    "tests/sweep/test_kill_resume.py::test_sigkill_then_resume_finishes_the_sweep[ray",
    # elastic arrays on the shared Ray: data-parallel workers as actors, two sweeps per test
    "tests/sweep/test_ray_elastic.py::",
    # the lifecycle over the Ray executor and the Tune plugin, each process with a Ray of its own
    "tests/test_lifecycle.py::test_a_killed_sweep_resumes_to_the_same_end[ray-",
    # a data-parallel array's workers as actors in a placement group, on the shared Ray
    "tests/parallel/test_ray_data_parallel.py::",
    # a data-parallel array resized on the shared Ray, its actors kept across the resize
    "tests/parallel/test_ray_resize.py::",
    # a benchmark's smoke run with its own local Ray (ray.init in the script)
    "tests/test_benchmarks.py::test_sweep_end_to_end_quick_runs",
    # the README's Tune quick start, on the shared Ray
    "tests/test_docs.py::test_python_block_with_ray_runs",
)


def _ray_tests_together(items: list[pytest.Item]) -> None:
    """Within :data:`RAY_TESTS`, the tests on the shared Ray (``shared_ray``) first, then those
    that start a Ray of their own, each part in collection order; the other tests keep their
    places. The shared Ray then starts once for the lot instead of once per run of its users
    between the others (each start is seconds of a worker's time)."""
    places = [i for i, item in enumerate(items) if item.nodeid.startswith(RAY_TESTS)]
    ray_items = [items[i] for i in places]
    ray_items.sort(key=lambda item: "shared_ray" not in getattr(item, "fixturenames", ()))
    for i, item in zip(places, ray_items, strict=True):
        items[i] = item


_TESTS = Path(__file__).resolve().parent


def pytest_configure(config: pytest.Config) -> None:
    """Profiles cached by the tests go to a folder of this run's own (inherited by xdist workers
    and Ray workers), never to the user's ~/.cache/hfsweep: a profile another run left there
    would skip profiling that a test expects."""
    if "HFSWEEP_CACHE_DIR" not in os.environ:
        os.environ["HFSWEEP_CACHE_DIR"] = tempfile.mkdtemp(prefix="hfsweep-test-cache-")
    # Tests compare runs value for value (a resumed run against an uninterrupted one): torch's
    # thread count must not follow the machine's load between them, which changes the rounding
    # of CPU reductions. The tests of that choice (tests/training/test_threads.py) unset it.
    os.environ.setdefault("HFSWEEP_CPU_THREADS", "torch")


#: SIGINT's and SIGTERM's handlers as the test process started (Python's defaults)
_HANDLERS = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}


@pytest.fixture(autouse=True)
def _signal_handlers_as_at_start() -> Iterator[None]:
    """Every test ends with SIGINT's and SIGTERM's handlers as the process started: a library
    a test or a module's fixture ran may leave its own (Ray Tune's SIGINT handler, which only
    logs; ``ray.init``'s SIGTERM handler), and a later test of hfsweep's signal handling would
    meet it instead of Python's defaults."""
    yield
    for signum, handler in _HANDLERS.items():
        if handler is not None and signal.getsignal(signum) is not handler:
            signal.signal(signum, handler)


@pytest.fixture(autouse=True)
def _deterministic_torch():
    """Every test starts from the same global RNG state and torch's default dtype."""
    torch.manual_seed(0)
    yield
    torch.set_default_dtype(torch.float32)


def pytest_collection_modifyitems(config, items):
    _ray_tests_together(items)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.hookimpl(optionalhook=True)  # an xdist hook: no error without xdist (-p no:xdist)
def pytest_xdist_make_scheduler(config, log):
    """``-n`` (``--dist load``): each test is a unit of its own, handed out in collection order
    to whichever worker runs low, except :data:`RAY_TESTS`: one unit, handed out first."""
    if config.getoption("dist") != "load":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class RayTogether(LoadScopeScheduling):
        # the largest unit is handed out first (xdist's --loadscope-reorder, the default)
        def _split_scope(self, nodeid: str) -> str:
            return "ray" if nodeid.startswith(RAY_TESTS) else nodeid

    return RayTogether(config, log)


class SharedRay:
    """One local Ray for the tests of this process that use one in-process (the ``shared_ray``
    fixture): 2 CPUs, loopback, no dashboard. Started when the first such test needs it, shut
    down as soon as the next test does not (see :func:`pytest_runtest_teardown`), so a test that
    must start a Ray of its own finds none, and no idle Ray runs beside the other tests.

    Ray's workers inherit the environment Ray starts with, so everything they need is set here,
    before ``ray.init``, and put back at shutdown: ``tests/`` on ``PYTHONPATH`` (workers import
    ``sweep._toy`` and ``sweep._crashy``), and the files the crash-once tasks look for:
    ``HFSWEEP_TEST_CRASH_FLAG`` (tests/sweep/_crashy.py) and ``HFSWEEP_TUNE_TEST_CRASH_DIR``
    (tests/tune/_tune_toy.py).
    """

    def __init__(self, root: Path) -> None:
        self.root = root
        self._saved: dict[str, str | None] | None = None

    def start(self) -> None:
        import ray

        if self._saved is not None and ray.is_initialized():
            return
        assert not ray.is_initialized(), "a Ray this fixture did not start is running"
        crash_dir = self.root / "tune-crash"
        crash_dir.mkdir(exist_ok=True)
        path = os.environ.get("PYTHONPATH")
        env = {
            "PYTHONPATH": str(_TESTS) + (os.pathsep + path if path else ""),
            "HFSWEEP_TEST_CRASH_FLAG": str(self.root / "die-once"),
            "HFSWEEP_TUNE_TEST_CRASH_DIR": str(crash_dir),
            "RAY_DEDUP_LOGS": "0",
            # Ray's wait for its GCS to bind a port (30 s by default) is too short under load
            "RAY_gcs_server_port_wait_time_s": str(SERVER_START_S),
        }
        self._saved = {k: os.environ.get(k) for k in env}
        os.environ.update(env)
        from hfsweep.executors._connect import on_loopback

        def init() -> None:
            with on_loopback():  # else Ray moves 127.0.0.1 to another address of the machine
                ray.init(
                    address="local",  # a Ray of its own, even where a `ray start` cluster runs
                    num_cpus=2,
                    include_dashboard=False,
                    _node_ip_address="127.0.0.1",
                    logging_level=logging.WARNING,
                    log_to_driver=False,
                    configure_logging=False,
                )

        try:
            # Ray's raylet has a fixed 30 s to register, which a loaded machine can miss
            start_with_retries("the tests' shared local Ray", init, ray.shutdown)
        except BaseException:
            self.stop()
            raise

    def stop(self) -> None:
        import ray

        if self._saved is None:
            return
        try:
            ray.shutdown()
        finally:
            for k, v in self._saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
            self._saved = None


_shared_ray: SharedRay | None = None


@pytest.fixture(scope="session")
def shared_ray(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SharedRay]:
    """This process's :class:`SharedRay`; a fixture that needs Ray up calls its ``start()``."""
    global _shared_ray
    pytest.importorskip("ray")
    _shared_ray = SharedRay(tmp_path_factory.mktemp("shared_ray"))
    try:
        yield _shared_ray
    finally:
        _shared_ray.stop()
        _shared_ray = None


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    try:
        return (yield)
    finally:
        # the test's fixtures (and its module's, if it was the module's last) are torn down
        if _shared_ray is not None and (
            nextitem is None or "shared_ray" not in getattr(nextitem, "fixturenames", ())
        ):
            _shared_ray.stop()


def _postgres_server() -> Iterator[object]:
    """A real PostgreSQL server on loopback (see tests/_postgres.py), closed when the fixture
    ends; skips with the reason where its binaries or the postgres extra are absent."""
    from _postgres import PostgresServer, skip_reason

    reason = skip_reason()
    if reason is not None:
        pytest.skip(reason)
    server = PostgresServer()
    try:
        yield server
    finally:
        server.close()


@pytest.fixture(scope="session")
def postgres_server_shared() -> Iterator[object]:
    """One PostgreSQL server for the session (see :func:`_postgres_server`)."""
    yield from _postgres_server()


@pytest.fixture
def postgres(postgres_server_shared) -> str:
    """The URL of a new, empty database on the session's PostgreSQL server."""
    return postgres_server_shared.create_database()


@pytest.fixture
def postgres_server() -> Iterator[object]:
    """A PostgreSQL server of this test's own, for tests that stop or restart it."""
    yield from _postgres_server()
