"""hs.Task: config resolution and errors, the per-member / shared split, the built-in losses
against torch's, and the ready tasks in hfsweep.tasks."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from _tasks import make_task

import hfsweep as hs
from hfsweep import tasks


def test_resolve_completes_defaults_and_optimizer_hyperparameters() -> None:
    task = make_task()
    c = task.resolve({"optimizer": "adamw", "lr": 0.1})
    assert c["hidden"] == 16 and c["batch_size"] == 32
    assert (c["beta1"], c["beta2"], c["eps"]) == (0.9, 0.999, 1e-8)
    assert task.resolve({})["momentum"] == 0.0


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({"hiden": 3}, "'hiden' is not known to task 'toy'; known keys are"),
        ({"optimizer": "lamb"}, "optimizer='lamb' is not one of"),
        (
            {"optimizer": "adam", "momentum": 0.9},
            "'momentum' is not a hyperparameter of optimizer 'adam'",
        ),
        ({"lr_schedule": "poly"}, "lr_schedule='poly' is not one of"),
        ({"gamma": 0.5}, "'gamma' is not an argument of lr_schedule 'constant'"),
        ({"lr": -1}, "lr=-1 must be a finite number >= 0.0"),
        ({"lr": float("nan")}, "lr=nan"),
        ({"dropout": 1.5}, "dropout=1.5"),
        ({"label_smoothing": "x"}, "label_smoothing='x'"),
        ({"grad_clip": 0}, "grad_clip=0 must be a finite number > 0.0"),
        ({"epochs": 0}, "epochs=0 must be an integer >= 1"),
        ({"seed": 1.5}, "seed=1.5 must be an integer"),
    ],
)
def test_bad_configs_name_the_key_and_the_valid_values(config, message) -> None:
    with pytest.raises(hs.TaskError, match=message.replace("(", r"\(").replace("[", r"\[")):
        make_task().resolve(config)


def test_split_separates_per_member_values_from_the_compatibility_key() -> None:
    task = make_task()
    a = {"lr": 0.1, "seed": 1, "dropout": 0.2, "epochs": 2, "momentum": 0.9}
    b = {"lr": 0.3, "seed": 5, "label_smoothing": 0.1, "grad_clip": 1.0}
    member_a, key_a = task.split(a)
    _, key_b = task.split(b)
    assert key_a == key_b
    assert member_a["lr"] == 0.1 and "hidden" not in member_a
    assert task.compatibility_key({"hidden": 8}) != key_a
    assert task.compatibility_key({"optimizer": "adam"}) != key_a
    assert task.compatibility_key({"batch_size": 16}) != key_a


def test_extra_per_member_keys_are_declared_by_the_task() -> None:
    base = make_task()
    task = hs.Task(
        model=base.model,
        data=base.data,
        defaults={**base.defaults, "init": 1.0},
        per_member=["init"],
    )
    assert task.compatibility_key({"init": 2.0}) == task.compatibility_key({"init": 3.0})
    assert base.compatibility_key({}) != hs.Task(
        model=base.model, data=base.data, defaults={**base.defaults, "hidden": 8}
    ).compatibility_key({})


def test_data_may_not_read_per_member_keys() -> None:
    base = make_task()

    def data(config):
        torch.manual_seed(config["seed"])
        return base.data(config)

    task = hs.Task(model=base.model, data=data, defaults=base.defaults)
    with pytest.raises(hs.TaskError, match="data\\(config\\) read 'seed', a per-member key"):
        task.build_data(task.resolve({}))


def test_bad_tasks() -> None:
    with pytest.raises(hs.TaskError, match="loss 'hinge'"):
        hs.Task(model=lambda c: None, data=lambda c: None, loss="hinge")
    with pytest.raises(hs.TaskError, match="metric 'f1'"):
        hs.Task(model=lambda c: None, data=lambda c: None, metrics=["f1"])
    with pytest.raises(hs.TaskError, match=r"returned NoneType, not an nn\.Module"):
        hs.Task(model=lambda c: None, data=lambda c: None).build_model({"seed": 0})


def test_cross_entropy_with_per_member_label_smoothing_matches_torch() -> None:
    task = make_task()
    out = torch.randn(3, 10, 4, dtype=torch.float64)
    y = torch.randint(4, (10,))
    smooth = torch.tensor([0.0, 0.1, 0.35], dtype=torch.float64)
    got = task.member_loss(out, y, smooth)
    want = torch.stack(
        [F.cross_entropy(out[i], y, label_smoothing=float(smooth[i])) for i in range(3)]
    )
    torch.testing.assert_close(got, want)
    acc = task.member_metrics(out, y)["val_accuracy"]
    torch.testing.assert_close(acc, (out.argmax(-1) == y).double().mean(1))
    # a -inf logit of a wrong class: finite without smoothing (as torch), whatever the others
    # in the array use, and the same as with no smoothing vector at all
    out[0, 0, (int(y[0]) + 1) % 4] = -math.inf
    got = task.member_loss(out, y, smooth)
    assert torch.isfinite(got[0])
    torch.testing.assert_close(got[0], F.cross_entropy(out[0], y))
    assert torch.equal(got[0], task.member_loss(out, y, None)[0])


def test_cross_entropy_layouts_match_torch() -> None:
    base = make_task()
    # [N, C, H, W] segmentation-style outputs: classes in dimension 1
    out = torch.randn(2, 5, 3, 4, 4, dtype=torch.float64)
    y = torch.randint(3, (5, 4, 4))
    got = base.member_loss(out, y, torch.tensor([0.0, 0.2], dtype=torch.float64))
    want = torch.stack(
        [F.cross_entropy(out[0], y), F.cross_entropy(out[1], y, label_smoothing=0.2)]
    )
    torch.testing.assert_close(got, want)
    # [N, T, vocab] language-model outputs: classes last
    lm = hs.Task(model=base.model, data=base.data, loss="sequence_cross_entropy")
    out = torch.randn(2, 4, 6, 9, dtype=torch.float64)
    y = torch.randint(9, (4, 6))
    got = lm.member_loss(out, y, None)
    want = torch.stack([F.cross_entropy(out[i].reshape(-1, 9), y.reshape(-1)) for i in range(2)])
    torch.testing.assert_close(got, want)


@pytest.mark.parametrize("name", sorted(tasks.TASKS))
def test_ready_tasks_fuse_and_train(name: str) -> None:
    task = tasks.get(name)
    members = [
        hs.Member("a", {"seed": 1, "max_steps": 2, "dropout": 0.1}),
        hs.Member("b", {"seed": 2, "max_steps": 3, "lr": task.resolve({})["lr"] / 2}),
    ]
    results = hs.ArrayTrainer(task, eval_every=2).run(members)
    assert [r.status for r in results] == ["completed", "completed"]
    assert [r.steps for r in results] == [2, 3]
    for r in results:
        assert set(task.metric_names) <= set(r.metrics)
        model = task.build_model(r.config)
        model.load_state_dict(r.state["model"])


def test_token_transformer_drops_each_members_attention_weights_as_alone() -> None:
    """The ready Transformer's dropout covers the attention weights too, per member: a member
    with dropout draws attention masks (its stream's count moves) and trains as it does alone;
    a member without dropout draws none."""
    task = tasks.token_transformer
    members = [
        hs.Member("a", {"seed": 1, "max_steps": 3, "dropout": 0.3}),
        hs.Member("b", {"seed": 2, "max_steps": 3}),
    ]
    fused = hs.ArrayTrainer(task, dtype=torch.float64).run(members)
    alone = hs.ArrayTrainer(task, dtype=torch.float64).run(members[:1])[0]
    attention = "encoder.layers.0.self_attn"
    assert fused[0].state["rng"][attention] == [1, 3]
    assert fused[1].state["rng"][attention] == [2, 0]
    assert fused[0].state["rng"] == alone.state["rng"]
    for got, want in zip(fused[0].history, alone.history, strict=True):
        assert got == pytest.approx(want, rel=1e-9)
    for k, v in fused[0].state["model"].items():
        torch.testing.assert_close(v, alone.state["model"][k], rtol=1e-9, atol=1e-12)


def test_unknown_ready_task() -> None:
    with pytest.raises(hs.TaskError, match="no ready task 'mnist'; ready tasks are"):
        tasks.get("mnist")


def test_digits_mlp_learns() -> None:
    result = hs.ArrayTrainer(tasks.digits_mlp).run([hs.Member("a", {"epochs": 5})])[0]
    assert result.metrics["val_accuracy"] > 0.9


@pytest.mark.parametrize("name", sorted(tasks.TASKS))
@pytest.mark.parametrize(
    "config",
    [
        {},
        {"optimizer": "adam"},
        {"optimizer": "rmsprop", "lr_schedule": "step", "gamma": 0.5},
        {"lr_schedule": "cosine", "eta_min": 1e-4},
        {"optimizer": "adagrad", "lr_schedule": "exponential"},
    ],
)
def test_resolve_is_idempotent(name, config) -> None:
    task = tasks.get(name)
    resolved = task.resolve(config)
    assert task.resolve(resolved) == resolved
    assert task.split(resolved) == task.split(config)


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({"momentum": -1}, "momentum=-1 must be a finite number >= 0.0"),
        ({"optimizer": "adam", "beta1": 1.5}, "beta1=1.5 must be a finite number >= 0.0 and < 1.0"),
        ({"lr_schedule": "step", "step_size": 0}, "step_size=0 must be an integer >= 1"),
        (
            {"lr_schedule": "step", "gamma": 2.0},
            "gamma=2.0 must be a finite number > 0.0 and <= 1.0",
        ),
        ({"weight_decay": "0.1"}, "weight_decay='0.1'"),
        ({"data_seed": "x"}, "data_seed='x' must be an integer >= 0"),
    ],
)
def test_out_of_range_hyperparameters_are_refused_up_front(config, message) -> None:
    with pytest.raises(hs.TaskError, match=message.replace("(", r"\(").replace(".", r"\.")):
        make_task().resolve(config)


def test_loss_specific_checks() -> None:
    base = make_task()
    mse = hs.Task(model=base.model, data=base.data, loss="mse", defaults=base.defaults)
    assert mse.metric_names == ["train_loss", "val_loss"]  # no accuracy for a regression loss
    with pytest.raises(hs.TaskError, match="label smoothing needs 'cross_entropy'"):
        mse.resolve({"label_smoothing": 0.1})
    with pytest.raises(hs.TaskError, match=r"target shaped like one member's output \(4, 1\)"):
        mse.member_loss(torch.zeros(2, 4, 1), torch.zeros(4), None)
    out, y = torch.randn(2, 4, 3), torch.randn(4, 3)
    torch.testing.assert_close(
        mse.member_loss(out, y, None), torch.stack([F.mse_loss(o, y) for o in out])
    )


def test_task_argument_errors() -> None:
    base = make_task()
    with pytest.raises(hs.TaskError, match="not a string"):
        hs.Task(model=base.model, data=base.data, metrics="accuracy")
    with pytest.raises(hs.TaskError, match="per_member may not name 'optimizer'"):
        hs.Task(model=base.model, data=base.data, per_member=["optimizer"])


def test_data_check_ignores_membership_tests() -> None:
    base = make_task()

    def data(config):
        assert "seed" in config  # a membership test is not a read
        return base.data(config)

    task = hs.Task(model=base.model, data=data, defaults=base.defaults)
    task.build_data(task.resolve({}))


def test_manual_seed_draws_what_torch_manual_seed_draws() -> None:
    from hfsweep.training.task import manual_seed

    torch.manual_seed(123)
    expected = (torch.rand(5), torch.randn(3, 4), torch.randint(0, 100, (7,)))
    torch.manual_seed(999)
    manual_seed(123)
    got = (torch.rand(5), torch.randn(3, 4), torch.randint(0, 100, (7,)))
    for a, b in zip(expected, got, strict=True):
        assert torch.equal(a, b)


def test_build_model_is_seeded_like_torch_manual_seed() -> None:
    task = tasks.get("digits_mlp")
    config = task.resolve({"seed": 5})
    torch.manual_seed(5)
    reference = task.model(config)
    built = task.build_model(config)
    for (name, a), (_, b) in zip(
        reference.state_dict().items(), built.state_dict().items(), strict=True
    ):
        assert torch.equal(a, b), name
