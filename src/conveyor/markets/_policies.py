"""What each policy holds at a decision: spot machines per market and on-demand ones.

- ``on-demand``: the job's machines on demand, start to end.
- ``spot-restart``: spot in one zone (the one most available over the past week), waiting while there is none;
  a loss restarts the job from its last checkpoint; on demand once the deadline needs it (every deadline
  policy shares this safety net, :func:`behind_deadline`).
- ``uniform-progress`` (Can't Be Late, NSDI'24): the same zone's spot while progress is at or ahead of the
  line ``work * elapsed / deadline``; on-demand while behind it and no spot is there.
- ``portfolio`` (Tributary): machines across the markets of one region and instance kind (its place, the one
  with the most capacity over the past week at the start: data parallelism runs within a region), chosen by
  :func:`conveyor.markets._portfolio.choose` for the capacity ``R = pace * work left / (time left - reserve)``
  (its survival target binding once the deadline's slack is under ``binding_h``: a loss then puts the job on
  on-demand machines; before, holding ``E[C] >= R`` and riding out a loss costs less than buying survival);
  on-demand added while behind the uniform line and the spot held falls short of ``R``. Elastic: a loss that
  leaves machines running costs a pause, not the work since the checkpoint.
- ``portfolio-moves`` (DISPA): the portfolio, moving to another place (region and instance kind) when its
  expected cost per work is 10% lower, at most every ``move_every_h``, paying a checkpoint and a restart.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from conveyor.markets._forecast import Forecaster
from conveyor.markets._job import Job, Overheads, PolicySettings
from conveyor.markets._portfolio import Holding, choose
from conveyor.markets._prices import Pricing

__all__ = ["Decision", "Situation", "behind_deadline", "decide"]

MOVE_GAIN = 0.9  # move only to a kind whose expected cost per work is below 0.9x the current one's


@dataclass(frozen=True)
class Situation:
    """What a decision at tick ``t`` may see: the present counts, the job's progress, the past (forecaster)."""

    t: int
    elapsed_h: float
    progress: float
    counts: np.ndarray
    places: tuple[Place, ...]  # each market's
    place: Place  # where the portfolio runs now
    home: int  # the single-zone policies' market
    may_move: bool  # portfolio-moves: the last move is move_every_h ago
    on_demand: int  # on-demand machines held now
    spot_held: tuple[int, ...]  # spot machines held now, per market


Place = tuple[str, str]  # (region, instance kind)


@dataclass(frozen=True)
class Decision:
    spot: tuple[int, ...]
    on_demand: int
    place: Place


class Context:
    """Everything a policy consults besides the situation (one per trace set and job)."""

    def __init__(
        self,
        *,
        job: Job,
        pricing: Pricing,
        overheads: Overheads,
        settings: PolicySettings,
        speeds: dict[str, float],
        forecaster: Forecaster,
    ) -> None:
        self.job, self.pricing, self.overheads, self.settings = job, pricing, overheads, settings
        self.speeds, self.forecaster = speeds, forecaster

    def market_speeds(self, places: tuple[Place, ...]) -> np.ndarray:
        return np.array([self.speeds[kind] for _, kind in places])

    def behind_line(self, s: Situation) -> bool:
        """Progress below ``work x elapsed / deadline``; on-demand machines bought for it are kept until a
        decision interval's work at their rate ahead of it (not bought and restarted every interval)."""
        line = self.job.work * s.elapsed_h / self.job.deadline_h
        if s.on_demand > self.job.reliable:
            line += self.job.rate(float(self.job.machines), self.job.machines) * self.settings.decide_every_h
        return s.progress < line

    def required(self, s: Situation) -> float:
        """Capacity in V100s that finishes by ``1/pace`` of the time left less a reserve for a restart."""
        left_h = self.job.deadline_h - s.elapsed_h - self.settings.horizon_h - self.overheads.restart_s / 3600
        need = self.settings.pace * (self.job.work - s.progress) / max(left_h, 1e-3)
        machines = max(1, int(np.ceil(need)))
        return need / self.job.scaling[min(machines, len(self.job.scaling)) - 1]


def slack_h(ctx: Context, s: Situation) -> float:
    """Hours to spare if the job's on-demand machines did the rest: the deadline less the time now, less the
    work left at their rate."""
    job = ctx.job
    return job.deadline_h - s.elapsed_h - (job.work - s.progress) / job.rate(float(job.machines), job.machines)


def behind_deadline(ctx: Context, s: Situation, gap_h: float) -> bool:
    """The safety net: the job's on-demand machines could only just finish in time (a restart and a tick kept)."""
    return slack_h(ctx, s) <= (ctx.overheads.restart_s + ctx.overheads.checkpoint_s) / 3600 + 2 * gap_h


def decide(policy: str, ctx: Context, s: Situation) -> Decision:
    n, zeros = ctx.job.machines, [0] * len(s.counts)
    if policy == "on-demand":
        return Decision(tuple(zeros), n, s.place)
    if policy in ("spot-restart", "uniform-progress"):
        spot = list(zeros)
        spot[s.home] = min(int(s.counts[s.home]), n)
        od = n - spot[s.home] if policy == "uniform-progress" and ctx.behind_line(s) else 0
        return Decision(tuple(spot), od, s.place)
    place = _cheapest_place(ctx, s) if policy == "portfolio-moves" and s.may_move else s.place
    holding = _portfolio(ctx, s, place)
    short = ctx.required(s) - ctx.job.reliable - float(np.dot(holding.machines, ctx.market_speeds(s.places)))
    od = int(np.ceil(short)) if ctx.behind_line(s) and short > 0 else 0
    return Decision(holding.machines, od, place)


def _portfolio(ctx: Context, s: Situation, place: Place) -> Holding:
    available = np.array([c if p == place else 0 for c, p in zip(s.counts, s.places, strict=True)])
    prices = np.array([ctx.pricing.spot(kind) for _, kind in s.places])
    return choose(
        available=available,
        speeds=ctx.market_speeds(s.places),
        prices=prices,
        losses=ctx.forecaster.losses(s.t),
        required=ctx.required(s),
        target=ctx.settings.target,
        extra=ctx.settings.extra,
        base=float(ctx.job.reliable),
        most=ctx.settings.most_spot,
        binding=slack_h(ctx, s) < ctx.settings.binding_h,
        held_now=np.array(s.spot_held) if place == s.place else None,
    )


def _cheapest_place(ctx: Context, s: Situation) -> Place:
    """The place whose portfolio's expected dollars per V100-hour, on-demand top-up included, are lowest."""

    def cost_per_work(place: Place) -> float:
        h = _portfolio(ctx, s, place)
        speed = float(np.dot(h.machines, ctx.market_speeds(s.places))) * h.survival
        short = max(ctx.required(s) - speed, 0.0)
        dollars = h.price_per_h + short * ctx.pricing.on_demand("v100_1")
        return dollars / max(speed + short, 1e-9)

    costs = {p: cost_per_work(p) for p in sorted(set(s.places))}
    best = min(costs, key=costs.__getitem__)
    return best if costs[best] < MOVE_GAIN * costs[s.place] else s.place
