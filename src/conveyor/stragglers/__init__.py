"""Stragglers (FlexRR): replicas that reassign work from slow peers, back up chunks stalled peers hold, and
tolerate bounded staleness (slack)."""

from conveyor.stragglers._claims import StepClaims
from conveyor.stragglers._granularity import Chunks, check_chunks
from conveyor.stragglers._modes import DEFAULT_MODE, MODES, ModeSettings, flexible_layout, mode_settings
from conveyor.stragglers._records import StepRecord
from conveyor.stragglers._route import Router
from conveyor.stragglers._trainer import FlexiblePipeline

__all__ = [
    "DEFAULT_MODE",
    "MODES",
    "Chunks",
    "FlexiblePipeline",
    "ModeSettings",
    "Router",
    "StepClaims",
    "StepRecord",
    "check_chunks",
    "flexible_layout",
    "mode_settings",
]
