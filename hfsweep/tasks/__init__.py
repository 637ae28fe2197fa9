"""Ready tasks that run offline on a CPU in seconds to minutes.

========================  ==================================================================
``digits_mlp``            MLP on scikit-learn's bundled 8x8 digits (1438 train, 359 val)
``digits_cnn``            small CNN on the same digits
``cifar_resnet``          CIFAR-style ResNet on generated CIFAR-shaped images (3x32x32)
``token_transformer``     causal Transformer language model on generated Markov token sequences
``text_lora``             LoRA (peft) fine-tuning of a tiny BERT encoder pretrained in-process,
                          on generated keyword texts (4 classes)
========================  ==================================================================

``hfsweep.tasks.get(name)`` returns the :class:`hfsweep.Task`; each task's ``defaults`` lists
the config keys it understands. The digits tasks need scikit-learn (``hfsweep[examples]``),
``text_lora`` needs transformers and peft.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from ..training.task import Task, TaskError
from ._data import TensorBatches, digits, markov_tokens, pattern_images
from ._lora import text_lora
from ._models import MLP, BasicBlock, DigitsCNN, ResNet, TokenTransformer, _p

if TYPE_CHECKING:
    from torch import Tensor

__all__ = [
    "TASKS",
    "BasicBlock",
    "TensorBatches",
    "cifar_resnet",
    "digits",
    "digits_cnn",
    "digits_mlp",
    "get",
    "text_lora",
    "token_transformer",
]


def _digits_data(config: Mapping[str, Any]) -> tuple[TensorBatches, TensorBatches]:
    xt, yt, xv, yv = digits(config["data_seed"])
    batch = config["batch_size"]
    return TensorBatches(xt, yt, batch, shuffle=True), TensorBatches(xv, yv, 512, shuffle=False)


digits_mlp = Task(
    name="digits_mlp",
    model=lambda c: MLP(64, c["hidden"], c["depth"], 10, _p(c)),
    data=_digits_data,
    defaults={
        "hidden": 64,
        "depth": 2,
        "batch_size": 64,
        "lr": 0.05,
        "momentum": 0.9,
        "epochs": 10,
    },
)

digits_cnn = Task(
    name="digits_cnn",
    model=lambda c: DigitsCNN(c["channels"], c["hidden"], _p(c)),
    data=_digits_data,
    defaults={
        "channels": 8,
        "hidden": 64,
        "batch_size": 64,
        "lr": 0.05,
        "momentum": 0.9,
        "epochs": 10,
    },
)


def _split(x: Tensor, y: Tensor, config: Mapping[str, Any]) -> tuple[TensorBatches, TensorBatches]:
    """The first ``config["n_train"]`` samples as the shuffled training batches of the config's
    ``batch_size``, the rest as validation batches of 256 in order."""
    n_train = config["n_train"]
    return (
        TensorBatches(x[:n_train], y[:n_train], config["batch_size"], shuffle=True),
        TensorBatches(x[n_train:], y[n_train:], 256, shuffle=False),
    )


def _image_data(config: Mapping[str, Any]) -> tuple[TensorBatches, TensorBatches]:
    x, y = pattern_images(config["data_seed"], config["n_train"] + config["n_val"])
    return _split(x, y, config)


cifar_resnet = Task(
    name="cifar_resnet",
    model=lambda c: ResNet(c["width"], c["blocks"], 10, _p(c)),
    data=_image_data,
    defaults={
        "width": 8,
        "blocks": 1,
        "n_train": 1024,
        "n_val": 256,
        "batch_size": 64,
        "lr": 0.05,
        "momentum": 0.9,
        "weight_decay": 5e-4,
        "epochs": 3,
    },
)


def _token_data(config: Mapping[str, Any]) -> tuple[TensorBatches, TensorBatches]:
    n_train, n_val = config["n_train"], config["n_val"]
    tokens = markov_tokens(
        config["data_seed"], n_train + n_val, vocab=config["vocab"], length=config["length"] + 1
    )
    return _split(tokens[:, :-1], tokens[:, 1:], config)


token_transformer = Task(
    name="token_transformer",
    model=lambda c: TokenTransformer(
        c["vocab"], c["length"], c["d_model"], c["heads"], c["layers"], _p(c)
    ),
    data=_token_data,
    loss="sequence_cross_entropy",
    defaults={
        "vocab": 32,
        "length": 32,
        "d_model": 32,
        "heads": 2,
        "layers": 2,
        "n_train": 1024,
        "n_val": 256,
        "batch_size": 32,
        "optimizer": "adamw",
        "lr": 3e-3,
        "epochs": 3,
    },
)

#: the ready tasks by name
TASKS: dict[str, Task] = {
    t.name: t for t in (digits_mlp, digits_cnn, cifar_resnet, token_transformer, text_lora)
}


def get(name: str) -> Task:
    """The ready task called ``name``."""
    if name not in TASKS:
        raise TaskError(f"no ready task {name!r}; ready tasks are {sorted(TASKS)}")
    return TASKS[name]
