"""Checks that B models can be one array: same structure, same shapes, same non-tensor settings.

Everything that is not stacked per member (a module's class, a parameter's shape, a BatchNorm's
``eps``, an activation's ``negative_slope``...) is taken from member 0 when the array runs, so any
difference there would silently train the other members wrongly. These checks turn each such
difference into a :class:`~hfsweep.FusionError` naming the submodule and the attribute.
"""

from __future__ import annotations

import dataclasses
import types
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor, nn
from torch.nn.utils import parametrize

from .._checks import is_number
from .._errors import FusionError
from ._peft import configs_agree, is_peft_configs

__all__ = ["check_compatible", "describe_path", "ignored_hook", "per_member_attributes"]

_HOOK_DICTS = (
    "_forward_hooks",
    "_forward_pre_hooks",
    "_backward_hooks",
    "_backward_pre_hooks",
)


#: Hugging Face's forward hook on the input embeddings (``enable_input_require_grads``, which
#: ``gradient_checkpointing_enable`` adds): it marks the embeddings' output as requiring grad so
#: that *reentrant* checkpointing of frozen-embedding models gets gradients. It changes no value
#: and no gradient of the model's parameters, and the array's recomputation (non-reentrant, see
#: ``_recompute``) does not need it, so it is the one hook a model may carry into an array.
_INPUT_REQUIRE_GRADS = (
    "PreTrainedModel.enable_input_require_grads.<locals>.make_inputs_require_grads"
)


def ignored_hook(hooks: str, hook: Any) -> bool:
    """Whether ``hook`` (in the module's ``hooks`` dict) is one a fused array may ignore."""
    return (
        hooks == "_forward_hooks"
        and getattr(hook, "__qualname__", "") == _INPUT_REQUIRE_GRADS
        and str(getattr(hook, "__module__", "")).startswith("transformers.")
    )


def describe_path(path: str) -> str:
    """Human name of a submodule path (``""`` is the root model)."""
    return f"submodule '{path}'" if path else "the root model"


def per_member_attributes(module: nn.Module) -> frozenset[str]:
    """Attributes of ``module`` that may differ between members (they become per-member data):
    a dropout layer's ``p`` and a ``MultiheadAttention``'s ``dropout``, in the user's model and
    in an array's fused layer alike."""
    from ..nn import FusedDropoutMixin, FusedMultiheadAttentionMixin
    from ._peft import is_lora_layer
    from ._plan import stream_attribute

    if is_lora_layer(module):  # peft LoRA: lora_alpha (so scaling) per member, see _peft
        return frozenset({"scaling", "lora_alpha"})
    attr = stream_attribute(module)
    if attr is not None:
        return frozenset({attr})
    if isinstance(module, FusedDropoutMixin):
        return frozenset({"p"})
    if isinstance(module, FusedMultiheadAttentionMixin):
        return frozenset({"dropout"})
    return frozenset()


def _equal(a: Any, b: Any) -> bool:
    if isinstance(a, Tensor) or isinstance(b, Tensor):
        return (
            isinstance(a, Tensor)
            and isinstance(b, Tensor)
            and a.shape == b.shape
            and a.dtype == b.dtype
            and bool(torch.equal(a.cpu(), b.cpu()))
        )
    if isinstance(a, float) and isinstance(b, float) and a != a and b != b:
        return True  # both NaN
    try:
        return bool(a == b)
    except Exception:
        return a is b


def _tensors(module: nn.Module, kind: str) -> dict[str, Tensor]:
    items = module._parameters if kind == "parameter" else module._buffers
    return {k: v for k, v in items.items() if v is not None}


def _check_pair(
    ref: nn.Module, other: nn.Module, index: int, what: str, placement: bool = True
) -> None:
    ref_mods = dict(ref.named_modules(remove_duplicate=False))
    other_mods = dict(other.named_modules(remove_duplicate=False))
    if list(ref_mods) != list(other_mods):
        missing = [p for p in ref_mods if p not in other_mods]
        extra = [p for p in other_mods if p not in ref_mods]
        raise FusionError(
            f"{what} {index} has a different module tree than member 0: "
            f"missing {missing or 'nothing'}, extra {extra or 'nothing'}. "
            "All members must be instances of one architecture."
        )
    ref_paths = {id(m): p for p, m in ref_mods.items()}
    other_paths = {id(m): p for p, m in other_mods.items()}
    for path, rm in ref_mods.items():
        om = other_mods[path]
        where = describe_path(path)
        if _module_class(rm) is not _module_class(om):
            kinds = {type(rm).__name__, type(om).__name__}
            hint = (
                " peft builds nn.Identity for lora_dropout=0 and nn.Dropout otherwise: give "
                "every member a lora_dropout above 0 (it may differ per member), or 0 to all."
                if "lora_dropout" in path and "Identity" in kinds and "Dropout" in kinds
                else ""
            )
            raise FusionError(
                f"{where} is {_class_name(rm)} in member 0 but {_class_name(om)} "
                f"in {what} {index}; all members must use the same classes.{hint}"
            )
        for kind in ("parameter", "buffer"):
            rt, ot = _tensors(rm, kind), _tensors(om, kind)
            if list(rt) != list(ot):
                raise FusionError(
                    f"{where} has {kind}s {list(rt)} in member 0 but {list(ot)} in {what} {index}."
                )
            for name, a in rt.items():
                b = ot[name]
                if a.shape != b.shape or (placement and a.dtype != b.dtype):
                    raise FusionError(
                        f"{kind} '{_join(path, name)}' is {tuple(a.shape)} {a.dtype} in member 0 but "
                        f"{tuple(b.shape)} {b.dtype} in {what} {index}. Hyperparameters that change "
                        "shapes (widths, depths, vocabulary) must be equal within one array; put such "
                        "trials in different arrays."
                    )
                if placement and a.device != b.device:
                    raise FusionError(
                        f"{kind} '{_join(path, name)}' is on {a.device} in member 0 but on {b.device} "
                        f"in {what} {index}; move all models to one device before fusing."
                    )
                if isinstance(a, nn.Parameter) and a.requires_grad != b.requires_grad:
                    raise FusionError(
                        f"parameter '{_join(path, name)}' has requires_grad={a.requires_grad} in "
                        f"member 0 but {b.requires_grad} in {what} {index}."
                    )
        free = per_member_attributes(rm) | (frozenset() if placement else frozenset({"training"}))
        for key, value in vars(rm).items():
            if key.startswith("_") or key in free:
                continue
            other_value = vars(om).get(key, _MISSING)
            if _equal(value, other_value) or _same_method(
                value, other_value, ref_paths, other_paths
            ):
                continue
            if is_peft_configs(value) and configs_agree(value, other_value):
                continue  # lora_alpha and lora_dropout may differ per member (see _peft)
            fields = _field_differences(value, other_value)
            if fields is not None:
                if fields:  # a configuration object: name the field
                    raise FusionError(
                        f"{where}: attribute '{key}' ({type(value).__name__}) differs in "
                        f"{_describe_fields(fields, what, index)}"
                    )
                continue  # equal apart from where it was loaded from
            hint = (
                " Register it as a buffer so that each member keeps its own value."
                if isinstance(value, Tensor)
                else " Settings that are not tensors are shared by the whole array."
            )
            raise FusionError(
                f"{where}: attribute '{key}' is {_short(value)} in member 0 but "
                f"{_short(other_value)} in {what} {index}.{hint}"
            )


_MISSING = object()


def _module_class(module: nn.Module) -> type:
    """A module's class; for a parametrized module (``torch.nn.utils.parametrize``), the class
    it had before: torch gives each parametrized module a class of its own, so members whose
    modules carry the same parametrizations have different classes. Their parametrizations are
    submodules (``parametrizations.<tensor>.<k>``), compared like any other."""
    cls = type(module)
    if parametrize.is_parametrized(module) and len(cls.__bases__) == 1:
        return cls.__bases__[0]
    return cls


def _class_name(module: nn.Module) -> str:
    cls = _module_class(module)
    if cls is type(module):
        return cls.__qualname__
    names = sorted(getattr(module, "parametrizations", {}))
    return f"{cls.__qualname__} with parametrized {names}"


#: fields of a configuration that say where it was loaded from, not what the model computes
_PROVENANCE_FIELDS = frozenset({"_name_or_path", "name_or_path", "_commit_hash"})


def _same_method(a: Any, b: Any, ref_paths: dict[int, str], other_paths: dict[int, str]) -> bool:
    """Methods of one function bound to corresponding objects of the two members: the same
    submodule path, or equal objects outside the module tree. (peft's causal-LM wrapper keeps
    ``base_model.prepare_inputs_for_generation`` bound to each member's own base model.)"""
    if not (isinstance(a, types.MethodType) and isinstance(b, types.MethodType)):
        return False
    if a.__func__ is not b.__func__:
        return False
    ref_path, other_path = ref_paths.get(id(a.__self__)), other_paths.get(id(b.__self__))
    if ref_path is not None or other_path is not None:
        return ref_path == other_path
    return _equal(a.__self__, b.__self__)


def _fields(value: Any) -> dict[str, Any] | None:
    """A configuration object's fields: a Hugging Face ``PretrainedConfig``'s ``to_dict()``
    (every field, nested configurations as dicts) or a dataclass's fields; ``None`` for other
    values."""
    to_dict = getattr(value, "to_dict", None)
    if callable(to_dict) and not isinstance(value, type):
        try:
            fields = to_dict()
        except Exception:
            fields = None
        if isinstance(fields, dict):
            return fields
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: getattr(value, f.name, _MISSING) for f in dataclasses.fields(value)}
    return None


def _diff(a: dict[str, Any], b: dict[str, Any], prefix: str) -> list[tuple[str, Any, Any]]:
    out: list[tuple[str, Any, Any]] = []
    for key in [*a, *(k for k in b if k not in a)]:
        if key in _PROVENANCE_FIELDS:
            continue
        va, vb = a.get(key, _MISSING), b.get(key, _MISSING)
        if isinstance(va, dict) and isinstance(vb, dict):
            out.extend(_diff(va, vb, f"{prefix}{key}."))
        elif not _equal(va, vb):
            out.append((f"{prefix}{key}", va, vb))
    return out


def _field_differences(a: Any, b: Any) -> list[tuple[str, Any, Any]] | None:
    """``(field, value in a, value in b)`` for every field where two configuration objects of
    one class differ (empty if they differ only in where they were loaded from); ``None`` if
    they are not configuration objects of one class."""
    if type(a) is not type(b):
        return None
    fa, fb = _fields(a), _fields(b)
    if fa is None or fb is None:
        return None
    out = _diff(fa, fb, "")
    if not out and hasattr(a, "__dict__"):  # fields that to_dict() leaves out
        out = _diff(vars(a), vars(b), "")
    return out


def _is_dropout_field(name: str, value: Any) -> bool:
    """A configuration field holding a dropout probability (``hidden_dropout_prob``,
    ``attention_dropout``, GPT-2's ``resid_pdrop``)."""
    leaf = name.rsplit(".", 1)[-1].lower()
    probability = is_number(value)
    return probability and ("dropout" in leaf or leaf.endswith("pdrop"))


def _describe_fields(fields: list[tuple[str, Any, Any]], what: str, index: int) -> str:
    """The first differing field with both values and what to do, and how many others differ."""
    name, first, other = fields[0]
    text = f"field '{name}': {_short(first)} in member 0 but {_short(other)} in {what} {index}"
    if len(fields) > 1:
        rest = [f[0] for f in fields[1:]]
        shown = ", ".join(f"'{n}'" for n in rest[:5]) + (", ..." if len(rest) > 5 else "")
        text += f" (and {len(rest)} other field{'s' if len(rest) > 1 else ''}: {shown})"
    if all(_is_dropout_field(n, v) and _is_dropout_field(n, w) for n, v, w in fields):
        return (
            f"{text}. A dropout probability may differ between members, but not through the "
            "configuration, which the whole array shares: build every member from one "
            "configuration and give each member's probability to hs.fuse(models, dropout=[p0, "
            "p1, ...]) (every dropout layer) or dropout={submodule path: [p0, p1, ...]} (some "
            "layers)."
        )
    return (
        f"{text}. The configuration is shared by the whole array, so members must agree on "
        "it; put members whose configurations differ in different arrays."
    )


def _join(path: str, name: str) -> str:
    return f"{path}.{name}" if path else name


def _short(value: Any) -> str:
    if value is _MISSING:
        return "missing"
    if isinstance(value, Tensor):
        return f"a tensor of shape {tuple(value.shape)}"
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _legacy_reparametrization(hook: Any) -> str | None:
    """``weight_norm`` or ``spectral_norm`` for the forward pre-hook of torch's older, hook-based
    ``torch.nn.utils.weight_norm`` / ``spectral_norm``; ``None`` for any other hook."""
    from torch.nn.utils.spectral_norm import SpectralNorm
    from torch.nn.utils.weight_norm import WeightNorm

    if isinstance(hook, WeightNorm):
        return "weight_norm"
    if isinstance(hook, SpectralNorm):
        return "spectral_norm"
    return None


def _check_supported(model: nn.Module, unsupported: Callable[[nn.Module], str | None]) -> None:
    for path, module in model.named_modules():
        where = describe_path(path)
        for name, p in module._parameters.items():
            if isinstance(p, nn.parameter.UninitializedParameter):
                raise FusionError(
                    f"parameter '{_join(path, name)}' is not initialised (a lazy module); run one "
                    "forward pass through each model before fusing."
                )
        for hook in getattr(module, "_forward_pre_hooks", {}).values():
            legacy = _legacy_reparametrization(hook)
            if legacy is not None:
                raise FusionError(
                    f"{where} ({type(module).__name__}) uses torch.nn.utils.{legacy} on "
                    f"'{getattr(hook, 'name', '?')}', which recomputes it in a forward pre-hook; "
                    "module hooks are not carried into a fused array. Use "
                    f"torch.nn.utils.parametrizations.{legacy} instead: the same computation as "
                    "a parametrization, which fuses."
                )
        for hooks in _HOOK_DICTS:
            found = getattr(module, hooks, None) or {}
            if any(not ignored_hook(hooks, h) for h in found.values()):
                raise FusionError(
                    f"{where} ({type(module).__name__}) has {hooks.strip('_').replace('_', ' ')} "
                    "registered; module hooks are not carried into a fused array (they would see "
                    "all members at once). Remove them before fusing and attach them to "
                    "array.member(i) instead."
                )
        reason = unsupported(module)
        if reason is not None:
            raise FusionError(f"{where} ({type(module).__name__}) cannot be fused: {reason}")


def check_compatible(
    models: Sequence[nn.Module],
    unsupported: Callable[[nn.Module], str | None],
    what: str = "member",
    placement: bool = True,
) -> None:
    """Raise :class:`FusionError` unless every model can share one array with ``models[0]``.

    ``placement=False`` ignores devices, dtypes and train/eval mode (used when a module is loaded
    into an existing array slot, where values are copied and cast).
    """
    if len(models) == 0:
        raise FusionError("fuse() needs at least one model; got an empty sequence.")
    for i, m in enumerate(models):
        if not isinstance(m, nn.Module):
            raise FusionError(
                f"{what} {i} is a {type(m).__name__}, not a torch.nn.Module; pass a list of models."
            )
    for m in models if not placement else models[:1]:
        _check_supported(m, unsupported)
    ids = {id(m) for m in models}
    if len(ids) != len(models):
        raise FusionError(
            "the same model object appears more than once; create each member separately (for "
            "example with copy.deepcopy and a fresh initialisation) so members do not share weights."
        )
    for i, m in enumerate(models[1:], start=1):
        _check_pair(models[0], m, i, what, placement)
