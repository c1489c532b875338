"""What a :class:`~conveyor.config.TrainConfig` means on this machine and with torch: the loss, optimizer and
autocast it names, the device, backend and worker count it resolves to, and the rules that need the model and
its data (one line each, before any worker starts)."""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F

from conveyor.config import LayoutConfig, OptimizerConfig, TrainConfig
from conveyor.errors import InputError
from conveyor.plan import Topology
from conveyor.plan.parts import read_plan_file
from conveyor.runtime import (
    Blocks,
    OptimizerFactory,
    as_blocks,
    block_shapes,
    check_workers,
    default_workers,
    load_checkpoint,
    resolve_backend,
    resolve_device,
    under_torchrun,
)
from conveyor.runtime.parts import check_checkpoint
from conveyor.schedule import parse_replicas

__all__ = [
    "RunState",
    "autocast_dtype",
    "check_against_data",
    "explicit_workers",
    "job_devices",
    "loss_and_optimizer",
    "prediction_leaves_out",
]

_OPTIMIZERS = {"sgd": torch.optim.SGD, "adam": torch.optim.Adam}  # conveyor.config.OPTIMIZERS' classes
_AUTOCAST = {"off": None, "bf16": torch.bfloat16}  # conveyor.config.AUTOCAST's dtypes


def autocast_dtype(cfg: TrainConfig) -> torch.dtype | None:
    """The dtype ``--autocast`` names (``None``: off)."""
    return _AUTOCAST[cfg.run.autocast]


def wan_sites(cfg: TrainConfig) -> int:
    """The data centres ``--wan`` joins: the count of ``--network``'s outer level (conveyor.config.check_wan has
    made sure there is one)."""
    assert cfg.emulation.network is not None
    return Topology.parse(cfg.emulation.network).levels[-1].count


@dataclass(frozen=True, kw_only=True)
class RunState:
    """What :func:`~conveyor.job.train` decides before the workers start and hands each beside the config: the
    outcome of a recurrence's and a warm start's preparation, not options."""

    stop_above: float = math.inf  # a recurrence's cost at which it stops early (--batch-size auto)
    warm_start_plan: str | None = None  # warm_start.json: the parent and layer pairs every worker applies
    history_before: tuple[dict[str, Any], ...] = ()  # --resume: the epochs the checkpoint's runs trained


def loss_and_optimizer(
    optimizer: OptimizerConfig, sequence: bool
) -> tuple[Callable[[Any, Any], Any], OptimizerFactory]:
    """The loss (cross-entropy; per position for a sequence's logits (B, T, V)) and the optimizer asked for."""
    opt_args = {"lr": optimizer.lr, "momentum": optimizer.momentum} if optimizer.name == "sgd" else {"lr": optimizer.lr}
    make_optimizer = partial(_OPTIMIZERS[optimizer.name], **opt_args)
    if sequence:
        return (lambda logits, y: F.cross_entropy(logits.flatten(0, 1), y.flatten())), make_optimizer
    return F.cross_entropy, make_optimizer


def job_devices(cfg: TrainConfig) -> tuple[str, str, int]:
    """The job's device type, backend and local workers (``--workers``, else what a fixed layout needs, else one
    per GPU on CUDA and 4 on the CPU).

    Raises:
        ValueError: a device or backend this machine lacks, or more workers than GPUs under NCCL (one line each).
    """
    device = resolve_device(cfg.run.device)
    backend = resolve_backend(cfg.run.backend, device)
    nprocs = cfg.layout.workers or explicit_workers(cfg.layout) or default_workers(device)
    check_workers(int(os.environ.get("LOCAL_WORLD_SIZE", nprocs)) if under_torchrun() else nprocs, device, backend)
    return device, backend, nprocs


def explicit_workers(layout: LayoutConfig) -> int | None:
    """Workers a fixed layout needs (None when the planner decides)."""
    if layout.plan:
        return read_plan_file(layout.plan).workers
    if layout.replicas:
        return sum(parse_replicas(layout.replicas, layout.stages))
    return layout.stages


def prediction_leaves_out(cfg: TrainConfig) -> bool:
    """Whether a run of ``cfg`` pays what its prediction leaves out by design (what crosses a WAN, injected faults,
    straggler handling, a power limit): its miss then says nothing of its layout."""
    return (
        cfg.wan.mode != "off"
        or bool(cfg.emulation.faults)
        or cfg.stragglers is not None
        or cfg.energy.power_limit is not None
    )


def check_against_data(cfg: TrainConfig, model: Blocks, samples: int) -> None:
    """The rules that need the model and the training set's size (``samples``); one line each, before any worker
    starts (a checkpoint of another model would otherwise fail in every worker after the start-up measurements).

    Raises:
        ValueError: a batch larger than the training set, more microbatches than samples in a batch, or a
            ``--resume`` checkpoint missing, unreadable or of another model.
    """
    batch, microbatches = cfg.optimizer.batch_size, cfg.layout.microbatches
    if batch > samples and not cfg.energy.tune_batch_size:  # auto=B0 may start above: the tuner shrinks it
        raise InputError(f"--batch-size {batch} is more than the {samples} training samples: use at most {samples}")
    if (microbatches or 1) > batch:
        raise InputError(
            f"--microbatches {microbatches} is more than the {batch} samples of a batch: use at most {batch}"
        )
    if cfg.run.resume:
        state = load_checkpoint(cfg.run.resume, mapped=True)["model"]  # the shapes alone: none of the weights read
        check_checkpoint(state, block_shapes(as_blocks(model)), cfg.run.resume)
