"""A Conveyor job's throughput on each device type, from the planner: what the scheduler assumes of a job the
planner lays out over the devices it is given."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import replace

from conveyor.errors import InputError
from conveyor.plan import COST_MODELS, Level, PlanError, Profile, Topology, optimize

__all__ = ["planned_throughputs"]


def planned_throughputs(
    profile: Profile,
    device_speeds: Mapping[str, float],
    scale_factors: Iterable[int] = (1, 2, 4, 8),
    batch_size: int | None = None,
    bandwidth: float = 1.17e9,
    *,
    memory: Mapping[str, float] | None = None,
    cost_model: str = "physical",
) -> dict[tuple[int, str], float]:
    """A Conveyor job's steps/s on ``scale`` devices of each type, from the planner's cost model.

    Each type's compute is the profile's divided by its relative speed (``device_speeds``, e.g. v100 = 1);
    the devices of a job share one server, joined at ``bandwidth`` bytes/s. The planner
    (:func:`conveyor.plan.optimize`, which includes data parallelism among its candidates) gives the best
    time per minibatch on ``m`` devices; a step is one minibatch of ``batch_size`` samples on one device, as
    Gavel counts steps, so ``m`` devices run ``1 / seconds_per_minibatch`` steps/s. A job holding ``scale``
    devices may leave some idle, so its rate is the best over ``m <= scale``: never less with more devices.

    Args:
        profile: the model's per-layer profile (a PipeDream ``graph.txt`` or Conveyor's JSON).
        device_speeds: each device type's compute speed relative to the profiled device.
        scale_factors: the device counts to plan for.
        batch_size: the minibatch the times are for: one of the profile's batch sizes (``None``: its own),
            or any size for a profile that does not record one.
        bandwidth: bytes/s of each device's link.
        memory: bytes per device of each type (``None``: no limit); where no plan fits, the rate is 0.
        cost_model: the planner's cost model (``"physical"`` or ``"pipedream"``).

    Example:
        >>> p = Profile.chain("toy", [1.0, 1.0], [2.0, 2.0], [1000, 1000], [1000, 1000])
        >>> rates = planned_throughputs(p, {"v100": 1.0, "k80": 0.25}, scale_factors=(1, 2))
        >>> [round(rates[(s, t)], 3) for s in (1, 2) for t in ("v100", "k80")]
        [0.167, 0.042, 0.333, 0.083]
    """
    if batch_size is not None and batch_size in profile.batch_sizes:
        profile = profile.at(batch_size)
    elif batch_size is not None and (profile.batch_size is not None or profile.variants):
        raise InputError(
            f"profile {profile.model!r} has no measurements at batch size {batch_size} (it has {profile.batch_sizes}): "
            "give one of those, or profile that batch size"
        )
    if cost_model not in COST_MODELS:
        raise InputError(f"unknown cost model {cost_model!r}: use one of {', '.join(COST_MODELS)}")
    if not (bandwidth > 0 and math.isfinite(bandwidth)):
        raise InputError(f"bandwidth {bandwidth} must be a finite number of bytes/s > 0")
    scales = sorted(set(scale_factors))
    if not scales or scales[0] < 1:
        raise InputError(f"scale factors {scales} must be at least 1 (devices per job)")
    out = {}
    for device, speed in device_speeds.items():
        if not (speed > 0 and math.isfinite(speed)):
            raise InputError(f"device type {device!r} has relative speed {speed}: give a finite number > 0")
        scaled = replace(
            profile,
            layers=tuple(
                replace(
                    lay, forward_s=lay.forward_s / speed, backward_s=lay.backward_s / speed, step_s=lay.step_s / speed
                )
                for lay in profile.layers
            ),
            variants=(),
        )
        limit = None if memory is None else memory.get(device)
        best = 0.0
        for m in range(1, scales[-1] + 1):
            try:
                plan = optimize(scaled, Topology((Level(m, bandwidth),)), memory=limit, cost_model=cost_model)
                best = max(best, 1.0 / plan.seconds_per_minibatch)
            except PlanError:
                pass  # nothing fits on m devices of this type: it stays at the best on fewer
            if m in scales:
                out[(m, device)] = best
    return out
