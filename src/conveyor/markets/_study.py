"""A study: one job over one trace set at one pricing, its policies replayed from many starts."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from conveyor.config import MARKET_POLICIES
from conveyor.elastic import throughput_from_plan
from conveyor.errors import InputError
from conveyor.markets._bidbrain import replay_bidbrain
from conveyor.markets._forecast import Forecaster
from conveyor.markets._job import Job, Overheads, PolicySettings, Run
from conveyor.markets._policies import Context
from conveyor.markets._prices import Pricing
from conveyor.markets._simulate import replay
from conveyor.markets._traces import MarketTrace
from conveyor.plan import read_graph_txt

__all__ = ["Study", "scaling_from_plan", "simulate_markets"]


def scaling_from_plan(profile: str | Path, *, batch: int, bandwidth: float, most: int) -> tuple[float, ...]:
    """Data parallelism's efficiency on 1..``most`` machines, ``x(m) / (m x(1))``, from the planner's cost model
    of a PipeDream profile folder (its ``graph.txt``) on ``bandwidth`` bytes/s links, without a reliable tier."""
    x = throughput_from_plan(
        read_graph_txt(Path(profile) / "graph.txt"), batch=batch, bandwidth=bandwidth, max_machines=most, reliable=0
    )
    return tuple(x(m) / (m * x(1)) for m in range(1, most + 1))


@dataclass
class Study:
    """A trace set, a job and its prices; :meth:`starts` and :func:`simulate_markets` replay policies on it.

    ``kind`` is the instance kind single-kind policies run on (default: the cheapest spot per work);
    ``warmup_h`` the trace kept before the first start, so the preemption model has a past to learn from.
    """

    traces: list[MarketTrace]
    job: Job
    speeds: dict[str, float]
    pricing: Pricing = field(default_factory=Pricing)
    overheads: Overheads = field(default_factory=Overheads)
    settings: PolicySettings = field(default_factory=PolicySettings)
    kind: str = ""
    warmup_h: float = 72.0

    def __post_init__(self) -> None:
        if not self.traces:
            raise InputError("a study needs at least one market trace")
        if missing := sorted({t.instance for t in self.traces} - set(self.speeds)):
            raise InputError(f"no training speed for instance kinds {missing}: known are {sorted(self.speeds)}")
        self.kind = self.kind or min(self.kinds, key=lambda k: self.pricing.spot(k) / self.speeds[k])
        if self.kind not in self.kinds:
            raise InputError(
                f"instance kind {self.kind!r} is not in the trace set: choose from {', '.join(self.kinds)}"
            )
        gap = self.traces[0].gap_s
        self.forecaster = Forecaster(
            self.traces,
            horizon=max(1, round(self.settings.horizon_h * 3600 / gap)),
            refit_every=max(1, round(self.settings.refit_every_h * 3600 / gap)),
        )
        self.context = Context(
            job=self.job,
            pricing=self.pricing,
            overheads=self.overheads,
            settings=self.settings,
            speeds=self.speeds,
            forecaster=self.forecaster,
        )

    @property
    def kinds(self) -> tuple[str, ...]:
        return tuple(sorted({t.instance for t in self.traces}))

    def starts(self, count: int) -> list[int]:
        """``count`` evenly spaced start ticks, after the warm-up and early enough that the deadline is in the trace."""
        gap, ticks = self.traces[0].gap_s, len(self.traces[0].counts)
        first = int(self.warmup_h * 3600 / gap)
        last = ticks - int(np.ceil(self.job.deadline_h * 3600 / gap)) - 1
        if last < first:
            hours = ticks * gap / 3600
            raise InputError(
                f"the trace set covers {hours:.0f} h: too short for a {self.warmup_h:g} h warm-up and a "
                f"{self.job.deadline_h:g} h deadline; shorten --warmup or --deadline"
            )
        return sorted({round(float(x)) for x in np.linspace(first, last, count)})

    def limit_cost_per_work(self) -> float:
        """The physical limit: every second of work on the cheapest spot capacity at the job's own size, nothing
        lost (dollars per V100-hour)."""
        eff = self.job.scaling[min(self.job.machines, len(self.job.scaling)) - 1]
        return min(self.pricing.spot(k) / (self.speeds[k] * eff) for k in self.kinds)


def simulate_markets(study: Study, policy: str, start: int, *, kind: str = "") -> Run:
    """Replay ``policy`` from tick ``start`` (``kind``: a single-kind policy's instance kind, else the study's).

    Example:
        >>> from conveyor.markets import MarketTrace
        >>> always = MarketTrace("z", "v100_1", 3600.0, np.ones(100, dtype=np.int64))
        >>> study = Study([always], Job(work=10.0, deadline_h=15.0), {"v100_1": 1.0}, warmup_h=0.0)
        >>> run = simulate_markets(study, "on-demand", 0)
        >>> run.deadline_met, round(run.cost_usd / run.work, 2)  # $3.06 an hour, slowed by restarts and checkpoints
        (True, 3.07)
    """
    if policy not in MARKET_POLICIES:
        raise InputError(f"unknown policy {policy!r}: choose from {', '.join(MARKET_POLICIES)}")
    if policy == "bidbrain":
        return replay_bidbrain(study.context, study.traces, start)
    return replay(policy, study.context, study.traces, start, kind=kind or study.kind)
