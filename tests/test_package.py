"""Package-level promises: a light import, the public names, the mapped subpackages."""

from __future__ import annotations

import subprocess
import sys

import hfsweep as hs


def test_import_does_not_pull_in_ray_or_optuna() -> None:
    code = "import sys, hfsweep; print('ray' in sys.modules, 'optuna' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "False"]


def test_public_names() -> None:
    for name in ("fuse", "FusedArray", "FusionError", "member_losses", "__version__"):
        assert name in hs.__all__ and hasattr(hs, name)


def test_mapped_subpackages_import() -> None:
    import hfsweep.schedulers
    import hfsweep.search_spaces

    assert "make_scheduler" in hfsweep.schedulers.__all__
    assert "SearchSpace" in hfsweep.search_spaces.__all__
