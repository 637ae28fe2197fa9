"""Every private name of torch, Optuna and Ray that hfsweep relies on, in one place.

hfsweep uses a few names that these libraries do not publish (``_``-prefixed modules and
attributes) where no public API does the job. An upgrade can rename or remove any of them
without notice; gathered here, each has one definition to fix and a test
(tests/test_compat.py) that fails on the release that breaks it, instead of a sweep that breaks
somewhere deep inside. Code elsewhere in the package imports these names from here, never the
private originals.

The tested ranges are those of ``pyproject.toml``'s dependencies: torch >= 2.4, optuna >= 4.0,
ray >= 2.60.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import torch
import torch.utils._pytree as pytree
from torch._ops import OpOverload
from torch.optim import optimizer as _torch_optimizer
from torch.utils._python_dispatch import TorchDispatchMode

if TYPE_CHECKING:
    import optuna

__all__ = [
    "GCS_PROBE",
    "TORCH_BINDING_OWNERS",
    "OpOverload",
    "TorchDispatchMode",
    "ask_with_user_attrs",
    "compile_backward_eagerly",
    "compile_in_this_process",
    "distribution_contains",
    "dynamo_graphs_compiled",
    "dynamo_refused",
    "flatten_dense_tensors",
    "is_batched_tensor",
    "mark_static_address",
    "optimizer_step_observed",
    "pytree",
    "ray_auto_address",
    "ray_is_localhost",
    "ray_localhost_rewritten",
    "ray_loopback_switch",
    "set_trial_param",
    "sparse_tensor_rebuilders",
    "study_id",
    "study_storage",
    "trial_for",
    "trial_id",
    "tune_scheduler_attr",
    "tune_searcher_sampler",
    "unflatten_dense_tensors",
]

# ---------------------------------------------------------------- torch
# torch.utils._pytree: flattening nested outputs (no public pytree API in torch 2.4-2.13);
# TorchDispatchMode: counting and intercepting dispatched operators; OpOverload: the type of
# an ATen operator in a traced graph (torch.fx graphs hold them as node targets).


#: whether a tensor is a functorch ``BatchedTensor`` (inside ``vmap``): the fused layers' own
#: batching rules (BatchNorm, convolutions) take over only there; no public predicate exists.
is_batched_tensor: Callable[[torch.Tensor], bool] = torch._C._functorch.is_batchedtensor


def flatten_dense_tensors(tensors: list[torch.Tensor]) -> torch.Tensor:
    """The tensors' values in one flat tensor (torch's own bucket helper, as DDP uses), so a
    data-parallel array sums all its gradients with one collective."""
    from torch._utils import _flatten_dense_tensors

    return _flatten_dense_tensors(tensors)


def unflatten_dense_tensors(flat: torch.Tensor, like: list[torch.Tensor]) -> list[torch.Tensor]:
    """The inverse of :func:`flatten_dense_tensors`: views of ``flat`` shaped as ``like``."""
    from torch._utils import _unflatten_dense_tensors

    return list(_unflatten_dense_tensors(flat, like))


def mark_static_address(t: torch.Tensor) -> None:
    """Tell torch.compile (CUDA graphs) that ``t`` keeps its address between calls, so a replay
    does not copy it into the graph's own buffer first (no ``torch.compiler`` equivalent)."""
    import torch._dynamo

    torch._dynamo.mark_static_address(t, guard=False)


def functorch_transforms_active() -> bool:
    """Whether a ``torch.func`` transform (``vmap``, ``grad``, ...) is running around this call:
    an ``autograd.Function`` must then have the ``setup_context`` form (no public query)."""
    return bool(torch._C._are_functorch_transforms_active())


@contextmanager
def checkpoint_internals_refused(refusal: Callable[[bool], BaseException]) -> Iterator[None]:
    """While active, ``torch.utils.checkpoint.checkpoint`` raises ``refusal(reentrant)`` where it
    would start a checkpointed region: a call hfsweep's stand-in did not see (through a name
    bound with ``from torch.utils.checkpoint import checkpoint`` before the stand-in was put in
    place). The function's two forms start through these module globals, looked up per call."""
    import torch.utils.checkpoint as module

    def without_reentrant(*args: Any, **kwargs: Any) -> Any:
        raise refusal(False)

    class Reentrant:
        @staticmethod
        def apply(*args: Any, **kwargs: Any) -> Any:
            raise refusal(True)

    names = {
        "_checkpoint_without_reentrant_generator": without_reentrant,
        "CheckpointFunction": Reentrant,
    }
    saved = {name: getattr(module, name) for name in names}
    for name, value in names.items():
        setattr(module, name, value)
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(module, name, value)


def compile_backward_eagerly() -> Any | None:
    """A context manager that makes AOTAutograd compile a graph's backward with its forward
    (at the first call, not at the first backward pass), or ``None`` where this torch lacks the
    setting."""
    import torch._functorch.config as config

    if not hasattr(config, "force_non_lazy_backward_lowering"):
        return None
    return config.patch(force_non_lazy_backward_lowering=True)


def compile_in_this_process() -> None:
    """Have inductor compile in the calling process's own thread from now on
    (``compile_threads = 1``), not in its thread or process pools. A process forked after its
    parent compiled inherits the parent's thread pool object but none of its threads: work it
    submits there never runs, and its first compile hangs (torch resets the process pool after
    a fork, not the thread pool). Where this torch has no such setting, nothing changes."""
    try:
        import torch._inductor.config as config
    except ImportError:
        return
    if hasattr(config, "compile_threads"):
        config.compile_threads = 1


def dynamo_graphs_compiled() -> int:
    """How many graphs dynamo has compiled in this process (``torch._dynamo.utils.counters``; 0
    where this torch does not count them): a call that moved it compiled a new graph, so its
    time is compiling, not a step's."""
    try:
        from torch._dynamo.utils import counters

        return int(counters["stats"]["unique_graphs"])
    except (ImportError, AttributeError, KeyError, TypeError):
        return 0


def dynamo_refused(exc: BaseException) -> bool:
    """Whether ``exc`` is dynamo's refusal to compile a call (an unsupported construct, a backend
    failure, the recompile limit reached), raised before the compiled code runs, so that running
    the same call uncompiled instead changes nothing twice."""
    import torch._dynamo.exc as dynamo_exc

    refusals: tuple[type[BaseException], ...] = (dynamo_exc.TorchDynamoException,)
    limit = getattr(dynamo_exc, "FailOnRecompileLimitHit", None)
    if isinstance(limit, type):
        refusals = (*refusals, limit)
    return isinstance(exc, refusals)


def optimizer_step_observed(optimizer: torch.optim.Optimizer) -> bool:
    """Whether anything watches ``optimizer``'s steps through the wrapper torch puts around every
    optimizer's ``step`` (``Optimizer.profile_hook_step``): a step pre- or post-hook of its own
    or of every optimizer (torch keeps those in ``torch.optim.optimizer``'s module-level dicts),
    or a running profiler (``torch.autograd._profiler_enabled``), which records the step's
    range. No public query tells."""
    return bool(
        optimizer._optimizer_step_pre_hooks
        or optimizer._optimizer_step_post_hooks
        or _torch_optimizer._global_optimizer_pre_hooks
        or _torch_optimizer._global_optimizer_post_hooks
        or torch.autograd._profiler_enabled()
    )


#: where torch's generated C bindings live: the functions of ``torch`` and the methods of tensors
TORCH_BINDING_OWNERS: tuple[Any, ...] = (torch._C._VariableFunctions, torch._C.TensorBase)


def sparse_tensor_rebuilders() -> list[Callable[..., Any]]:
    """The functions a pickled sparse tensor names (allowed when loading a checkpoint)."""
    return [torch.serialization._get_layout, torch._utils._rebuild_sparse_tensor]


# ---------------------------------------------------------------- optuna


# Optuna's private classes a storage implementing Optuna's interface needs are in
# hfsweep/_compat_optuna.py, so that importing this module (the fusion core does) does not
# import Optuna.


def study_storage(study: optuna.Study) -> Any:
    """The storage ``study`` reads and writes (Optuna's own object, wrappers included)."""
    return study._storage


def study_id(study: optuna.Study) -> int:
    """The storage's id of ``study``."""
    return int(study._study_id)


def trial_for(study: optuna.Study, frozen: optuna.trial.FrozenTrial) -> optuna.Trial:
    """A live :class:`optuna.Trial` for a RUNNING trial read back from the storage (a resumed
    sweep reports to and tells trials it did not ask in this process). Optuna has no public way
    to reattach to a running trial."""
    import optuna

    return optuna.Trial(study, frozen._trial_id)


def ask_with_user_attrs(study: optuna.Study, user_attrs: Mapping[str, Any]) -> optuna.Trial:
    """``study.ask()``, whose trial carries ``user_attrs`` from its first write: a trial it
    creates is created with them (one storage write: one transaction of a database, one
    journal record), so a process killed just after leaves no trial without them. A trial
    taken from the study's queue of enqueued trials (Optuna's ``WAITING``) gets them just
    after it is taken, as ``study.ask()`` then ``set_user_attr`` would. Otherwise as
    ``study.ask()``: the queue first, the sampler's ``before_trial``; Optuna's ``ask`` has no
    argument for a trial's first attrs, hence its steps here."""
    import datetime

    import optuna
    from optuna.trial import FrozenTrial, TrialState

    storage = study._storage
    study._thread_local.cached_all_trials = None  # as ask(): read the storage afresh
    ident = study._pop_waiting_trial_id()
    if ident is None:
        template = FrozenTrial(
            number=-1,  # the storage numbers it
            state=TrialState.RUNNING,
            value=None,
            datetime_start=datetime.datetime.now(),
            datetime_complete=None,
            params={},
            distributions={},
            user_attrs=dict(user_attrs),
            system_attrs={},
            intermediate_values={},
            trial_id=-1,
        )
        ident = storage.create_new_trial(study._study_id, template_trial=template)
    else:
        for key, value in user_attrs.items():
            storage.set_trial_user_attr(ident, key, value)
    return optuna.Trial(study, ident)


def trial_id(trial: optuna.Trial | optuna.trial.FrozenTrial) -> int:
    """The storage's id of ``trial`` (Optuna numbers trials per study; storages key them by id)."""
    return int(trial._trial_id)


def set_trial_param(
    trial: optuna.Trial, name: str, internal: float, dist: optuna.distributions.BaseDistribution
) -> None:
    """Record a parameter a custom searcher chose for ``trial`` (its internal representation),
    as ``trial.suggest_*`` would after sampling it."""
    trial.storage.set_trial_param(trial._trial_id, name, internal, dist)


def distribution_contains(dist: optuna.distributions.BaseDistribution, internal: float) -> bool:
    """Whether the internal representation ``internal`` lies in ``dist``."""
    return bool(dist._contains(internal))


# ---------------------------------------------------------------- ray


#: a child process's script that asks the GCS server at ``argv[1]`` for its live nodes within
#: ``argv[2]`` seconds and prints their number (Ray's client has no public, bounded probe)
GCS_PROBE = (
    "import sys\n"
    "from ray._raylet import GcsClient\n"
    "nodes = GcsClient(address=sys.argv[1]).get_all_node_info(timeout=float(sys.argv[2]))\n"
    "print(sum(1 for n in nodes.values() if n.state == 0))\n"
)


def ray_loopback_switch() -> Any | None:
    """The module holding Ray's ``ENABLE_RAY_CLUSTER`` switch, which makes ``ray.init`` rewrite
    a loopback address to another address of the machine (what the environment variable
    ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER`` sets when ``ray`` is imported); None where this Ray
    has no such switch."""
    from ray._private import ray_constants

    return ray_constants if hasattr(ray_constants, "ENABLE_RAY_CLUSTER") else None


def ray_auto_address() -> str | None:
    """The address ``ray.init(address="auto")`` would connect to: ``RAY_ADDRESS``, else the
    cluster started last on this machine (raises where several are found)."""
    from ray._private import services

    found = services.get_ray_address_from_environment("auto", None)
    return str(found) if found else None


def ray_is_localhost(host: str) -> bool:
    """Whether Ray treats ``host`` as a loopback address it rewrites."""
    try:
        from ray._common.network_utils import is_localhost
    except ImportError:
        return host in ("localhost", "127.0.0.1", "::1")
    return bool(is_localhost(host))


def ray_localhost_rewritten(host: str) -> str:
    """The address Ray connects to in place of the loopback ``host``."""
    try:
        from ray._private import services

        return str(services.resolve_ip_for_localhost(host))
    except Exception:  # no other address
        return host


def tune_scheduler_attr(scheduler: Any, name: str) -> Any:
    """A Tune trial scheduler's private attribute (``_stopped_trials`` of the median stopping
    rule, ``_max_t`` and ``_time_attr`` of ASHA), or None where this release has none."""
    return getattr(scheduler, name, None)


def tune_searcher_sampler(searcher: Any) -> Any:
    """The Optuna sampler inside Tune's ``OptunaSearch`` (None for other searchers)."""
    return getattr(searcher, "_sampler", None)
