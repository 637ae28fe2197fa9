"""Random ops that a member's forward calls itself, drawn from that member's own stream.

Dropout layers, attention dropout and random slopes have fused layers with per-member streams.
Forward code also draws directly: ``F.dropout`` (``nn.LSTM``/``nn.GRU`` between layers,
``nn.Dropout`` subclasses), ``F.scaled_dot_product_attention(dropout_p=...)`` (Hugging Face
attention), ``torch.rand``/``torch.randn`` (noise). Under ``vmap`` those would draw from torch's
global generator, so a member's masks would depend on the array around it.

While the array runs a member's forward, :class:`MemberRandomness` (a ``TorchFunctionMode``)
routes each such call to the member's *functional stream* (:class:`FunctionalStream`: a seed and a
count of the training forwards that drew, per member). The n-th random call of a forward uses the
stream's n-th salt: call sites are told apart by their order, which is the same for a member alone
and in any array, as every member runs the same code. A dropout probability that user code reads
from a fused dropout layer (``self.dropout.p``, as Hugging Face's attention does) is a
:class:`StreamFloat`: the call then uses that layer's per-member ``p`` and stream, as the layer
itself would. A random op that cannot be routed is refused with an error naming the op and the
submodule; the array's ``vmap`` runs with ``randomness="error"``, so one that this mode does not
see is refused too.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode

from .._errors import FusionError
from ..nn import apply_multiplier, key_multiplier, key_uniform, stream_multiplier
from ._check import describe_path

__all__ = [
    "FunctionalStream",
    "MemberRandomness",
    "StreamFloat",
    "active_randomness",
    "draws_functionally",
    "is_random_call",
    "member_randomness",
]

#: the functional stream's salts: this plus the call's position among the forward's random calls
_SITE_SALTS = 1 << 21

#: the key under which :meth:`FusedArray.rng_state` lists the functional stream
STREAM_KEY = "<functional>"


class FunctionalStream(nn.Module):
    """Per-member ``member_seed`` and ``member_calls`` (``[B]`` int64 buffers) for the random calls
    a forward makes itself. ``member_calls`` counts the training forwards that drew."""

    member_seed: Tensor
    member_calls: Tensor

    def __init__(self, seeds: Tensor) -> None:
        super().__init__()
        self.register_buffer("member_seed", seeds)
        self.register_buffer("member_calls", torch.zeros_like(seeds))


class StreamFloat(float):
    """A fused dropout layer's ``p`` as forward code reads it: member 0's value (a float like any
    other), carrying the layer, whose per-member ``p`` and stream a functional dropout given this
    value uses."""

    layer: nn.Module

    def __new__(cls, value: float, layer: nn.Module) -> StreamFloat:
        obj = super().__new__(cls, value)
        obj.layer = layer
        return obj

    def __reduce__(self) -> tuple[Any, ...]:
        return (StreamFloat, (float(self), self.layer))


def draws_functionally(model: nn.Module) -> bool:
    """Whether ``model``'s forward may call random ops itself: it has a module whose class is
    not torch's (user or library code), an ``nn.RReLU``, an alpha dropout, or an RNN with
    dropout between layers."""
    for m in model.modules():
        cls = type(m)
        if not cls.__module__.startswith("torch.nn."):
            return True
        if isinstance(m, nn.RReLU | nn.AlphaDropout | nn.FeatureAlphaDropout):
            return True
        if isinstance(m, nn.modules.rnn.RNNBase) and m.dropout > 0:
            return True
    return False


class MemberRandomness(TorchFunctionMode):
    """Routes the random calls of one member's forward (see the module docstring). Without a
    ``stream`` every call that would draw from it is refused; ``refused`` then says why in the
    error (the offload engine's shards: a stream counts the whole array's forwards)."""

    def __init__(self, stream: FunctionalStream | None, refused: str | None = None) -> None:
        super().__init__()
        self.stream = stream
        self.refused = refused
        self.path: list[
            tuple[str, str]
        ] = []  # the submodules running (path, class), innermost last
        self._site = 0
        self._calls: Tensor | None = None
        self.current: Any = None  # the last call passed on to torch

    def __torch_function__(
        self, func: Any, types: Any, args: Sequence[Any] = (), kwargs: Any = None
    ) -> Any:
        kwargs = kwargs or {}
        route = _ROUTES.get(func)
        if route is not None:
            return route(self, func, *args, **kwargs)
        refused = _REFUSED.get(func)
        if refused is not None and refused[1](args, kwargs):
            raise self.refusal(refused[0])
        self.current = func  # what vmap's refusal of a random op inside it is about
        return func(*args, **kwargs)

    def where(self) -> str:
        if not self.path:
            return "the model"
        path, cls = self.path[-1]
        return f"{describe_path(path)} ({cls})"

    def refusal(self, op: str) -> FusionError:
        if self.refused is not None:
            return FusionError(
                f"{self.where()} calls {op}, which draws random numbers: {self.refused}"
            )
        return FusionError(
            f"{self.where()} calls {op}, which draws random numbers that hfsweep cannot take from "
            "each member's own seeded stream, so a member would train differently in an array "
            "than alone. "
            "Use nn.Dropout layers, F.dropout/dropout1d/2d/3d, "
            "F.scaled_dot_product_attention(dropout_p=...), torch.rand/rand_like or "
            "torch.randn/randn_like (each member draws those from its own stream), or draw the "
            "numbers outside the model's forward."
        )

    def key(self, op: str) -> tuple[Tensor, Tensor, int]:
        """(seed, calls, salt) of the forward's next functional random call; the first one
        advances the member's count."""
        stream = self.stream
        if stream is None:  # draws_functionally said no: a torch layer we do not know draws
            raise self.refusal(op)
        if self._calls is None:
            calls = stream.get_buffer("member_calls")
            self._calls = calls.clone()
            calls.add_(1)
        salt = _SITE_SALTS + self._site
        self._site += 1
        return stream.get_buffer("member_seed"), self._calls, salt

    def multiplier(self, op: str, p: float, shape: tuple[int, ...], dtype: torch.dtype) -> Tensor:
        """The scaled mask for a dropout of probability ``p``: from the fused layer's stream
        and per-member ``p`` for a :class:`StreamFloat`, else from the functional stream."""
        if isinstance(p, StreamFloat):
            return stream_multiplier(p.layer, shape, dtype)
        seed, calls, salt = self.key(op)
        probability = torch.full((), float(p), dtype=torch.float64, device=seed.device)
        return key_multiplier(seed, calls, probability, salt, shape, dtype)


def _check_p(p: float) -> None:
    if not 0.0 <= p <= 1.0:
        raise ValueError(f"dropout probability has to be between 0 and 1, but got {p}")


def _dropout_route(feature_dims: int, name: str) -> Callable[..., Any]:
    """The route of ``F.dropout`` (``feature_dims=0``) and ``F.dropout1d/2d/3d``."""

    def route(
        mode: MemberRandomness,
        func: Any,
        input: Tensor,
        p: float = 0.5,
        training: bool = True,
        inplace: bool = False,
    ) -> Tensor:
        _check_p(p)
        if not training or (p == 0 and not isinstance(p, StreamFloat)):
            return input
        k = feature_dims
        shape = input.shape if k == 0 else (*input.shape[: input.dim() - k], *([1] * k))
        multiplier = mode.multiplier(name, p, tuple(shape), input.dtype)
        # in place, autograd keeps the multiplier itself (an in-place op cannot be the custom
        # op that keeps a 1-byte mask instead)
        return input.mul_(multiplier) if inplace else apply_multiplier(input, multiplier)

    return route


def _aten_dropout_route(name: str) -> Callable[..., Any]:
    """``torch.dropout(input, p, train)`` and ``torch.feature_dropout``."""
    feature = name.endswith("feature_dropout")

    def route(mode: MemberRandomness, func: Any, input: Tensor, p: float, train: bool) -> Tensor:
        inner = _dropout_route(max(0, input.dim() - 2) if feature else 0, name)
        return inner(mode, func, input, p, train)

    return route


def _sdpa_route(
    mode: MemberRandomness,
    func: Any,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attn_mask: Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> Tensor:
    """Scaled dot-product attention whose attention-weight dropout comes from the member's
    stream: written out (scores, softmax, mask, product) when ``dropout_p`` drops, torch's own
    function otherwise."""
    if dropout_p == 0 and not isinstance(dropout_p, StreamFloat):
        return func(
            query,
            key,
            value,
            attn_mask=attn_mask,
            dropout_p=0.0,
            is_causal=is_causal,
            scale=scale,
            enable_gqa=enable_gqa,
        )
    _check_p(dropout_p)
    length, source = query.size(-2), key.size(-2)
    factor = 1 / math.sqrt(query.size(-1)) if scale is None else scale
    if enable_gqa:
        key = key.repeat_interleave(query.size(-3) // key.size(-3), -3)
        value = value.repeat_interleave(query.size(-3) // value.size(-3), -3)
    scores = (query * factor) @ key.transpose(-2, -1)
    if is_causal:
        allowed = torch.ones(length, source, dtype=torch.bool, device=query.device).tril()
        scores = scores.masked_fill(~allowed, float("-inf"))
    if attn_mask is not None:
        if attn_mask.dtype == torch.bool:
            scores = scores.masked_fill(~attn_mask, float("-inf"))
        else:
            scores = scores + attn_mask
    weights = torch.softmax(scores, dim=-1)
    multiplier = mode.multiplier(
        "F.scaled_dot_product_attention", dropout_p, tuple(weights.shape), weights.dtype
    )
    return apply_multiplier(weights, multiplier) @ value


def _size_and_options(args: Sequence[Any], kwargs: dict[str, Any]) -> tuple[tuple[int, ...], Any]:
    size = kwargs.pop("size", None)
    if size is None:
        size = args[0] if len(args) == 1 and isinstance(args[0], Sequence) else args
    return tuple(int(s) for s in size), kwargs


def _draw(
    mode: MemberRandomness, op: str, shape: tuple[int, ...], options: dict[str, Any], normal: bool
) -> Tensor:
    """``torch.rand``/``randn`` of ``shape`` from the functional stream (a normal number from
    two uniform ones by the Box-Muller transform)."""
    if options.get("generator") is not None or options.get("out") is not None:
        raise mode.refusal(f"{op} with a generator= or out= argument")
    dtype = options.get("dtype") or torch.get_default_dtype()
    seed, calls, salt = mode.key(op)
    if not normal:
        out = key_uniform(seed, calls, salt, shape, dtype)
    else:
        wide = dtype if dtype == torch.float64 else torch.float32
        u = key_uniform(seed, calls, salt, (2, *shape), wide, batch_dim=1)
        out = (torch.sqrt(-2 * torch.log1p(-u[0])) * torch.cos(2 * math.pi * u[1])).to(dtype)
    device = options.get("device")
    if device is not None:
        out = out.to(device)
    if options.get("requires_grad"):
        out.requires_grad_(True)
    return out


def _factory_route(op: str, normal: bool) -> Callable[..., Any]:
    def route(mode: MemberRandomness, func: Any, *args: Any, **kwargs: Any) -> Tensor:
        shape, options = _size_and_options(args, dict(kwargs))
        return _draw(mode, op, shape, options, normal)

    return route


def _like_route(op: str, normal: bool) -> Callable[..., Any]:
    def route(mode: MemberRandomness, func: Any, input: Tensor, **kwargs: Any) -> Tensor:
        kwargs.setdefault("dtype", input.dtype)
        kwargs.setdefault("device", input.device)
        return _draw(mode, op, tuple(input.shape), kwargs, normal)

    return route


_ROUTES: dict[Any, Callable[..., Any]] = {
    F.dropout: _dropout_route(0, "F.dropout"),
    F.dropout1d: _dropout_route(1, "F.dropout1d"),
    F.dropout2d: _dropout_route(2, "F.dropout2d"),
    F.dropout3d: _dropout_route(3, "F.dropout3d"),
    torch.dropout: _aten_dropout_route("torch.dropout"),
    torch.feature_dropout: _aten_dropout_route("torch.feature_dropout"),
    F.scaled_dot_product_attention: _sdpa_route,
    torch.rand: _factory_route("torch.rand", normal=False),
    torch.randn: _factory_route("torch.randn", normal=True),
    torch.rand_like: _like_route("torch.rand_like", normal=False),
    torch.randn_like: _like_route("torch.randn_like", normal=True),
}


def _always(args: Sequence[Any], kwargs: dict[str, Any]) -> bool:
    return True


def _training(position: int, default: bool) -> Callable[[Sequence[Any], dict[str, Any]], bool]:
    """Refuse a call whose ``training`` argument (at ``position``) is true and ``p`` above 0."""

    def check(args: Sequence[Any], kwargs: dict[str, Any]) -> bool:
        training = args[position] if len(args) > position else kwargs.get("training", default)
        p = args[1] if len(args) > 1 else kwargs.get("p", 0.5)
        return bool(training) and p != 0

    return check


def _rrelu_training(args: Sequence[Any], kwargs: dict[str, Any]) -> bool:
    return bool(args[3] if len(args) > 3 else kwargs.get("training", False))


#: random ops refused while a member's forward runs: (name in messages, whether a call draws)
_REFUSED: dict[Any, tuple[str, Callable[[Sequence[Any], dict[str, Any]], bool]]] = {
    F.alpha_dropout: ("F.alpha_dropout", _training(2, False)),
    F.feature_alpha_dropout: ("F.feature_alpha_dropout", _training(2, False)),
    torch.alpha_dropout: ("torch.alpha_dropout", _training(2, False)),
    torch.feature_alpha_dropout: ("torch.feature_alpha_dropout", _training(2, False)),
    F.rrelu: ("F.rrelu", _rrelu_training),
    F.gumbel_softmax: ("F.gumbel_softmax", _always),
    **{
        getattr(torch, name): (f"torch.{name}", _always)
        for name in (
            "bernoulli",
            "multinomial",
            "normal",
            "poisson",
            "randint",
            "randint_like",
            "randperm",
            "binomial",
        )
    },
    **{
        getattr(Tensor, name): (f"Tensor.{name}", _always)
        for name in (
            "bernoulli",
            "bernoulli_",
            "uniform_",
            "normal_",
            "random_",
            "exponential_",
            "geometric_",
            "cauchy_",
            "log_normal_",
            "multinomial",
        )
    },
}


def is_random_call(target: Any) -> bool:
    """Whether ``target`` (a function or a ``Tensor`` method) is a random call of forward code
    that a fused array routes through its members' streams or refuses (``F.dropout``,
    ``torch.rand``...): what a traced graph that must not draw is checked against."""
    return target in _ROUTES or target in _REFUSED


def _name(func: Any) -> str:
    """How messages name a torch function: ``torch.x``, ``F.x``, ``Tensor.x``."""
    if func is None:
        return "a random op"
    name = getattr(func, "__name__", repr(func))
    for prefix, owner in (("torch", torch), ("F", F), ("Tensor", Tensor)):
        if getattr(owner, name, None) is func:
            return f"{prefix}.{name}"
    return str(getattr(func, "__qualname__", name))


#: the member-randomness modes of the forwards running now, innermost last
_ACTIVE: list[MemberRandomness] = []


def active_randomness() -> MemberRandomness | None:
    """The mode routing the random calls of the member forward that runs now, if any (a
    checkpointed region starts its own where this one stands: see :mod:`._recompute`)."""
    return _ACTIVE[-1] if _ACTIVE else None


@contextmanager
def member_randomness(
    stream: FunctionalStream | None, root: nn.Module, refused: str | None = None
) -> Iterator[None]:
    """Run one member's forward of ``root`` (the array's template) with its random calls routed
    (when ``stream`` is given: the model may draw functionally) and any random op that ``vmap``
    refuses named with its submodule. With ``refused`` (and no stream), every random call the
    stream would serve is refused, saying ``refused``: also where no ``vmap`` runs (one member)."""
    if stream is None and refused is None:  # nothing to route: only name what vmap refuses
        try:
            yield
        except RuntimeError as exc:
            if "randomness error mode" not in str(exc):
                raise
            raise MemberRandomness(None).refusal("a random op") from exc
        return
    mode = MemberRandomness(stream, refused)
    names = {id(m): path for path, m in root.named_modules()}

    def enter(module: nn.Module, args: Any) -> None:
        if id(module) in names:
            mode.path.append((names[id(module)], type(module).__name__))

    def leave(module: nn.Module, args: Any, out: Any) -> None:
        if mode.path and id(module) in names:
            mode.path.pop()

    hooks = [
        nn.modules.module.register_module_forward_pre_hook(enter),
        nn.modules.module.register_module_forward_hook(leave),
    ]
    _ACTIVE.append(mode)
    try:
        with mode:
            yield
    except RuntimeError as exc:
        if "randomness error mode" not in str(exc):
            raise
        raise mode.refusal(_name(mode.current)) from exc
    finally:
        _ACTIVE.pop()
        for hook in hooks:
            hook.remove()
