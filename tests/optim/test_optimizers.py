"""Fused optimizers against torch.optim's plain single-tensor loop (foreach=False), per member.

Every case gives each member different hyperparameters and trains B models fused and B copies with
their own torch optimizer for 100 steps on the same data; parameters, state (momentum buffers,
Adam moments...) and the exported state dicts must agree.
"""

from __future__ import annotations

import copy
import inspect
from typing import Any

import pytest
import torch
import torch.nn.functional as F

import hfsweep as hs
from hfsweep.testing import MLP

B = 3

CASES: dict[str, tuple[type, type, list[dict[str, Any]], dict[str, Any]]] = {
    "SGD": (
        hs.optim.SGD,
        torch.optim.SGD,
        [
            {"lr": 0.1, "momentum": 0.9, "dampening": 0.1, "weight_decay": 0.01},
            {"lr": 0.05},
            {"lr": 0.02, "momentum": 0.5, "weight_decay": 0.1},
        ],
        {},
    ),
    "SGD-momentum-weight-decay": (  # no dampening: the multi-tensor path
        hs.optim.SGD,
        torch.optim.SGD,
        [
            {"lr": 0.1, "momentum": 0.9, "weight_decay": 0.01},
            {"lr": 0.05},
            {"lr": 0.02, "momentum": 0.5, "weight_decay": 0.1},
        ],
        {},
    ),
    "SGD-nesterov-maximize": (
        hs.optim.SGD,
        torch.optim.SGD,
        [
            {"lr": 0.01, "momentum": 0.9},
            {"lr": 0.005, "momentum": 0.5},
            {"lr": 0.002, "momentum": 0.1, "weight_decay": 0.1},
        ],
        {"nesterov": True, "maximize": True},
    ),
    "Adam": (
        hs.optim.Adam,
        torch.optim.Adam,
        [
            {"lr": 1e-2, "betas": (0.9, 0.99), "eps": 1e-6, "weight_decay": 0.1},
            {"lr": 1e-3},
            {"lr": 3e-3, "betas": (0.8, 0.9)},
        ],
        {},
    ),
    "Adam-amsgrad": (
        hs.optim.Adam,
        torch.optim.Adam,
        [
            {"lr": 1e-2},
            {"lr": 1e-3, "weight_decay": 0.01},
            {"lr": 3e-3, "betas": (0.8, 0.9)},
        ],
        {"amsgrad": True},
    ),
    "AdamW": (
        hs.optim.AdamW,
        torch.optim.AdamW,
        [
            {"lr": 1e-2, "weight_decay": 0.1},
            {"lr": 1e-3},
            {"lr": 3e-3, "betas": (0.8, 0.9), "weight_decay": 0.0},
        ],
        {},
    ),
    "AdamW-amsgrad-maximize": (
        hs.optim.AdamW,
        torch.optim.AdamW,
        [
            {"lr": 1e-3, "weight_decay": 0.1},
            {"lr": 2e-3},
            {"lr": 5e-4, "eps": 1e-6},
        ],
        {"amsgrad": True, "maximize": True},
    ),
    "RMSprop": (
        hs.optim.RMSprop,
        torch.optim.RMSprop,
        [
            {"lr": 1e-2, "alpha": 0.9, "momentum": 0.5, "weight_decay": 0.01},
            {"lr": 1e-3},
            {"lr": 3e-3, "eps": 1e-5, "momentum": 0.9},
        ],
        {},
    ),
    "RMSprop-centered": (
        hs.optim.RMSprop,
        torch.optim.RMSprop,
        [
            {"lr": 1e-2, "alpha": 0.9, "momentum": 0.5},
            {"lr": 1e-3},
            {"lr": 3e-3, "eps": 1e-5},
        ],
        {"centered": True},
    ),
    "Adagrad": (
        hs.optim.Adagrad,
        torch.optim.Adagrad,
        [
            {"lr": 1e-1, "lr_decay": 0.01, "initial_accumulator_value": 0.1},
            {"lr": 1e-2},
            {"lr": 3e-2, "weight_decay": 0.1, "eps": 1e-8},
        ],
        {},
    ),
}


def fused_kwargs(torch_cls: type, per_member: list[dict[str, Any]]) -> dict[str, Any]:
    """{name: [value of member 0, 1, ...]} with torch's defaults filled in."""
    sig = inspect.signature(torch_cls.__init__)
    out: dict[str, Any] = {}
    for name in set().union(*per_member):
        values = [h.get(name, sig.parameters[name].default) for h in per_member]
        out[name] = ([v[0] for v in values], [v[1] for v in values]) if name == "betas" else values
    return out


def build(name: str, dtype: torch.dtype = torch.float64, seed: int = 0):
    fused_cls, torch_cls, per_member, options = CASES[name]
    torch.manual_seed(seed)
    models = [MLP(d_in=6, hidden=8, d_out=3).to(dtype) for _ in range(B)]
    refs = [copy.deepcopy(m) for m in models]
    array = hs.fuse(models)
    opt = fused_cls(array, **fused_kwargs(torch_cls, per_member), **options)
    ref_opts = [
        torch_cls(r.parameters(), **h, **options, foreach=False)
        for r, h in zip(refs, per_member, strict=True)
    ]
    return array, opt, refs, ref_opts


def train(
    array,
    opt,
    refs,
    ref_opts,
    steps: int,
    dtype=torch.float64,
    seed: int = 1,
    active=None,
    same_grads: bool = False,
):
    """Train both sides on the same batches. ``same_grads`` hands the references the fused
    gradients, so only the optimizers' arithmetic is compared (for float32, where tiny gradient
    differences get amplified by normalised updates). A maximizing optimizer ascends -loss."""
    sign = -1.0 if opt.param_groups[0].get("maximize") else 1.0
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x = torch.randn(5, 6, generator=gen, dtype=dtype)
        y = torch.randint(0, 3, (5,), generator=gen)
        opt.zero_grad()
        (sign * hs.member_losses(array(x), y).sum()).backward()
        for i, (r, o) in enumerate(zip(refs, ref_opts, strict=True)):
            if active is not None and not active[i]:
                continue
            o.zero_grad()
            if same_grads:
                for p, q in zip(r.parameters(), array.parameters(), strict=True):
                    p.grad = q.grad[i].clone()
            else:
                (sign * F.cross_entropy(r(x), y)).backward()
            o.step()
        opt.step()


def assert_members_match(array, opt, refs, ref_opts, rtol=1e-7, atol=1e-10, members=None) -> None:
    for i in members if members is not None else range(B):
        for (name, p), q in zip(
            refs[i].named_parameters(), array.member(i).parameters(), strict=True
        ):
            torch.testing.assert_close(q, p, rtol=rtol, atol=atol, msg=f"member {i} {name}")
        mine, theirs = opt.member_state_dict(i), ref_opts[i].state_dict()
        # the reference runs torch's plain loop (foreach=False); the export keeps torch's default
        drop = ("foreach",)
        assert [{k: v for k, v in g.items() if k not in drop} for g in mine["param_groups"]] == [
            {k: v for k, v in g.items() if k not in drop} for g in theirs["param_groups"]
        ]
        assert mine["state"].keys() == theirs["state"].keys()
        for k, st in theirs["state"].items():
            assert mine["state"][k].keys() == st.keys()
            for key, value in st.items():
                if value is None:
                    assert mine["state"][k][key] is None
                else:
                    torch.testing.assert_close(
                        mine["state"][k][key].to(value.dtype),
                        value,
                        rtol=rtol,
                        atol=atol,
                        msg=f"member {i} state {k}.{key}",
                    )


@pytest.mark.parametrize("name", sorted(CASES))
def test_matches_torch_per_member_float64(name: str) -> None:
    array, opt, refs, ref_opts = build(name)
    train(array, opt, refs, ref_opts, steps=100)
    assert_members_match(array, opt, refs, ref_opts)


@pytest.mark.parametrize("name", sorted(CASES))
def test_matches_torch_per_member_float32(name: str) -> None:
    """float32, same gradients on both sides: the optimizers' arithmetic agrees to rtol 1e-4."""
    array, opt, refs, ref_opts = build(name, dtype=torch.float32)
    train(array, opt, refs, ref_opts, steps=100, dtype=torch.float32, same_grads=True)
    assert_members_match(array, opt, refs, ref_opts, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize(
    "name", ["SGD", "SGD-momentum-weight-decay", "Adam", "RMSprop-centered", "Adagrad"]
)
def test_inactive_member_is_frozen_and_others_unaffected(name: str) -> None:
    array, opt, refs, ref_opts = build(name)
    train(array, opt, refs, ref_opts, steps=5)
    frozen_params = [p.detach().clone() for p in array.member(1).parameters()]
    frozen_state = opt.member_state_dict(1)
    opt.set_active(1, False)
    train(array, opt, refs, ref_opts, steps=20, seed=2, active=[True, False, True])
    for p, q in zip(frozen_params, array.member(1).parameters(), strict=True):
        assert torch.equal(p, q)
    after = opt.member_state_dict(1)
    for k, st in frozen_state["state"].items():
        for key, value in st.items():
            if value is not None:
                assert torch.equal(after["state"][k][key], value)
    assert_members_match(array, opt, refs, ref_opts, members=[0, 2])
    opt.set_active(1, True)  # back in: continues exactly where it stopped
    train(array, opt, refs, ref_opts, steps=10, seed=3)
    assert_members_match(array, opt, refs, ref_opts)


@pytest.mark.parametrize("name", ["SGD", "Adam", "AdamW", "RMSprop", "Adagrad"])
def test_reset_member_starts_a_new_trial_in_the_slot(name: str) -> None:
    _, torch_cls, per_member, options = CASES[name]
    array, opt, refs, ref_opts = build(name)
    train(array, opt, refs, ref_opts, steps=10)
    torch.manual_seed(7)
    newcomer = MLP(d_in=6, hidden=8, d_out=3).double()
    array.load_member(2, newcomer)
    new_lr = per_member[2]["lr"] / 2
    opt.reset_member(2, lr=new_lr)
    refs[2] = copy.deepcopy(newcomer)
    ref_opts[2] = torch_cls(
        refs[2].parameters(), **{**per_member[2], "lr": new_lr}, **options, foreach=False
    )
    train(array, opt, refs, ref_opts, steps=30, seed=4)
    assert_members_match(array, opt, refs, ref_opts)
    assert opt.hyperparameters(2)["lr"] == pytest.approx(new_lr)


@pytest.mark.parametrize("name", ["SGD", "Adam-amsgrad", "RMSprop-centered", "Adagrad"])
def test_member_state_round_trips_through_torch(name: str) -> None:
    """Export member 0 to torch, load a torch optimizer's state into member 1, keep training."""
    _, torch_cls, per_member, options = CASES[name]
    array, opt, refs, ref_opts = build(name)
    train(array, opt, refs, ref_opts, steps=8)
    # member 1 takes over member 0's weights and optimizer state (e.g. a resumed checkpoint)
    array.load_member(1, refs[0])
    opt.load_member_state_dict(1, ref_opts[0].state_dict())
    refs[1] = copy.deepcopy(refs[0])
    ref_opts[1] = torch_cls(refs[1].parameters(), **per_member[0], **options, foreach=False)
    # torch's load_state_dict keeps same-device tensors as they are: copy, or both share buffers
    ref_opts[1].load_state_dict(copy.deepcopy(ref_opts[0].state_dict()))
    train(array, opt, refs, ref_opts, steps=15, seed=5)
    assert_members_match(array, opt, refs, ref_opts)


@pytest.mark.parametrize("name", ["SGD", "SGD-momentum-weight-decay", "Adam"])
def test_hyperparameters_changed_between_steps_take_effect(name: str) -> None:
    """The step keeps its [B, 1, ...] hyperparameter views across steps; values changed in
    place (set_hyperparameters, a schedule) or replaced (load_state_dict) are used at once."""
    for dtype in (torch.float64, torch.float32):
        array, opt, refs, ref_opts = build(name, dtype=dtype)
        train(array, opt, refs, ref_opts, steps=3, dtype=dtype, same_grads=True)
        opt.set_hyperparameters(1, lr=0.003, weight_decay=0.02)
        for g in ref_opts[1].param_groups:
            g.update(lr=0.003, weight_decay=0.02)
        train(array, opt, refs, ref_opts, steps=3, dtype=dtype, seed=2, same_grads=True)
        opt.param_groups[0]["lr"][2] = 0.001  # in place, as the schedulers write
        for g in ref_opts[2].param_groups:
            g["lr"] = 0.001
        train(array, opt, refs, ref_opts, steps=3, dtype=dtype, seed=3, same_grads=True)
        saved = opt.state_dict()
        saved["param_groups"][0]["lr"] = saved["param_groups"][0]["lr"].clone()
        saved["param_groups"][0]["lr"][0] = 0.004
        opt.load_state_dict(saved)  # new tensors
        for g in ref_opts[0].param_groups:
            g["lr"] = 0.004
        train(array, opt, refs, ref_opts, steps=3, dtype=dtype, seed=4, same_grads=True)
        tol = (
            {"rtol": 1e-7, "atol": 1e-10}
            if dtype == torch.float64
            else {"rtol": 1e-4, "atol": 1e-5}
        )
        assert_members_match(array, opt, refs, ref_opts, **tol)


def test_update_is_batched_not_a_loop_over_members() -> None:
    """The number of tensor ops in a step does not grow with B."""
    from torch.profiler import profile

    def ops_per_step(size: int) -> int:
        array = hs.fuse([MLP(d_in=6, hidden=8, d_out=3) for _ in range(size)])
        opt = hs.optim.Adam(array, lr=[1e-3 * (i + 1) for i in range(size)])
        for p in array.parameters():
            p.grad = torch.ones_like(p)
        opt.step()
        with profile() as prof:
            opt.step()
        return sum(e.count for e in prof.key_averages() if e.key.startswith("aten::"))

    assert ops_per_step(2) == ops_per_step(16)


def test_scalar_and_tensor_hyperparameters() -> None:
    array = hs.fuse([MLP() for _ in range(4)])
    opt = hs.optim.SGD(array, lr=torch.tensor([0.1, 0.2, 0.3, 0.4]), momentum=0.9)
    assert opt.hyperparameters(3) == {
        "lr": pytest.approx(0.4),
        "momentum": pytest.approx(0.9),
        "dampening": 0.0,
        "weight_decay": 0.0,
    }
    assert "lr=[0.1, 0.2, 0.3, 0.4]" in repr(opt) and "momentum=0.9" in repr(opt)


def test_param_groups_with_their_own_values() -> None:
    array = hs.fuse([MLP(d_in=6, hidden=8, d_out=3) for _ in range(2)])
    head = list(array.module.head.parameters())
    body = [p for p in array.parameters() if all(p is not h for h in head)]
    opt = hs.optim.SGD([{"params": body}, {"params": head, "lr": [0.5, 0.6]}], lr=[0.1, 0.2])
    assert opt.hyperparameters(1, group=0)["lr"] == pytest.approx(0.2)
    assert opt.hyperparameters(1, group=1)["lr"] == pytest.approx(0.6)


@pytest.mark.parametrize(
    ("make", "match"),
    [
        (
            lambda a: hs.optim.SGD(a, lr=[0.1, 0.2]),
            r"lr \(param group 0\) has 2 values for 3 members",
        ),
        (
            lambda a: hs.optim.SGD(a, lr=[0.1, -0.2, 0.3]),
            r"lr\[1\] = -0\.2 .*outside \[0\.0, inf\]",
        ),
        (lambda a: hs.optim.Adam(a, betas=(0.9, [0.9, 1.0, 0.99])), r"beta2\[1\] = 1\.0"),
        (lambda a: hs.optim.SGD(a, lr=0.1, nesterov=True), "nesterov=True .* momentum > 0"),
        (lambda a: hs.optim.SGD(a, lr=float("nan")), "is NaN"),
        (lambda a: hs.optim.SGD(a, lr="fast"), "must be a number or one number per member"),
        (lambda a: hs.optim.Adam(a, amsgrad=1), "must be a bool shared by all members"),
    ],
)
def test_bad_hyperparameters_name_the_member(make, match) -> None:
    array = hs.fuse([MLP() for _ in range(3)])
    with pytest.raises(ValueError, match=match):
        make(array)


def test_unknown_hyperparameter_and_member_index() -> None:
    opt = hs.optim.SGD(hs.fuse([MLP() for _ in range(2)]), lr=0.1)
    with pytest.raises(ValueError, match=r"no per-member hyperparameter 'betas'.*\['lr'"):
        opt.set_hyperparameters(0, betas=0.9)
    with pytest.raises(IndexError, match="out of range"):
        opt.reset_member(2)


def test_parameters_of_different_arrays_are_refused() -> None:
    a = hs.fuse([MLP() for _ in range(2)])
    b = hs.fuse([MLP() for _ in range(3)])
    with pytest.raises(ValueError, match=r"disagree on the member count.*\[2, 3\]"):
        hs.optim.Adam([*a.parameters(), *b.parameters()])


@pytest.mark.parametrize("name", ["SGD", "Adam", "RMSprop-centered"])
def test_whole_optimizer_checkpoint_resumes_exactly(name: str) -> None:
    fused_cls, torch_cls, _, options = CASES[name]
    array, opt, refs, ref_opts = build(name)
    train(array, opt, refs, ref_opts, steps=6)
    opt.set_active(2, False)
    saved_array = copy.deepcopy(array.state_dict())
    saved_opt = copy.deepcopy(opt.state_dict())
    train(array, opt, refs, ref_opts, steps=6, seed=8, active=[True, True, False])

    resumed = hs.fuse([MLP(d_in=6, hidden=8, d_out=3).double() for _ in range(B)])
    resumed.load_state_dict(saved_array)
    opt2 = fused_cls(resumed, **fused_kwargs(torch_cls, [{"lr": 0.5}] * B), **options)
    opt2.load_state_dict(saved_opt)
    assert not bool(opt2.active[2])
    gen = torch.Generator().manual_seed(8)
    for _ in range(6):
        x = torch.randn(5, 6, generator=gen, dtype=torch.float64)
        y = torch.randint(0, 3, (5,), generator=gen)
        opt2.zero_grad()
        hs.member_losses(resumed(x), y).sum().backward()
        opt2.step()
    for p, q in zip(array.parameters(), resumed.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-12, atol=1e-14)


def test_param_group_added_later_gets_per_member_values() -> None:
    array = hs.fuse([MLP(d_in=6, hidden=8, d_out=3) for _ in range(2)])
    head = list(array.module.head.parameters())
    body = [p for p in array.parameters() if all(p is not h for h in head)]
    opt = hs.optim.Adam(body, lr=[0.1, 0.2])
    opt.add_param_group({"params": head, "lr": [0.3, 0.4]})
    assert opt.hyperparameters(1, group=1)["lr"] == pytest.approx(0.4)
    for p in array.parameters():
        p.grad = torch.ones_like(p)
    opt.step()
    with pytest.raises(ValueError, match="member counts"):
        opt.add_param_group({"params": [torch.nn.Parameter(torch.zeros(3, 2))]})


@pytest.mark.parametrize("amsgrad", [False, True])
def test_adam_member_with_zero_lr_stays_put_without_nan(amsgrad: bool) -> None:
    """Schedules such as cosine annealing reach lr = 0 exactly; zero gradients make v = 0 too."""
    array = hs.fuse([MLP(d_in=6, hidden=8, d_out=3) for _ in range(2)])
    opt = hs.optim.AdamW(array, lr=[0.0, 1e-2], amsgrad=amsgrad)
    before = [p.detach().clone() for p in array.parameters()]
    for p in array.parameters():
        p.grad = torch.zeros_like(p)
        p.grad[1] = 1.0
    opt.step()
    for p, q in zip(before, array.parameters(), strict=True):
        assert torch.equal(p[0], q[0])
        assert torch.isfinite(q).all()
    assert opt.nonfinite_members == []
