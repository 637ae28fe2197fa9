"""Helpers to prove that a fused array trains exactly like its members would alone."""

from . import _models
from ._conformance import assert_fusion_matches, assert_trees_close
from ._models import *  # noqa: F403 - the reference models, as _models.__all__ lists them

__all__ = [*_models.__all__, "assert_fusion_matches", "assert_trees_close"]
