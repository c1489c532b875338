"""Conveyor: pipeline-parallel PyTorch training over torch.distributed."""

from conveyor.job._train import TrainConfig, train
from conveyor.plan._optimizer import Plan, optimize
from conveyor.plan._profiles import Profile
from conveyor.plan._topology import Topology
from conveyor.runtime._checkpoint import CheckpointError
from conveyor.runtime._launch import WorkerError, launch
from conveyor.runtime._pipeline import Pipeline
from conveyor.runtime._profiler import profile
from conveyor.runtime._versions import StashError, WeightVersions
from conveyor.schedule._schedule import (
    Action,
    Op,
    Schedule,
    flush,
    forward_only,
    gpipe,
    make_schedule,
    pipedream,
    twobw,
)
from conveyor.schedule._simulate import DeadlockError, ScheduleError, SimResult, simulate
from conveyor.schedule._validate import validate

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
