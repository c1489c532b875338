"""Today's BidBrain (Proteus, :func:`conveyor.elastic.simulate_spot`) on a trace set's window, as a :class:`Run`.

BidBrain knows no deadline: it is run as it is (a reliable on-demand tier of one V100 and spot machines where its
expected cost per work is lowest) and its finish set beside the deadline.
"""

from __future__ import annotations

from conveyor.elastic import Costs, Market, MarketPrice, Throughput, simulate_spot
from conveyor.emulate import count_events
from conveyor.markets._job import Run
from conveyor.markets._policies import Context
from conveyor.markets._traces import MarketTrace

__all__ = ["replay_bidbrain"]


def _market(ctx: Context, trace: MarketTrace, start: int) -> Market:
    """The trace from ``start`` on as add/remove events, the highest slots leaving first."""
    events = count_events(trace.gap_s, trace.counts[start:].tolist())
    price = MarketPrice(
        trace.name, ctx.pricing.on_demand(trace.instance), ctx.pricing.spot(trace.instance), ctx.speeds[trace.instance]
    )
    return Market(trace.name, price, tuple(events))


def replay_bidbrain(ctx: Context, traces: list[MarketTrace], start: int) -> Run:
    """One BidBrain run from tick ``start``; work counted in V100-hours (one "sample" is a V100-hour)."""
    job, o = ctx.job, ctx.overheads
    # A step of one V100-hour: step_s(m) = 3600 / scaling(m), so m machines do m * scaling(m) V100-hours an hour.
    top = max(int(max(t.counts.max() for t in traces)) + 2, len(job.scaling))
    ring = tuple(3600.0 / job.scaling[min(m, len(job.scaling)) - 1] - 3600.0 for m in range(1, top + 1))
    x = Throughput(batch=1, compute_s=3600.0, ring_s=ring)
    costs = Costs(
        revocation_s=o.revocation_s,
        addition_s=o.addition_s,
        restart_s=o.restart_s,
        steps_redone=0.0,
        checkpoint_s=o.checkpoint_s,
        checkpoint_every_s=o.checkpoint_every_s,
        decide_every_s=ctx.settings.decide_every_h * 3600,
    )
    markets = [_market(ctx, t, start) for t in traces if t.counts[start:].max() > 0]
    out = simulate_spot(
        "bidbrain",
        markets,
        x,
        job.work,
        fleet=job.machines,
        reliable=1,
        machines=max(int(t.counts.max()) for t in traces),
        billing=ctx.pricing.billing,
        costs=costs,
    )
    run = Run("bidbrain", start * traces[0].gap_s / 3600, job.deadline_h, job.work, cost_usd=out.cost)
    run.finish_h = out.seconds / 3600 if out.finished else float("inf")
    run.losses, run.work_lost = out.revocations, out.work_lost
    run.on_demand_h = sum(h for name, h in out.machine_hours.items() if name.endswith(" on-demand"))
    run.spot_h = sum(h for name, h in out.machine_hours.items() if not name.endswith(" on-demand"))
    run.held = [(t / 3600, n, 0) for t, n in out.held]
    return run
