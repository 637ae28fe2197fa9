"""Whether an array trains compiled (``fusion: {compile: auto}``): the profiler times the fused
step eager and compiled at the chosen array size and keeps the faster, counting the compile time.

Compile time is *amortised*: compiling pays when ``compile_s + compiled_step_s * horizon`` is
below ``eager_step_s * horizon``, ``horizon`` being the steps an array of this kind is expected to
train (:data:`DEFAULT_HORIZON_STEPS` unless the caller knows better). So a compiled step that is
faster by 1 ms does not pay for a 30 s compile in a 1,000-step array, and a compiled step that is
slower never wins. The decision is stored with the profile in the profile cache, so a sweep
measures it once per kind of array and machine.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from ._units import _check_int, _check_real

__all__ = ["DEFAULT_HORIZON_STEPS", "CompileChoice", "choose_compile"]

#: the steps over which compile time is amortised when the caller does not say
DEFAULT_HORIZON_STEPS = 1000


@dataclass(frozen=True)
class CompileChoice:
    """The measured eager and compiled step times at array size ``size``, the compile time, the
    horizon they were compared over, the decision (``compiled``) and why in one sentence."""

    size: int
    eager_step_s: float
    compiled_step_s: float
    compile_s: float
    horizon_steps: int
    compiled: bool
    reason: str

    def to_dict(self) -> dict[str, Any]:
        """Plain numbers and strings, as the profile cache stores them."""
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> CompileChoice:
        """The choice :meth:`to_dict` wrote."""
        return cls(**d)


def choose_compile(
    size: int,
    eager_step_s: float,
    compiled_step_s: float,
    compile_s: float,
    horizon_steps: int = DEFAULT_HORIZON_STEPS,
) -> CompileChoice:
    """Compile when the compile time plus ``horizon_steps`` compiled steps take less time than
    ``horizon_steps`` eager steps (all measured at array size ``size``)."""
    _check_int("size", size, 1)
    horizon = _check_int("horizon_steps", horizon_steps, 1)
    for name, value in (
        ("eager_step_s", eager_step_s),
        ("compiled_step_s", compiled_step_s),
        ("compile_s", compile_s),
    ):
        _check_real(name, value)
    eager_total = eager_step_s * horizon
    compiled_total = compile_s + compiled_step_s * horizon
    times = (
        f"compiled {compiled_step_s * 1e3:.3g} ms/step vs eager {eager_step_s * 1e3:.3g} ms/step "
        f"at B={size}, compiling took {compile_s:.3g} s"
    )
    if compiled_step_s >= eager_step_s:
        compiled, why = False, f"eager: the compiled step is not faster ({times})"
    elif compiled_total >= eager_total:
        compiled, why = (
            False,
            f"eager: compiling does not pay back within {horizon} steps ({times})",
        )
    else:
        saved = eager_total - compiled_total
        compiled, why = True, f"compiled: saves {saved:.3g} s over {horizon} steps ({times})"
    return CompileChoice(size, eager_step_s, compiled_step_s, compile_s, horizon, compiled, why)
