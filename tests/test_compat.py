"""The private names of torch, Optuna and Ray that hfsweep relies on (hfsweep/_compat.py) still
work in the installed releases, and those releases lie in the ranges pyproject.toml admits.

A release that renames one of them fails here, naming it, instead of deep inside a sweep.
"""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any

import optuna
import pytest
import torch
from optuna.storages import JournalStorage
from optuna.storages.journal import JournalFileBackend
from optuna.trial import TrialState
from packaging.version import Version

from hfsweep import _compat

_PYPROJECT = Path(__file__).resolve().parents[1] / "pyproject.toml"


def _lower_bound(package: str) -> Version:
    """The lower bound pyproject.toml's dependencies give ``package``."""
    found = re.search(rf'^\s*"{package}(\[[^\]]*\])?>=([^",;]+)', _PYPROJECT.read_text(), re.M)
    assert found is not None, f"{package} has no lower bound in pyproject.toml's dependencies"
    return Version(found.group(2))


@pytest.mark.parametrize(
    "package, version",
    [
        ("torch", torch.__version__.split("+")[0]),
        ("optuna", optuna.__version__),
        ("ray", __import__("ray").__version__),
    ],
)
def test_installed_release_is_in_the_supported_range(package: str, version: str) -> None:
    assert Version(version) >= _lower_bound(package)


def test_torch_private_names() -> None:
    leaves, spec = _compat.pytree.tree_flatten({"a": (torch.ones(1), [torch.zeros(2)])})
    assert len(leaves) == 2
    assert _compat.pytree.tree_unflatten(leaves, spec)["a"][1][0].shape == (2,)
    assert isinstance(torch.ops.aten.add.Tensor, _compat.OpOverload)
    assert not _compat.functorch_transforms_active()
    inside = torch.func.vmap(lambda t: t * float(_compat.functorch_transforms_active()))(
        torch.ones(3)
    )
    assert torch.equal(inside, torch.ones(3))

    seen: list[Any] = []

    class Count(_compat.TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
            seen.append(func)
            return func(*args, **(kwargs or {}))

    with Count():
        torch.ones(2) + 1
    assert torch.ops.aten.add.Tensor in seen

    dense = torch.eye(3)
    sparse = dense.to_sparse()
    import io

    buffer = io.BytesIO()
    torch.save(sparse, buffer)
    buffer.seek(0)
    with torch.serialization.safe_globals(_compat.sparse_tensor_rebuilders()):
        loaded = torch.load(buffer, weights_only=True)
    assert torch.equal(loaded.to_dense(), dense)


def test_optuna_private_names() -> None:
    study = optuna.create_study()
    trial = study.ask()
    dist = optuna.distributions.FloatDistribution(0.0, 1.0)
    assert _compat.distribution_contains(dist, 0.5)
    assert not _compat.distribution_contains(dist, 2.0)
    _compat.set_trial_param(trial, "x", 0.25, dist)
    frozen = study.get_trials(deepcopy=False)[0]
    assert frozen.params == {"x": 0.25}
    again = _compat.trial_for(study, frozen)
    again.report(1.5, step=0)
    study.tell(again, 0.75)
    done = study.get_trials(deepcopy=False)[0]
    assert done.value == 0.75 and done.intermediate_values == {0: 1.5}
    assert math.isclose(done.params["x"], 0.25)


def test_optuna_ask_with_user_attrs(tmp_path: Path) -> None:
    """A new trial carries the attrs in its create record; an enqueued one is taken from the
    queue first (as ``study.ask()`` does) and gets them too; the sampler sees each trial."""
    storage = JournalStorage(JournalFileBackend(str(tmp_path / "j")))
    seen: list[int] = []

    class Sampler(optuna.samplers.RandomSampler):
        def before_trial(self, study: optuna.Study, trial: optuna.trial.FrozenTrial) -> None:
            seen.append(trial.number)

    study = optuna.create_study(study_name="s", storage=storage, sampler=Sampler(seed=0))
    study.enqueue_trial({"x": 0.5})
    first = _compat.ask_with_user_attrs(study, {"k": 1})
    second = _compat.ask_with_user_attrs(study, {"k": 2})
    assert first.suggest_float("x", 0, 1) == 0.5  # the enqueued one
    assert (first.number, second.number) == (0, 1) and seen == [0, 1]
    creates = [
        log for log in JournalFileBackend(str(tmp_path / "j")).read_logs(0) if log["op_code"] == 4
    ]
    assert [log.get("user_attrs") for log in creates] == [{}, {"k": 2}]  # born with them
    assert [t.user_attrs for t in study.get_trials()] == [{"k": 1}, {"k": 2}]
    assert {t.state for t in study.get_trials()} == {TrialState.RUNNING}


def test_tune_private_attributes() -> None:
    from ray.tune.schedulers import ASHAScheduler, MedianStoppingRule
    from ray.tune.search.optuna import OptunaSearch

    asha = ASHAScheduler(time_attr="training_iteration", max_t=9, metric="m", mode="max")
    assert _compat.tune_scheduler_attr(asha, "_max_t") == 9
    assert _compat.tune_scheduler_attr(asha, "_time_attr") == "training_iteration"
    median = MedianStoppingRule(metric="m", mode="max")
    assert isinstance(_compat.tune_scheduler_attr(median, "_stopped_trials"), set)
    sampler = optuna.samplers.RandomSampler(seed=0)
    search = OptunaSearch(
        space={"x": optuna.distributions.FloatDistribution(0, 1)},
        metric="m",
        mode="max",
        sampler=sampler,
    )
    assert _compat.tune_searcher_sampler(search) is sampler


def test_optuna_trial_id() -> None:
    study = optuna.create_study()
    trial = study.ask()
    frozen = study.get_trials(deepcopy=False)[0]
    assert _compat.trial_id(trial) == _compat.trial_id(frozen)
    assert study._storage.get_trial(_compat.trial_id(trial)).number == 0


def test_ray_private_names(monkeypatch: pytest.MonkeyPatch) -> None:
    switch = _compat.ray_loopback_switch()
    assert switch is not None and isinstance(switch.ENABLE_RAY_CLUSTER, bool)
    assert _compat.ray_is_localhost("127.0.0.1") and _compat.ray_is_localhost("localhost")
    assert not _compat.ray_is_localhost("192.0.2.7")
    assert isinstance(_compat.ray_localhost_rewritten("127.0.0.1"), str)
    monkeypatch.setenv("RAY_ADDRESS", "127.0.0.1:6390")
    assert _compat.ray_auto_address() == "127.0.0.1:6390"


def test_no_private_name_outside_the_compat_module() -> None:
    """Code outside hfsweep/_compat.py (and _compat_optuna.py) reaches torch's, Optuna's and Ray's private names only
    through it (torch's ``_foreach_*`` kernels excepted: torch.optim's own building blocks)."""
    root = Path(__file__).resolve().parents[1]
    private = re.compile(
        r"torch\.utils\._|torch\._(ops|utils|C)\b|serialization\._|\bray\._|"
        r"\boptuna\.\w*\._|from optuna\._|\._trial_id\b|\._contains\(|study\._st"
    )
    found = [
        f"{path.relative_to(root)}:{number}: {line.strip()}"
        for folder in ("hfsweep", "schedulers", "search_spaces")
        for path in sorted((root / folder).rglob("*.py"))
        if path.name not in ("_compat.py", "_compat_optuna.py")
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if private.search(line.split("#", 1)[0])
    ]
    assert found == []


def test_optuna_private_classes() -> None:
    from optuna.storages import BaseStorage

    from hfsweep._compat_optuna import BaseHeartbeat, FrozenStudy

    study = optuna.create_study(study_name="compat")
    storage = study._storage
    assert isinstance(storage, BaseStorage)
    assert all(isinstance(s, FrozenStudy) for s in storage.get_all_studies())
    rdb = optuna.storages.RDBStorage("sqlite:///:memory:", heartbeat_interval=60)
    assert isinstance(rdb, BaseHeartbeat) and rdb.get_heartbeat_interval() == 60


def test_torch_private_names_of_the_fused_layers_and_compile() -> None:
    """The functorch batched-tensor predicate, torch's flat bucket helpers (data-parallel
    arrays) and the two torch.compile settings (CUDA-graph static addresses, eager backward
    compilation) still exist and do what hfsweep relies on."""
    seen: list[bool] = []

    def probe(t: torch.Tensor) -> torch.Tensor:
        seen.append(_compat.is_batched_tensor(t))
        return t * 2

    torch.vmap(probe)(torch.ones(3, 2))
    assert seen == [True]
    assert not _compat.is_batched_tensor(torch.ones(2))

    tensors = [torch.arange(3.0), torch.ones(2, 2)]
    flat = _compat.flatten_dense_tensors(tensors)
    assert flat.tolist() == [0.0, 1.0, 2.0, 1.0, 1.0, 1.0, 1.0]
    back = _compat.unflatten_dense_tensors(flat * 2, tensors)
    assert [t.shape for t in back] == [(3,), (2, 2)]
    assert torch.equal(back[0], torch.arange(3.0) * 2)

    _compat.mark_static_address(torch.zeros(2))  # no error: the setting exists
    patch = _compat.compile_backward_eagerly()
    assert patch is not None  # torch 2.13 has it; None on a release that drops it
    import torch._functorch.config as config

    with patch:
        assert config.force_non_lazy_backward_lowering is True


def test_optimizer_step_observed_sees_hooks_and_the_profiler() -> None:
    """torch's per-optimizer and global step hooks, and a running profiler, are what
    ``optimizer_step_observed`` reads (the fused optimizers then step through torch's wrapper)."""
    from torch.optim.optimizer import register_optimizer_step_post_hook

    opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)
    assert not _compat.optimizer_step_observed(opt)
    handle = opt.register_step_pre_hook(lambda o, a, k: None)
    assert _compat.optimizer_step_observed(opt)
    handle.remove()
    handle = register_optimizer_step_post_hook(lambda o, a, k: None)
    assert _compat.optimizer_step_observed(opt)
    handle.remove()
    assert not _compat.optimizer_step_observed(opt)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]):
        assert _compat.optimizer_step_observed(opt)
    assert not _compat.optimizer_step_observed(opt)
