"""The runtime: pipelines over torch.distributed, their executor, transport, weight versions, checkpoints, launcher."""

from conveyor.runtime._calibrate import (
    MeasuredLink,
    UpdateTimes,
    measure_allreduce,
    measure_link,
    measure_overhead,
    measure_updates,
)
from conveyor.runtime._checkpoint import CheckpointError
from conveyor.runtime._checkpoint import load as load_checkpoint
from conveyor.runtime._checkpoint import save as save_checkpoint
from conveyor.runtime._devices import (
    check_workers,
    default_backend,
    default_device,
    default_workers,
    resolve_backend,
    resolve_device,
)
from conveyor.runtime._graph_block import GraphBlock
from conveyor.runtime._launch import WorkerError, keep_first, launch, under_torchrun
from conveyor.runtime._materialize import Materialize, initialise_from, is_on_meta, load_from
from conveyor.runtime._microbatch import batch_size, to_device
from conveyor.runtime._microbatch import split as split_batch
from conveyor.runtime._outer import OuterSync, site_parts
from conveyor.runtime._pipeline import OptimizerFactory, Pipeline, WorldSizeError
from conveyor.runtime._profiler import profile
from conveyor.runtime._split import split_model
from conveyor.runtime._stage import (
    Blocks,
    as_blocks,
    block_shapes,
    build_stage,
    stage_ranges,
)
from conveyor.runtime._threads import CoreShare
from conveyor.runtime._transport import differentiable_leaves
from conveyor.runtime._versions import StashError, WeightVersions

__all__ = [
    "Blocks",
    "CheckpointError",
    "CoreShare",
    "GraphBlock",
    "Materialize",
    "MeasuredLink",
    "OptimizerFactory",
    "OuterSync",
    "Pipeline",
    "StashError",
    "UpdateTimes",
    "WeightVersions",
    "WorkerError",
    "WorldSizeError",
    "as_blocks",
    "batch_size",
    "block_shapes",
    "build_stage",
    "check_workers",
    "default_backend",
    "default_device",
    "default_workers",
    "differentiable_leaves",
    "initialise_from",
    "is_on_meta",
    "keep_first",
    "launch",
    "load_checkpoint",
    "load_from",
    "measure_allreduce",
    "measure_link",
    "measure_overhead",
    "measure_updates",
    "profile",
    "resolve_backend",
    "resolve_device",
    "save_checkpoint",
    "site_parts",
    "split_batch",
    "split_model",
    "stage_ranges",
    "to_device",
    "under_torchrun",
]
