"""Schedules as data: per-worker action lists, their generators, the validator and the simulator (no torch).

Example:
    >>> s = make_schedule("pipedream", stages=2, microbatches=1, steps=3)
    >>> print(" ".join(map(str, s.actions[1])))
    RECV_F0<0 F0 B0 SEND_B0>0 REDUCE STEP RECV_F1<0 F1 B1 SEND_B1>0 REDUCE STEP RECV_F2<0 F2 B2 SEND_B2>0 REDUCE STEP
"""

from conveyor.schedule._actions import Action, Op
from conveyor.schedule._generate import BatchCount, Batches, worker_actions
from conveyor.schedule._grid import action_grid
from conveyor.schedule._kinds import KINDS, PLANNER_SCHEDULES, Kind, kind, warmup
from conveyor.schedule._layout import check_replicas, parse_replicas, stage_workers, worker_stages
from conveyor.schedule._schedule import (
    SCHEDULES,
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
    "KINDS",
    "PLANNER_SCHEDULES",
    "SCHEDULES",
    "Action",
    "BatchCount",
    "Batches",
    "DeadlockError",
    "Kind",
    "Op",
    "Schedule",
    "ScheduleError",
    "SimResult",
    "action_grid",
    "check_replicas",
    "flush",
    "forward_only",
    "gpipe",
    "kind",
    "make_schedule",
    "parse_replicas",
    "pipedream",
    "simulate",
    "stage_workers",
    "twobw",
    "twobw_min_microbatches",
    "validate",
    "warmup",
    "worker_actions",
    "worker_stages",
]
