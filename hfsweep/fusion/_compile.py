"""The compiled path: a fused array's traced forward compiled with ``torch.compile`` (inductor).

What is compiled. A fused array already replays each call signature's forward from a trace: a
graph of plain batched aten ops (see :mod:`hfsweep.fusion._tracing`). With ``compile`` on, that
graph is handed to ``torch.compile`` (backend ``inductor``, static shapes, one graph, no graph
breaks), whose AOTAutograd compiles the backward of the same graph too. Compiling the trace
rather than the user's ``forward`` keeps dynamo away from ``vmap``, the module swaps and the
per-member random routing: it sees a pure function of the stacked state and the inputs. The
per-member dropout masks come from hfsweep's own custom ops (``hfsweep::dropout_multiplier``,
``hfsweep::uniform``), which inductor calls as they are, so masks are bit for bit the eager
ones; the call counters and BatchNorm statistics the graph updates in place are written back.

What is not compiled, and why (each falls back to the eager path with one warning naming it):

* a signature that runs eagerly anyway (``hs.fuse(..., trace=False)``, forward code that
  branches on tensor values, switches grad mode or changes module attributes): there is no
  graph to compile;
* a graph that ``torch.compile`` refuses or that fails at its first run: the signature goes
  on with the uncompiled trace (same results).

Loss and optimizer step stay outside the compiled graph (the fused optimizers are already
one ``torch._foreach`` pass over the stacked tensors). On CUDA ``compile=True`` uses
``mode="reduce-overhead"`` (CUDA graphs: one launch replays the whole step's kernels).
"""

from __future__ import annotations

import copy
import logging
import warnings
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch

from .._compat import compile_backward_eagerly, mark_static_address

__all__ = [
    "COMPILE_MODES",
    "CompileFallbackWarning",
    "check_compile",
    "compile_error",
    "compile_graph",
    "compiling_backward_now",
    "mode_for",
    "warn_fallback",
]

_log = logging.getLogger("hfsweep.fusion")

#: the ``torch.compile`` modes ``compile=`` accepts by name (``True`` picks one per device)
COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")


class CompileFallbackWarning(UserWarning):
    """A fused array asked to compile runs (part of) its forward uncompiled; the message says
    why. Results are the same, only the speed differs."""


def check_compile(value: object, where: str = "compile") -> bool | str:
    """``value`` as ``compile=`` takes it: ``False``, ``True`` (a mode per device, see
    :func:`mode_for`) or one of :data:`COMPILE_MODES`; anything else raises naming ``where``."""
    if isinstance(value, bool) or value in COMPILE_MODES:
        return value
    raise ValueError(
        f"{where}={value!r} is not valid: give True, False or a torch.compile mode "
        f"({', '.join(COMPILE_MODES)})"
    )


def mode_for(compile: bool | str, device: torch.device) -> str | None:
    """The ``torch.compile`` mode of ``compile=`` on ``device``; ``None``: do not compile.

    ``True`` is ``"reduce-overhead"`` (CUDA graphs) on CUDA, where small models are bound by
    kernel launches, and ``"default"`` elsewhere (CUDA graphs exist only on CUDA)."""
    if compile is False:
        return None
    if compile is True:
        return "reduce-overhead" if device.type == "cuda" else "default"
    return str(compile)


def compile_graph(
    graph: torch.fx.GraphModule, mode: str, state: Sequence[torch.Tensor] = ()
) -> Callable[..., Any]:
    """``graph`` compiled by inductor in ``mode``: static shapes (each signature has its own
    trace), the whole graph or an error (``fullgraph``). Compiling happens at the first call.

    With CUDA graphs (``"reduce-overhead"``) the stacked ``state`` tensors, which the graph
    takes as inputs and the optimizers update in place, are marked as living at fixed
    addresses, so a replay does not copy every parameter into the graph's own buffers first
    (a new tensor there, after ``.to()`` say, re-records the graph).
    """
    if mode == "reduce-overhead":
        for t in state:
            mark_static_address(t)
    graph = _without_skipped_cat_inputs(graph)
    compiled = torch.compile(graph, backend="inductor", mode=mode, dynamic=False, fullgraph=True)
    return compiled


_CATS = (torch.cat, torch.ops.aten.cat.default)


def _without_skipped_cat_inputs(graph: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """``graph``, or a copy of it (the same module's constants) whose concatenations drop the
    1-d empty tensors eager ``cat`` skips, a cat left with one tensor becoming the contiguous
    copy eager ``cat`` made of it.

    Hugging Face's key-value cache concatenates each new key to an empty ``[0]`` tensor. Eager
    ``cat`` returns a contiguous copy of the key; compiled, the concatenation of one tensor is a
    copy in the key's own (transposed) layout, and the attention's ``view`` of it, valid in the
    eager run the trace recorded, fails to compile (without this rewrite every compiled GPT-2
    would fall back to the uncompiled trace). The
    trace recorded each result's layout (``meta["val"]``): a cat is rewritten only where its
    result was contiguous, so the rewrite keeps the eager layout."""

    def skipped(node: object) -> bool:
        val = getattr(node, "meta", {}).get("val")
        return isinstance(val, torch.Tensor) and val.dim() == 1 and val.numel() == 0

    cats = [
        n
        for n in graph.graph.nodes
        if n.op == "call_function"
        and n.target in _CATS
        and n.args
        and isinstance(n.args[0], (list, tuple))
        and any(skipped(t) for t in n.args[0])
        and not all(skipped(t) for t in n.args[0])
        and isinstance(n.meta.get("val"), torch.Tensor)
        and n.meta["val"].is_contiguous()
    ]
    if not cats:
        return graph
    new = copy.deepcopy(graph.graph)
    for node in [n for n in new.nodes if n.name in {c.name for c in cats}]:
        kept = [t for t in node.args[0] if not skipped(t)]
        dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0)
        with new.inserting_before(node):
            if len(kept) == 1:
                replacement = new.call_function(
                    torch.ops.aten.clone.default,
                    (kept[0],),
                    {"memory_format": torch.contiguous_format},
                )
            else:
                replacement = new.call_function(torch.ops.aten.cat.default, (kept, dim))
        replacement.meta = dict(node.meta)
        node.replace_all_uses_with(replacement)
        new.erase_node(node)
    # the skipped tensors' nodes stay (no dead-code pass: it would also drop the in-place
    # counter updates whose results nothing reads); inductor leaves out what is unused
    return torch.fx.GraphModule(graph, new)


def compiling_backward_now() -> AbstractContextManager[object]:
    """While a compiled graph's first call runs: compile its backward then too, not at the first
    backward pass (AOTAutograd's default), so that the first call's time is all the compiling
    (what step timers leave out) and a backward that fails to compile falls back with the
    forward. A no-op where torch lacks the setting."""
    patch = compile_backward_eagerly()
    return nullcontext() if patch is None else patch


def compile_error(exc: BaseException) -> str:
    """``exc`` in one line for a fallback warning: its type and first line. Where dynamo's own
    error stands in front of another (a compiled graph that failed at run time, dynamo then
    refusing a frame of the code formatting that failure: "Attempt to trace generator"), the
    first error is named as well, since it is the one that says what to mend."""

    def line(e: BaseException) -> str:
        first = str(e).strip().splitlines()
        return f"{type(e).__name__}: {first[0] if first else ''}"

    cause = exc.__context__
    if cause is None or type(exc).__module__ != "torch._dynamo.exc":
        return line(exc)
    return f"{line(cause)}; torch.compile then raised {line(exc)}"


def warn_fallback(reason: str, stacklevel: int = 4) -> None:
    """The one warning a compiled array gives when a call signature runs uncompiled."""
    warnings.warn(
        f"compile=True: {reason}; this call signature runs uncompiled (same results, slower)",
        CompileFallbackWarning,
        stacklevel=stacklevel,
    )
    _log.info("fused array runs uncompiled: %s", reason)
