"""Conveyor: pipeline-parallel PyTorch training over torch.distributed."""

from conveyor.checkpoint import CheckpointError
from conveyor.launch import WorkerError, launch
from conveyor.pipeline import Pipeline
from conveyor.planner import Plan, optimize
from conveyor.profiler import profile
from conveyor.profiles import Profile
from conveyor.schedule import Action, Op, Schedule, flush, forward_only, gpipe, make_schedule, pipedream, twobw
from conveyor.simulate import DeadlockError, ScheduleError, SimResult, simulate
from conveyor.topology import Topology
from conveyor.train import TrainConfig, train
from conveyor.validate import validate
from conveyor.versions import StashError, WeightVersions

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
