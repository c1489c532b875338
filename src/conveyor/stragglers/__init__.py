"""Stragglers (FlexRR): replicas that reassign work from slow peers, back up chunks stalled peers hold, and
tolerate bounded staleness (slack)."""

from conveyor.stragglers._claims import StepClaims
from conveyor.stragglers._modes import flexible_layout
from conveyor.stragglers._records import StepRecord
from conveyor.stragglers._route import Router
from conveyor.stragglers._trainer import FlexiblePipeline

__all__ = [
    "FlexiblePipeline",
    "Router",
    "StepClaims",
    "StepRecord",
    "flexible_layout",
]
