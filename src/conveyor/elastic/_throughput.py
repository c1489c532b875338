"""A data-parallel job's throughput as a function of its machines, and the measured costs of changing them."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from conveyor.errors import check_amounts
from conveyor.plan import Profile, Topology
from conveyor.plan.parts import stage_seconds

__all__ = ["Costs", "Throughput", "throughput_from_plan"]


@dataclass(frozen=True)
class Throughput:
    """Synchronous data parallelism: ``m`` machines of summed speed ``s`` (V100 = 1) each take a share of a step
    of ``m * batch`` samples sized to their speed, then all-reduce:

    ``step_s(m, s) = max(m * compute_s / s + ring_s(m), min_step_s)`` and ``samples/s = m * batch / step_s``,

    where ``ring_s(m)`` is the planner's ring all-reduce of the weights among ``m`` machines (the last entry
    holds beyond the table) and ``min_step_s`` the reliable tier's limit (:func:`throughput_from_plan`).

    Example:
        >>> x = Throughput(batch=10, compute_s=1.0, ring_s=(0.0, 1.0))
        >>> x(1), x(2), x(4, speed=8.0)  # one, two (1 s of all-reduce), four machines twice as fast
        (10.0, 10.0, 26.666666666666668)
    """

    batch: int
    compute_s: float
    ring_s: tuple[float, ...] = (0.0,)
    min_step_s: float = 0.0

    def step_s(self, machines: int, speed: float | None = None) -> float:
        """Seconds per step of ``machines`` machines whose speeds sum to ``speed`` (default: one each)."""
        if machines <= 0:
            return math.inf
        speed = float(machines) if speed is None else speed
        ring = self.ring_s[min(machines, len(self.ring_s)) - 1]
        return max(machines * self.compute_s / speed + ring, self.min_step_s)

    def __call__(self, machines: int, speed: float | None = None) -> float:
        return 0.0 if machines <= 0 else machines * self.batch / self.step_s(machines, speed)


def throughput_from_plan(
    profile: Profile,
    *,
    batch: int,
    bandwidth: float = 1.17e9,
    latency: float = 0.0,
    max_machines: int = 256,
    reliable: int = 1,
    reliable_bandwidth: float | None = None,
    backup_bytes: float | None = None,
) -> Throughput:
    """Data parallelism on ``1..max_machines`` machines as the planner's cost model charges it (each machine its
    own server on a ``bandwidth`` link), with the reliable tier's limit.

    The reliable tier holds the state backups: every step it receives the updated weights (``backup_bytes``,
    default the profile's parameter bytes), spread over its ``reliable`` machines' links, so a step takes at least
    ``min_step_s = backup_bytes / (reliable * reliable_bandwidth)``. It binds when the transient tier is large and
    fast and the reliable tier's links are slow (for example in another region). ``reliable=0``: no limit.

    Example:
        >>> p = Profile.chain("toy", [0.1], [0.2], [0], [4e8], batch_size=32)
        >>> x = throughput_from_plan(p, batch=32, bandwidth=1e9, max_machines=4, reliable=1, reliable_bandwidth=1e8)
        >>> round(x.step_s(1), 3), round(x.step_s(4), 3)  # 0.3 s of compute; the 4 s backup binds
        (4.0, 4.0)
    """
    compute = profile.compute_s(0, len(profile.layers))
    weights = float(profile.param_bytes(0, len(profile.layers)))
    top = Topology.parse(f"{max_machines}:{bandwidth:g}" + (f"/{latency}s" if latency else ""))
    m = np.arange(1, max_machines + 1)
    per_minibatch = stage_seconds(
        "physical", top, k=0, inner=compute, weights=weights, cut_in=0.0, cut_out=0.0, units=m, per_update=m
    )
    ring = (m * per_minibatch - compute).tolist()
    backup = weights if backup_bytes is None else backup_bytes
    limit = backup / (reliable * (reliable_bandwidth or bandwidth)) if reliable else 0.0
    return Throughput(batch, compute, tuple(max(r, 0.0) for r in ring), limit)


@dataclass(frozen=True)
class Costs:
    """Measured overheads (seconds of the whole job) and the simulation's knobs.

    Attributes:
        revocation_s: the survivors' lost time per revocation (Conveyor elastic).
        addition_s: the job's pause per addition of machines (Conveyor elastic).
        restart_s: a restart with a reload from the last checkpoint (torchrun).
        steps_redone: steps recomputed after a revocation (Conveyor elastic).
        checkpoint_s: the pause to write a checkpoint (checkpoint-restart).
        checkpoint_every_s: running seconds between checkpoints.
        decide_every_s: BidBrain's decision period beside every trace event.
        prior_revocations: BidBrain's prior on a market's revocation rate: this many revocations ...
        prior_hours: ... in this many machine-hours.
    """

    revocation_s: float = 30.0
    addition_s: float = 20.0
    restart_s: float = 120.0
    steps_redone: float = 1.0
    checkpoint_s: float = 30.0
    checkpoint_every_s: float = 600.0
    decide_every_s: float = 300.0
    prior_revocations: float = 1.0
    prior_hours: float = 10.0

    def __post_init__(self) -> None:
        check_amounts(vars(self), what="cost", positive=["checkpoint_every_s", "decide_every_s", "prior_hours"])
