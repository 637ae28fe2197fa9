"""The forward's trace key reads every module's public settings, so that a changed setting never
replays a stale trace; which of a module's keys are settings is remembered with the key set it
was worked out from (issue 21: most of the trace lookup's time was reading every key of every
module's ``__dict__``). Each case is checked against the same model run eagerly, in float64."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import hfsweep as hs
from hfsweep.fusion import _tracing


class Scaled(nn.Module):
    """A Linear whose forward reads plain settings: ``scale``, ``training`` and, when set,
    ``shift``."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 3)
        self.scale = 2.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.fc(x) * self.scale
        if not self.training:
            out = out - 1.0
        shift = getattr(self, "shift", None)
        return out if shift is None else out + shift


def _setup(size: int = 3) -> tuple[hs.FusedArray, list[nn.Module], torch.Tensor]:
    torch.manual_seed(0)
    models = [Scaled().double() for _ in range(size)]
    refs = [copy.deepcopy(m) for m in models]
    return hs.fuse(models), refs, torch.randn(5, 4, dtype=torch.float64)


def _same_as_eager(array: hs.FusedArray, refs: list[nn.Module], x: torch.Tensor) -> None:
    out = array(x)
    for i, ref in enumerate(refs):
        torch.testing.assert_close(out[i], ref(x), rtol=1e-7, atol=0)


def _each(refs: list[nn.Module], change) -> None:  # type: ignore[no-untyped-def]
    for ref in refs:
        change(ref)


@pytest.mark.parametrize(
    "change",
    [
        pytest.param(lambda m: m.eval(), id="eval"),
        pytest.param(lambda m: setattr(m, "scale", 3.0), id="a changed value"),
        pytest.param(lambda m: setattr(m, "shift", 0.5), id="a new attribute"),
        pytest.param(lambda m: setattr(m.fc, "note", "x"), id="a new attribute, unread"),
    ],
)
def test_a_changed_setting_never_replays_a_stale_trace(change) -> None:  # type: ignore[no-untyped-def]
    array, refs, x = _setup()
    for _ in range(3):  # traced and replayed
        _same_as_eager(array, refs, x)
    traces = len(array._traces)
    change(array.module)
    _each(refs, change)
    for _ in range(2):
        _same_as_eager(array, refs, x)
    assert len(array._traces) == traces + 1  # a new key: traced again, not replayed


def test_a_removed_or_replaced_attribute_is_seen() -> None:
    """Same number of keys, another key set: the comparison is of the keys, not their count."""
    array, refs, x = _setup()
    for ref in [array.module, *refs]:
        ref.shift = 0.25
    _same_as_eager(array, refs, x)
    for ref in [array.module, *refs]:
        del ref.shift
        ref.other = 1  # replaces it: as many keys as before
    _same_as_eager(array, refs, x)
    for ref in [array.module, *refs]:
        del ref.other
        ref.shift = -1.5
    _same_as_eager(array, refs, x)
    assert len(array._traces) == 3


def test_the_settings_are_worked_out_once_per_key_set(monkeypatch: pytest.MonkeyPatch) -> None:
    """A call with no module changed compares key sets and reads the remembered settings; it
    works nothing out again (before, every call read every key of every module)."""
    array, _refs, x = _setup()
    array(x)
    worked_out: list[int] = []
    real = frozenset

    def counting(keys):  # type: ignore[no-untyped-def]
        worked_out.append(1)
        return real(keys)

    monkeypatch.setattr(_tracing, "frozenset", counting, raising=False)
    before = array._attributes()
    for _ in range(5):
        assert array._attributes() == before
    assert worked_out == []
    array.module.shift = 0.5
    after = array._attributes()
    assert len(worked_out) == 1  # the one module whose keys changed
    assert after != before and "shift" in after
    names = list(after[::2])
    assert all(not n.startswith("_") for n in names)
    assert "training" in names and "scale" in names and "in_features" in names


def test_a_deep_copy_reads_its_own_modules() -> None:
    """A copy's template has new ``__dict__`` objects, and its remembered settings are its own:
    the copy's ``eval()`` is seen, the original's is not."""
    array, refs, x = _setup()
    array(x)
    copied = copy.deepcopy(array)
    copied.eval()
    evals = copy.deepcopy(refs)
    for ref in evals:
        ref.eval()
    _same_as_eager(copied, evals, x)
    _same_as_eager(array, refs, x)
