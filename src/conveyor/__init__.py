"""Conveyor: pipeline-parallel PyTorch training over torch.distributed.

The package is split by system: :mod:`conveyor.schedule` (schedules as data, their validator and
simulator), :mod:`conveyor.plan` (profiles, topologies and the planners), :mod:`conveyor.runtime` (the
pipeline over torch.distributed), :mod:`conveyor.job` (``conveyor train``) and :mod:`conveyor.bench`. The
names below are imported on first use, so scheduling and planning work without importing torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from conveyor.config import TrainConfig
    from conveyor.job import train
    from conveyor.plan import Plan, Profile, Topology, optimize
    from conveyor.runtime import CheckpointError, Pipeline, StashError, WeightVersions, WorkerError, launch, profile
    from conveyor.schedule import (
        Action,
        DeadlockError,
        Op,
        Schedule,
        ScheduleError,
        SimResult,
        flush,
        forward_only,
        gpipe,
        make_schedule,
        pipedream,
        simulate,
        twobw,
        validate,
    )

_HOME = {
    "conveyor.schedule": (
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
        "validate",
    ),
    "conveyor.plan": ("Plan", "Profile", "Topology", "optimize"),
    "conveyor.runtime": (
        "CheckpointError",
        "Pipeline",
        "StashError",
        "WeightVersions",
        "WorkerError",
        "launch",
        "profile",
    ),
    "conveyor.config": ("TrainConfig",),
    "conveyor.job": ("train",),
}
_WHERE = {name: module for module, names in _HOME.items() for name in names}

__all__ = [
    "Action",
    "CheckpointError",
    "DeadlockError",
    "Op",
    "Pipeline",
    "Plan",
    "Profile",
    "Schedule",
    "ScheduleError",
    "SimResult",
    "StashError",
    "Topology",
    "TrainConfig",
    "WeightVersions",
    "WorkerError",
    "flush",
    "forward_only",
    "gpipe",
    "launch",
    "make_schedule",
    "optimize",
    "pipedream",
    "profile",
    "simulate",
    "train",
    "twobw",
    "validate",
]
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module 'conveyor' has no attribute {name!r}")
    return getattr(importlib.import_module(_WHERE[name]), name)


def __dir__() -> list[str]:
    return [*globals(), *__all__]
