"""Elastic training on revocable machines (Proteus): tiers, AgileML's stages, revocations, additions, BidBrain.

A job's first workers are reliable, the rest transient; the trainer (:class:`ElasticTrainer`) keeps going when
transient workers are revoked, with or without notice, and takes in new ones, without restarting anyone
or reading a checkpoint file, as data parallelism or as a pipeline the planner re-plans at every change
(:func:`planned_layouts`). The market simulator (:func:`simulate_spot`) replays spot-availability traces
with prices to compare acquisition policies, BidBrain's among them.

Example:
    >>> from conveyor.elastic import agile_stage
    >>> agile_stage(transient=5, reliable=2)
    2
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from conveyor.elastic._bidbrain import SPOT_POLICIES, SpotOutcome, simulate_spot
    from conveyor.elastic._job import ElasticJob, ElasticOptions, WorkerOutcome
    from conveyor.elastic._launch import launch_elastic, store_address
    from conveyor.elastic._market import BILLINGS, PRICES, Billing, Market, MarketPrice, read_markets
    from conveyor.elastic._membership import Coordinator, Generation, JobFailed, MembershipChanged
    from conveyor.elastic._objective import Offer, hold_cost, paid_left, plan_holdings
    from conveyor.elastic._pipeline import planned_layouts
    from conveyor.elastic._throughput import Costs, Throughput, throughput_from_plan
    from conveyor.elastic._tiers import Roles, agile_stage, roles, shard_bounds
    from conveyor.elastic._trainer import ElasticTrainer

# Imported on first use: the market simulator and the CLI need none of torch.
_HOME = {
    "_bidbrain": ("SPOT_POLICIES", "SpotOutcome", "simulate_spot"),
    "_objective": ("Offer", "hold_cost", "paid_left", "plan_holdings"),
    "_pipeline": ("planned_layouts",),
    "_throughput": ("Costs", "Throughput", "throughput_from_plan"),
    "_launch": ("launch_elastic", "store_address"),
    "_market": ("BILLINGS", "PRICES", "Billing", "Market", "MarketPrice", "read_markets"),
    "_membership": ("Coordinator", "Generation", "JobFailed", "MembershipChanged"),
    "_tiers": ("Roles", "agile_stage", "roles", "shard_bounds"),
    "_job": ("ElasticJob", "ElasticOptions", "WorkerOutcome"),
    "_trainer": ("ElasticTrainer",),
}
_WHERE = {name: module for module, names in _HOME.items() for name in names}
__all__ = [
    "BILLINGS",
    "PRICES",
    "SPOT_POLICIES",
    "Billing",
    "Coordinator",
    "Costs",
    "ElasticJob",
    "ElasticOptions",
    "ElasticTrainer",
    "Generation",
    "JobFailed",
    "Market",
    "MarketPrice",
    "MembershipChanged",
    "Offer",
    "Roles",
    "SpotOutcome",
    "Throughput",
    "WorkerOutcome",
    "agile_stage",
    "hold_cost",
    "launch_elastic",
    "paid_left",
    "plan_holdings",
    "planned_layouts",
    "read_markets",
    "roles",
    "shard_bounds",
    "simulate_spot",
    "store_address",
    "throughput_from_plan",
]


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module 'conveyor.elastic' has no attribute {name!r}")
    return getattr(importlib.import_module(f"conveyor.elastic.{_WHERE[name]}"), name)
