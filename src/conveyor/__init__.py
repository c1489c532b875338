"""Conveyor: pipeline-parallel PyTorch training over torch.distributed."""

from conveyor.checkpoint import CheckpointError
from conveyor.launch import WorkerError, launch
from conveyor.pipeline import Pipeline
from conveyor.schedule import Action, Op, Schedule, flush, forward_only, gpipe, make_schedule
from conveyor.simulate import DeadlockError, ScheduleError, SimResult, simulate
from conveyor.validate import validate

__all__ = [
    "Action",
    "CheckpointError",
    "DeadlockError",
    "Op",
    "Pipeline",
    "Schedule",
    "ScheduleError",
    "SimResult",
    "WorkerError",
    "flush",
    "forward_only",
    "gpipe",
    "launch",
    "make_schedule",
    "simulate",
    "validate",
]

__version__ = "0.1.0"
