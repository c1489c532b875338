"""Per-worker memory of a pipeline stage under a schedule: weight versions, gradients, optimizer state, stash.

A worker of a stage holds some copies of the stage's weights, one gradient buffer, the optimizer state,
and the activations of every microbatch whose forward ran and whose backward has not. How many copies
and microbatches depends on the schedule and on the layout (its record,
:class:`~conveyor.schedule.Kind`, gives the counts); the tests check them against what the schedules'
action lists hold (:meth:`~conveyor.schedule.Schedule.worker_peak_versions` and the simulator's peak stash).

Example:
    >>> int(in_flight("pipedream", replicas=1, downstream=4, microbatches=8)), int(weight_versions("2bw", 1, 4))
    (4, 2)
"""

from __future__ import annotations

import numpy as np

from conveyor.errors import InputError
from conveyor.plan._profiles import Profile
from conveyor.schedule import PLANNER_SCHEDULES, Kind, kind

__all__ = ["in_flight", "layer_stash_bytes", "planned_kind", "stage_bytes", "weight_versions", "worker_bytes"]

Count = int | np.ndarray
Bytes = int | float | np.ndarray


def planned_kind(schedule: str) -> Kind:
    """The record of a schedule the planner has a memory model for.

    Raises:
        ValueError: a schedule the planner does not know.
    """
    if schedule not in PLANNER_SCHEDULES:
        raise InputError(f"the planner knows schedules {', '.join(PLANNER_SCHEDULES)}, not {schedule!r}")
    return kind(schedule)


def in_flight(schedule: str, replicas: Count, downstream: Count, microbatches: int) -> Count:
    """Microbatches a worker of the stage holds activations for at its peak (arrays broadcast)."""
    return planned_kind(schedule).in_flight(replicas, downstream, microbatches)


def weight_versions(schedule: str, replicas: Count, downstream: Count) -> Count:
    """Copies of the stage's weights a worker holds at its peak (arrays broadcast)."""
    return planned_kind(schedule).weight_versions(replicas, downstream)


def layer_stash_bytes(profile: Profile) -> list[int]:
    """Per layer, the activation bytes one microbatch leaves stashed for its backward.

    The bytes autograd saves when the profile measured them; otherwise the layer's output, as PipeDream's
    optimizer assumed (its ``graph.txt`` records nothing else).
    """
    if any(lay.saved_bytes for lay in profile.layers):
        return [lay.saved_bytes for lay in profile.layers]
    return [lay.output_bytes for lay in profile.layers]


def stage_bytes(
    profile: Profile, *, first: int, stop: int, schedule: str, replicas: int, downstream: int, microbatches: int
) -> int:
    """Peak bytes on one worker of a stage running layers ``[first, stop)``.

    Args:
        profile: the model (its batch is one microbatch).
        first, stop: the stage's layers.
        schedule: one of :data:`~conveyor.schedule.PLANNER_SCHEDULES`.
        replicas: the stage's data-parallel workers.
        downstream: workers from this stage to the end of the pipeline, this stage's included.
        microbatches: microbatches per optimizer step (bounds the stash of ``flush`` and ``gpipe``).
    """
    weights = profile.param_bytes(first, stop)
    optimizer = sum(lay.optimizer_bytes for lay in profile.layers[first:stop])
    stash = sum(layer_stash_bytes(profile)[first:stop])
    return int(
        worker_bytes(
            schedule,
            replicas=replicas,
            downstream=downstream,
            microbatches=microbatches,
            weights=weights,
            optimizer=optimizer,
            stash=stash,
        )
    )


def worker_bytes(
    schedule: str,
    *,
    replicas: Count,
    downstream: Count,
    microbatches: int,
    weights: Bytes,
    optimizer: Bytes,
    stash: Bytes,
) -> Bytes:
    """Peak bytes on one worker of a stage with these weights, optimizer state and stash per microbatch:
    its weight versions and a gradient buffer, the optimizer state, its microbatches in flight (arrays
    broadcast)."""
    versions = weight_versions(schedule, replicas, downstream)
    return (versions + 1) * weights + optimizer + in_flight(schedule, replicas, downstream, microbatches) * stash
