"""Stragglers (FlexRR): data parallelism with rapid reassignment of work and bounded staleness (slack)."""

from conveyor.stragglers._claims import StepClaims
from conveyor.stragglers._modes import MODES, mode_settings
from conveyor.stragglers._trainer import FlexibleDataParallel, StepRecord

__all__ = ["MODES", "FlexibleDataParallel", "StepClaims", "StepRecord", "mode_settings"]
