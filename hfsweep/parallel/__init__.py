"""Data-parallel arrays: one fused array trained on k workers, resized while it trains.

Each worker holds every member and trains on 1/k of every global batch; the gradients are summed
across workers with ``torch.distributed`` (gloo on CPUs, NCCL on GPUs), each worker's loss
weighted by its share of the batch's rows, so that a k-worker array equals the 1-worker array
within float rounding (dropout masks included) and every hyperparameter keeps its meaning. The
checkpoint is the one-worker trainer's, so an array can go on with another number of workers at
any evaluation boundary, and after a worker is lost. docs/elastic.md has the details.

One job per module, each importing only those below it in this list:

- ``_ray``: :func:`train_data_parallel_ray`, the k workers as Ray actors in a placement group.
- ``_launch``: :func:`train_data_parallel`, k worker processes on this machine, resized and
  shrunk from the checkpoint (the loop both share).
- ``_run``: :class:`DataParallelTrainer`, the trainer of one worker; :func:`request_resize`.
- ``_collectives``: the process group's collectives the workers use.
- ``_split``: how a batch is split between the workers.
- ``_sent``: what a worker process sends its launcher (outcome, exception) as plain data.
"""

from ._collectives import Group
from ._launch import COLLECTIVE_TIMEOUT_S, WorkerError, train_data_parallel
from ._ray import train_data_parallel_ray
from ._run import DataParallelTrainer, ResizeRequested, read_resize, request_resize
from ._sent import WorkerRaised
from ._split import batch_rows, shard_bounds, shard_sizes, take_rows

__all__ = [
    "COLLECTIVE_TIMEOUT_S",
    "DataParallelTrainer",
    "Group",
    "ResizeRequested",
    "WorkerError",
    "WorkerRaised",
    "batch_rows",
    "read_resize",
    "request_resize",
    "shard_bounds",
    "shard_sizes",
    "take_rows",
    "train_data_parallel",
    "train_data_parallel_ray",
]
