"""The search-space language of ``sweep.yaml``, and ready spaces.

Importable as ``hfsweep.search_spaces``. A search space maps config keys (the flat names
``hs.Task`` configs use) to how they are drawn::

    lr: {type: float, low: 1.0e-4, high: 1.0, log: true}
    momentum: {type: float, low: 0.0, high: 0.99, step: 0.01}
    hidden: {type: int, low: 32, high: 256, log: true}
    optimizer: {type: categorical, choices: [sgd, adamw]}
    batch_size: 64                                         # a plain value is fixed
    beta1: {type: float, low: 0.8, high: 0.99, when: {optimizer: adamw}}

:class:`SearchSpace` validates a space (:class:`SpaceError` names the YAML path, the bad value
and what is valid), draws configs from an Optuna trial (:meth:`SearchSpace.sample`), and gives
Optuna's static distributions and a grid for ``GridSampler``. :func:`load_space` reads a space
from a mapping, a YAML file or the name of a ready space (:func:`ready_spaces`).

Importing this package does not import Optuna; the methods that need it import it.

Every YAML file hfsweep reads goes through :func:`load_yaml`/:func:`read_yaml_file` and one
loader (:func:`yaml_loader`), which refuse a key given twice (:class:`DuplicateKeyError`) and
a document too large, deep or aliased (:class:`YamlLimitError`).
"""

from ._errors import SpaceError
from ._params import CategoricalParam, FixedParam, FloatParam, IntParam, Param
from ._ready import load_space, ready_spaces
from ._space import SearchSpace
from ._yaml import DuplicateKeyError, YamlLimitError, load_yaml, read_yaml_file, yaml_loader

__all__ = [
    "CategoricalParam",
    "DuplicateKeyError",
    "FixedParam",
    "FloatParam",
    "IntParam",
    "Param",
    "SearchSpace",
    "SpaceError",
    "YamlLimitError",
    "load_space",
    "load_yaml",
    "read_yaml_file",
    "ready_spaces",
    "yaml_loader",
]
