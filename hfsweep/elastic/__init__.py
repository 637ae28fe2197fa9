"""Elastic arrays: how many accelerators (workers) each array of a sweep trains on.

The packer (:mod:`hfsweep.core.packer`) decides *which* trials share an array; this package
decides *how many* workers each array gets, data-parallel, re-deciding whenever arrays start,
end, shrink or the cluster changes (``ray.elastic`` in a sweep file, on ``backend: ray``):

- :mod:`~hfsweep.elastic.allocator`: the allocator itself, pure Python on a clock the caller
  passes in (a dynamic program over arrays and worker counts, after Jayaram et al. 2020);
- :mod:`~hfsweep.elastic.policy`: the allocator as ``hfsweep run`` drives it, the Ray
  executor's worker policy, with every decision logged;
- :mod:`~hfsweep.elastic.scaling`: each compatibility key's scaling profile (cached, modelled,
  then measured), which the allocator decides with;
- :mod:`~hfsweep.elastic.survival`: how long an array is expected to train on under the trial
  scheduler's rungs (ASHA, Hyperband).

Importing the package imports none of them.
"""

__all__: list[str] = []
