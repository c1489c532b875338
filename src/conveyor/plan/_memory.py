"""Per-worker memory of a pipeline stage under a schedule: weight versions, gradients, optimizer state, stash.

A worker of a stage holds ``versions`` copies of the stage's weights, one gradient buffer, the optimizer
state, and the activations of every microbatch whose forward ran and whose backward has not. How many
of each depends on the schedule and on the layout, through the worker's warm-up: a stage with ``r``
replicas and ``d`` workers from it to the end of the pipeline (its own included) admits ``ceil(d / r)``
microbatches before its first backward (PipeDream's NOAM for the input stage).

================  ====================  =============================
schedule          weight versions       microbatches in flight
================  ====================  =============================
``pipedream``     ``ceil(d / r)``       ``ceil(d / r)``
``2bw``           2                     ``ceil(d / r)``
``flush``         1                     ``min(ceil(d / r), ceil(M / r))``
``gpipe``         1                     ``ceil(M / r)`` (all forwards first)
================  ====================  =============================

``M`` is the microbatches of one optimizer step, shared round-robin by the stage's replicas. These
counts equal what the schedule module's action lists hold
(:meth:`~conveyor.schedule._schedule.Schedule.worker_peak_versions` and the simulator's peak stash); the tests
check that.

Example:
    >>> int(in_flight("pipedream", replicas=1, downstream=4, microbatches=8)), int(weight_versions("2bw", 1, 4))
    (4, 2)
"""

from __future__ import annotations

import numpy as np

from conveyor.plan._profiles import Profile

__all__ = ["PLANNER_SCHEDULES", "in_flight", "layer_stash_bytes", "stage_bytes", "weight_versions", "worker_bytes"]

PLANNER_SCHEDULES = ("pipedream", "2bw", "flush", "gpipe")

Count = int | np.ndarray
Bytes = int | float | np.ndarray


def _check(schedule: str) -> None:
    if schedule not in PLANNER_SCHEDULES:
        raise ValueError(f"the planner knows schedules {', '.join(PLANNER_SCHEDULES)}, not {schedule!r}")


def in_flight(schedule: str, replicas: Count, downstream: Count, microbatches: int) -> Count:
    """Microbatches a worker of the stage holds activations for at its peak (arrays broadcast)."""
    _check(schedule)
    warmup = -(-downstream // replicas)
    own = -(-microbatches // replicas)
    if schedule == "gpipe":
        return own
    if schedule == "flush":
        return np.minimum(warmup, own)
    return warmup


def weight_versions(schedule: str, replicas: Count, downstream: Count) -> Count:
    """Copies of the stage's weights a worker holds at its peak (arrays broadcast)."""
    _check(schedule)
    if schedule == "pipedream":
        return -(-downstream // replicas)
    return np.broadcast_to(2 if schedule == "2bw" else 1, np.broadcast_shapes(np.shape(replicas), np.shape(downstream)))


def layer_stash_bytes(profile: Profile) -> list[int]:
    """Per layer, the activation bytes one microbatch leaves stashed for its backward.

    The bytes autograd saves when the profile measured them; otherwise the layer's output, as PipeDream's
    optimizer assumed (its ``graph.txt`` records nothing else).
    """
    if any(lay.saved_bytes for lay in profile.layers):
        return [lay.saved_bytes for lay in profile.layers]
    return [lay.output_bytes for lay in profile.layers]


def stage_bytes(
    profile: Profile, first: int, stop: int, schedule: str, replicas: int, downstream: int, microbatches: int
) -> int:
    """Peak bytes on one worker of a stage running layers ``[first, stop)``.

    Args:
        profile: the model (its batch is one microbatch).
        first, stop: the stage's layers.
        schedule: one of :data:`PLANNER_SCHEDULES`.
        replicas: the stage's data-parallel workers.
        downstream: workers from this stage to the end of the pipeline, this stage's included.
        microbatches: microbatches per optimizer step (bounds the stash of ``flush`` and ``gpipe``).
    """
    weights = profile.param_bytes(first, stop)
    optimizer = sum(lay.optimizer_bytes for lay in profile.layers[first:stop])
    stash = sum(layer_stash_bytes(profile)[first:stop])
    return int(worker_bytes(schedule, replicas, downstream, microbatches, weights, optimizer, stash))


def worker_bytes(
    schedule: str, replicas: Count, downstream: Count, microbatches: int, weights: Bytes, optimizer: Bytes, stash: Bytes
) -> Bytes:
    """Peak bytes on one worker of a stage with these weights, optimizer state and stash per microbatch:
    its weight versions and a gradient buffer, the optimizer state, its microbatches in flight (arrays
    broadcast)."""
    versions = weight_versions(schedule, replicas, downstream)
    return (versions + 1) * weights + optimizer + in_flight(schedule, replicas, downstream, microbatches) * stash
