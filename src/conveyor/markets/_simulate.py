"""The replay: one policy from one start over a trace set, tick by tick.

At each tick ``k`` (``gap`` seconds): the markets' counts ``c_i(k)`` revoke what no longer fits
(``held_i > c_i``: the newest machines go, billed as revoked); a loss that leaves nothing running, or any loss
of a non-elastic policy without a reliable tier (``Job.reliable``), sends the job back to its last checkpoint;
the policy re-decides at a loss, every ``decide_every_h`` and while nothing is held (the reliable tier's
machines always are); machines started while the job runs join it ``addition_s`` later (billed meanwhile),
the job going on without them; then the job runs for what is left of the tick after its pauses:

    ``progress += rate(held) * run_s / 3600 * (1 - checkpoint_s / checkpoint_every_s)``

with ``rate`` data parallelism's (:meth:`Job.rate`). After a trace ends its markets have nothing. Machines are
billed by :class:`conveyor.elastic.Billing` from their start to their release or revocation.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from conveyor.markets._job import Run
from conveyor.markets._policies import Context, Decision, Place, Situation, behind_deadline, decide
from conveyor.markets._traces import MarketTrace

__all__ = ["replay"]

ELASTIC = ("portfolio", "portfolio-moves")
DEADLINE = ("spot-restart", "uniform-progress", "portfolio", "portfolio-moves")


class _Fleet:
    """The machines held: their start times (seconds from the run's start) per market, and on demand."""

    def __init__(self, ctx: Context, traces: list[MarketTrace], run: Run) -> None:
        self.ctx, self.run = ctx, run
        self.kinds = tuple(t.instance for t in traces)
        self.places = tuple((t.region, t.instance) for t in traces)
        self.spot: list[list[float]] = [[] for _ in traces]
        self.od: list[float] = []
        self.joining: list[tuple[float, float]] = []  # (ready at, speed) of machines still joining the job

    def count(self) -> tuple[int, int]:
        return sum(len(m) for m in self.spot), len(self.od)

    def speed(self, now: float, gap: float) -> float:
        """The machines' summed speed over the tick from ``now``, a joining machine's counted from when it is
        ready."""
        held = sum(len(m) * self.ctx.speeds[k] for m, k in zip(self.spot, self.kinds, strict=True)) + len(self.od)
        self.joining = [(ready, v) for ready, v in self.joining if ready > now]
        return held - sum(v * min(ready - now, gap) / gap for ready, v in self.joining)

    def bill(self, price: float, start: float, end: float, *, revoked: bool, on_demand: bool) -> None:
        self.run.cost_usd += self.ctx.pricing.rule.charge(price, start, end, revoked)
        hours = (end - start) / 3600
        if on_demand:
            self.run.on_demand_h += hours
        else:
            self.run.spot_h += hours

    def revoke(self, counts: np.ndarray, now: float) -> int:
        """Machines above each market's count are revoked; returns how many."""
        lost = 0
        for i, starts in enumerate(self.spot):
            while len(starts) > counts[i]:
                self.bill(self.ctx.pricing.spot(self.kinds[i]), starts.pop(), now, revoked=True, on_demand=False)
                lost += 1
        return lost

    def hold(self, d: Decision, now: float, join_s: float = 0.0) -> tuple[int, int]:
        """Release or start machines to match ``d``, those started working ``join_s`` later; returns (started,
        released)."""
        started = released = 0
        for i, want in enumerate(d.spot):
            while len(self.spot[i]) > want:
                self.bill(self.ctx.pricing.spot(self.kinds[i]), self.spot[i].pop(), now, revoked=False, on_demand=False)
                released += 1
            started += want - len(self.spot[i])
            self.joining += [(now + join_s, self.ctx.speeds[self.kinds[i]])] * max(want - len(self.spot[i]), 0)
            self.spot[i].extend([now] * (want - len(self.spot[i])))
        while len(self.od) > d.on_demand:
            self.bill(self.ctx.pricing.on_demand("v100_1"), self.od.pop(), now, revoked=False, on_demand=True)
            released += 1
        started += max(d.on_demand - len(self.od), 0)
        self.joining += [(now + join_s, 1.0)] * max(d.on_demand - len(self.od), 0)
        self.od.extend([now] * max(d.on_demand - len(self.od), 0))
        return started, released

    def spent(self, now: float) -> float:
        """Dollars billed so far plus what the machines held have run up (per second)."""
        open_ = sum(
            self.ctx.pricing.spot(k) * sum(now - s for s in m) for m, k in zip(self.spot, self.kinds, strict=True)
        )
        return self.run.cost_usd + (open_ + self.ctx.pricing.on_demand("v100_1") * sum(now - s for s in self.od)) / 3600


def _start_place(ctx: Context, traces: list[MarketTrace], start: int, kind: str) -> tuple[int, Place]:
    """The single-zone policies' market and the portfolio's place: the most available over the past week."""
    past = ctx.forecaster.availability(start) * np.array([t.counts.max() for t in traces])
    mine = np.array([t.instance == kind for t in traces])
    home = int(np.argmax(np.where(mine, past, -1.0)))
    regions = {t.region for t in traces}
    best = max(
        sorted(regions), key=lambda r: sum(p for p, t, m in zip(past, traces, mine, strict=True) if m and t.region == r)
    )
    return home, (best, kind)


@dataclass
class _Progress:
    """The job's work done, saved at its last checkpoint, and the pause it owes (seconds)."""

    done: float = 0.0
    saved: float = 0.0
    pause: float = 0.0
    since_checkpoint: float = 0.0

    def restart(self) -> float:
        """Back to the last checkpoint; returns the work lost."""
        lost, self.done = self.done - self.saved, self.saved
        return lost

    def run(self, rate: float, gap: float) -> tuple[float, float]:
        """A tick at ``rate`` V100-hours an hour, after the pause owed: (seconds run, work done). With nothing
        running the pause owed lapses: the next start pays its own."""
        if rate <= 0:
            self.pause = 0.0
            return 0.0, 0.0
        run_s = max(gap - self.pause, 0.0)
        self.pause = max(self.pause - gap, 0.0)
        return run_s, rate * run_s / 3600

    def bank(self, gain: float, run_s: float, checkpoint_every_s: float) -> None:
        self.done += gain
        self.since_checkpoint += run_s
        if self.since_checkpoint >= checkpoint_every_s:
            self.saved, self.since_checkpoint = self.done, 0.0


def replay(policy: str, ctx: Context, traces: list[MarketTrace], start: int, *, kind: str) -> Run:
    """Run ``policy`` from tick ``start`` until the job's work is done (see the module docstring)."""
    job, o, gap = ctx.job, ctx.overheads, traces[0].gap_s
    run = Run(policy, start * gap / 3600, job.deadline_h, job.work)
    fleet, work = _Fleet(ctx, traces, run), _Progress()
    home, place = _start_place(ctx, traces, start, kind)
    nothing = Decision((0,) * len(traces), 0, place)
    last_decision, last_move, rescue = -math.inf, 0.0, False
    elastic = policy in ELASTIC or job.reliable > 0
    for k in range(start, start + int(20 * job.deadline_h * 3600 / gap)):
        now = (k - start) * gap
        counts = np.array([t.counts[k] if k < len(t.counts) else 0 for t in traces])
        running_before = sum(fleet.count()) > 0
        if lost := fleet.revoke(counts, now):
            run.losses += 1
            if elastic and sum(fleet.count()) > 0:
                work.pause += o.revocation_s
            else:  # a restart takes the whole job down
                run.work_lost += work.restart()
                fleet.hold(nothing, now)
                running_before = False
        may_move = now - last_move >= ctx.settings.move_every_h * 3600
        held = tuple(len(m) for m in fleet.spot)
        s = Situation(k, now / 3600, work.done, counts, fleet.places, place, home, may_move, len(fleet.od), held)
        rescue = rescue or (policy in DEADLINE and behind_deadline(ctx, s, gap / 3600))
        if rescue:
            d = Decision(nothing.spot, job.machines, place)
        elif lost or now - last_decision >= ctx.settings.decide_every_h * 3600 or sum(fleet.count()) == 0:
            d, last_decision = decide(policy, ctx, s), now
        else:
            d = Decision(tuple(len(m) for m in fleet.spot), len(fleet.od), place)
        if d.place != place:
            run.moves += 1
            fleet.hold(nothing, now)
            work.pause += o.move_s
            place, last_move, running_before = d.place, now, False
        joins = running_before and elastic  # machines join a running job: it goes on while they start
        wanted = Decision(d.spot, max(d.on_demand, job.reliable), d.place)
        started, released = fleet.hold(wanted, now, o.addition_s if joins else 0.0)
        if (started and not joins) or (released and not elastic):
            work.pause += o.restart_s
        run.held.append((now / 3600, *fleet.count()))
        run.spent.append((now / 3600, fleet.spent(now)))
        rate = job.rate(fleet.speed(now, gap), sum(fleet.count())) * (1 - o.checkpoint_s / o.checkpoint_every_s)
        run_s, gain = work.run(rate, gap)
        if gain > 0 and work.done + gain >= job.work:
            _finish(run, fleet, now + (gap - run_s) + run_s * (job.work - work.done) / gain)
            return run
        work.bank(gain, run_s, o.checkpoint_every_s)
    fleet.hold(nothing, (k + 1 - start) * gap)
    return run


def _finish(run: Run, fleet: _Fleet, end: float) -> None:
    fleet.hold(Decision((0,) * len(fleet.spot), 0, ("", "")), end)
    run.finish_h = end / 3600
    run.held.append((run.finish_h, 0, 0))
    run.spent.append((run.finish_h, run.cost_usd))
