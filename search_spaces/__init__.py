"""The search-space language (YAML or dict to Optuna distributions / Tune domains) and ready spaces.

Importable as ``hfsweep.search_spaces``. Nothing is implemented here yet: the sweep engine that
reads search spaces is planned (see the project's issues) and this package exists so the layout
and import path are fixed from the start.
"""

__all__: list[str] = []
