"""The plain types at the simulator's boundaries: the job, the measured overheads, the policies' settings, a run."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from conveyor.errors import InputError, check_amounts

__all__ = ["Job", "Overheads", "PolicySettings", "Run"]


@dataclass(frozen=True)
class Job:
    """A training job: ``work`` in V100-hours, sized to ``machines`` on-demand V100s, due ``deadline_h`` after
    its start; ``scaling[m - 1]`` is data parallelism's efficiency on ``m`` machines (the last holds beyond);
    ``reliable`` on-demand V100s hold its state from start to end (Proteus' reliable tier, ``conveyor train
    --reliable``), so that no loss sends it back to a checkpoint.

    Example:
        >>> job = Job(work=48.0, machines=2, deadline_h=36.0, scaling=(1.0, 0.9))
        >>> job.rate(2.0, 2), round(job.on_demand_h, 3)
        (1.8, 26.667)
    """

    work: float
    machines: int = 1
    deadline_h: float = 36.0
    scaling: tuple[float, ...] = (1.0,)
    reliable: int = 0

    def __post_init__(self) -> None:
        if not (self.work > 0 and self.machines >= 1 and self.deadline_h > 0 and self.reliable >= 0):
            raise InputError(f"a job needs work > 0, machines >= 1, a deadline > 0 hours, reliable >= 0; got {self}")
        if not self.scaling or not all(0 < s <= 1 for s in self.scaling):
            raise InputError(f"scaling efficiencies must be in (0, 1], got {self.scaling}")

    def rate(self, speed: float, machines: int) -> float:
        """V100-hours of work an hour on ``machines`` machines whose speeds sum to ``speed``."""
        if machines <= 0:
            return 0.0
        return speed * self.scaling[min(machines, len(self.scaling)) - 1]

    @property
    def on_demand_h(self) -> float:
        """Hours on its ``machines`` on-demand V100s."""
        return self.work / self.rate(float(self.machines), self.machines)


@dataclass(frozen=True)
class Overheads:
    """Seconds the job stands still (billed), measured by ``conveyor bench elastic`` (see bench/spot.py).

    Attributes:
        revocation_s: survivors' pause when some machines are revoked (Conveyor elastic).
        addition_s: from a machine's start to its first step in a running job (it is billed, the job goes on).
        restart_s: a start from the last checkpoint (nothing running, or a non-elastic job's loss).
        checkpoint_s: writing a checkpoint; every ``checkpoint_every_s`` seconds of running.
    """

    revocation_s: float = 0.698
    addition_s: float = 14.6865
    restart_s: float = 14.1505
    checkpoint_s: float = 2.0
    checkpoint_every_s: float = 600.0

    def __post_init__(self) -> None:
        check_amounts(vars(self), what="overhead", positive=["checkpoint_every_s"])

    @property
    def move_s(self) -> float:
        """A move to another instance type: a checkpoint, then a start from it there."""
        return self.checkpoint_s + self.restart_s


@dataclass(frozen=True)
class PolicySettings:
    """The policies' knobs.

    Attributes:
        target: the portfolio's probability that the needed capacity survives an interval.
        horizon_h: the interval the preemption model predicts over.
        decide_every_h: how often a policy re-decides (also at every loss).
        extra: the most machines a portfolio holds beyond what it needs.
        pace: the portfolio aims to finish by ``1 / pace`` of the time left.
        move_every_h: the least time between two moves to another instance type.
        refit_every_h: how often the preemption model is refitted (on the past only).
        most_spot: the most spot machines a portfolio holds (0: no limit).
        binding_h: the portfolio's survival target binds once the deadline's slack (hours to spare if on-demand
            machines did the rest) is under this.
    """

    target: float = 0.99
    horizon_h: float = 1.0
    decide_every_h: float = 1.0
    extra: int = 2
    pace: float = 1.25
    move_every_h: float = 6.0
    refit_every_h: float = 24.0
    most_spot: int = 0
    binding_h: float = 3.0

    def __post_init__(self) -> None:
        if not 0 < self.target < 1:
            raise InputError(f"target must be in (0, 1), got {self.target}")
        if not (self.horizon_h > 0 and self.decide_every_h > 0 and self.move_every_h > 0 and self.refit_every_h > 0):
            raise InputError("horizon_h, decide_every_h, move_every_h and refit_every_h must be > 0")
        if self.extra < 0 or self.pace < 1 or self.most_spot < 0:
            raise InputError(
                f"need extra >= 0, pace >= 1, most_spot >= 0; got {self.extra}, {self.pace}, {self.most_spot}"
            )


@dataclass
class Run:
    """One policy from one start: what it cost, when it finished, what it held (hours from the start)."""

    policy: str
    start_h: float
    deadline_h: float
    work: float
    cost_usd: float = 0.0
    finish_h: float = math.inf
    on_demand_h: float = 0.0
    spot_h: float = 0.0
    losses: int = 0
    work_lost: float = 0.0
    moves: int = 0
    held: list[tuple[float, int, int]] = field(default_factory=list)  # (hours, spot machines, on-demand ones)
    spent: list[tuple[float, float]] = field(default_factory=list)  # (hours, dollars so far)

    @property
    def deadline_met(self) -> bool:
        return self.finish_h <= self.deadline_h + 1e-9

    def row(self, trace_set: str, limit_cost_per_work: float) -> dict[str, object]:
        """The benchmark's result row (``cost_per_work`` in dollars per V100-hour of work)."""
        return {
            "trace_set": trace_set,
            "policy": self.policy,
            "start_h": self.start_h,
            "cost_usd": self.cost_usd,
            "work": self.work,
            "cost_per_work": self.cost_usd / self.work,
            "limit_cost_per_work": limit_cost_per_work,
            "finish_h": self.finish_h,
            "deadline_h": self.deadline_h,
            "deadline_met": self.deadline_met,
            "on_demand_h": self.on_demand_h,
            "spot_h": self.spot_h,
            "losses": self.losses,
            "work_lost": self.work_lost,
            "moves": self.moves,
        }
