"""Spot markets (Tributary, DISPA'20, Can't Be Late): a job with a deadline, bought from the markets that exist.

Each (zone, instance kind) of a trace set is a market (:func:`read_trace_set`); a preemption model learned from
the past alone (:mod:`conveyor.markets._hazard`) tells each market's chance of a loss within the next interval;
Tributary's portfolio holds machines across markets so that the needed capacity survives with a chosen
probability; DISPA's moves change instance kind when another is cheaper per work; a deadline is kept by
on-demand machines when spot cannot keep it. :func:`simulate_markets` replays the policies over the traces (no torch).

Example:
    >>> from conveyor.markets import Job
    >>> Job(work=24.0, deadline_h=36.0).on_demand_h
    24.0
"""

from __future__ import annotations

from conveyor.markets._hazard import FEATURES, HazardModel, Losses, calibration, features, fit, labels
from conveyor.markets._job import Job, Overheads, PolicySettings, Run
from conveyor.markets._portfolio import Holding, choose
from conveyor.markets._prices import DISCOUNT_2016, INSTANCES, Instance, Pricing, gavel_speeds
from conveyor.markets._study import Study, scaling_from_plan, simulate_markets
from conveyor.markets._traces import MarketTrace, read_market_trace, read_trace_set

__all__ = [
    "DISCOUNT_2016",
    "FEATURES",
    "INSTANCES",
    "HazardModel",
    "Holding",
    "Instance",
    "Job",
    "Losses",
    "MarketTrace",
    "Overheads",
    "PolicySettings",
    "Pricing",
    "Run",
    "Study",
    "calibration",
    "choose",
    "features",
    "fit",
    "gavel_speeds",
    "labels",
    "read_market_trace",
    "read_trace_set",
    "scaling_from_plan",
    "simulate_markets",
]
