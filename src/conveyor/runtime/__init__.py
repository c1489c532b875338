"""The runtime: pipelines over torch.distributed, their executor, transport, weight versions, checkpoints, launcher."""

from conveyor.runtime._calibrate import Link, measure_allreduce, measure_link, measure_overhead
from conveyor.runtime._checkpoint import CheckpointError
from conveyor.runtime._checkpoint import check_compatible as check_checkpoint
from conveyor.runtime._checkpoint import load as load_checkpoint
from conveyor.runtime._devices import (
    BACKENDS,
    DEVICES,
    check_workers,
    default_backend,
    default_device,
    default_workers,
    resolve_backend,
    resolve_device,
)
from conveyor.runtime._launch import WorkerError, launch, stop_requested, under_torchrun
from conveyor.runtime._pipeline import OptimizerFactory, Pipeline, WorldSizeError
from conveyor.runtime._profiler import profile
from conveyor.runtime._stage import Blocks, as_blocks, block_shapes, even_balance
from conveyor.runtime._threads import CoreShare
from conveyor.runtime._transport import P2P
from conveyor.runtime._versions import StashError, WeightVersions

__all__ = [
    "BACKENDS",
    "DEVICES",
    "P2P",
    "Blocks",
    "CheckpointError",
    "CoreShare",
    "Link",
    "OptimizerFactory",
    "Pipeline",
    "StashError",
    "WeightVersions",
    "WorkerError",
    "WorldSizeError",
    "as_blocks",
    "block_shapes",
    "check_checkpoint",
    "check_workers",
    "default_backend",
    "default_device",
    "default_workers",
    "even_balance",
    "launch",
    "load_checkpoint",
    "measure_allreduce",
    "measure_link",
    "measure_overhead",
    "profile",
    "resolve_backend",
    "resolve_device",
    "stop_requested",
    "under_torchrun",
]
