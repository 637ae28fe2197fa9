"""``sweep.yaml``: the schema of a sweep, read and validated before anything trains.

A sweep file is one YAML mapping. Every key, with its default::

    task: digits_mlp            # required. A ready task (hfsweep.tasks: digits_mlp, digits_cnn,
                                #   cifar_resnet, token_transformer), "package.module:attribute"
                                #   (imported from the working directory / sys.path) or
                                #   "path/to/file.py:attribute" (relative to the sweep file's folder)
    config: {hidden: 64}        # fixed config values of every trial; keys the task knows
    search_space: sgd_momentum  # required. A ready space (sgd_momentum, adamw, sgd_or_adamw), a
                                #   path to a YAML space file (relative to the sweep file's folder,
                                #   ending in .yaml/.yml or containing a "/"), or the space inline:
                                #   {lr: {type: float, low: 1.0e-3, high: 1.0, log: true}, ...}
    searcher: tpe               # tpe, random, grid, cmaes, qmc or gp (Optuna's samplers), or
                                #   {name: tpe, seed: 0, options: {constant_liar: true}}; options
                                #   are the sampler's constructor arguments; seed defaults to
                                #   the sweep's seed. grid needs a space grid() can build (floats
                                #   with a step, no conditional params); the engine caps the
                                #   trials at the grid size (SearcherConfig.grid_size). A search
                                #   algorithm of your own: {name: "file.py:Class" or
                                #   "module:Class", options: {...}}, an hfsweep.Searcher subclass
                                #   built with the options as keyword arguments.
    scheduler: fifo             # fifo, asha, hyperband, median or optuna:<pruner> (optuna:median,
                                #   optuna:successive_halving, ...), or
                                #   {name: asha, options: {grace_period: 1, reduction_factor: 3}};
                                #   resources (grace_period...) count epochs, or steps when the
                                #   budget is in steps.
    budget:                     # required
      trials: 64                # required, an integer from 1 to 1,000,000
      epochs: 10                # per trial; exactly one of epochs (an integer from 1 to 100,000)
      # steps: 500              #   and steps (an integer from 1 to 1,000,000,000)
      time_limit: null          # null: unbounded; or seconds (a number > 0) or a string: "90s",
                                #   "30m", "2h", "1h30m"; at most a year (8784h)
    metric: val_accuracy        # required; one of the task's metric_names
                                #   (train_loss, val_loss, val_<metric>...)
    mode: max                   # required; max or min
    fusion:
      size: auto                # array size B: auto (chosen by the profiler) or an int >= 1
                                #   (auto: at most half the trials unless the searcher
                                #   is random, grid or qmc, so the searcher learns)
      device: auto              # auto (cuda if available, else cpu), cpu, cuda or cuda:N
      dtype: float32            # float32, float64 or bfloat16
      eval_every: null          # evaluate every this many steps (int >= 1); null: every epoch
      share_frozen: true        # keep frozen tensors every member holds identically (a
                                #   pretrained backbone) once, not once per member
      compile: false            # true: torch.compile each array's fused step (CUDA graphs on
                                #   cuda); auto: the profiler times both, keeps the faster
                                #   (backend ray too: in each worker, elastic arrays' included)
      offload: none             # none, host (state in host memory, run shard by shard) or
                                #   auto (where the array does not fit the device: the profiler
                                #   times it offloaded and split into arrays that fit, keeps the faster;
                                #   with size: auto, sizes beyond the device are timed offloaded too)
      device_memory: null       # bytes offload may hold on the device (an int >= 1, with offload
                                #   host or auto); null: a CUDA device's free memory (on a cpu,
                                #   auto then keeps arrays as they are)
      alternate: 1              # offloaded arrays trained at once on a device, their shards
                                #   alternating (an int >= 1; > 1 needs offload: host; on backend
                                #   ray, in each worker)
      offload_step: host        # where an offloaded array's optimizer steps: host, device (each
                                #   shard after its backward; host while a member clips) or auto (both
                                #   timed on the array's first steps, the faster kept)
    backend: local              # local (in-process) or ray (arrays on a Ray cluster)
    ray:                        # only with backend: ray
      address: null             # null: start a local Ray for the run; "auto", "host:6379" or
                                #   "ray://host:10001" to use a running cluster
      cpus_per_array: 1         # CPUs each array's actor reserves (a number > 0)
      gpus_per_array: auto      # auto: 1 when fusion.device is cuda, or auto on a cluster with
                                #   GPUs; else 0. Or a number >= 0
      max_concurrent: null      # arrays training at once; null: as many as the cluster fits
      max_failures: 3           # restarts of an array from its checkpoint after its worker died
      connect_timeout_s: 30     # seconds the cluster at address has to answer (a number > 0)
      elastic:                  # arrays on several workers, resized while they run
        enabled: false          #   true: arrays train data-parallel on the workers the
                                #   allocator gives them (docs/elastic-allocator.md)
        min_workers_per_array: 1    # an integer >= 1
        max_workers_per_array: null # an integer >= min_workers_per_array; null: the cluster
        resize_every_s: 60      #   an array is resized at most this often (seconds or "1m")
        resize_cost_s: 0        #   seconds a resize pauses an array: it must gain more
        max_wait_s: 600         #   longest wait of an array paused when workers are too few
        scaling: model          #   model: each key's scaling modelled (measured step and
                                #   all-reduce, cached); perfect: k workers = k times one
    storage: null               # null: an Optuna journal file in the run directory; or an Optuna
                                #   RDB URL (sqlite:///study.db, postgresql+psycopg2://user@host/db
                                #   with hfsweep[postgres], ...) whose driver is installed;
                                #   ${NAME} is an environment variable (a password, the URL)
                                #   or journal://PATH: a journal file drivers share
    storage_retry: 120          # seconds (or "2m") to retry a lost database connection; null: none
    output: runs/<file stem>    # the run directory, relative to the sweep file's folder
    study_name: <file stem>     # the Optuna study's name ("sweep" without a file)
    seed: 0                     # int >= 0; the searcher's seed unless searcher.seed is given
    tracking: []                # experiment trackers, each a name or {name: {options}}:
                                #   mlflow {tracking_uri, experiment, tags}, tensorboard
                                #   {log_dir}, wandb {mode, project, entity, group, dir, tags};
                                #   each needs its extra (pip install "hfsweep[mlflow]")

Numbers such as ``1e-4`` are read as floats (as YAML 1.2 does). A key given twice in any mapping
(here or in a search-space file) is an error naming both lines, not a silent override; merge keys
(``<<: *anchor``) may still override the keys they bring in. Validation goes as far as can be
checked without training or writing anything: unknown keys (with a did-you-mean), types, ranges,
the task's entry point imports, every config and search-space key is one the task knows, the
metric is one the task reports, the searcher and scheduler build with their options, and sampled
configs (corners of the space and 20 random draws) pass ``task.resolve``. ``epochs`` and
``max_steps`` belong to the budget, not to ``config`` or the search space.

Every problem raises :class:`ConfigError` naming the file, the YAML path (``budget.trials``,
``search_space.lr.low``), the bad value and what is valid. :func:`load_sweep` reads a file,
:func:`parse_sweep` a mapping (the Python API's route); both check the file's own keys, types
and sections before they import the task. :func:`check_sweep_file` checks a file alone, without
importing its task or torch, and returns a :class:`SweepFile` (``hfsweep validate --file-only``).
A file is read within bounds: at most 8 MiB, 100 levels deep, and 100,000 nodes brought in by
aliases. The result, :class:`SweepConfig`, is
frozen; :meth:`SweepConfig.to_dict` is its JSON-safe resolved form, which ``parse_sweep`` reads
back to an equal config.

The package, a module a job: :mod:`~hfsweep.config.schema` (the dataclasses, names and limits),
:mod:`~hfsweep.config.parse` (reading a file or mapping, a section at a time),
:mod:`~hfsweep.config.fields` (the checks every section uses),
:mod:`~hfsweep.config.algorithms` (``searcher:`` and ``scheduler:``),
:mod:`~hfsweep.config.elastic` (``ray.elastic:``),
:mod:`~hfsweep.config.validate` (the checks against the task), :mod:`~hfsweep.config.build`
(the sampler or searcher a sweep runs with) and :mod:`~hfsweep.config.entry` (importing a task or
searcher a user names).
"""

from .build import make_sampler, make_searcher
from .parse import check_sweep_file, load_sweep, parse_sweep
from .schema import (
    BACKENDS,
    DTYPES,
    MAX_TRIALS,
    SEARCHER_NAMES,
    Budget,
    ConfigError,
    ElasticConfig,
    FusionConfig,
    RayConfig,
    SchedulerConfig,
    SearcherConfig,
    SweepConfig,
    SweepFile,
    TrackerConfig,
)

__all__ = [
    "BACKENDS",
    "DTYPES",
    "MAX_TRIALS",
    "SEARCHER_NAMES",
    "Budget",
    "ConfigError",
    "ElasticConfig",
    "FusionConfig",
    "RayConfig",
    "SchedulerConfig",
    "SearcherConfig",
    "SweepConfig",
    "SweepFile",
    "TrackerConfig",
    "check_sweep_file",
    "load_sweep",
    "make_sampler",
    "make_searcher",
    "parse_sweep",
]
