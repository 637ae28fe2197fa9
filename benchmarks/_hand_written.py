"""B models written by hand as one, HFTA-style: the fused step without any engine.

``fusion_throughput.py`` times these beside ``hs.fuse``'s array and the ideal bound, so a row
below the bound says how close hand-written fusion itself gets to one model on a B-times-larger
batch on the device, and how close the engine gets to the hand-written version.

* The MLPs (``nn.Sequential`` of ``Linear`` and ``ReLU``): one ``baddbmm`` per layer over the
  stacked ``[B, out, in]`` weights, the shared input expanded (not copied) to ``[B, N, in]``.
* The LeNet-style CNN (``fusion_throughput.SmallCNN``): each convolution one convolution over
  ``B * C`` channels, with every member's filters and biases stacked into one weight and one
  bias, as HFTA writes it: the first, on the shared input, with ``groups=1`` (each member's
  filters read the one input); the second with ``groups=B`` (each member's filters read its own
  channels). ReLU and pooling run on ``[N, B * C, H, W]`` as they are; the pooled features go to
  the stacked Linear layers members first.

Each member's loss is its mean cross-entropy, and the step's loss their sum, as the fused way's
``hs.member_losses(...).sum()``; one ``torch.optim.SGD`` (lr 0.01) updates the stacked tensors.
:attr:`HandWritten.member_state` reads member ``i``'s tensors under its model's ``state_dict``
names, so a test can check that the hand-written step trains every member as the engine does.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = ["HandWritten", "hand_written"]


@dataclass
class HandWritten:
    """A hand-written fused training step and what it trains."""

    #: one training step: zero_grad, forward, the members' summed losses, backward, SGD
    step: Callable[[], None]
    #: the forward on the step's batch: ``[B, N, classes]``
    forward: Callable[[], Tensor]
    #: member ``i``'s tensors, each a view of the stacked ones, by its model's state_dict names
    member_state: Callable[[int], dict[str, Tensor]]


def _stacked(tensors: list[Tensor]) -> Tensor:
    """The members' tensors stacked (copies), as a leaf the optimizer updates."""
    return torch.stack([t.detach() for t in tensors]).requires_grad_()


def _linears(models: list[nn.Module], names: list[str]) -> list[tuple[Tensor, Tensor]]:
    """``(weight [B, out, in], bias [B, out])`` of the Linear submodule ``name`` of every model."""
    out = []
    for name in names:
        layers = [m.get_submodule(name) for m in models]
        out.append((_stacked([m.weight for m in layers]), _stacked([m.bias for m in layers])))
    return out


def _stacked_layers(h: Tensor, layers: list[tuple[Tensor, Tensor]]) -> Tensor:
    """``[B, N, in]`` through the stacked Linear layers, ReLU between them."""
    for k, (w, b) in enumerate(layers):
        h = torch.baddbmm(b.unsqueeze(1), h, w.transpose(1, 2))
        if k < len(layers) - 1:
            h = h.relu()
    return h


def _linear_state(names: list[str], layers: list[tuple[Tensor, Tensor]], i: int) -> dict:
    state = {}
    for name, (w, b) in zip(names, layers, strict=True):
        state[f"{name}.weight"], state[f"{name}.bias"] = w[i], b[i]
    return state


def _training(
    forward: Callable[[], Tensor], params: list[Tensor], y: Tensor, size: int
) -> Callable[[], None]:
    """The step: per-member mean cross-entropy, summed, backward, one SGD over ``params``."""
    opt = torch.optim.SGD(params, lr=0.01)
    labels = y.repeat(size)

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        out = forward()
        losses = F.cross_entropy(out.flatten(0, 1), labels, reduction="none")
        losses.view(size, -1).mean(1).sum().backward()
        opt.step()

    return step


def _hand_mlp(models: list[nn.Module], x: Tensor, y: Tensor) -> HandWritten:
    names = [n for n, m in models[0].named_children() if isinstance(m, nn.Linear)]
    layers = _linears(models, names)
    size = len(models)

    def forward() -> Tensor:
        return _stacked_layers(x.expand(size, *x.shape), layers)

    params = [t for layer in layers for t in layer]
    return HandWritten(
        _training(forward, params, y, size), forward, lambda i: _linear_state(names, layers, i)
    )


def _hand_cnn(models: list[nn.Module], x: Tensor, y: Tensor) -> HandWritten:
    size, batch = len(models), x.shape[0]
    convs = []
    for name in ("conv1", "conv2"):
        layers = [m.get_submodule(name) for m in models]
        # [B * C_out, C_in, k, k] and [B * C_out]: member i's filters are rows i*C_out...
        w = torch.cat([m.weight.detach() for m in layers]).requires_grad_()
        b = torch.cat([m.bias.detach() for m in layers]).requires_grad_()
        convs.append((name, w, b, layers[0].out_channels))
    names = ["fc1", "fc2", "fc3"]
    layers = _linears(models, names)
    (_, w1, b1, _), (_, w2, b2, _) = convs

    def forward() -> Tensor:
        h = F.max_pool2d(F.relu(F.conv2d(x, w1, b1)), 2)  # shared input: [N, B * 6, 12, 12]
        h = F.max_pool2d(F.relu(F.conv2d(h, w2, b2, groups=size)), 2)  # [N, B * 16, 4, 4]
        # member i's flattened features are its channels' [16, 4, 4]
        return _stacked_layers(h.view(batch, size, -1).transpose(0, 1), layers)

    def member_state(i: int) -> dict[str, Tensor]:
        state = {}
        for name, w, b, c in convs:
            state[f"{name}.weight"] = w[i * c : (i + 1) * c]
            state[f"{name}.bias"] = b[i * c : (i + 1) * c]
        return {**state, **_linear_state(names, layers, i)}

    params = [w1, b1, w2, b2, *(t for layer in layers for t in layer)]
    return HandWritten(_training(forward, params, y, size), forward, member_state)


def hand_written(models: list[nn.Module], x: Tensor, y: Tensor) -> HandWritten | None:
    """The hand-written fused step of ``models`` on the batch ``(x, y)``: for an MLP
    (``nn.Sequential`` of Linear and ReLU) or the LeNet-style CNN; ``None`` for other models."""
    first = models[0]
    if isinstance(first, nn.Sequential) and all(isinstance(m, (nn.Linear, nn.ReLU)) for m in first):
        return _hand_mlp(models, x, y)
    if type(first).__name__ == "SmallCNN":
        return _hand_cnn(models, x, y)
    return None
