"""The runtime: pipelines over torch.distributed, their executor, transport, weight versions, checkpoints, launcher."""

from conveyor.runtime._checkpoint import CheckpointError
from conveyor.runtime._launch import WorkerError, default_backend, launch, under_torchrun
from conveyor.runtime._pipeline import OptimizerFactory, Pipeline, WorldSizeError
from conveyor.runtime._profiler import profile
from conveyor.runtime._versions import StashError, WeightVersions

__all__ = [
    "CheckpointError",
    "OptimizerFactory",
    "Pipeline",
    "StashError",
    "WeightVersions",
    "WorkerError",
    "WorldSizeError",
    "default_backend",
    "launch",
    "profile",
    "under_torchrun",
]
