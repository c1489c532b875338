"""Conveyor: pipeline-parallel PyTorch training over torch.distributed."""

from conveyor.checkpoint import CheckpointError
from conveyor.launch import WorkerError, launch
from conveyor.pipeline import Pipeline
from conveyor.schedule import Action, Op, Schedule, flush, forward_only, gpipe, make_schedule, pipedream, twobw
from conveyor.simulate import DeadlockError, ScheduleError, SimResult, simulate
from conveyor.validate import validate
from conveyor.versions import StashError, WeightVersions

__all__ = [
    "Action",
    "CheckpointError",
    "DeadlockError",
    "Op",
    "Pipeline",
    "Schedule",
    "ScheduleError",
    "SimResult",
    "StashError",
    "WeightVersions",
    "WorkerError",
    "flush",
    "forward_only",
    "gpipe",
    "launch",
    "make_schedule",
    "pipedream",
    "simulate",
    "twobw",
    "validate",
]

__version__ = "0.1.0"
