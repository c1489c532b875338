"""Schedules as data: per-worker action lists, their generators, the validator and the simulator (no torch)."""

from conveyor.schedule._schedule import (
    ASYNCHRONOUS,
    SCHEDULES,
    Action,
    Op,
    Schedule,
    flush,
    forward_only,
    gpipe,
    make_schedule,
    pipedream,
    twobw,
    twobw_min_microbatches,
)
from conveyor.schedule._simulate import DeadlockError, ScheduleError, SimResult, simulate
from conveyor.schedule._validate import validate

__all__ = [
    "ASYNCHRONOUS",
    "SCHEDULES",
    "Action",
    "DeadlockError",
    "Op",
    "Schedule",
    "ScheduleError",
    "SimResult",
    "flush",
    "forward_only",
    "gpipe",
    "make_schedule",
    "pipedream",
    "simulate",
    "twobw",
    "twobw_min_microbatches",
    "validate",
]
