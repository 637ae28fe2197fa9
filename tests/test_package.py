"""Package-level promises: a light import, the public names, the mapped subpackages."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

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


def test_the_wheel_holds_every_module(tmp_path: Path) -> None:
    """A non-editable install (``pip install hfsweep``) carries every module and data file.

    The package list in pyproject.toml is explicit (two subpackages live outside ``hfsweep/``),
    so a new subpackage that is not added there would import in the editable checkout and be
    missing from the wheel users install.
    """
    root = Path(__file__).resolve().parents[1]
    src = tmp_path / "src"  # a copy: setuptools' build/ folder in the checkout could hide a gap
    skip = shutil.ignore_patterns("__pycache__")
    for name in ("hfsweep", "schedulers", "search_spaces"):
        shutil.copytree(root / name, src / name, ignore=skip)
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(root / name, src / name)
    pip = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q"]
    subprocess.run(
        [*pip, "-w", str(tmp_path), str(src)],
        check=True,
        capture_output=True,
        text=True,
    )
    (wheel,) = tmp_path.glob("hfsweep-*.whl")
    with zipfile.ZipFile(wheel) as z:
        held = {n for n in z.namelist() if not n.startswith("hfsweep-")}
    expected = set()
    for source, target in (
        ("hfsweep", "hfsweep"),
        ("schedulers", "hfsweep/schedulers"),
        ("search_spaces", "hfsweep/search_spaces"),
    ):
        for f in (root / source).rglob("*"):
            if f.suffix in (".py", ".yaml") and "__pycache__" not in f.parts:
                rel = f.relative_to(root / source).as_posix()
                if source == "hfsweep" and rel.split("/")[0] in ("schedulers", "search_spaces"):
                    continue
                expected.add(f"{target}/{rel}")
    assert not expected - held, (
        f"missing from the wheel (add to [tool.setuptools] packages): {sorted(expected - held)}"
    )
